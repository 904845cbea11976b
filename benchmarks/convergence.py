"""Does AMP reach FP32's accuracy? A small, learnable detection task, trained to the end.

    python benchmarks/convergence.py --plot conv.png --json conv.json
    python benchmarks/convergence.py --smoke            # seconds: the pipeline and the metric

The data set is made in code with a fixed seed: coloured shapes (square, disc, triangle, bar)
on noisy backgrounds, 1-4 objects per 64x64 image, with boxes and labels, split into train
and held-out images. A small GluonCV SSD (its anchor generator, SSDTargetGenerator,
SSDMultiBoxLoss, VOC07MApMetric) trains with the tutorial's loop (``init``, ``init_trainer``,
``scale_loss``) in each mode, every mode in its own process with the same seed, data order
and steps: FP32 with two seeds (the run-to-run spread), native bfloat16 where the host has
bf16 kernels, and emulated float16 and bfloat16 everywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("square", "disc", "triangle", "bar")
SIZE = 64


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
    values on ``seed``. Returns the per-step losses, the mAP after every epoch and the
    scaler's state, or ``{"unavailable": why}`` if this gluon_amp cannot run ``mode``.
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
    losses, maps, t0 = [], [], time.time()
    steps_per_epoch = n_train // batch
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
        net.hybridize(static_alloc=True, static_shape=True)
        maps.append(evaluate(net, x_te, y_te, VOC07MApMetric, batch))
    return {"mode": mode, "seed": seed, "losses": losses, "map_per_epoch": maps, "final_map": maps[-1],
            "final_loss": float(np.mean(losses[-steps_per_epoch:])), "skipped_steps": scaler.skipped_steps,
            "loss_scale": scaler.loss_scale, "seconds": time.time() - t0,
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

def plan(smoke: bool) -> Tuple[List[Tuple[str, int]], List[str]]:
    """The modes as ``(mode, seed)``, and why native bfloat16 is not among them, if it is not."""
    sys.path.insert(0, ROOT)
    import gluon_amp
    info = gluon_amp.runtime_info()
    modes = [("fp32", 0), ("fp32", 1)] if not smoke else [("fp32", 0)]
    skipped: List[str] = []
    if info["bf16"] == "native":
        modes.append(("bfloat16", 0))
    else:
        skipped.append(f"native bfloat16 not run: {info['bf16_why']}")
    modes += [("emulated-float16", 0), ("emulated-bfloat16", 0)]
    return modes, skipped


def run_in_subprocess(mode: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Run ``train_mode`` in a fresh interpreter and return its result; exit if it fails."""
    cfg = json.dumps({"mode": mode, "seed": seed, "epochs": args.epochs, "n_train": args.train,
                      "n_test": args.test, "batch": args.batch_size, "lr": args.lr, "data_seed": args.data_seed})
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", cfg], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"mode {mode} (seed {seed}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def verdict(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each AMP mode's final mAP minus FP32's mean, and whether it is within the allowed
    difference: the FP32 seed spread, or 1 mAP point (0.01) if the spread is smaller."""
    fp32 = [r["final_map"] for r in results if r["mode"] == "fp32"]
    ref = float(np.mean(fp32))
    spread = float(max(fp32) - min(fp32)) if len(fp32) > 1 else 0.0
    allowed = max(spread, 0.01)
    out = {"fp32_mean_map": ref, "fp32_spread": spread, "allowed": allowed, "modes": {}}
    for r in results:
        if r["mode"] != "fp32":
            diff = r["final_map"] - ref
            out["modes"][r["mode"]] = {"map_diff": diff, "within": abs(diff) <= allowed}
    return out


def print_table(doc: Dict[str, Any]) -> None:
    """Print the table, the FP32 reference, one verdict line per AMP mode and the skipped modes."""
    head = f"{'mode':<18}{'seed':>5}{'final mAP':>11}{'final loss':>12}{'skipped':>9}{'scale':>9}{'time s':>9}"
    print(head)
    print("-" * len(head))
    for r in doc["results"]:
        print(f"{r['mode']:<18}{r['seed']:>5}{r['final_map']:>11.4f}{r['final_loss']:>12.4f}"
              f"{r['skipped_steps']:>9}{r['loss_scale']:>9g}{r['seconds']:>9.1f}")
    v = doc["verdict"]
    print(f"FP32 mAP {v['fp32_mean_map']:.4f}, seed spread {v['fp32_spread']:.4f}; allowed difference "
          f"{v['allowed']:.4f} (the spread, or 1 mAP point if smaller)")
    for mode, m in v["modes"].items():
        print(f"verdict: {mode} mAP {m['map_diff']:+.4f} vs FP32: {'within' if m['within'] else 'NOT within'}")
    for why in doc["skipped"]:
        print(why)


def plot(doc: Dict[str, Any], path: str) -> None:
    """Write the loss curves of every mode (left) and the held-out mAP per epoch (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in doc["results"]:
        label = f"{r['mode']} (seed {r['seed']})"
        k = max(1, len(r["losses"]) // 100)
        smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        a.plot(smooth, label=label)
        b.plot(range(1, len(r["map_per_epoch"]) + 1), r["map_per_epoch"], marker="o", label=label)
    a.set_xlabel("step")
    a.set_ylabel("SSD loss (moving mean)")
    a.set_yscale("log")
    b.set_xlabel("epoch")
    b.set_ylabel("VOC07 mAP (held out)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line; bad values are argparse errors (exit status 2)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--train", type=int, default=768, help="training images")
    p.add_argument("--test", type=int, default=192, help="held-out images")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data-seed", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data: the pipeline and the metric")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("epochs", "train", "test", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if args.smoke:
        args.epochs, args.train, args.test, args.batch_size = 1, 32, 16, 16
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run every mode in its own process, print the table and write ``--json``/``--plot``."""
    args = parse_args(argv)
    if args.worker:
        cfg = json.loads(args.worker)
        print(json.dumps(train_mode(**cfg)))
        return {}
    modes, skipped = plan(args.smoke)
    results = []
    for mode, seed in modes:
        print(f"training {mode} (seed {seed}) ...", flush=True)
        r = run_in_subprocess(mode, seed, args)
        if "unavailable" in r:
            skipped.append(f"{mode} not run: {r['unavailable']}")
        else:
            results.append(r)
    doc = {"task": "coloured shapes, 64x64, small GluonCV SSD", "epochs": args.epochs, "train": args.train,
           "test": args.test, "batch_size": args.batch_size, "lr": args.lr, "results": results,
           "verdict": verdict(results), "skipped": skipped,
           "command": " ".join(["python", "benchmarks/convergence.py"] + (argv if argv is not None else sys.argv[1:]))}
    print_table(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return doc


if __name__ == "__main__":
    main()
