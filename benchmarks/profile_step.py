"""Per-op profile of one SSD-512 training step, FP32 against AMP, and the ceiling it implies.

    python benchmarks/profile_step.py [--batch-size 8] [--impl gluon_amp,mxnet-contrib] [--json out.json]

Each mode (``fp32``, ``gluon_amp``, the peer ``mxnet-contrib``) runs in its own process:
it builds the tutorial's network (``ssd_synthetic.Mode``), takes one untimed step, then
profiles one step with MXNet's profiler and ``MXNET_EXEC_BULK_EXEC_TRAIN=0`` (so every op
is its own entry). Forward and backward of an op are summed under the op's name. The
ceiling column answers: what would the AMP step take if every op other than the
low-precision ones (convolutions, dense layers) ran at its FP32 time? Where the target dtype
cannot run natively here, only FP32 is profiled and the reason is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
from _report import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: the ops whose speedup AMP is for; every other op counts at its FP32 time in the ceiling
LOW_PRECISION_OPS = ("Convolution", "FullyConnected", "Deconvolution", "dot", "batch_dot")
#: AMP modes it can profile beside FP32 (``gluon_amp-untuned``: ``init(tune=False)``)
PROFILED = ("gluon_amp", "gluon_amp-untuned", "mxnet-contrib")


def op_name(profiled: str) -> str:
    """``_backward_Convolution`` and ``Convolution`` are one op."""
    return profiled[len("_backward_"):] if profiled.startswith("_backward_") else profiled


def worker(mode: str, batch_size: int, target: Optional[str], seed: int) -> Dict[str, Any]:
    os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"] = "0"  # before MXNet starts its engine
    sys.path[:0] = [HERE, ROOT]
    import mxnet as mx
    from ssd_synthetic import Mode, SyntheticData
    batch = SyntheticData(batch_size, mx.cpu(), seed)
    m = Mode(mode, mx.cpu(), batch, seed, target)  # builds and takes its first step
    # MXNet replaces its trace file at exit: run as root with os.devnull, it deleted /dev/null
    with tempfile.TemporaryDirectory() as tmp:
        mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                               filename=os.path.join(tmp, "profile.json"))
        mx.profiler.set_state("run")
        seconds = m.step(record=False)
        mx.nd.waitall()
        mx.profiler.set_state("stop")
        stats = json.loads(mx.profiler.dumps(reset=True, format="json"))
    ops: Dict[str, float] = {}
    for name, s in stats["Time"].get("operator", {}).items():
        ops[op_name(name)] = ops.get(op_name(name), 0.0) + s["Total"]
    return {"mode": mode, "step_ms": seconds * 1000, "ops_ms": ops}


def run_mode(mode: str, args: argparse.Namespace, target: Optional[str]) -> Dict[str, Any]:
    cfg = json.dumps({"mode": mode, "batch_size": args.batch_size, "target": target, "seed": args.seed})
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", cfg], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"profiling {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ceiling(fp32: Dict[str, Any], amp: Dict[str, Any]) -> Dict[str, Any]:
    """The AMP step if every op but the low-precision ones ran at its FP32 time."""
    ops = set(fp32["ops_ms"]) | set(amp["ops_ms"])
    total = sum(amp["ops_ms"].get(o, 0.0) if o in LOW_PRECISION_OPS else fp32["ops_ms"].get(o, 0.0) for o in ops)
    return {"ceiling_ms": total, "fp32_ops_ms": sum(fp32["ops_ms"].values()),
            "amp_ops_ms": sum(amp["ops_ms"].values()),
            "ceiling_speedup": sum(fp32["ops_ms"].values()) / total if total else None}


def table(results: List[Dict[str, Any]], top: int) -> str:
    names = [r["mode"] for r in results]
    ops = sorted(set().union(*(r["ops_ms"] for r in results)), key=lambda o: -results[0]["ops_ms"].get(o, 0.0))
    head = f"{'op (fwd+bwd)':<34}" + "".join(f"{n + ' ms':>18}" for n in names)
    lines = [head, "-" * len(head)]
    for o in ops[:top]:
        lines.append(f"{o[:34]:<34}" + "".join(f"{r['ops_ms'].get(o, 0.0):>18.1f}" for r in results))
    lines.append(f"{'sum of ops':<34}" + "".join(f"{sum(r['ops_ms'].values()):>18.1f}" for r in results))
    lines.append(f"{'step (wall)':<34}" + "".join(f"{r['step_ms']:>18.1f}" for r in results))
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--impl", default="gluon_amp,mxnet-contrib",
                   help=f"AMP modes to profile beside FP32, comma separated, from {', '.join(PROFILED)}")
    p.add_argument("--target-dtype", default="auto", choices=("auto", "float16", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="ops shown in the table (all in the JSON)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    if any(i not in PROFILED for i in impls):
        p.error(f"--impl {args.impl!r}: choose from {', '.join(PROFILED)}")
    args.impls = impls
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return {}
    sys.path.insert(0, ROOT)
    import gluon_amp
    requested = None if args.target_dtype == "auto" else args.target_dtype
    res = gluon_amp.runtime.resolve(requested, warn=False)
    modes, skipped = ["fp32"], None
    if res.dtype == "float32" or not res.executable:
        skipped = f"AMP not profiled: {res.warning}"
    else:
        modes += args.impls
    results = [run_mode(m, args, None if m == "fp32" else res.dtype) for m in modes]
    doc = {"batch_size": args.batch_size, "target_dtype": res.dtype, "results": results, "skipped": skipped,
           "ceilings": {r["mode"]: ceiling(results[0], r) for r in results[1:]},
           "runtime": gluon_amp.runtime_info()}
    print(f"SSD-512 training step, batch {args.batch_size}, per-op ms (MXNET_EXEC_BULK_EXEC_TRAIN=0)")
    print(table(results, args.top))
    for mode, c in doc["ceilings"].items():
        print(f"{mode}: ops {c['amp_ops_ms']:.0f} ms vs FP32 {c['fp32_ops_ms']:.0f} ms; ceiling (other ops at "
              f"FP32 time) {c['ceiling_ms']:.0f} ms = {c['ceiling_speedup']:.2f}x FP32")
    if skipped:
        print(skipped)
    write_json(doc, args.json)
    return doc


if __name__ == "__main__":
    main()
