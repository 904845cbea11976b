"""One Horovod process of ``ssd_synthetic.py --horovod N`` (launched by ``_horovod_mode.py``):
the gluon_amp mode on a DistributedTrainer; writes its timings to OUT/rank<r>.json."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
from typing import List, Optional

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(argv: Optional[List[str]] = None) -> None:
    """One Horovod process: build the gluon_amp mode on a DistributedTrainer, train, write times."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--target-dtype", required=True, choices=("float16", "bfloat16", "float32"),
                   help="as the parent decided it (float32: AMP off)")
    a = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import horovod.mxnet as hvd
    import mxnet as mx
    import ssd_synthetic as ssd

    # after MXNet's own SIGSEGV handler (which prints the C stack and exits 255): a crash
    # shows this process's Python stack first, then MXNet's
    faulthandler.enable()
    hvd.init()

    class HorovodMode(ssd.Mode):
        def _build(self, seed: int) -> None:
            super()._build(seed)
            hvd.broadcast_parameters(self.net.collect_params(), root_rank=0)
            # the optimizer ssd_synthetic chose, on Horovod's trainer (it averages over processes)
            self.trainer = hvd.DistributedTrainer(self.net.collect_params(), self.trainer._optimizer)

    import gluon_amp
    target = a.target_dtype if a.target_dtype != "float32" else gluon_amp.Policy.create(
        "float32", reason="the parent process decided AMP is off here")
    ctx = mx.cpu()
    mode = HorovodMode("gluon_amp", ctx, ssd.SyntheticData(a.batch_size, ctx, a.seed + hvd.rank()), a.seed, target)
    for _ in range(a.warmup):
        mode.step(record=False)
    for _ in range(a.iters):
        mode.step()
    med = statistics.median(mode.result.iter_seconds)
    with open(os.path.join(a.out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"rank": hvd.rank(), "size": hvd.size(), "target_dtype": a.target_dtype,
                   "sec_per_iter": med, "samples_per_sec": a.batch_size / med,
                   "iter_seconds": mode.result.iter_seconds, "loss_scale": mode.scaler.loss_scale,
                   "skipped_steps": mode.scaler.skipped_steps}, f)


if __name__ == "__main__":
    worker()
