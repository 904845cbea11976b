"""Module training with a large softmax head: FP32 against each AMP mode, step time.

    python benchmarks/module_head.py                       # 3 rounds, every mode this host runs
    python benchmarks/module_head.py --rounds 1 --steps 5 --json head.json

The network of MXNet 1.9.1's ``example/nce-loss/toy_softmax.py``: ``FullyConnected(100)``,
``FullyConnected(10,000)``, ``SoftmaxOutput``; batch 128, bound by ``mx.mod.Module``, SGD with
momentum, ``forward_backward`` and ``update`` per step. A Module's loss heads are scaled through
an identity in the bound graph (docs/training.md); what it costs shows on a head this size.
Modes: ``fp32`` (plain MXNet), ``float16``/``bfloat16`` (``init(dtype, emulate=True)``: the
scaler's default), ``native`` (``init('bfloat16')``: needs bfloat16 kernels, else reported as not
measurable here). Each (mode, round) runs in a process of its own, the modes back to back each
round; each process times 5 blocks of ``--steps`` steps queued as a training loop queues them
(``waitall`` at a block's ends only) and gives its median block's time per step; the median over
rounds and its ratio to FP32's are reported, with whether the bound graph holds the scaled
identity and the op it multiplies by.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

MODES = ("fp32", "float16", "bfloat16", "native")
BATCH, HIDDEN, CLASSES = 128, 100, 10000
BLOCKS = 5  # timed blocks of --steps steps per process: the median block is the process's figure


def child(mode: str, warmup: int, steps: int) -> Dict[str, Any]:
    """One process: build, bind, train ``warmup`` steps, then :data:`BLOCKS` blocks of ``steps``
    steps; the median block's time per step."""
    warnings.simplefilter("ignore")
    import numpy as np
    import mxnet as mx
    if mode != "fp32":
        import gluon_amp
        gluon_amp.init(target_dtype="bfloat16" if mode == "native" else mode, emulate=mode != "native")
    data, label = mx.sym.Variable("data"), mx.sym.Variable("label")
    pred = mx.sym.FullyConnected(mx.sym.FullyConnected(data, num_hidden=HIDDEN, name="fc1"),
                                 num_hidden=CLASSES, name="fc2")
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(pred, label, name="softmax"), data_names=["data"],
                        label_names=["label"], context=mx.cpu())
    mod.bind([("data", (BATCH, HIDDEN))], [("label", (BATCH,))])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.03, "momentum": 0.9})
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.rand(BATCH, HIDDEN))], [mx.nd.array(rng.randint(0, CLASSES, BATCH))])
    for _ in range(warmup):
        mod.forward_backward(batch)
        mod.update()
    times = []
    for _ in range(BLOCKS):  # steps queued as a training loop queues them; a block's mean per step
        mx.nd.waitall()
        start = time.perf_counter()
        for _ in range(steps):
            mod.forward_backward(batch)
            mod.update()
        mx.nd.waitall()
        times.append((time.perf_counter() - start) * 1e3 / steps)
    nodes = json.loads(mod._exec_group.execs[0]._symbol.tojson())["nodes"]
    scale = [n["op"] for n in nodes if n["name"] == "softmax_amp_scale_mul"]
    return {"mode": mode, "ms": statistics.median(times), "identity": scale[0] if scale else None}


def _run_child(mode: str, warmup: int, steps: int, timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--warmup", str(warmup), "--steps", str(steps)]
    env = {**os.environ, "GLUON_AMP_TUNE": "0"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        if mode == "native" and ("emulate=True" in r.stderr or "bfloat16 kernels" in r.stderr):
            return {"mode": mode, "skipped": f"not measurable here: needs bfloat16 kernels ({tail[:200]})"}
        return {"mode": mode, "error": f"exit {r.returncode}: {tail[:300]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(modes: List[str], rounds: int, warmup: int, steps: int, timeout: float = 600) -> Dict[str, Any]:
    """Every mode in its own process, ``rounds`` times, the modes back to back each round."""
    per: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            per[m].append(_run_child(m, warmup, steps, timeout))
    rows = []
    fp32 = [r["ms"] for r in per.get("fp32", []) if "ms" in r]
    base = statistics.median(fp32) if fp32 else None
    for m in modes:
        got = [r for r in per[m] if "ms" in r]
        if not got:
            bad = per[m][0]
            rows.append({"mode": m, **{k: v for k, v in bad.items() if k != "mode"}})
            continue
        ms = statistics.median(r["ms"] for r in got)
        rows.append({"mode": m, "ms": ms, "vs_fp32": (ms / base) if base else None,
                     "identity": got[0]["identity"], "rounds": [r["ms"] for r in got]})
    from _report import host_info  # benchmarks/ is on sys.path when run as a script
    return {"host": host_info(), "batch": BATCH, "classes": CLASSES, "rounds": rounds, "warmup": warmup,
            "steps": steps, "rows": rows}


def format_table(doc: Dict[str, Any]) -> str:
    lines = ["| mode | step ms (median) | vs FP32 | scaled identity in the bound graph |", "|---|---|---|---|"]
    for r in doc["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['mode']} | {r.get('skipped') or r.get('error')} | - | - |")
            continue
        ratio = f"{r['vs_fp32']:.2f}x" if r["vs_fp32"] is not None else "-"
        lines.append(f"| {r['mode']} | {r['ms']:.1f} | {ratio} | {r['identity'] or 'none'} |")
    h = doc["host"]
    lines.append(f"host flags {' '.join(h['flags'])}, DNNL_MAX_CPU_ISA={h['DNNL_MAX_CPU_ISA']}, {h['cpus']} cpus")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, from {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=3, help="processes per mode, modes back to back")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (5 blocks a process)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON document here")
    p.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.warmup, args.steps)))
        return None
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: {', '.join(bad)} not among {', '.join(MODES)}")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    from _report import emit
    doc = run(modes, args.rounds, args.warmup, args.steps)
    emit(doc, format_table(doc), args.json)
    return doc


if __name__ == "__main__":
    main()
