"""Does a loss scale change anything in bfloat16? The measurement behind the default scaler.

    python benchmarks/loss_scale_need.py                       # all workloads, every mode this host runs
    python benchmarks/loss_scale_need.py --workloads bert --steps 5 --json out.json

For each workload (GluonNLP's BERT classifier, small; GluonCV's SSD-512 ResNet-18 at 256x256
with its own target generator; GluonCV's ResNet-18 v1 on 32x32 images) and each AMP mode
(native bfloat16 where the host has it, emulated bfloat16, and emulated float16 as the
control), from the same initial weights and batches:

* one batch's parameter gradients with the loss multiplied by 1 and by 65536 (divided back),
  against FP32's: the fraction of elements that are 0 where FP32's are not (underflow), the
  relative L2 error, the non-finite count, and the fraction of elements where the two scales
  give different bits;
* ``--steps`` training steps on that batch (static scale 1 or 65536, SGD with momentum), as
  MXNet's AMP tutorial trains on one synthetic batch: how far apart the two loss curves are,
  and how far each is from FP32's.

``init(..., tune=False)`` runs the op table's plan as it is (every op it allows in the low
dtype). Numerics only: nothing here is timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gluon_amp  # noqa: E402  first: its numpy shim (docs/python.md), before MXNet loads
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from _report import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

SCALES = (1.0, 2.0 ** 16)
MODES = {
    "fp32": None,
    "bfloat16 (native)": {"target_dtype": "bfloat16"},
    "bfloat16 (emulated)": {"target_dtype": "bfloat16", "emulate": True},
    "float16 (emulated)": {"target_dtype": "float16", "emulate": True},
}

Batch = Tuple[mx.nd.NDArray, ...]
#: a workload: (build a fresh seeded net, its batch, the loss of the batch as a scalar NDArray)
Workload = Tuple[Callable[[], gluon.Block], Batch, Callable[[gluon.Block, Batch], mx.nd.NDArray]]


def bert_workload() -> Workload:
    import gluonnlp as nlp

    def build() -> gluon.Block:
        mx.random.seed(0)
        enc = nlp.model.BERTEncoder(num_layers=2, units=128, hidden_size=512, max_length=64, num_heads=4,
                                    dropout=0.0)
        bert = nlp.model.BERTModel(enc, vocab_size=1000, token_type_vocab_size=2, units=128, embed_size=128,
                                   use_pooler=True, use_decoder=False, use_classifier=False)
        net = nlp.model.BERTClassifier(bert, num_classes=2, dropout=0.0)
        net.initialize(mx.init.Normal(0.02))
        return net

    rng = np.random.RandomState(0)
    batch = (mx.nd.array(rng.randint(1, 1000, (8, 64))), mx.nd.array(rng.randint(0, 2, (8, 64))),
             mx.nd.array(rng.randint(16, 65, 8)), mx.nd.array(rng.randint(0, 2, 8)))
    loss_fn = gluon.loss.SoftmaxCELoss()

    def loss(net: gluon.Block, b: Batch) -> mx.nd.NDArray:
        return loss_fn(net(b[0], b[1], b[2].astype("float32")), b[3]).mean()
    return build, batch, loss


def ssd_workload() -> Workload:
    from gluoncv.model_zoo import get_model
    from gluoncv.loss import SSDMultiBoxLoss
    from gluoncv.model_zoo.ssd.target import SSDTargetGenerator
    size = 256

    def build() -> gluon.Block:
        mx.random.seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = get_model("ssd_512_resnet18_v1_voc", pretrained_base=False, norm_layer=gluon.nn.BatchNorm)
            net.initialize()  # MXNet's default, as ssd_synthetic.py
        net.hybridize(static_alloc=True, static_shape=True)
        return net

    with autograd.train_mode():
        anchors = build()(mx.nd.zeros((1, 3, size, size)))[2]
    target = SSDTargetGenerator(iou_thresh=0.5, stds=(0.1, 0.1, 0.2, 0.2), negative_mining_ratio=-1)
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.uniform(-1, 1, (2, 3, size, size)))
    corner = rng.uniform(0, size * 0.6, (2, 2, 2))  # two boxes per image
    boxes = np.concatenate([corner, corner + rng.uniform(20, size * 0.4, (2, 2, 2))], axis=-1)
    ids = rng.randint(0, 20, (2, 2, 1)).astype("float32")
    cls_t, box_t, _ = target(anchors, None, mx.nd.array(boxes), mx.nd.array(ids))
    batch = (x, cls_t, box_t)
    loss_fn = SSDMultiBoxLoss()

    def loss(net: gluon.Block, b: Batch) -> mx.nd.NDArray:
        cls_p, box_p, _ = net(b[0])
        total, _, _ = loss_fn([cls_p], [box_p], [b[1]], [b[2]])
        return total[0].mean()
    return build, batch, loss


def resnet_workload() -> Workload:
    from gluoncv.model_zoo import get_model

    def build() -> gluon.Block:
        mx.random.seed(0)
        net = get_model("resnet18_v1", classes=10, pretrained=False)
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True)
        return net

    rng = np.random.RandomState(0)
    batch = (mx.nd.array(rng.uniform(-1, 1, (16, 3, 32, 32))), mx.nd.array(rng.randint(0, 10, 16)))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def loss(net: gluon.Block, b: Batch) -> mx.nd.NDArray:
        return loss_fn(net(b[0]), b[1]).mean()
    return build, batch, loss


WORKLOADS = {"bert": bert_workload, "ssd": ssd_workload, "resnet": resnet_workload}


def run(workload: Workload, mode: Optional[Dict[str, Any]], scale: float, steps: int
        ) -> Tuple[List[np.ndarray], List[float]]:
    """The first step's parameter gradients (divided by ``scale``) and ``steps`` losses."""
    build, batch, loss_of = workload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gluon_amp.autocast(**mode, tune=False) if mode else _nothing():
            net = build()
            trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                    update_on_kvstore=False)
            gluon_amp.init_trainer(trainer, gluon_amp.LossScaler.static(scale))
            params = [p for p in net.collect_params().values() if p.grad_req != "null"]
            grads, losses = [], []
            for i in range(steps):
                with autograd.record():
                    loss = loss_of(net, batch)
                    with gluon_amp.scale_loss(loss, trainer) as scaled:
                        autograd.backward(scaled)
                if i == 0:
                    grads = [p.grad().astype("float32").asnumpy() / scale for p in params]
                trainer.step(1)
                losses.append(float(loss.asscalar()))
    return grads, losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def gradient_figures(grads: List[np.ndarray], ref: List[np.ndarray]) -> Dict[str, float]:
    g, r = np.concatenate([a.ravel() for a in grads]), np.concatenate([a.ravel() for a in ref])
    finite = np.isfinite(g)
    return {"elements": int(g.size), "nonfinite": int((~finite).sum()),
            "zero_where_fp32_nonzero": float(((g == 0) & (r != 0)).mean()),
            "fp32_zero_fraction": float((r == 0).mean()),
            "rel_l2_error": float(np.linalg.norm(np.where(finite, g, 0) - r) / np.linalg.norm(r))}


def measure(names: List[str], steps: int) -> Dict[str, Any]:
    cap = gluon_amp.runtime.capability()
    native = cap.bf16.value == "native"
    doc: Dict[str, Any] = {"host": {"cpu_flags": sorted(f for f in gluon_amp.runtime.cpu_flags()
                                                         if "avx512" in f or "amx" in f or f == "avx2"),
                                    "bf16": cap.bf16.value, "isa": cap.isa}, "steps": steps, "workloads": {}}
    for name in names:
        workload = WORKLOADS[name]()
        ref_grads, ref_losses = run(workload, None, 1.0, steps)
        rows: Dict[str, Any] = {}
        for mode, spec in MODES.items():
            if spec is None or (mode == "bfloat16 (native)" and not native):
                continue
            by_scale = {s: run(workload, spec, s, steps) for s in SCALES}
            (g1, l1), (g2, l2) = by_scale[SCALES[0]], by_scale[SCALES[1]]
            a, b = np.concatenate([x.ravel() for x in g1]), np.concatenate([x.ravel() for x in g2])
            rows[mode] = {
                "scale 1": gradient_figures(g1, ref_grads), "scale 65536": gradient_figures(g2, ref_grads),
                "bits_differ_between_scales": float((a.view(np.uint32) != b.view(np.uint32)).mean()),
                "losses": {"scale 1": l1, "scale 65536": l2, "fp32": ref_losses},
                "loss_gap_between_scales": max(abs(x - y) / abs(y) for x, y in zip(l2, l1)),
                "loss_gap_to_fp32": {f"scale {s:g}": max(abs(x - y) / abs(y)
                                                         for x, y in zip(by_scale[s][1], ref_losses))
                                     for s in SCALES},
            }
            print(f"{name} {mode}: done", flush=True)
        doc["workloads"][name] = rows
    return doc


def table(doc: Dict[str, Any]) -> str:
    lines = [f"host: bf16 {doc['host']['bf16']} ({doc['host']['isa']}), flags {' '.join(doc['host']['cpu_flags'])}; "
             f"{doc['steps']} steps",
             f"{'workload':8} {'mode':20} {'zero where FP32 not, s=1 / 65536':>34} {'rel err s=1 / 65536':>22} "
             f"{'inf/NaN':>9} {'bits differ':>12} {'loss gap s':>11} {'to FP32':>9}"]
    for name, rows in doc["workloads"].items():
        for mode, r in rows.items():
            s1, s2 = r["scale 1"], r["scale 65536"]
            lines.append(f"{name:8} {mode:20} {s1['zero_where_fp32_nonzero']:>16.2e} / "
                         f"{s2['zero_where_fp32_nonzero']:<15.2e}"
                         f"{s1['rel_l2_error']:>11.2e} / {s2['rel_l2_error']:<9.2e}"
                         f"{s1['nonfinite']:>4}/{s2['nonfinite']:<4}"
                         f"{r['bits_differ_between_scales']:>12.2e} {r['loss_gap_between_scales']:>11.2e}"
                         f" {max(r['loss_gap_to_fp32'].values()):>9.2e}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    ap.add_argument("--json", help="write the full document here")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    doc = measure(names, args.steps)
    emit(doc, table(doc), args.json)
    return doc


if __name__ == "__main__":
    main()
