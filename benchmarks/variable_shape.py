"""Variable-shape training: what AMP's tuning costs a run whose input size keeps changing.

    python benchmarks/variable_shape.py                                   # defaults: a few minutes per mode
    python benchmarks/variable_shape.py --model yolo3_darknet53_voc --sizes 320,416,512,608 --iters 50
    python benchmarks/variable_shape.py --modes fp32,untuned,default,tuned --json out.json

GluonCV's YOLOv3 (``pretrained_base=False``) trains on synthetic batches whose input size
changes every ``--interval`` batches, cycling through ``--sizes`` as GluonCV's
``train_yolo3.py`` draws a new size every 10 batches; the number of boxes per batch varies
as its padded batches do. Each mode runs in a process of its own, with a timing cache of
its own that starts empty (``XDG_CACHE_HOME`` points at a fresh folder):

- ``fp32``: no AMP;
- ``untuned``: ``gluon_amp.init(tune=False)``, the op table's plan;
- ``default``: ``gluon_amp.init()``: tuning within its default budget (``--budget`` to change it);
- ``tuned`` (not run by default): ``init(tune_budget='inf')``, every tuning paid at once.

Reported per mode: the wall time of the first ``--iters`` iterations *including* tuning
(what a user waits for), the steady state after them (``--steady-iters`` more iterations, a
whole number of passes through the sizes: per iteration as the user waits, and the training
steps alone, without what tuning took meanwhile), what tuning spent, and the process's peak
resident memory. The speed ratios against FP32 and the untuned plan come from these times.
On a CPU without native bfloat16 there is nothing to compare: it says why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from _report import emit  # noqa: E402

MODES = ("fp32", "untuned", "default", "tuned")
#: What each mode passes to gluon_amp.init (None: no init).
INIT: Dict[str, Optional[Dict[str, Any]]] = {"fp32": None, "untuned": {"tune": False}, "default": {},
                                            "tuned": {"tune_budget": "inf"}}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="yolo3_mobilenet1.0_voc",
                   help="a GluonCV YOLOv3 (default: %(default)s; yolo3_darknet53_voc is train_yolo3.py's)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--sizes", default="320,352,384",
                   help="input sizes cycled through, multiples of 32 (default: %(default)s; train_yolo3.py: 320..608)")
    p.add_argument("--interval", type=int, default=10,
                   help="batches per size (default: %(default)s, as train_yolo3.py)")
    p.add_argument("--iters", type=int, default=50,
                   help="the first iterations, timed with tuning (default: %(default)s)")
    p.add_argument("--steady-iters", type=int, default=None,
                   help="iterations after them for the steady state (default: one pass through the sizes)")
    p.add_argument("--modes", default="fp32,untuned,default", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--budget", default=None, help="the default mode's tune_budget (default: gluon_amp's own)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every mode this many times, the modes taking turns, and report medians "
                        "(processes differ by a few %% from run to run here: use 3 or more to compare)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not args.sizes or any(s <= 0 or s % 32 for s in args.sizes):
        p.error(f"--sizes must be positive multiples of 32 (YOLOv3's largest stride), got {args.sizes}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown {bad or args.modes}; choose from {', '.join(MODES)}")
    for name in ("batch_size", "interval", "iters", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steady_iters is None:
        args.steady_iters = len(args.sizes) * args.interval
    if args.steady_iters < 1:
        p.error(f"--steady-iters must be >= 1, got {args.steady_iters}")
    return args


# -- one mode, in its own process -------------------------------------------------------

def child(args: argparse.Namespace) -> Dict[str, Any]:
    import resource
    import time
    import warnings
    warnings.simplefilter("ignore")
    import gluon_amp
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    t_start = time.perf_counter()
    options = INIT[args.child]
    if options is not None:
        gluon_amp.init(**options, **({"tune_budget": args.budget} if args.child == "default" and args.budget else {}))
    from gluoncv.model_zoo import get_model
    mx.random.seed(args.seed)
    net = get_model(args.model, pretrained_base=False)
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-4, "momentum": 0.9, "wd": 5e-4},
                            update_on_kvstore=False)
    amp = options is not None and gluon_amp.is_enabled()
    if amp:
        gluon_amp.init_trainer(trainer)
    classes = len(net.classes)
    rng = np.random.default_rng(args.seed)

    def batch(size: int) -> List[Any]:
        """A synthetic batch with YOLOv3's training targets (their shapes follow the size)."""
        b = args.batch_size
        anchors = 3 * sum((size // s) ** 2 for s in (8, 16, 32))
        boxes = int(rng.integers(1, 9))  # padded to the batch's most boxes, as train_yolo3.py's Pad does
        corners = np.sort(rng.uniform(0, size, (b, boxes, 2, 2)), axis=2).transpose(0, 1, 3, 2).reshape(b, boxes, 4)
        arrays = [rng.uniform(-1, 1, (b, 3, size, size)), corners,
                  (rng.uniform(0, 1, (b, anchors, 1)) < 0.01), rng.uniform(0, 1, (b, anchors, 2)),
                  rng.uniform(-1, 1, (b, anchors, 2)), rng.uniform(0, 2, (b, anchors, 2)),
                  (rng.uniform(0, 1, (b, anchors, classes)) < 0.05)]
        return [mx.nd.array(a, dtype="float32") for a in arrays]

    def step(data: List[Any]) -> float:
        t0 = time.perf_counter()
        with autograd.record():
            losses = net(*data)
            total = mx.nd.add_n(*[loss.sum() for loss in losses])
            if amp:
                with gluon_amp.scale_loss(total, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                autograd.backward(total)
        trainer.step(args.batch_size)
        mx.nd.waitall()
        dt = time.perf_counter() - t0
        if not np.isfinite(total.asscalar()):
            raise SystemExit(f"{args.child}: the loss is not finite")
        return dt

    def spent() -> float:
        return gluon_amp.runtime_info()["tune"].get("spent_s", 0.0)

    sizes = [args.sizes[(i // args.interval) % len(args.sizes)] for i in range(args.iters + args.steady_iters)]
    first = [step(batch(s)) for s in sizes[:args.iters]]
    before = spent()
    steady = [step(batch(s)) for s in sizes[args.iters:]]
    tuning = spent() - before  # what tuning took during the steady iterations
    info = gluon_amp.runtime_info()
    return {"mode": args.child, "amp": amp, "policy": gluon_amp.current_policy().describe() if amp else "float32",
            "first_s": sum(first), "steady_s_per_iter": sum(steady) / len(steady),
            "steady_steps_s_per_iter": (sum(steady) - tuning) / len(steady), "steady_tuning_s": tuning,
            "iter_s": first + steady, "sizes": sizes,
            "setup_s": time.perf_counter() - t_start - sum(first) - sum(steady),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tune": info["tune"], "speed": info["speed"]}


def run_mode(mode: str, args: argparse.Namespace, argv: List[str]) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLUON_AMP_TUNE", "GLUON_AMP_TUNE_BUDGET")}
    with tempfile.TemporaryDirectory(prefix="gluon-amp-bench-cache-") as cache:  # an empty timing cache
        env.update(XDG_CACHE_HOME=cache, PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", mode],
                           capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the parent: every mode, then the comparison ---------------------------------------

#: The figures a mode's rounds are summarised by (their median).
_FIGURES = ("first_s", "steady_s_per_iter", "steady_steps_s_per_iter", "peak_rss_mb")


def summarise(rounds: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per mode: the median of each figure over the rounds (the last round's other
    fields), with each round's own row under ``rounds``."""
    rows = []
    for k, last in enumerate(rounds[-1]):
        runs = [r[k] for r in rounds]
        rows.append({**last, **{f: statistics.median(run[f] for run in runs) for f in _FIGURES},
                     "rounds": runs})
    return rows


def round_ratios(rounds: List[List[Dict[str, Any]]], mode: str, base: str, figure: str) -> List[float]:
    """``base``'s ``figure`` over ``mode``'s, in each round (above 1: ``mode`` is faster)."""
    out = []
    for r in rounds:
        by = {row["mode"]: row for row in r}
        if mode in by and base in by:
            out.append(by[base][figure] / by[mode][figure])
    return out


def table(rows: List[Dict[str, Any]], args: argparse.Namespace,
          rounds: Optional[List[List[Dict[str, Any]]]] = None) -> str:
    by = {r["mode"]: r for r in rows}
    fp32, untuned = by.get("fp32"), by.get("untuned")
    lines = [f"{args.model}, batch {args.batch_size}, sizes {args.sizes} (a new one every {args.interval} batches): "
             f"first {args.iters} iterations including tuning, then {args.steady_iters} for the steady state"
             + (f"; median of {len(rounds)} rounds, the modes taking turns" if rounds and len(rounds) > 1 else ""),
             f"{'mode':<9}{'first (s)':>10}{'vs fp32':>9}{'vs untuned':>11}{'steady s/it':>13}{'vs untuned':>11}"
             f"{'steps s/it':>12}{'vs untuned':>11}{'tuning s':>10}{'peak MB':>9}"]
    for r in rows:
        def ratio(base: Optional[Dict[str, Any]], key: str) -> str:
            return f"{base[key] / r[key]:.3f}x" if base else "-"
        lines.append(f"{r['mode']:<9}{r['first_s']:>10.1f}{ratio(fp32, 'first_s'):>9}{ratio(untuned, 'first_s'):>11}"
                     f"{r['steady_s_per_iter']:>13.3f}{ratio(untuned, 'steady_s_per_iter'):>11}"
                     f"{r['steady_steps_s_per_iter']:>12.3f}{ratio(untuned, 'steady_steps_s_per_iter'):>11}"
                     f"{r['tune'].get('spent_s', 0.0):>10.1f}{r['peak_rss_mb']:>9.0f}")
    if rounds and len(rounds) > 1:
        for mode in [r["mode"] for r in rows]:
            for base, figure, label in (("fp32", "first_s", "first"), ("untuned", "first_s", "first"),
                                        ("untuned", "steady_s_per_iter", "steady")):
                got = round_ratios(rounds, mode, base, figure)
                if mode != base and got:
                    lines.append(f"{mode} vs {base}, {label}, each round: "
                                 + ", ".join(f"{g:.3f}x" for g in got))
    for r in rows:
        tune = r["tune"]
        if tune.get("spent_on"):  # what the budget paid for, and what it allowed by the end
            lines.append(f"{r['mode']}: budget {tune['budget']}: spent {tune['spent_s']:.2f} s of "
                         f"{tune['allowance_s']:.2f} s allowed ("
                         + ", ".join(f"{k} {v:.2f} s" for k, v in tune["spent_on"].items()) + ")")
        for g in tune.get("graphs", []):
            lines.append(f"{r['mode']}: {', '.join(g['blocks'])}: {g['status']}")
            if g.get("trials"):
                lines.append(f"{r['mode']}: whole-graph trials (ms): "
                             + ", ".join(f"{what} {ms}" for what, ms in g["trials"]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    import gluon_amp
    from gluon_amp_core.capability import Bf16
    cap = gluon_amp.runtime.capability()
    if cap.bf16 is not Bf16.NATIVE:
        why = f"no native bfloat16 on this CPU ({cap.why})"
        print(f"cannot measure: {why}; AMP would run FP32 in every mode, so there is nothing to compare.")
        emit({"modes": [], "not_measured": why, "runtime": gluon_amp.runtime_info()}, "", args.json)
        return {}
    parent_argv = [a for a in argv]
    rounds = []
    for k in range(args.rounds):
        rows = []
        for mode in args.modes:
            print(f"running {mode} ..." + (f" (round {k + 1}/{args.rounds})" if args.rounds > 1 else ""), flush=True)
            rows.append(run_mode(mode, args, parent_argv))
        rounds.append(rows)
    rows = summarise(rounds)
    doc = {"model": args.model, "batch_size": args.batch_size, "sizes": args.sizes, "interval": args.interval,
           "iters": args.iters, "steady_iters": args.steady_iters, "rounds": args.rounds, "modes": rows,
           "cpu_flags": sorted(f for f in gluon_amp.runtime.cpu_flags() if "avx" in f or "amx" in f)}
    emit(doc, table(rows, args, rounds), args.json)
    return doc


if __name__ == "__main__":
    main()
