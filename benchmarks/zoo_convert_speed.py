"""Converted inference speed over the model zoos: FP32 against ``convert_hybrid_block`` with the
defaults, and against the peer's conversion.

Issue 48 asks converted inference to be at least as fast as the peer's and never slower than
FP32 under the defaults; ``vs_peer.py`` checks that on four hand-picked models. This sweep asks
it of every network of GluonCV's zoo and of ``mxnet.gluon.model_zoo.vision`` that builds
offline (the builders of ``model_zoo_sweep.py``: random weights, sockets blocked), at its
sweep input shape (batch 1 at 224x224 for a classifier; ``--batch`` changes the batch).

Two kinds of worker process, each network in both:

* ``ours``: the FP32 block, hybridized with ``static_alloc``/``static_shape``, and
  ``gluon_amp.convert_hybrid_block(net)`` with no other argument (the machine's default target,
  fusion and the rule for a graph not measured: what a user who calls it gets);
* ``peer``: the same FP32 block and ``mxnet.contrib.amp.convert_hybrid_block(net,
  target_dtype='bfloat16', ctx=mx.cpu())``, in a process where gluon_amp is imported only to
  let oneDNN use AMX, as in ``vs_peer.py`` (nothing of it is called there).

Each worker times its two blocks in the same process, alternating (``--rounds`` rounds of a
few calls each, about ``--block-s`` seconds per block), so load drift hits both alike; the
figure is the ratio of their medians (``speedup``: FP32 ms / converted ms). Ours against the
peer is the ratio of the two speedups. Networks whose FP32 call takes longer than
``--max-ms`` are left out (``skipped``, with the time), as are those that do not build.

    PYTHONPATH=. python benchmarks/zoo_convert_speed.py [--models all|a,b] [--batch 1]
        [--state /tmp/zoo_convert_speed] [--no-peer] [--json out.json]

It ends with the networks where ours is slower than FP32 (below ``--slow``, 0.97 by default)
or than the peer, and the geometric means.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
import model_zoo_sweep as zoo
import zoo_default_convert as zdc
from _report import host_info, write_json

KINDS = ("ours", "peer")


def _reinit(net: Any) -> None:
    """Xavier weights where a parameter takes them (unit-scale activations: no denormals that
    would slow FP32 alone); the sweep's uniform values elsewhere."""
    import mxnet as mx
    for p in net.collect_params().values():
        if p.name.endswith("weight") and len(p.shape) > 1:
            p.initialize(mx.init.Xavier(magnitude=2), force_reinit=True)


def _call_ms(mx: Any, block: Any, x: Any) -> float:
    mx.nd.waitall()
    t0 = time.perf_counter()
    block(x)
    mx.nd.waitall()
    return (time.perf_counter() - t0) * 1e3


def timed_pair(mx: Any, a: Any, b: Any, x: Any, rounds: int, block_s: float) -> Tuple[List[float], List[float]]:
    """Per-call milliseconds of ``a`` and ``b``, alternating blocks of calls."""
    for blk in (a, b):
        _call_ms(mx, blk, x)
    first = max(_call_ms(mx, a, x), _call_ms(mx, b, x))
    calls = max(2, min(50, int(block_s * 1e3 / max(first, 1e-3))))
    ta: List[float] = []
    tb: List[float] = []
    for _ in range(rounds):
        ta += [_call_ms(mx, a, x) for _ in range(calls)]
        tb += [_call_ms(mx, b, x) for _ in range(calls)]
    return ta, tb


def _convert(kind: str, net: Any) -> Tuple[Any, Dict[str, Any]]:
    import mxnet as mx
    if kind == "peer":
        from mxnet.contrib.amp import amp as peer
        return peer.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu()), {}
    import gluon_amp
    block = gluon_amp.convert_hybrid_block(net)
    policy = block.amp_result.policy
    info: Dict[str, Any] = {"target": policy.target_dtype if policy.enabled else "float32",
                            "fused": block.fuse_backend}
    try:
        r = gluon_amp.report(block)
        info.update(casts=r.casts, ops_by_dtype=r.totals_by_dtype)
    except Exception as exc:  # noqa: BLE001 -- a figure we cannot read is reported, not fatal
        info["report_error"] = zoo.first_line(exc)
    return block, info


def run_one(kind: str, name: str, args: argparse.Namespace) -> Dict[str, Any]:
    import mxnet as mx
    try:
        mx.random.seed(0)
        with zoo._quiet():
            net, shape = zoo.build_fp32(name)
            _reinit(net)
    except Exception as exc:  # noqa: BLE001
        return {"model": name, "status": "skipped", "why": zoo.first_line(exc)}
    shape = (args.batch,) + tuple(shape[1:])
    x = mx.nd.random.uniform(-1, 1, shape=shape)
    net.hybridize(static_alloc=True, static_shape=True)
    try:
        net(x)
        fp32_once = min(_call_ms(mx, net, x) for _ in range(2))
    except Exception as exc:  # noqa: BLE001
        return {"model": name, "status": "skipped", "why": f"FP32 at {shape}: {zoo.first_line(exc)}"}
    if fp32_once > args.max_ms:
        return {"model": name, "status": "skipped", "why": f"FP32 call {fp32_once:.0f} ms > --max-ms"}
    try:
        with zoo._quiet():
            low, info = _convert(kind, net)
            fp32, ms = timed_pair(mx, net, low, x, args.rounds, args.block_s)
            if kind == "ours":  # what ran, where the rule for a graph not measured sent it to float32
                info["fallbacks"] = list(getattr(low, "amp_fallbacks", ()))
    except Exception as exc:  # noqa: BLE001
        return {"model": name, "status": "fail", "shape": shape, "why": zoo.first_line(exc)}
    f, c = statistics.median(fp32), statistics.median(ms)
    return {"model": name, "status": "ok", "shape": shape, "fp32_ms": round(f, 3),
            "converted_ms": round(c, 3), "speedup": round(f / c, 4), **info}


def worker(kind: str, models: Sequence[str], state: str, args: argparse.Namespace) -> None:
    import gc
    import gluon_amp  # noqa: F401  first, in both kinds: it lets oneDNN use AMX (the peer's too, as in vs_peer.py)
    import mxnet as mx
    zoo.block_network()
    for name in models:
        zdc._append(state, {"model": name, "begin": True})
        zdc._append(state, run_one(kind, name, args))
        mx.nd.waitall()
        gc.collect()


def _geomean(xs: Sequence[float]) -> Optional[float]:
    return round(math.exp(sum(math.log(v) for v in xs) / len(xs)), 3) if xs else None


def summary(results: Dict[str, Dict[str, Dict[str, Any]]], slow: float) -> Dict[str, Any]:
    """Counts per kind; where ours is below ``slow`` x FP32 or below the peer; geometric means."""
    ours, peer = results.get("ours", {}), results.get("peer", {})
    counts: Dict[str, Dict[str, int]] = {}
    for kind, recs in results.items():
        for r in recs.values():
            counts.setdefault(kind, {}).setdefault(r["status"], 0)
            counts[kind][r["status"]] += 1
    ok = {m: r for m, r in ours.items() if r["status"] == "ok"}
    both = {m: (r["speedup"], peer[m]["speedup"]) for m, r in ok.items()
            if peer.get(m, {}).get("status") == "ok"}
    return {
        "counts": counts,
        "ours_below_fp32": {m: r["speedup"] for m, r in sorted(ok.items()) if r["speedup"] < slow},
        "ours_below_peer": {m: round(o / p, 3) for m, (o, p) in sorted(both.items()) if o < p * slow},
        "peer_failed_ours_ran": sorted(m for m in ok if peer.get(m, {}).get("status") == "fail"),
        "geomean_ours_vs_fp32": _geomean([r["speedup"] for r in ok.values()]),
        "geomean_peer_vs_fp32": _geomean([p for _, p in both.values()]),
        "geomean_ours_vs_peer": _geomean([o / p for o, p in both.values()]),
        "failures": {f"{k}:{m}": r["why"] for k, recs in results.items() for m, r in recs.items()
                     if r["status"] in ("fail", "crash", "timeout")},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-s", type=float, default=0.3, help="seconds of calls per timed block")
    ap.add_argument("--max-ms", type=float, default=1500.0, help="leave out networks whose FP32 call is slower")
    ap.add_argument("--slow", type=float, default=0.97, help="list networks below this speedup")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--state", default="/tmp/zoo_convert_speed", help="prefix of the resumable state files")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=KINDS, default="ours", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.kind, args.worker.split(","), args.state, args)
        return 0
    models = zoo.select_models(args.models)
    passed = ["--batch", str(args.batch), "--rounds", str(args.rounds), "--block-s", str(args.block_s),
              "--max-ms", str(args.max_ms)]
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for kind in KINDS[:1] if args.no_peer else KINDS:
        results[kind] = zdc.orchestrate(models, f"{args.state}.{kind}.jsonl", args.timeout,
                                        os.path.abspath(__file__), passed + ["--kind", kind])
    out = {"host": host_info(), "args": vars(args), "summary": summary(results, args.slow),
           "results": results}
    print(json.dumps(out["summary"], indent=1))
    write_json(out, args.json)
    return 0


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    sys.exit(main())
