"""One worker of a 2-worker job (dist_sync kvstore or Horovod), or the whole device-kvstore run.

    python dist_worker.py --engine dist_sync|horovod --out DIR [--mode step|split] [--checks]

Writes ``DIR/<engine>-<mode>-rank<r>.json``: per-step finiteness of its own gradients, skip decisions and
loss scales, the final weights, and with ``--checks`` what each disagreement probe raised.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import gluon_amp  # noqa: E402  (before mxnet: its numpy shim, issue 28)
from gluon_amp import init_kvstore  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import gluon  # noqa: E402
import dist_scenario as sc  # noqa: E402


@dataclass
class Setup:
    """What differs between engines: who am I, where do my shards live, how to step."""

    rank: int
    size: int
    ctxs: List[mx.Context]
    trainer: gluon.Trainer
    batch_size: int  # what trainer.step/update is given for the global batch to be averaged
    barrier: Callable[[], None]


def setup_dist_sync(net: gluon.Block) -> Setup:
    kv = mx.kv.create("dist_sync")
    trainer = gluon.Trainer(net.collect_params(), sc.OPTIMIZER, dict(sc.OPTIMIZER_PARAMS),
                            kvstore=kv, update_on_kvstore=False)
    init_kvstore(trainer)  # broadcast rank 0's weights before any gradient is pushed
    return Setup(kv.rank, kv.num_workers, [mx.cpu()], trainer, sc.GLOBAL_BATCH, kv._barrier)


def setup_horovod(net: gluon.Block) -> Setup:
    import horovod.mxnet as hvd
    hvd.init()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), sc.OPTIMIZER, dict(sc.OPTIMIZER_PARAMS))

    def barrier() -> None:
        hvd.allreduce(mx.nd.zeros((1,)), name="test.barrier").wait_to_read()
    # DistributedTrainer divides by the number of processes itself: pass the local batch.
    return Setup(hvd.rank(), hvd.size(), [mx.cpu()], trainer, sc.GLOBAL_BATCH // hvd.size(), barrier)


def setup_device(net: gluon.Block) -> Setup:
    ctxs = [mx.cpu(0), mx.cpu(1)]
    trainer = gluon.Trainer(net.collect_params(), sc.OPTIMIZER, dict(sc.OPTIMIZER_PARAMS),
                            kvstore="device", update_on_kvstore=False)
    return Setup(0, 1, ctxs, trainer, sc.GLOBAL_BATCH, lambda: None)


def run(engine: str, out_dir: str, mode: str = "step", checks: bool = False) -> Dict[str, object]:
    ctxs = [mx.cpu(0), mx.cpu(1)] if engine == "device" else [mx.cpu()]
    net = sc.make_net(ctxs)
    s = {"dist_sync": setup_dist_sync, "horovod": setup_horovod, "device": setup_device}[engine](net)
    gluon_amp.init_trainer(s.trainer, sc.make_scaler())
    parts = s.size * len(s.ctxs)  # the global batch is cut into one shard per context per worker

    def batch_of(step: int) -> sc.Batch:
        return [sc.shard(step, s.rank * len(s.ctxs) + i, parts, c) for i, c in enumerate(s.ctxs)]

    def update() -> None:
        if mode == "split":
            s.trainer.allreduce_grads()
            s.trainer.update(s.batch_size)
        else:
            s.trainer.step(s.batch_size)

    def poison_ctx(step: int):
        if step != sc.POISON_STEP:
            return None
        if engine == "device":
            return s.ctxs[1]  # one context of one process: the other copy stays finite
        return s.ctxs[0] if s.rank == sc.POISON_RANK else None

    ckpt = os.path.join(out_dir, f"{engine}-{mode}.states")
    pfile = os.path.join(out_dir, f"{engine}-{mode}.params")

    def resume() -> None:
        if s.rank == 0:
            gluon_amp.save_states(s.trainer, ckpt)
            net.save_parameters(pfile)
        s.barrier()
        sc.scramble(net, s.trainer)
        net.load_parameters(pfile, ctx=s.ctxs)
        gluon_amp.load_states(s.trainer, ckpt)

    record = sc.train(net, s.trainer, batch_of, update, poison_ctx, resume)
    result = {"engine": engine, "mode": mode, "rank": s.rank, "size": s.size, **record,
              "params": sc.params_of(net, s.ctxs[0]),
              "params_by_ctx": [sc.params_of(net, c) for c in s.ctxs]}
    if checks:
        result["checks"] = probe_disagreements(net, s, batch_of)
    with open(os.path.join(out_dir, f"{engine}-{mode}-rank{s.rank}.json"), "w") as f:
        json.dump(result, f)
    return result


def _outcome(fn: Callable[[], None]) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "ok"


def probe_disagreements(net: gluon.Block, s: Setup, batch_of: Callable[[int], sc.Batch]) -> Dict[str, object]:
    """Ways workers could disagree, each run on every worker in the same order."""
    scaler = gluon_amp.get_scaler(s.trainer)
    out: Dict[str, object] = {}

    # update() without allreduce_grads(): the check sees unreduced gradients.
    sc.backward(net, s.trainer, batch_of(0))
    if s.rank == sc.POISON_RANK:
        sc.poison(net, s.ctxs[0])
    out["unreduced_finite_by_ctx"] = sc.finite_by_ctx(net)
    s.trainer.update(s.batch_size)
    out["unreduced_skipped"] = scaler.last_step_skipped
    out["unreduced_params"] = sc.params_of(net, s.ctxs[0])

    # One rank restored a different scale.
    saved = scaler.state_dict()
    if s.rank == 1:
        scaler.load_state_dict({**saved, "scale": saved["scale"] * 2})
    sc.backward(net, s.trainer, batch_of(1))
    out["scale_mismatch"] = _outcome(lambda: s.trainer.step(s.batch_size))
    scaler.load_state_dict(saved)

    # The same scaler on a trainer whose gradients never leave this process.
    local_net = sc.make_net([mx.cpu()])
    local = gluon.Trainer(local_net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None,
                          update_on_kvstore=False)
    gluon_amp.init_trainer(local, scaler)
    sc.backward(local_net, local, batch_of(2))
    out["shared_with_local"] = _outcome(lambda: local.step(sc.GLOBAL_BATCH))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", choices=["dist_sync", "horovod", "device"], required=True)
    ap.add_argument("--mode", choices=["step", "split"], default="step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checks", action="store_true")
    args = ap.parse_args()
    try:
        run(args.engine, args.out, args.mode, args.checks)
    except BaseException:
        # A dist kvstore worker that raises would hang in ps-lite's finalize at exit.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
