"""Per-op Python dispatch overhead of AMP-patched imperative ``mx.nd`` calls.

For each of a few ops (one per AMP class: float32, widest-type, low-precision, neutral)
this times many calls on tiny tensors -- so the cost is Python dispatch and casting, not
compute -- first unpatched, then with AMP on, in the same process. It does that twice,
each in its own worker subprocess started from this script:

* ``ours``: ``gluon_amp.init(target_dtype)``
* ``peer``: ``mxnet.contrib.amp.init(target_dtype)`` (irreversible and global, hence
  the separate process; ours gets one too so both are measured the same way).

Each figure is the median over ``--repeats`` runs of ``--calls`` calls (after a warm-up),
each run ending with ``mx.nd.waitall()``. Overhead = patched - unpatched, in µs/call.
The report is printed as JSON, then as a table.

``ours`` also measures an ``autocast`` region without ``init`` (PyTorch's pattern,
``with gluon_amp.autocast(target_dtype): ...`` around every step): the first region of the
process (it patches MXNet's op functions), then entry + exit of an empty region, the median over
``--repeats`` runs of ``--regions`` regions, in µs per region, wall and CPU time (issue 43: at
most 20 µs).

Run::

    PYTHONPATH=. python benchmarks/dispatch_overhead.py [--calls 3000] [--repeats 5]
        [--target-dtype bfloat16] [--json out.json]

With ``--target-dtype float16`` the ops run on ``mx.gpu(0)`` when a GPU is visible; without
one they run on the CPU, minus FullyConnected (MXNet's CPU backend has no float16 GEMM),
and the report says so. On a CPU, bfloat16 (the default) is the dtype that runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
from gluon_amp_core.dtypes import dtype_name  # noqa: E402  (pure: no MXNet)

from _report import emit  # benchmarks/ is on sys.path when run as a script

# name -> AMP class in gluon_amp's bfloat16 table. The peer agrees except for relu, which
# it lists in BF16_FP32_FUNCS (run in the input's dtype) and so wraps; gluon_amp leaves it alone.
OPS: Dict[str, str] = {
    "softmax": "fp32",
    "elemwise_add": "widest",
    "broadcast_add": "widest",
    "FullyConnected": "lp16",
    "relu": "neutral",
}
LIBS = ("ours", "peer")


def _op_calls(mx: Any, ctx: Any) -> Dict[str, Callable[[], Any]]:
    """Zero-arg callables; each looks its function up on ``mx.nd`` at call time, so
    it sees the patched function once AMP is on. Inputs are fixed, so both workers match."""
    import numpy as np
    rng = np.random.RandomState(0)
    x, y = (mx.nd.array(rng.randn(1, 8), ctx=ctx, dtype="float32") for _ in range(2))
    w = mx.nd.array(rng.randn(8, 8), ctx=ctx, dtype="float32")
    nd = mx.nd
    return {
        "softmax": lambda: nd.softmax(x),
        "elemwise_add": lambda: nd.elemwise_add(x, y),
        "broadcast_add": lambda: nd.broadcast_add(x, y),
        "FullyConnected": lambda: nd.FullyConnected(x, w, num_hidden=8, no_bias=True),
        "relu": lambda: nd.relu(x),
    }


def _time_all(mx: Any, calls: Dict[str, Callable[[], Any]], n: int, repeats: int) -> Dict[str, float]:
    """Median µs/call for each op."""
    for fn in calls.values():  # warm-up (also builds any oneDNN primitives / casts)
        for _ in range(max(50, n // 10)):
            fn()
    mx.nd.waitall()
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            mx.nd.waitall()
            samples[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _time_regions(gluon_amp: Any, target_dtype: str, n: int, repeats: int) -> Dict[str, float]:
    """An autocast region without init: the first one (ms), then entry + exit (µs/region)."""
    t0 = time.perf_counter()
    with gluon_amp.autocast(target_dtype):
        pass
    first_ms = (time.perf_counter() - t0) * 1e3
    samples, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            with gluon_amp.autocast(target_dtype):
                pass
        samples.append((time.perf_counter() - t0) / n * 1e6)
        cpu.append((time.process_time() - c0) / n * 1e6)
    gluon_amp.disable()  # every function back before init is timed
    # the CPU time too: on a busy host the wall time counts the waits for a core
    return {"first_region_ms": first_ms, "region_us": statistics.median(samples),
            "region_cpu_us": statistics.median(cpu)}


def worker(lib: str, target_dtype: str, n: int, repeats: int, ops: List[str],
           regions: int = 2000) -> Dict[str, Any]:
    """Runs in a subprocess: unpatched timings, then (ours) regions without init, then patched
    timings, for one library."""
    if lib == "ours":
        import gluon_amp
        import mxnet as mx
    else:
        import mxnet as mx
        from mxnet.contrib import amp
    # float16 ops run on a GPU when there is one; on a CPU only the non-GEMM ops are timed
    ctx = mx.gpu(0) if target_dtype == "float16" and mx.context.num_gpus() > 0 else mx.cpu()
    calls = {k: v for k, v in _op_calls(mx, ctx).items() if k in ops}
    unpatched = _time_all(mx, calls, n, repeats)
    region = None
    if lib == "ours":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a target without kernels here: regions still build plans
            region = _time_regions(gluon_amp, target_dtype, regions, repeats)
        gluon_amp.init(target_dtype)
    else:
        amp.init(target_dtype=target_dtype)
    out_dtypes = {name: dtype_name(fn().dtype) for name, fn in calls.items()}
    patched = _time_all(mx, calls, n, repeats)
    return {"unpatched_us": unpatched, "patched_us": patched, "patched_out_dtype": out_dtypes,
            "region_without_init": region}


def _run_worker(lib: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", lib, "--calls", str(args.calls),
           "--repeats", str(args.repeats), "--target-dtype", args.target_dtype,
           "--ops", ",".join(args.ops), "--regions", str(args.regions)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{lib} worker failed (exit {proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # last line: the JSON


NOISE_US = 0.5  # overheads smaller than this are timing noise; no ratio is given against them


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if abs(b) >= NOISE_US else None


def build_report(res: Dict[str, Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    ops: Dict[str, Any] = {}
    for name in args.ops:
        row: Dict[str, Any] = {"class": OPS[name]}
        for lib in LIBS:
            u, p = res[lib]["unpatched_us"][name], res[lib]["patched_us"][name]
            row[lib] = {"unpatched_us": round(u, 3), "patched_us": round(p, 3),
                        "overhead_us": round(p - u, 3),
                        "patched_out_dtype": res[lib]["patched_out_dtype"][name]}
        row["overhead_ratio_ours_over_peer"] = _ratio(row["ours"]["overhead_us"], row["peer"]["overhead_us"])
        row["patched_ratio_ours_over_peer"] = _ratio(row["ours"]["patched_us"], row["peer"]["patched_us"])
        ops[name] = row
    mean = {lib: round(statistics.mean(r[lib]["overhead_us"] for r in ops.values()), 3) for lib in LIBS}
    region = res["ours"].get("region_without_init")
    return {"target_dtype": args.target_dtype, "calls": args.calls, "repeats": args.repeats,
            "statistic": "median", "ops": ops, "not_measured": args.not_measured,
            "region_without_init": ({k: round(v, 3) for k, v in region.items()} if region else None),
            "mean_overhead_us": {**mean, "ratio_ours_over_peer": _ratio(mean["ours"], mean["peer"])}}


def format_table(rep: Dict[str, Any]) -> str:
    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"
    head = (f"{'op':<15}{'class':<8}{'base ours':>10}{'amp ours':>10}{'ovh ours':>10}"
            f"{'base peer':>10}{'amp peer':>10}{'ovh peer':>10}{'ovh o/p':>9}{'amp o/p':>9}")
    lines = [f"dispatch overhead, µs/call (median of {rep['repeats']} x {rep['calls']} calls, "
             f"target {rep['target_dtype']}); base = unpatched, amp = patched, ovh = amp - base",
             head, "-" * len(head)]
    for name, r in rep["ops"].items():
        o, p = r["ours"], r["peer"]
        lines.append(f"{name:<15}{r['class']:<8}{o['unpatched_us']:>10.2f}{o['patched_us']:>10.2f}"
                     f"{o['overhead_us']:>10.2f}{p['unpatched_us']:>10.2f}{p['patched_us']:>10.2f}"
                     f"{p['overhead_us']:>10.2f}{f(r['overhead_ratio_ours_over_peer']):>9}"
                     f"{f(r['patched_ratio_ours_over_peer']):>9}")
    m = rep["mean_overhead_us"]
    lines.append(f"mean overhead: ours {m['ours']:.2f} µs/call vs peer {m['peer']:.2f} µs/call "
                 f"(ours/peer = {f(m['ratio_ours_over_peer'])})")
    r = rep.get("region_without_init")
    if r:
        lines.append(f"autocast region without init (ours): first {r['first_region_ms']:.1f} ms (patches), "
                     f"then {r['region_us']:.2f} µs per region entry + exit ({r['region_cpu_us']:.2f} µs CPU time)")
    if rep["not_measured"]:
        lines.append(rep["not_measured"])
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls per op per repeat")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported")
    ap.add_argument("--target-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON report here")
    ap.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    ap.add_argument("--ops", default=",".join(OPS), help=argparse.SUPPRESS)
    ap.add_argument("--regions", type=int, default=2000,
                    help="autocast regions without init per repeat (ours); the median is reported")
    args = ap.parse_args(argv)
    args.ops = args.ops.split(",")
    if args.calls < 1 or args.repeats < 1 or args.regions < 1:
        ap.error("--calls, --repeats and --regions must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.target_dtype, args.calls, args.repeats, args.ops, args.regions)))
        return
    import gluon_amp
    res = gluon_amp.runtime.resolve(args.target_dtype, warn=False)
    args.not_measured = None
    if not res.executable:  # FullyConnected would run a low-precision kernel this machine lacks
        args.ops = [n for n in args.ops if OPS[n] != "lp16"]
        args.not_measured = f"FullyConnected (a {args.target_dtype} kernel) was not measured: {res.warning}"
    rep = build_report({lib: _run_worker(lib, args) for lib in LIBS}, args)
    emit(rep, format_table(rep), args.json)


if __name__ == "__main__":
    main()
