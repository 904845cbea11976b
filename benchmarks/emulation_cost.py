"""What emulation costs: training step time and peak memory, FP32 against emulated float16/bfloat16.

    python benchmarks/emulation_cost.py                          # ResNet-18 and SSD-512, 2 rounds
    python benchmarks/emulation_cost.py --nets resnet18 --rounds 3 --json cost.json
    python benchmarks/emulation_cost.py --interleaved --rounds 2   # time only, FP32 beside emulated

Each (net, mode) runs in a process of its own: it builds the net (same seed in every mode),
runs ``--warmup`` untimed steps and ``--steps`` timed ones, and reports the median step time
and its peak RSS (``VmHWM``: what the process itself held at most, build included). A step
the loss scaler skipped (emulated float16 overflows on its first steps, as real float16 does)
skips the optimizer's update too, so it is cheaper: the step time is the median over the
steps that updated, and the skipped ones are counted. The parent runs the modes back to
back, round after round, so drift on a busy machine hits them alike, and reports each mode's
median step time over rounds and its fastest step (less sensitive to other processes on a
shared machine), each with its ratio to FP32's, and how emulation rounded
(``runtime_info()["emulation_kernel"]``: the compiled kernel, or MXNet's ops where it could
not be built; ``GLUON_AMP_EMULATION_KERNEL=0`` measures the latter). The kernel is built, on
first use, inside the first emulated process's untimed steps.

``--interleaved`` times each emulated mode against FP32 in one process: the FP32 net and its
emulated twin (built in an ``autocast(mode, emulate=True)`` region) take their steps in turn, so
load on a shared machine hits both alike; where one mode's processes differ by more than the
ratio sought (a VM's), this is the time figure. Memory needs a process per mode: run without it.

Workloads:
- ``resnet18``: Gluon model zoo ``resnet18_v1`` (10 classes), 112x112 inputs, batch 8,
  softmax cross-entropy;
- ``ssd512``: GluonCV ``ssd_512_resnet50_v1_coco`` (``pretrained_base=False``), 512x512,
  batch 1, ``SSDMultiBoxLoss`` on random targets (as ``ssd_synthetic.py``).
Both: SGD with momentum, ``hybridize(static_alloc=True, static_shape=True)``; the AMP modes
use ``init(target_dtype, emulate=True)``, ``init_trainer`` and ``scale_loss``.
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

from _report import median_of, own_peak_rss_mb, threads_text  # benchmarks/ is on sys.path when run as a script

MODES = ("fp32", "float16", "bfloat16")  # float16/bfloat16: emulated
NETS = ("resnet18", "ssd512")
#: (warmup, timed) steps per net by default; SSD-512's emulated float16 overflows on its first
#: steps (the scaler backs off from 65536): 3 untimed steps leave most of the timed ones updating
STEPS = {"resnet18": (2, 8), "ssd512": (3, 3)}
#: (warmup, timed) step pairs per net with ``--interleaved`` (each pair: one FP32, one emulated step)
INTERLEAVED_STEPS = {"resnet18": (4, 30), "ssd512": (3, 12)}


def _workload(net_name: str) -> tuple:
    """``(net, data, labels, loss function)``, built from seed 0."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if net_name == "resnet18":
            from mxnet.gluon.model_zoo import vision
            net = vision.resnet18_v1(classes=10)
            x = mx.nd.random.uniform(-1, 1, shape=(8, 3, 112, 112))
            labels = [mx.nd.array(mx.nd.random.randint(0, 10, shape=(8,)).asnumpy())]
            loss = gluon.loss.SoftmaxCrossEntropyLoss()
        else:
            import gluoncv as gcv
            from gluoncv.model_zoo import get_model
            net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False, norm_layer=gluon.nn.BatchNorm)
            x = mx.nd.random.uniform(-1, 1, shape=(1, 3, 512, 512))
            labels = [mx.nd.random.uniform(0, 1, shape=(1, 6132)), mx.nd.random.uniform(0, 1, shape=(1, 6132, 4))]
            loss = gcv.loss.SSDMultiBoxLoss()
        net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    return net, x, labels, loss


def _trained(net_name: str) -> tuple:
    """``(net, data, labels, loss function, trainer, scaler)``: the workload and its SGD trainer."""
    from mxnet import gluon
    import gluon_amp
    net, x, labels, loss_fn = _workload(net_name)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.001, "momentum": 0.9},
                            update_on_kvstore=False)
    return net, x, labels, loss_fn, trainer, gluon_amp.init_trainer(trainer)


def _step(net_name: str, parts: tuple) -> tuple:
    """One training step, waited for: ``(seconds, loss)``."""
    import mxnet as mx
    from mxnet import autograd
    import gluon_amp
    net, x, labels, loss_fn, trainer, _ = parts
    t0 = time.perf_counter()
    with autograd.record():
        out = net(x)
        if net_name == "resnet18":
            loss = loss_fn(out, labels[0])
        else:
            loss = loss_fn([out[0]], [out[1]], labels[:1], labels[1:])[0][0]
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(x.shape[0])
    mx.nd.waitall()
    return time.perf_counter() - t0, float(loss.asnumpy().mean())  # not an MXNet mean: model_families.py's _step


def child(net_name: str, mode: str, warmup: int, steps: int) -> Dict[str, Any]:
    """One mode of one net, in this process: median step seconds and peak RSS."""
    import gluon_amp
    if mode != "fp32":
        gluon_amp.init(target_dtype=mode, emulate=True)
    parts = _trained(net_name)
    scaler = parts[5]
    rounding = gluon_amp.runtime_info()["emulation_kernel"] if mode != "fp32" else None
    times, losses, skipped = [], [], []
    for i in range(warmup + steps):
        seconds, loss = _step(net_name, parts)
        if i >= warmup:
            times.append(seconds)
            skipped.append(scaler.last_step_skipped)
        losses.append(loss)
    updated = [t for t, s in zip(times, skipped) if not s] or times  # all skipped: every step counts
    return {"net": net_name, "mode": mode, "sec_per_step": statistics.median(updated), "step_seconds": updated,
            "timed_skipped": sum(skipped), "peak_rss_mb": own_peak_rss_mb(), "losses": losses,
            "skipped_steps": scaler.skipped_steps, "rounding": rounding}


def child_interleaved(net_name: str, mode: str, warmup: int, steps: int,
                      emulated_leads: bool = False) -> Dict[str, Any]:
    """The FP32 net and its emulated twin (built and stepped in an ``autocast(mode, emulate=True)``
    region) in this process, their steps alternating (which goes first alternates too), so that
    load on a shared machine hits both alike: each pair's time ratio, emulated over FP32. The
    twin takes the process's first step if ``emulated_leads`` (``_report.alternate``)."""
    import gluon_amp
    from _report import alternate  # benchmarks/ is on sys.path when run as a script
    fp32 = _trained(net_name)
    with gluon_amp.autocast(target_dtype=mode, emulate=True):
        emulated = _trained(net_name)
    rounding: List[Any] = []

    def emulated_step() -> float:
        with gluon_amp.autocast(target_dtype=mode, emulate=True):
            seconds = _step(net_name, emulated)[0]
            if not rounding:
                rounding.append(gluon_amp.runtime_info()["emulation_kernel"])
                if not gluon_amp.report(emulated[0]).emulated:
                    raise RuntimeError(f"{net_name}: the {mode} twin does not run emulated")
        return seconds

    # a skipped update is cheaper: not a pair to compare
    pairs = alternate(lambda: _step(net_name, fp32)[0], emulated_step, warmup, steps,
                      counts=lambda: not emulated[5].last_step_skipped, second_leads=emulated_leads)
    return {"net": net_name, "mode": mode, "emulated_led": emulated_leads, "ratios": pairs["ratios"],
            "ratio": pairs["ratio"],
            "fp32_sec_per_step": pairs["first_seconds"], "sec_per_step": pairs["second_seconds"],
            "timed_skipped": pairs["left_out"], "rounding": rounding[0] if rounding else None}


def _run_child(net_name: str, mode: str, warmup: int, steps: int, timeout: float,
               interleaved: bool = False, emulated_leads: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-interleaved" if interleaved else "--child",
           net_name, mode, "--warmup", str(warmup), "--steps", str(steps)] \
        + (["--emulated-leads"] if emulated_leads else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{net_name} {mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(nets: List[str], rounds: int, warmup: Optional[int], steps: Optional[int],
        timeout: float = 3600) -> Dict[str, Any]:
    """Every net and mode, ``rounds`` times (modes back to back within a round)."""
    load = os.getloadavg()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {m: [] for m in MODES} for n in nets}
    for r in range(rounds):
        for n in nets:
            w, s = STEPS[n]
            for m in MODES:
                res = _run_child(n, m, w if warmup is None else warmup, s if steps is None else steps, timeout)
                runs[n][m].append(res)
                print(f"round {r + 1}/{rounds} {n:<8} {m:<8} {res['sec_per_step']:.3f} s/step  "
                      f"{res['peak_rss_mb']:.0f} MB  {res['timed_skipped']} timed step(s) skipped",
                      file=sys.stderr, flush=True)
    summary = {}
    for n in nets:
        summary[n] = {}
        for m in MODES:
            summary[n][m] = {"sec_per_step": statistics.median(x["sec_per_step"] for x in runs[n][m]),
                             "min_sec_per_step": min(t for x in runs[n][m] for t in x["step_seconds"]),
                             "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs[n][m]),
                             "timed_skipped": sum(x["timed_skipped"] for x in runs[n][m]),
                             "rounding": runs[n][m][-1]["rounding"]}
        base = summary[n]["fp32"]
        for m in MODES:
            s = summary[n][m]
            s["time_vs_fp32"] = s["sec_per_step"] / base["sec_per_step"]
            s["min_time_vs_fp32"] = s["min_sec_per_step"] / base["min_sec_per_step"]
            s["memory_vs_fp32"] = s["peak_rss_mb"] / base["peak_rss_mb"]
    from _report import host_info  # benchmarks/ is on sys.path when run as a script
    return {"host": host_info(), "load_before": load, "load_after": os.getloadavg(), "rounds": rounds,
            "summary": summary, "runs": runs}


def _num(v: Optional[float], fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def run_interleaved(nets: List[str], rounds: int, warmup: Optional[int], steps: Optional[int],
                    timeout: float = 3600) -> Dict[str, Any]:
    """Each emulated mode against FP32, both in one process per (net, mode, round), steps
    alternating: the time ratio on a machine whose processes differ more than the ratio does.
    FP32 takes the first step in odd rounds, the twin in even ones (the net that stepped second
    could run its update slower: docs/benchmarks.md, the AVX2 host)."""
    load = os.getloadavg()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {m: [] for m in MODES[1:]} for n in nets}
    for r in range(rounds):
        for n in nets:
            w, s = INTERLEAVED_STEPS[n]
            for m in MODES[1:]:
                res = _run_child(n, m, w if warmup is None else warmup, s if steps is None else steps, timeout,
                                 interleaved=True, emulated_leads=r % 2 == 1)
                runs[n][m].append(res)
                print(f"round {r + 1}/{rounds} {n:<8} {m:<8} emulated/FP32 {_num(res['ratio'])} (FP32 "
                      f"{_num(res['fp32_sec_per_step'])} s/step)  {res['timed_skipped']} pair(s) skipped",
                      file=sys.stderr, flush=True)
    summary = {n: {m: {"time_vs_fp32": median_of(x["ratio"] for x in runs[n][m]),
                       "per_process": [x["ratio"] and round(x["ratio"], 3) for x in runs[n][m]],
                       "emulated_led": [x["emulated_led"] for x in runs[n][m]],
                       "fp32_sec_per_step": median_of(x["fp32_sec_per_step"] for x in runs[n][m]),
                       "timed_skipped": sum(x["timed_skipped"] for x in runs[n][m]),
                       "rounding": runs[n][m][-1]["rounding"]} for m in MODES[1:]} for n in nets}
    from _report import host_info  # benchmarks/ is on sys.path when run as a script
    return {"host": host_info(), "load_before": load, "load_after": os.getloadavg(), "rounds": rounds,
            "interleaved": True, "summary": summary, "runs": runs}


def format_interleaved(doc: Dict[str, Any]) -> str:
    lines = [f"{'net':<9} {'mode':<19} {'FP32 s/step':>11} {'time vs FP32':>12}  per process"]
    for n, modes in doc["summary"].items():
        for m, s in modes.items():
            lines.append(f"{n:<9} {'emulated ' + m:<19} {_num(s['fp32_sec_per_step']):>11} "
                         f"{_num(s['time_vs_fp32']):>11}x  "
                         + " ".join(_num(v) + "*" * led for v, led in zip(s["per_process"], s["emulated_led"]))
                         + (f"  ({s['timed_skipped']} pair(s) the scaler skipped, left out)" if s["timed_skipped"]
                            else ""))
    roundings = {f"{s['rounding']['path']} ({s['rounding']['why']})" for modes in doc["summary"].values()
                 for s in modes.values() if s.get("rounding")}
    lines += [f"emulation rounded with: {r}" for r in sorted(roundings)]
    h = doc["host"]
    lines.append(f"host flags {' '.join(h['flags'])}, {threads_text(h)}, "
                 f"DNNL_MAX_CPU_ISA={h['DNNL_MAX_CPU_ISA']}, load {doc['load_before'][0]:.2f} before, "
                 f"{doc['load_after'][0]:.2f} after; time vs FP32: median over {doc['rounds']} process(es) of "
                 "each one's median ratio of an emulated step to the FP32 step beside it (*: the emulated net "
                 "took the process's first step; memory: run without --interleaved)")
    return "\n".join(lines)


def format_table(doc: Dict[str, Any]) -> str:
    lines = [f"{'net':<9} {'mode':<19} {'s/step':>7} {'vs FP32':>8} {'min s':>7} {'vs FP32':>8} "
             f"{'peak MB':>8} {'vs FP32':>8}"]
    for n, modes in doc["summary"].items():
        for m, s in modes.items():
            name = m if m == "fp32" else f"emulated {m}"
            lines.append(f"{n:<9} {name:<19} {s['sec_per_step']:>7.3f} {s['time_vs_fp32']:>7.2f}x "
                         f"{s['min_sec_per_step']:>7.3f} {s['min_time_vs_fp32']:>7.2f}x "
                         f"{s['peak_rss_mb']:>8.0f} {s['memory_vs_fp32']:>7.2f}x")
    roundings = {f"{s['rounding']['path']} ({s['rounding']['why']})" for modes in doc["summary"].values()
                 for s in modes.values() if s.get("rounding")}
    lines += [f"emulation rounded with: {r}" for r in sorted(roundings)]
    skipped = {f"{n} {m}": s["timed_skipped"] for n, modes in doc["summary"].items() for m, s in modes.items()
               if s["timed_skipped"]}
    if skipped:
        lines.append("timed steps the loss scaler skipped (left out of s/step unless all were): "
                     + ", ".join(f"{k} {v}" for k, v in skipped.items()))
    h = doc["host"]
    lines.append(f"host flags {' '.join(h['flags'])}, {threads_text(h)}, "
                 f"DNNL_MAX_CPU_ISA={h['DNNL_MAX_CPU_ISA']}, load "
                 f"{doc['load_before'][0]:.2f} before, {doc['load_after'][0]:.2f} after; s/step: median "
                 f"over {doc['rounds']} process(es) of each one's median step; min s: fastest step")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default=",".join(NETS), help=f"comma separated, from {', '.join(NETS)}")
    p.add_argument("--rounds", type=int, default=2, help="processes per (net, mode), modes back to back")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default per net)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default per net)")
    p.add_argument("--json", metavar="PATH", help="also write the full JSON document here")
    p.add_argument("--interleaved", action="store_true",
                   help="time only: FP32 and emulated steps alternating in one process per (net, mode)")
    p.add_argument("--child", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--child-interleaved", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--emulated-leads", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.child_interleaved:
        net_name, mode = args.child or args.child_interleaved
        w, s = (STEPS if args.child else INTERLEAVED_STEPS)[net_name]
        w, s = w if args.warmup is None else args.warmup, s if args.steps is None else args.steps
        print(json.dumps(child(net_name, mode, w, s) if args.child
                         else child_interleaved(net_name, mode, w, s, args.emulated_leads)))
        return None
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    bad = [n for n in nets if n not in NETS]
    if bad or not nets:
        p.error(f"--nets: unknown {bad}; choose from {', '.join(NETS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.interleaved:
        doc = run_interleaved(nets, args.rounds, args.warmup, args.steps)
        print(format_interleaved(doc))
    else:
        doc = run(nets, args.rounds, args.warmup, args.steps)
        print(format_table(doc))
    print(json.dumps(doc["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
