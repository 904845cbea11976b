"""Is AMP worse than FP32? A small, learnable detection task, trained to the end, several seeds.

    python benchmarks/convergence.py --plot conv.png --json conv.json
    python benchmarks/convergence.py --smoke            # seconds: the pipeline and the metric

The data set is made in code with a fixed seed: coloured shapes (square, disc, triangle, bar)
on noisy backgrounds, 1-4 objects per 64x64 image, with boxes and labels, split into train
and held-out images. A small GluonCV SSD (its anchor generator, SSDTargetGenerator,
SSDMultiBoxLoss, VOC07MApMetric) trains with the tutorial's loop (``init``, ``init_trainer``,
``scale_loss``) in each mode: FP32, native bfloat16 where the host has bf16 kernels, and
emulated float16 and bfloat16 everywhere. Every mode runs with ``--seeds`` seeds (at least 3;
a seed sets the initial weights; data, their order and steps are the same for all), each run
in a process of its own.

The verdict is one-sided: an AMP mode fails only if its mean final mAP is below FP32's mean by
more than a tolerance taken from the seeds (see ``verdict``). Ending above FP32 never fails.
Each run's first step is also compared with FP32's of the same seed (equal weights: the
numerics alone), and the steps its loss scaler skipped are named with the scale it went to
(``first_steps``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from loss_match import CurveMatch, Step, match_curves  # noqa: E402  (benchmarks/ is on sys.path; pure: no MXNet)

CLASSES = ("square", "disc", "triangle", "bar")
SIZE = 64
MIN_SEEDS = 3        # a sample standard deviation from fewer runs says next to nothing
FLOOR = 0.01         # the smallest tolerance: 1 mAP point
SE_MULTIPLE = 2.0    # the tolerance is this many standard errors of the difference of the means


# -- the data set -------------------------------------------------------------------------

def _draw(img: np.ndarray, kind: int, box: Tuple[int, int, int, int], color: np.ndarray) -> None:
    """Paint one shape of class ``kind`` filling ``box`` (x0, y0, x1, y1) of ``img`` (H, W, 3)."""
    x0, y0, x1, y1 = box
    yy, xx = np.mgrid[y0:y1, x0:x1]
    w, h = x1 - x0, y1 - y0
    if kind == 0:
        mask = np.ones_like(yy, dtype=bool)
    elif kind == 1:
        mask = ((xx - x0 - w / 2 + 0.5) / (w / 2)) ** 2 + ((yy - y0 - h / 2 + 0.5) / (h / 2)) ** 2 <= 1
    elif kind == 2:
        mask = (yy - y0) >= np.abs(xx - x0 - w / 2 + 0.5) * 2 * h / w - 0.5
    else:
        mask = np.ones_like(yy, dtype=bool)
    img[y0:y1, x0:x1][mask] = color


def make_dataset(n: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Make ``n`` images of coloured shapes on noise, the same for the same ``seed``.

    Returns
    -------
    images : np.ndarray
        (n, 3, 64, 64) float32.
    labels : np.ndarray
        (n, 4, 5) float32 rows ``[class, x0, y0, x1, y1]`` in pixels; -1 rows pad.
    """
    rng = np.random.RandomState(seed)
    images = np.zeros((n, SIZE, SIZE, 3), np.float32)
    labels = -np.ones((n, 4, 5), np.float32)
    for i in range(n):
        img = rng.normal(0.0, 0.15, (SIZE, SIZE, 3)).astype(np.float32) + rng.uniform(-0.3, 0.3, 3)
        for j in range(rng.randint(1, 5)):
            kind = rng.randint(len(CLASSES))
            w = rng.randint(12, 26)
            h = max(4, w // 3) if kind == 3 else w
            x0, y0 = rng.randint(0, SIZE - w), rng.randint(0, SIZE - h)
            _draw(img, kind, (x0, y0, x0 + w, y0 + h), rng.uniform(-1.0, 1.0, 3).astype(np.float32))
            labels[i, j] = (kind, x0, y0, x0 + w, y0 + h)
        images[i] = img
    return images.transpose(0, 3, 1, 2).copy(), labels


# -- the model ----------------------------------------------------------------------------

def _features(**kwargs: Any) -> Any:
    """A small multi-output feature network (a HybridBlock): 16x16, 8x8 and 4x4 maps of a
    64x64 image. ``kwargs`` (GluonCV's pretrained/ctx) are ignored: nothing is downloaded."""
    from mxnet.gluon import nn

    class Features(nn.HybridBlock):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            with self.name_scope():
                self.stages = nn.HybridSequential()
                for i, (ch, stride) in enumerate([(32, 2), (48, 2), (64, 1), (96, 2), (128, 2)]):
                    blk = nn.HybridSequential()
                    blk.add(nn.Conv2D(ch, 3, strides=stride, padding=1, use_bias=False),
                            nn.BatchNorm(), nn.Activation("relu"))
                    self.stages.add(blk)

        def hybrid_forward(self, F: Any, x: Any) -> List[Any]:
            outs = []
            for i, stage in enumerate(self.stages):
                x = stage(x)
                if i >= 2:
                    outs.append(x)
            return outs

    return Features()


def build_net() -> Any:
    """GluonCV's ``SSD`` over ``_features``: 3 feature maps, 3 anchors per cell, 4 classes."""
    from gluoncv.model_zoo.ssd.ssd import SSD
    return SSD(None, SIZE, _features, None, sizes=[8, 20, 34, 56], ratios=[[1, 2, 0.5]] * 3,
               steps=[4, 8, 16], classes=CLASSES, nms_thresh=0.45, nms_topk=200, post_nms=50)


# -- one mode, in its own process ---------------------------------------------------------

def train_mode(mode: str, seed: int, epochs: int, n_train: int, n_test: int, batch: int,
               lr: float, data_seed: int) -> Dict[str, Any]:
    """Train and evaluate one mode in this process (``init`` patches it for good).

    The data, their order and the steps depend on ``data_seed`` only, the weights' initial
    values on ``seed``. Returns the per-step losses, the mAP before training (``map_initial``:
    where a run that never updates its weights stays) and after every epoch, and the scaler's
    state, or ``{"unavailable": why}`` if this gluon_amp cannot run ``mode``.
    """
    import mxnet as mx
    from mxnet import autograd, gluon
    import gluon_amp
    from gluoncv.loss import SSDMultiBoxLoss
    from gluoncv.model_zoo.ssd.target import SSDTargetGenerator
    from gluoncv.utils.metrics.voc_detection import VOC07MApMetric

    if mode.startswith("emulated-"):
        try:
            gluon_amp.init(target_dtype=mode.split("-", 1)[1], emulate=True)
        except TypeError as e:  # a gluon_amp from before emulate=True (issue 17)
            if "emulate" not in str(e):
                raise
            return {"mode": mode, "seed": seed, "unavailable": f"not available yet: {e}"}
    elif mode == "bfloat16":
        gluon_amp.init(target_dtype="bfloat16")
    mx.random.seed(seed)
    np.random.seed(seed)
    x_tr, y_tr = make_dataset(n_train, data_seed)
    x_te, y_te = make_dataset(n_test, data_seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = build_net()
        net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    with autograd.train_mode():
        _, _, anchors = net(mx.nd.zeros((1, 3, SIZE, SIZE)))
    target = SSDTargetGenerator(iou_thresh=0.5, stds=(0.1, 0.1, 0.2, 0.2), negative_mining_ratio=-1)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr, "momentum": 0.9, "wd": 5e-4},
                            update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer)
    loss_fn = SSDMultiBoxLoss()
    order = np.random.RandomState(data_seed).permutation
    losses, history, maps, t0 = [], [], [], time.time()
    steps_per_epoch = n_train // batch
    net.hybridize(static_alloc=True, static_shape=True)
    map_initial = evaluate(net, x_te, y_te, VOC07MApMetric, batch)  # inference: draws no random numbers
    for epoch in range(epochs):
        net.hybridize(static_alloc=True, static_shape=True)  # SSD's graph differs in training and
        idx = order(n_train)                                 # inference: rebuild it, as GluonCV does
        for s in range(steps_per_epoch):
            b = idx[s * batch:(s + 1) * batch]
            data, lab = mx.nd.array(x_tr[b]), mx.nd.array(y_tr[b])
            gt_boxes, gt_ids = lab.slice_axis(axis=-1, begin=1, end=5), lab.slice_axis(axis=-1, begin=0, end=1)
            cls_t, box_t, _ = target(anchors, None, gt_boxes, gt_ids)
            with autograd.record():
                cls_p, box_p, _ = net(data)
                total, _, _ = loss_fn([cls_p], [box_p], [cls_t], [box_t])
                with gluon_amp.scale_loss(total, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(1)  # SSDMultiBoxLoss already normalises by the positive anchors
            losses.append(float(total[0].mean().asscalar()))
            history.append(Step(losses[-1], not scaler.last_step_skipped, scaler.loss_scale).to_dict())
        net.hybridize(static_alloc=True, static_shape=True)
        maps.append(evaluate(net, x_te, y_te, VOC07MApMetric, batch))
    return {"mode": mode, "seed": seed, "losses": losses, "history": history, "map_initial": map_initial,
            "map_per_epoch": maps,
            "final_map": maps[-1],
            "final_loss": float(np.mean(losses[-steps_per_epoch:])), "skipped_steps": scaler.skipped_steps,
            "loss_scale": trainer._amp_loss_scaler.loss_scale, "seconds": time.time() - t0,
            "runtime_mode": gluon_amp.runtime_info()["mode"]}


def evaluate(net: Any, x: np.ndarray, y: np.ndarray, metric_cls: Any, batch: int) -> float:
    """VOC07 mAP (IoU 0.5) of ``net``'s detections on images ``x`` against labels ``y``."""
    import mxnet as mx
    metric = metric_cls(iou_thresh=0.5, class_names=CLASSES)
    for s in range(0, len(x), batch):
        ids, scores, boxes = net(mx.nd.array(x[s:s + batch]))
        lab = y[s:s + batch]
        metric.update(boxes, ids, scores, mx.nd.array(lab[:, :, 1:5]), mx.nd.array(lab[:, :, 0:1]))
    return float(metric.get()[1][-1])


# -- the driver ---------------------------------------------------------------------------

def plan(seeds: int) -> Tuple[List[Tuple[str, int]], List[str]]:
    """The runs as ``(mode, seed)``, seed by seed (each seed runs every mode back to back, so a
    change of the machine's load falls on all modes alike), and why native bfloat16 is not
    among them, if it is not."""
    sys.path.insert(0, ROOT)
    import gluon_amp
    info = gluon_amp.runtime_info()
    modes, skipped = ["fp32"], []
    if info["bf16"] == "native":
        modes.append("bfloat16")
    else:
        skipped.append(f"native bfloat16 not run: {info['bf16_why']}")
    modes += ["emulated-float16", "emulated-bfloat16"]
    return [(mode, seed) for seed in range(seeds) for mode in modes], skipped


def run_in_subprocess(mode: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Run ``train_mode`` in a fresh interpreter and return its result, or ``{"error": the last
    line of its stderr}`` if it died (its stderr's end is printed)."""
    cfg = json.dumps({"mode": mode, "seed": seed, "epochs": args.epochs, "n_train": args.train,
                      "n_test": args.test, "batch": args.batch_size, "lr": args.lr, "data_seed": args.data_seed})
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0, cpu0 = time.time(), _children_cpu()
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", cfg], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        print(f"mode {mode} (seed {seed}) died:\n{r.stderr[-3000:]}", file=sys.stderr)
        lines = r.stderr.strip().splitlines() or [f"exit status {r.returncode}"]
        return {"mode": mode, "seed": seed, "error": lines[-1], "process_seconds": time.time() - t0}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.time() - t0  # with start-up, imports and the evaluations
    out["process_cpu_seconds"] = _children_cpu() - cpu0  # all threads; grows less with others' load
    return out


def _children_cpu() -> float:
    """User plus system CPU seconds of this process's finished children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def summarize(results: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per mode, in the order the modes first appear: the seeds, their final mAPs, and the
    mean, sample standard deviation (``None`` for one run), min and max of those. Runs that
    died (``"error"``) are left out."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in results:
        if "error" in r:
            continue
        m = out.setdefault(r["mode"], {"seeds": [], "final_maps": []})
        m["seeds"].append(r["seed"])
        m["final_maps"].append(float(r["final_map"]))
    for m in out.values():
        v = np.asarray(m["final_maps"])
        m.update(n=len(v), mean=float(v.mean()), std=float(v.std(ddof=1)) if len(v) > 1 else None,
                 min=float(v.min()), max=float(v.max()))
    return out


def verdict(results: List[Dict[str, Any]], floor: float = FLOOR) -> Dict[str, Any]:
    """Is each AMP mode worse than FP32? A one-sided comparison of mean final mAPs.

    With ``m`` and ``s`` a mode's mean and sample standard deviation over its ``n`` seeds, the
    mode fails when ``m - m_fp32 < -tolerance``, where::

        tolerance = max(floor, SE_MULTIPLE * sqrt(s_fp32**2 / n_fp32 + s**2 / n))

    i.e. two standard errors of the difference of the two means (Welch's), never less than
    ``floor``. A mode above FP32, by any amount, passes. A mode with a run that died (a
    result with ``"error"``, e.g. gluon_amp's error after 25 skipped steps in a row) fails.

    Raises
    ------
    ValueError
        If FP32 or any mode has fewer than ``MIN_SEEDS`` runs (their spread is no tolerance),
        or an FP32 run died (there is no reference).
    """
    runs: Dict[str, int] = {}
    for r in results:
        runs[r["mode"]] = runs.get(r["mode"], 0) + 1
    if "fp32" not in runs:
        raise ValueError("the verdict compares every AMP mode with FP32, and there is no FP32 result; "
                         f"run FP32 with at least {MIN_SEEDS} seeds")
    died = {mode: [r["error"] for r in results if r["mode"] == mode and "error" in r] for mode in runs}
    if died["fp32"]:
        raise ValueError(f"{len(died['fp32'])} FP32 run(s) died, so there is no reference: {died['fp32'][0]}")
    short = {mode: n for mode, n in runs.items() if n < MIN_SEEDS}
    if short:
        counts = ", ".join(f"{mode} has {n} seed{'s' if n != 1 else ''}" for mode, n in short.items())
        raise ValueError(f"the verdict needs at least {MIN_SEEDS} seeds per mode for its tolerance, but "
                         f"{counts}; run with --seeds {MIN_SEEDS} or more")
    stats = summarize(results)
    ref = stats["fp32"]
    out: Dict[str, Any] = {"fp32": ref, "floor": floor, "se_multiple": SE_MULTIPLE, "modes": {}}
    initial = [r["map_initial"] for r in results if "map_initial" in r]
    if initial:  # what a mode that never updates its weights would end near
        out["initial_map"] = float(np.mean(initial))
    for mode in runs:
        if mode == "fp32":
            continue
        if died[mode]:
            out["modes"][mode] = {"n": runs[mode], "died": len(died[mode]), "error": died[mode][0],
                                  "passes": False}
            continue
        s = stats[mode]
        se = float(np.sqrt(ref["std"] ** 2 / ref["n"] + s["std"] ** 2 / s["n"]))
        tolerance = max(floor, SE_MULTIPLE * se)
        diff = s["mean"] - ref["mean"]
        out["modes"][mode] = {**s, "map_diff": diff, "se": se, "tolerance": tolerance,
                              "passes": bool(diff >= -tolerance)}
    return out


def first_steps(results: List[Dict[str, Any]]) -> Dict[str, CurveMatch]:
    """Per AMP run (``'mode (seed k)'``): its loss against FP32's of the same seed by
    benchmarks/loss_match.py's rule, where each step trains on a new batch: the first step
    (both at the same initial weights: the numerics alone), and the steps the loss scaler
    skipped, named with the scale it went to. Later steps are not compared: the runs
    decorrelate (the final mAPs are the verdict), and after a skip the same step index is
    another number of updates."""
    ref = {r["seed"]: r for r in results if r["mode"] == "fp32" and r.get("history")}
    out = {}
    for r in results:
        if r["mode"] != "fp32" and r.get("history") and r["seed"] in ref:
            out[f"{r['mode']} (seed {r['seed']})"] = match_curves(
                [Step.from_dict(s) for s in r["history"]], [Step.from_dict(s) for s in ref[r["seed"]]["history"]],
                same_batch=False, max_updates=1)
    return out


RULE = ("a mode FAILS if its mean final mAP is below FP32's by more than its tolerance, "
        "max({floor:g}, {k:g} * sqrt(std_fp32^2/n_fp32 + std_mode^2/n_mode)) (std: sample standard deviation "
        "over the seeds); ending above FP32 always passes")


def _modes(results: List[Dict[str, Any]]) -> List[str]:
    """The modes of ``results`` in the order they first appear, runs that died included."""
    return list(dict.fromkeys(r["mode"] for r in results))


def print_table(doc: Dict[str, Any]) -> None:
    """Print every run, then per mode the mean ± sample std over the seeds and the verdict."""
    head = (f"{'mode':<18}{'seed':>5}{'final mAP':>11}{'final loss':>12}{'skipped':>9}{'scale':>9}"
            f"{'train s':>9}{'proc s':>8}{'cpu s':>7}")
    print(head)
    print("-" * len(head))
    modes = _modes(doc["results"])
    for mode in modes:
        for r in (r for r in doc["results"] if r["mode"] == mode):
            if "error" in r:
                print(f"{r['mode']:<18}{r['seed']:>5}  died: {r['error']}")
                continue
            print(f"{r['mode']:<18}{r['seed']:>5}{r['final_map']:>11.4f}{r['final_loss']:>12.4f}"
                  f"{r['skipped_steps']:>9}{r['loss_scale']:>9g}{r['seconds']:>9.1f}"
                  f"{r.get('process_seconds', float('nan')):>8.1f}{r.get('process_cpu_seconds', float('nan')):>7.0f}")
    print()
    head = f"{'mode':<18}{'n':>3}{'mean ± std':>18}{'min - max':>17}{'vs FP32':>9}{'tolerance':>11}  verdict"
    print(head)
    print("-" * len(head))
    stats, v = summarize(doc["results"]), doc["verdict"]
    for mode in modes:
        m = v["modes"].get(mode) if v is not None else None
        if mode in stats:
            s = stats[mode]
            std = f"{s['std']:.4f}" if s["std"] is not None else "-"
            line = f"{mode:<18}{s['n']:>3}{s['mean']:>10.4f} ± {std:<6}{s['min']:>8.4f} - {s['max']:.4f}"
        else:
            line = f"{mode:<18}{0:>3}{'-':>18}{'-':>17}"
        if m is not None and "died" in m:
            line += f"  {m['died']} of {m['n']} runs died  FAIL"
        elif m is not None:
            line += f"{m['map_diff']:>+9.4f}{m['tolerance']:>11.4f}  {'pass' if m['passes'] else 'FAIL'}"
        print(line)
    if v is None:
        print(f"no verdict: {doc['no_verdict']}")
    else:
        print("rule: " + RULE.format(floor=v["floor"], k=v["se_multiple"]))
        if "initial_map" in v:
            print(f"untrained network: mAP {v['initial_map']:.4f}; a mode that never updated its weights would "
                  f"end {v['fp32']['mean'] - v['initial_map']:.4f} below FP32")
        for mode, m in v["modes"].items():
            if "died" in m:
                print(f"verdict: {mode} FAILS: {m['died']} of {m['n']} runs died ({m['error']})")
            else:
                print(f"verdict: {mode} {'passes' if m['passes'] else 'FAILS'}: mean mAP {m['map_diff']:+.4f} "
                      f"vs FP32, tolerance {m['tolerance']:.4f}")
    for name, m in first_steps(doc["results"]).items():
        print(m.describe(name))
    for why in doc["skipped"]:
        print(why)


def plot(doc: Dict[str, Any], path: str) -> None:
    """Three panels: the loss (mean over seeds, band min-max), the held-out mAP per epoch (mean,
    band min-max; epoch 0 is the untrained network) and every seed's final mAP with the mean ±
    sample std and, under the verdict, the level below which the mode fails."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1.1, 1.1, 1]})
    modes, stats, v = _modes(doc["results"]), summarize(doc["results"]), doc["verdict"]
    for i, mode in enumerate(modes):
        color = f"C{i}"
        m = v["modes"].get(mode) if v is not None else None
        if m is not None:
            label = "pass" if m["passes"] else ("FAIL: a run died" if "died" in m else "FAIL")
            top = stats[mode]["max"] if mode in stats else v["fp32"]["mean"]
            c.annotate(label, (i, top), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8,
                       color="black" if m["passes"] else "red")
            if "tolerance" in m:
                c.hlines(v["fp32"]["mean"] - m["tolerance"], i - 0.4, i + 0.4, colors="red", linestyles=":")
        if mode not in stats:
            continue
        s = stats[mode]
        runs = [r for r in doc["results"] if r["mode"] == mode and "error" not in r]
        k = max(1, len(runs[0]["losses"]) // 100)
        loss = np.array([np.convolve(r["losses"], np.ones(k) / k, mode="valid") for r in runs])
        steps = np.arange(loss.shape[1])
        a.plot(steps, loss.mean(0), color=color, label=f"{mode} (n={s['n']})")
        a.fill_between(steps, loss.min(0), loss.max(0), color=color, alpha=0.2, linewidth=0)
        maps = np.array([[r.get("map_initial", np.nan)] + r["map_per_epoch"] for r in runs])
        epochs = np.arange(maps.shape[1])
        b.plot(epochs, maps.mean(0), color=color, marker="o", markersize=3, label=mode)
        b.fill_between(epochs, maps.min(0), maps.max(0), color=color, alpha=0.2, linewidth=0)
        jitter = np.linspace(-0.12, 0.12, s["n"]) if s["n"] > 1 else np.zeros(1)
        c.scatter(i + jitter, s["final_maps"], color=color, s=18, alpha=0.7, zorder=3)
        c.errorbar(i + 0.3, s["mean"], yerr=s["std"] or 0.0, color=color, marker="D", capsize=4, zorder=3)
    if v is not None:
        c.axhline(v["fp32"]["mean"], color="gray", linestyle="--", linewidth=0.8, label="FP32 mean")
        c.plot([], [], color="red", linestyle=":", label="fails below (FP32 mean - tolerance)")
    c.set_xticks(range(len(modes)))
    c.set_xticklabels(modes, rotation=15, fontsize=8)
    c.set_ylabel("final mAP: seeds (dots), mean ± sample std")
    a.set_xlabel("step")
    a.set_ylabel("SSD loss (moving mean; band: min-max over seeds)")
    a.set_yscale("log")
    b.set_xlabel("epoch (0: untrained)")
    b.set_ylabel("VOC07 mAP, held out (band: min-max)")
    for ax in (a, b, c):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def failed(doc: Dict[str, Any]) -> bool:
    """True if a run died, the verdict failed a mode, or it could not be given though the run
    asked for one."""
    if any("error" in r for r in doc["results"]):
        return True
    if doc["verdict"] is None:
        return doc["seeds"] >= MIN_SEEDS
    return not all(m["passes"] for m in doc["verdict"]["modes"].values())


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line; bad values are argparse errors (exit status 2)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train", type=int, default=768, help="training images")
    p.add_argument("--test", type=int, default=192, help="held-out images")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data-seed", type=int, default=7)
    p.add_argument("--seeds", type=int, default=MIN_SEEDS,
                   help=f"runs per mode, seeds 0..N-1 (at least {MIN_SEEDS}: the tolerance needs each mode's spread)")
    p.add_argument("--floor", type=float, default=FLOOR,
                   help="the smallest tolerance, in mAP (default %(default)s: 1 mAP point)")
    p.add_argument("--smoke", action="store_true",
                   help="one seed, a few steps on tiny data: the pipeline and the metric, no verdict")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("epochs", "train", "test", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if args.seeds < MIN_SEEDS:
        p.error(f"--seeds must be >= {MIN_SEEDS} (the verdict's tolerance needs each mode's seed-to-seed "
                f"spread), got {args.seeds}; --smoke runs one seed without a verdict")
    if not 0 <= args.floor < 1:
        p.error(f"--floor must be in [0, 1) (an mAP difference), got {args.floor}")
    if args.smoke:
        args.epochs, args.train, args.test, args.batch_size, args.seeds = 1, 32, 16, 16, 1
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run every (mode, seed) in its own process, print the table and write ``--json``/``--plot``."""
    args = parse_args(argv)
    if args.worker:
        cfg = json.loads(args.worker)
        print(json.dumps(train_mode(**cfg)))
        return {}
    runs, skipped = plan(args.seeds)
    results, unavailable, t0 = [], set(), time.time()
    for mode, seed in runs:
        if mode in unavailable:
            continue
        print(f"training {mode} (seed {seed}) ...", flush=True)
        r = run_in_subprocess(mode, seed, args)
        if "unavailable" in r:
            unavailable.add(mode)
            skipped.append(f"{mode} not run: {r['unavailable']}")
        else:
            results.append(r)
        if mode == "fp32" and "error" in r:
            break  # no reference: the other runs could not be judged
    doc: Dict[str, Any] = {
        "task": "coloured shapes, 64x64, small GluonCV SSD", "epochs": args.epochs, "train": args.train,
        "test": args.test, "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds,
        "results": results, "skipped": skipped, "wall_seconds": time.time() - t0,
        "loss_match": {k: m.to_dict() for k, m in first_steps(results).items()},
        "command": " ".join(["python", "benchmarks/convergence.py"] + (argv if argv is not None else sys.argv[1:]))}
    try:
        doc["verdict"] = verdict(results, args.floor)
    except ValueError as e:
        doc["verdict"], doc["no_verdict"] = None, str(e)
    print_table(doc)
    if failed(doc):
        print("exit status 1: " + ("no verdict" if doc["verdict"] is None else "a mode FAILS"))
    print(f"wall time {doc['wall_seconds']:.0f} s for {len(results)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return doc


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result and failed(result) else 0)
