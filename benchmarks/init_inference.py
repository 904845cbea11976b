"""Inference under ``init``: parameter casts made once against casts at every call, FP32 and a conversion.

    python benchmarks/init_inference.py                        # every net, bfloat16, 2 rounds
    python benchmarks/init_inference.py --nets resnet50-b1 --rounds 3 --json out.json
    python benchmarks/init_inference.py --nets resnet50-b8,np-resnet50-b8 --modes fp32,convert-default

A hybridized block (``static_alloc=True, static_shape=True``) called outside
``autograd.record`` under ``init(target_dtype, tune=False)`` runs on casts of its parameters
made once, re-made when a parameter is written (``gluon_amp.mxnet_internals.forward_only``);
``GLUON_AMP_STORED_CASTS=0`` gives the cast at every call it replaced. Each (net, mode) runs in
a process of its own, modes back to back within a round: ``fp32`` (no gluon_amp),
``init-every-call`` (the environment variable set), ``init`` (the default) and ``convert``
(``convert_hybrid_block``, parameters stored low, ``fuse=False`` so as to compare the same
graph); with ``--modes``, also ``convert-default`` (``convert_hybrid_block`` with its defaults:
fused on a CPU, weights stored low except in numpy mode, where they stay float32 and are cast
once for the calls that record nothing). Reported: the median call time over rounds of each process's median, peak RSS
(``VmHWM``) and each against FP32. ``tune=False``: the plan as it is, not the per-graph
verdict (which may run a graph float32 where its plan is slower on this host).

Nets (random weights, seed 0):
- ``resnet50-b1``, ``resnet50-b8``: Gluon zoo ``resnet50_v1``, 224x224, batch 1 and 8;
- ``convs-b1``: 8 3x3 convolutions of 256 channels at 7x7, batch 1 (weights 4.7M elements,
  0.23 GFLOP: the case where casting the weights is most of the work);
- ``ffn-b1``: a transformer's feed-forward stack, 4 x (Dense 768->3072, GELU, Dense 3072->768)
  on 1 x 32 tokens;
- ``np-resnet50-b1``, ``np-resnet50-b8`` (only with ``--nets``): the ResNet-50s in numpy mode
  (``mx.npx.set_np()``, d2l's frontend), whose sums and relus are numpy's ops.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
from _report import emit, host_info, own_peak_rss_mb

MODES = ("fp32", "init-every-call", "init", "convert")
ALL_MODES = MODES + ("convert-default",)
NETS = ("resnet50-b1", "resnet50-b8", "convs-b1", "ffn-b1")
ALL_NETS = NETS + ("np-resnet50-b1", "np-resnet50-b8")


def _net(name: str) -> tuple:
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    if name.startswith("np-"):
        mx.npx.set_np()
    if "resnet50" in name:
        from mxnet.gluon.model_zoo import vision
        net = vision.resnet50_v1()
        shape = (int(name.split("-b")[1]), 3, 224, 224)
        x = mx.np.random.uniform(-1, 1, size=shape) if name.startswith("np-") else \
            mx.nd.random.uniform(-1, 1, shape=shape)
    elif name == "convs-b1":
        net = gluon.nn.HybridSequential()
        for _ in range(8):
            net.add(gluon.nn.Conv2D(256, 3, padding=1, activation="relu"))
        x = mx.nd.random.uniform(-1, 1, shape=(1, 256, 7, 7))
    elif name == "ffn-b1":
        net = gluon.nn.HybridSequential()
        for _ in range(4):
            net.add(gluon.nn.Dense(3072, flatten=False), gluon.nn.GELU(), gluon.nn.Dense(768, flatten=False))
        x = mx.nd.random.uniform(-1, 1, shape=(1, 32, 768))
    else:
        raise ValueError(f"unknown net {name!r}: choose from {', '.join(ALL_NETS)}")
    net.initialize(mx.init.Xavier())
    return net, x


def child(name: str, mode: str, target: str, calls: int) -> Dict[str, Any]:
    import gluon_amp
    if mode == "init-every-call":
        os.environ["GLUON_AMP_STORED_CASTS"] = "0"
    if mode.startswith("init"):
        gluon_amp.init(target_dtype=target, tune=False)
    net, x = _net(name)
    net.hybridize(static_alloc=True, static_shape=True)
    net(x).wait_to_read()
    if mode == "convert":
        net = gluon_amp.convert_hybrid_block(net, target_dtype=target, fuse=False, tune=False)
        net.hybridize(static_alloc=True, static_shape=True)
    elif mode == "convert-default":
        net = gluon_amp.convert_hybrid_block(net, target_dtype=target, tune=False)
    for _ in range(3):
        net(x).wait_to_read()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        net(x).wait_to_read()
        times.append(time.perf_counter() - t0)
    stored = getattr(net._cached_op, "stored", 0)
    return {"net": name, "mode": mode, "ms": 1000 * statistics.median(times), "peak_rss_mb": own_peak_rss_mb(),
            "stored_casts": stored}


def _run_child(name: str, mode: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, mode, "--target-dtype", args.target_dtype,
           "--calls", str(args.calls)]
    env = {k: v for k, v in os.environ.items() if k != "GLUON_AMP_STORED_CASTS"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{name} {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> Dict[str, Any]:
    load = os.getloadavg()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {m: [] for m in args.modes} for n in args.nets}
    for r in range(args.rounds):
        for n in args.nets:
            for m in args.modes:
                res = _run_child(n, m, args)
                runs[n][m].append(res)
                print(f"round {r + 1}/{args.rounds} {n:<12} {m:<16} {res['ms']:8.2f} ms  "
                      f"{res['peak_rss_mb']:6.0f} MB", file=sys.stderr, flush=True)
    summary: Dict[str, Dict[str, Dict[str, float]]] = {}
    for n in args.nets:
        summary[n] = {m: {"ms": statistics.median(x["ms"] for x in runs[n][m]),
                          "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs[n][m]),
                          "stored_casts": runs[n][m][-1]["stored_casts"]} for m in args.modes}
        base = summary[n].get("fp32")
        for s in summary[n].values():
            s["time_vs_fp32"] = s["ms"] / base["ms"] if base else float("nan")
            s["memory_vs_fp32"] = s["peak_rss_mb"] / base["peak_rss_mb"] if base else float("nan")
    return {"host": host_info(), "target_dtype": args.target_dtype, "rounds": args.rounds, "calls": args.calls,
            "load_before": load, "load_after": os.getloadavg(), "summary": summary, "runs": runs}


def format_table(doc: Dict[str, Any]) -> str:
    lines = [f"{'net':<14} {'mode':<16} {'ms/call':>8} {'vs FP32':>8} {'peak MB':>8} {'vs FP32':>8} {'stored':>6}"]
    for n, modes in doc["summary"].items():
        for m, s in modes.items():
            lines.append(f"{n:<14} {m:<16} {s['ms']:>8.2f} {s['time_vs_fp32']:>7.2f}x {s['peak_rss_mb']:>8.0f} "
                         f"{s['memory_vs_fp32']:>7.2f}x {s['stored_casts']:>6}")
    h = doc["host"]
    lines.append(f"target {doc['target_dtype']}; host flags {' '.join(h['flags'])}, DNNL_MAX_CPU_ISA="
                 f"{h['DNNL_MAX_CPU_ISA']}, load {doc['load_before'][0]:.2f} before, {doc['load_after'][0]:.2f} "
                 f"after; ms/call: median over {doc['rounds']} process(es) of each one's median of "
                 f"{doc['calls']} calls")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default=",".join(NETS), help=f"comma separated, from {', '.join(ALL_NETS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, from {', '.join(ALL_MODES)}")
    p.add_argument("--rounds", type=int, default=2, help="processes per (net, mode), modes back to back")
    p.add_argument("--calls", type=int, default=10, help="timed calls per process")
    p.add_argument("--target-dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--json", metavar="PATH", help="also write the full JSON document here")
    p.add_argument("--child", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.target_dtype, args.calls)))
        return
    args.nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [n for n in args.nets if n not in ALL_NETS] + [m for m in args.modes if m not in ALL_MODES]
    if unknown:
        p.error(f"unknown net(s) or mode(s) {', '.join(unknown)}: choose nets from {', '.join(ALL_NETS)}, "
                f"modes from {', '.join(ALL_MODES)}")
    doc = run(args)
    emit(doc, format_table(doc), args.json)


if __name__ == "__main__":
    main()
