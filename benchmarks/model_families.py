"""Model families beyond CNNs: the default (``init()``) against FP32 in steady-state training.

    python benchmarks/model_families.py                            # default vs FP32, 3 rounds
    python benchmarks/model_families.py --mode default,emulated-bfloat16,emulated-float16 --rounds 3
    python benchmarks/model_families.py --mode bfloat16            # native bfloat16 forced (AVX512-BF16/AMX)
    python benchmarks/model_families.py --nets lstm_lm --tiny --rounds 1 --json out.json
    python benchmarks/model_families.py --interleaved --nets mobilenet --rounds 2   # FP32 beside AMP, one process

Workloads (hybridized with ``static_alloc``/``static_shape``, as GluonTS's trainer does; Adam;
every batch prepared before timing):
- ``deepar``: GluonTS 0.11's ``DeepAREstimator`` training network (its defaults: 2 LSTM layers
  of 40 cells, Student-t output, batch 32), fed batches from GluonTS's own training data loader
  on a generated daily set (20 noisy sinusoids, prediction length 24). Where GluonTS is not
  installed, ``deepar`` names ``lstm_forecaster`` instead and the table says so;
- ``lstm_forecaster``: a network of this file, DeepAR's shape: 2-layer LSTM of 40 cells over
  the lagged target and time features, a Dense head giving a Gaussian's mean and scale, its
  negative log-likelihood as the loss;
- ``lstm_lm``: GluonNLP 0.10's ``standard_lstm_lm_200`` (2 layers of 200, dropout 0), 2,000
  words, 35 steps x batch 20, softmax cross-entropy;
- ``transformer``: GluonNLP 0.10's BERT encoder at a small size (2 layers, 128 units, 4 heads,
  feed-forward 512, dropout 0) with its classifier, sequences of 64 x batch 16;
- ``cifar_resnet`` (only with ``--nets``): GluonCV 0.10's ``cifar_resnet20_v1``, 32x32 images x
  batch 32, softmax cross-entropy: a small CNN whose stages of 16, 32 and 64
  channels meet both of oneDNN's bfloat16 layouts on an AMX host (docs/speed.md);
- ``mobilenet``, ``resnext``, ``alexnet`` (only with ``--nets``): GluonCV 0.10's ``mobilenet1.0``
  (depthwise convolutions), ``resnext50_32x4d`` (grouped ones) and ``alexnet`` (4096-wide dense
  layers), 112x112 images x batch 4: each met a bfloat16 kernel slower than FP32's on an AMX host.

Each (net, mode) runs in a process of its own: ``--warmup`` untimed steps (graph build, the
emulation kernel, tuning within its budget), then ``--steps`` timed ones; a step is forward,
backward, ``trainer.step`` and ``waitall``. Modes run back to back within each of ``--rounds``
rounds, so drift on a busy machine hits them alike. it/s is the median over rounds of each
process's median step; "best" is the fastest step's it/s and "CPU it/s" the same median by the
process's CPU time (``time.process_time``, all its threads): both less sensitive to other jobs on a
shared machine; CPU time counts work, so it equals wall time only where the process has a core of
its own per thread. "vs FP32" divides by FP32's figure of the same net. FP32 is plain MXNet
(gluon_amp imported, ``init`` never called).

``--interleaved`` times each mode against FP32 in one process per (net, mode, round): the FP32
net, and the AMP net built and trained in an ``autocast`` region of the mode, their steps
alternating (which goes first alternates too); the figure is FP32's step time over the AMP
step's beside it, the median pair per process, then the median over processes. On a host
whose processes differ more than the ratio does (a shared VM), it is the one to read. FP32
takes a process's first step in odd rounds, AMP in even ones (marked ``*``): on an AVX2 host
the net that stepped second ran AlexNet's Adam update slower, FP32 or not. ``--mode fp32`` is
the control: a second plain FP32 net where the AMP net goes, the figure the harness alone gives.

``--mode`` (comma separated): ``default`` is ``init()`` as a user calls it: the dtype this host
picks (float32, AMP off, on a CPU without bfloat16 kernels); ``bfloat16`` forces native
bfloat16 (hosts with AVX512-BF16 or AMX; elsewhere the row says why it could not run);
``emulated-bfloat16``/``emulated-float16`` run the plan emulated in float32 (what emulation
costs). AMP modes train through ``init_trainer`` and ``scale_loss``. Each row gives the dtype the
mode ran and, from ``gluon_amp.report`` on the trained block, its ops in low precision, the
casts in its graph and casts per low-precision op (host-independent: the plan's), and where
tuning stands.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NETS = ("deepar", "lstm_forecaster", "lstm_lm", "transformer", "cifar_resnet", "mobilenet", "resnext", "alexnet")
DEFAULT_NETS = ("deepar", "lstm_lm", "transformer")
#: mode -> init's arguments (None: FP32, no init)
MODES: Dict[str, Optional[Dict[str, Any]]] = {
    "fp32": None,
    "default": {},
    "bfloat16": {"target_dtype": "bfloat16"},
    "emulated-bfloat16": {"target_dtype": "bfloat16", "emulate": True},
    "emulated-float16": {"target_dtype": "float16", "emulate": True},
}
#: (warmup, timed) steps by default
STEPS = (15, 30)
#: sizes: full, and --tiny (the smoke test's, seconds per process)
SIZES = {
    "deepar": {"full": dict(batch=32, cells=40, layers=2, pred=24), "tiny": dict(batch=4, cells=8, layers=1, pred=6)},
    "lstm_forecaster": {"full": dict(batch=32, cells=40, layers=2, seq=72, feats=12),
                        "tiny": dict(batch=4, cells=8, layers=1, seq=8, feats=4)},
    "lstm_lm": {"full": dict(vocab=2000, seq=35, batch=20), "tiny": dict(vocab=50, seq=6, batch=4)},
    "transformer": {"full": dict(layers=2, units=128, heads=4, hidden=512, seq=64, batch=16, vocab=2000),
                    "tiny": dict(layers=1, units=16, heads=2, hidden=32, seq=8, batch=4, vocab=50)},
    "cifar_resnet": {"full": dict(batch=32), "tiny": dict(batch=2)},
    "mobilenet": {"full": dict(batch=4, size=112), "tiny": dict(batch=2, size=64)},
    "resnext": {"full": dict(batch=4, size=112), "tiny": dict(batch=2, size=64)},
    "alexnet": {"full": dict(batch=4, size=112), "tiny": dict(batch=2, size=64)},
}
#: GluonCV's model of each ImageNet-style family
ZOO = {"mobilenet": "mobilenet1.0", "resnext": "resnext50_32x4d", "alexnet": "alexnet"}


def gluonts_available() -> bool:
    try:
        with warnings.catch_warnings():  # GluonTS warns at import that orjson/ujson are missing
            warnings.simplefilter("ignore")
            import gluonts.mx  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- workloads (run in the child)
# Each builder returns (net, batches, step_loss): step_loss(net, batch) -> the scalar-per-sample loss.

Workload = Tuple[Any, List[Any], Callable[[Any, Any], Any]]


def _deepar(size: Dict[str, int], n_batches: int) -> Workload:
    import numpy as np
    import pandas as pd
    from gluonts.dataset.common import ListDataset
    from gluonts.mx import DeepAREstimator
    from gluonts.mx.trainer import Trainer
    rng = np.random.RandomState(0)
    t = np.arange(400)
    series = [(10 + 5 * np.sin(2 * np.pi * t / 7 + i) + rng.randn(len(t))).astype("float32") for i in range(20)]
    # daily data: GluonTS 0.11 reads pandas 2's hourly offset name ("h") as an invalid frequency
    data = ListDataset([{"target": s, "start": pd.Period("2020-01-01", freq="D")} for s in series], freq="D")
    est = DeepAREstimator(freq="D", prediction_length=size["pred"], num_layers=size["layers"],
                          num_cells=size["cells"], batch_size=size["batch"], trainer=Trainer(hybridize=True))
    loader = est.create_training_data_loader(est.create_transformation().apply(data))
    batches = []
    for b in loader:
        batches.append(list(b.values()))
        if len(batches) == n_batches:
            break
    net = est.create_training_network()
    net.initialize(init="xavier")

    def step_loss(net: Any, batch: Any) -> Any:
        out = net(*batch)
        return out[0] if isinstance(out, (list, tuple)) else out  # GluonTS: the loss comes first
    return net, batches, step_loss


def _lstm_forecaster(size: Dict[str, int], n_batches: int) -> Workload:
    import mxnet as mx
    from mxnet import gluon

    class Forecaster(gluon.HybridBlock):
        """DeepAR's shape: an LSTM over features, a Gaussian head, its negative log-likelihood."""

        def __init__(self, cells: int, layers: int) -> None:
            super().__init__()
            self.rnn = gluon.rnn.LSTM(cells, num_layers=layers, layout="NTC")
            self.proj = gluon.nn.Dense(2, flatten=False)

        def hybrid_forward(self, F: Any, x: Any, target: Any) -> Any:
            h = self.proj(self.rnn(x))
            mu = F.slice_axis(h, axis=2, begin=0, end=1).reshape((0, 0))
            sigma = F.Activation(F.slice_axis(h, axis=2, begin=1, end=2).reshape((0, 0)), "softrelu") + 1e-3
            nll = F.log(sigma) + 0.5 * F.square((target - mu) / sigma)
            return F.mean(nll, axis=1)

    net = Forecaster(size["cells"], size["layers"])
    net.initialize(mx.init.Xavier())
    shape = (size["batch"], size["seq"])
    batches = [[mx.nd.random.normal(shape=shape + (size["feats"],)), mx.nd.random.normal(shape=shape)]
               for _ in range(n_batches)]
    return net, batches, lambda n, b: n(*b)


def _lstm_lm(size: Dict[str, int], n_batches: int) -> Workload:
    import mxnet as mx
    import gluonnlp as nlp
    from mxnet import gluon
    vocab = nlp.Vocab(nlp.data.count_tokens([str(i) for i in range(size["vocab"])]))
    net, _ = nlp.model.get_model("standard_lstm_lm_200", dataset_name=None, vocab=vocab, pretrained=False,
                                 dropout=0)
    net.initialize(mx.init.Xavier())
    v, shape = len(vocab), (size["seq"], size["batch"])
    batches = [[mx.nd.random.randint(0, v, shape=shape).astype("float32"),
                mx.nd.random.randint(0, v, shape=shape).astype("float32")] for _ in range(n_batches)]
    ce = gluon.loss.SoftmaxCrossEntropyLoss()

    def step_loss(net: Any, batch: Any) -> Any:
        state = net.begin_state(batch_size=size["batch"], func=mx.nd.zeros)
        out, _ = net(batch[0], state)
        return ce(out.reshape((-3, -1)), batch[1].reshape((-1,)))
    return net, batches, step_loss


def _transformer(size: Dict[str, int], n_batches: int) -> Workload:
    import mxnet as mx
    import gluonnlp as nlp
    from mxnet import gluon
    vocab = nlp.Vocab(nlp.data.count_tokens([str(i) for i in range(size["vocab"])]))
    bert, _ = nlp.model.bert.get_bert_model(
        "bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False, use_pooler=True, use_decoder=False,
        use_classifier=False, hparam_allow_override=True, num_layers=size["layers"], units=size["units"],
        embed_size=size["units"], hidden_size=size["hidden"], num_heads=size["heads"],
        max_length=max(64, size["seq"]), dropout=0.0)
    net = nlp.model.BERTClassifier(bert, num_classes=2, dropout=0.0)
    net.initialize(mx.init.Normal(0.02))
    b, s = size["batch"], size["seq"]
    batches = [[mx.nd.random.randint(0, len(vocab), shape=(b, s)), mx.nd.zeros((b, s), dtype="int32"),
                mx.nd.random.randint(s // 2, s + 1, shape=(b,)).astype("float32"),
                mx.nd.random.randint(0, 2, shape=(b,)).astype("float32")] for _ in range(n_batches)]
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    return net, batches, lambda n, x: ce(n(*x[:3]), x[3])


def _cifar_resnet(size: Dict[str, int], n_batches: int) -> Workload:
    import mxnet as mx
    from gluoncv.model_zoo import get_model
    from mxnet import gluon
    net = get_model("cifar_resnet20_v1", classes=10)
    net.initialize(mx.init.Xavier())
    b = size["batch"]
    batches = [[mx.nd.random.normal(shape=(b, 3, 32, 32)), mx.nd.random.randint(0, 10, shape=(b,)).astype("float32")]
               for _ in range(n_batches)]
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    return net, batches, lambda n, x: ce(n(x[0]), x[1])


def _zoo(family: str) -> Callable[[Dict[str, int], int], Workload]:
    """The builder of a GluonCV ImageNet classifier (:data:`ZOO`), 10 classes, random weights."""
    def build(size: Dict[str, int], n_batches: int) -> Workload:
        import mxnet as mx
        from gluoncv.model_zoo import get_model
        from mxnet import gluon
        net = get_model(ZOO[family], pretrained=False, classes=10)
        net.initialize(mx.init.Xavier())
        b, px = size["batch"], size["size"]
        batches = [[mx.nd.random.normal(shape=(b, 3, px, px)),
                    mx.nd.random.randint(0, 10, shape=(b,)).astype("float32")] for _ in range(n_batches)]
        ce = gluon.loss.SoftmaxCrossEntropyLoss()
        return net, batches, lambda n, x: ce(n(x[0]), x[1])
    return build


BUILDERS = {"deepar": _deepar, "lstm_forecaster": _lstm_forecaster, "lstm_lm": _lstm_lm,
            "transformer": _transformer, "cifar_resnet": _cifar_resnet, **{f: _zoo(f) for f in ZOO}}


def _plan_figures(net: Any) -> Dict[str, Any]:
    """Low-precision ops, casts and casts per low op of the block's plan (``gluon_amp.report``)."""
    import gluon_amp
    rep = gluon_amp.report(net)
    low = sum(v for k, v in rep.totals_by_dtype.items() if k in ("float16", "bfloat16"))
    return {"low_ops": low, "casts": rep.casts, "casts_per_low_op": rep.casts / low if low else None,
            "tuning": rep.tuning}


def _cannot_run(mode: str) -> Optional[str]:
    """Why ``mode`` cannot run on this host (native bfloat16 without its kernels), or None."""
    import gluon_amp
    args = MODES[mode]
    if args is not None and not args.get("emulate") and args.get("target_dtype") == "bfloat16":
        info = gluon_amp.runtime_info()
        if info["bf16"] == "none":
            return f"native bfloat16 cannot run here: {info['bf16_why']}"
    return None


def _build(net_name: str, tiny: bool, amp: bool) -> Tuple[Any, ...]:
    """(net, batches, step_loss, trainer): the net hybridized, Adam, ``init_trainer`` if ``amp``."""
    import gluon_amp
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, batches, step_loss = BUILDERS[net_name](SIZES[net_name]["tiny" if tiny else "full"], 4)
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, update_on_kvstore=False)
    if amp:
        gluon_amp.init_trainer(trainer)
    return net, batches, step_loss, trainer


def _step(parts: Tuple[Any, ...], i: int, amp: bool) -> Tuple[float, float, float]:
    """One training step (forward, backward, ``trainer.step``, ``waitall``) on batch ``i``:
    (wall seconds, CPU seconds, loss)."""
    import gluon_amp
    import mxnet as mx
    from mxnet import autograd
    net, batches, step_loss, trainer = parts
    batch = batches[i % len(batches)]
    t0, c0 = time.perf_counter(), time.process_time()
    with autograd.record():
        loss = step_loss(net, batch)
        if amp:
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        else:
            loss.backward()
    trainer.step(loss.shape[0])
    mx.nd.waitall()
    # read in NumPy: reading the loss through an MXNet ``mean`` made the Adam update of whichever
    # net stepped second in the process 2x slower (AlexNet on an AVX2 host, FP32 beside FP32)
    return time.perf_counter() - t0, time.process_time() - c0, float(loss.asnumpy().mean())


def child(net_name: str, mode: str, warmup: int, steps: int, tiny: bool) -> Dict[str, Any]:
    """One mode of one net, in this process: the median step time and the plan's figures."""
    import gluon_amp  # first: its numpy shim and the AMX permission, before MXNet loads
    out: Dict[str, Any] = {"net": net_name, "mode": mode}
    why_not = _cannot_run(mode)
    if why_not:
        return {**out, "ran": None, "why_not": why_not}
    args = MODES[mode]
    policy = gluon_amp.init(**args) if args is not None else None
    out["ran"] = ("float32" if policy is None or not policy.enabled
                  else policy.target_dtype + (" emulated" if policy.emulate else ""))
    out["amp"] = policy is not None and policy.enabled
    parts = _build(net_name, tiny, out["amp"])
    times, cpu_times, losses = [], [], []
    for i in range(warmup + steps):
        seconds, cpu_seconds, loss = _step(parts, i, out["amp"])
        if i >= warmup:
            times.append(seconds)
            cpu_times.append(cpu_seconds)
        losses.append(loss)
    out.update(sec_per_step=statistics.median(times), step_seconds=times, losses=losses,
               cpu_sec_per_step=statistics.median(cpu_times), step_cpu_seconds=cpu_times)
    out.update(_plan_figures(parts[0]) if out["amp"] else {"low_ops": 0, "casts": 0, "casts_per_low_op": None,
                                                            "tuning": ""})
    return out


def child_interleaved(net_name: str, mode: str, warmup: int, steps: int, tiny: bool,
                      amp_leads: bool = False) -> Dict[str, Any]:
    """FP32 and one AMP mode of one net in this process, their steps alternating
    (``_report.alternate``; the AMP net takes the process's first step if ``amp_leads``).
    FP32's net is plain MXNet; the AMP net is built, and trains through ``init_trainer`` and
    ``scale_loss``, in an ``autocast`` region of the mode's ``init`` arguments (the default's:
    ``autocast()``). Mode ``fp32`` is the control: a second plain FP32 net in place of the AMP
    one, built and stepped as the first. Each pair's time ratio, AMP over FP32."""
    import gluon_amp  # first: its numpy shim and the AMX permission, before MXNet loads
    from _report import alternate  # benchmarks/ is on sys.path when run as a script
    out: Dict[str, Any] = {"net": net_name, "mode": mode, "amp_led": amp_leads}
    why_not = _cannot_run(mode)
    if why_not:
        return {**out, "ran": None, "why_not": why_not}
    fp32 = _build(net_name, tiny, False)
    amp_batch, fp32_batch = itertools.count(), itertools.count()
    if MODES[mode] is None:
        second = _build(net_name, tiny, False)
        out["ran"] = "float32 (no AMP)"

        def amp_step() -> float:
            return _step(second, next(amp_batch), False)[0]

        skipped, figures = (lambda: False), {"low_ops": 0, "casts": 0, "casts_per_low_op": None, "tuning": ""}
    else:
        args = MODES[mode] or {}
        with gluon_amp.autocast(**args) as policy:
            amp = _build(net_name, tiny, True)
        out["ran"] = "float32" if policy is None else policy.target_dtype + (" emulated" if policy.emulate else "")

        def amp_step() -> float:
            with gluon_amp.autocast(**args):
                return _step(amp, next(amp_batch), True)[0]

        scaler = gluon_amp.get_scaler(amp[3])
        skipped, figures = (lambda: scaler.last_step_skipped), None
    # a skipped update is cheaper: not a pair to compare
    pairs = alternate(lambda: _step(fp32, next(fp32_batch), False)[0], amp_step, warmup, steps,
                      counts=lambda: not skipped(), second_leads=amp_leads)
    out.update(ratio=pairs["ratio"], ratios=pairs["ratios"], fp32_sec_per_step=pairs["first_seconds"],
               sec_per_step=pairs["second_seconds"], timed_skipped=pairs["left_out"],
               **(figures or _plan_figures(amp[0])))
    return out


# ---------------------------------------------------------------- the parent

def _run_child(net: str, mode: str, warmup: int, steps: int, tiny: bool, timeout: float,
               interleaved: bool = False, amp_leads: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-interleaved" if interleaved else "--child", net,
           mode, "--warmup", str(warmup), "--steps", str(steps)] + (["--tiny"] if tiny else []) \
        + (["--amp-leads"] if amp_leads else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"model_families: {net} under mode {mode} failed (exit {r.returncode}):\n"
                           f"{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(nets: List[str], modes: List[str], rounds: int, warmup: int, steps: int, tiny: bool = False,
        timeout: float = 1800) -> Dict[str, Any]:
    """FP32 and every mode of every net, ``rounds`` times, back to back within a round."""
    load = os.getloadavg()
    order = ["fp32"] + [m for m in modes if m != "fp32"]
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {m: [] for m in order} for n in nets}
    for r in range(rounds):
        for n in nets:
            for m in order:
                res = _run_child(n, m, warmup, steps, tiny, timeout)
                runs[n][m].append(res)
                figure = f"{1 / res['sec_per_step']:.2f} it/s" if res["ran"] else "not run"
                print(f"round {r + 1}/{rounds} {n:<15} {m:<18} {figure}", file=sys.stderr, flush=True)
    from _report import host_info  # benchmarks/ is on sys.path when run as a script
    return {"host": host_info(), "load_before": load, "load_after": os.getloadavg(), "rounds": rounds,
            "warmup": warmup, "steps": steps, "tiny": tiny, "summary": summarize(runs), "runs": runs}


def run_interleaved(nets: List[str], modes: List[str], rounds: int, warmup: int, steps: int, tiny: bool = False,
                    timeout: float = 1800) -> Dict[str, Any]:
    """Each AMP mode of each net against FP32 in one process per (net, mode, round), their steps
    alternating: the speed ratio on a machine whose processes differ more than the ratio does.
    FP32 takes the first step in odd rounds, AMP in even ones (it can decide more than AMP does:
    on an AVX2 host, AlexNet's second Adam ran 2x slower whichever net it was)."""
    from _report import median_of  # benchmarks/ is on sys.path when run as a script
    load = os.getloadavg()
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {n: {m: [] for m in modes} for n in nets}
    for r in range(rounds):
        for n in nets:
            for m in modes:
                res = _run_child(n, m, warmup, steps, tiny, timeout, interleaved=True, amp_leads=r % 2 == 1)
                runs[n][m].append(res)
                figure = ("not run" if not res["ran"] else "no pair kept: the scaler skipped them all"
                          if not res["ratio"] else f"{1 / res['ratio']:.3f}x FP32")
                print(f"round {r + 1}/{rounds} {n:<15} {m:<18} {figure}", file=sys.stderr, flush=True)
    summary: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for n in nets:
        summary[n] = {}
        for m in modes:
            last = runs[n][m][-1]
            if not last["ran"]:
                summary[n][m] = {"ran": None, "why_not": last["why_not"]}
                continue
            speeds = [1 / x["ratio"] for x in runs[n][m] if x["ratio"]]
            summary[n][m] = {"ran": last["ran"], "vs_fp32": statistics.median(speeds) if speeds else None,
                             "per_process": [round(v, 3) for v in speeds],
                             "amp_led": [x["amp_led"] for x in runs[n][m] if x["ratio"]],
                             "fp32_sec_per_step": median_of(x["fp32_sec_per_step"] for x in runs[n][m]),
                             "sec_per_step": median_of(x["sec_per_step"] for x in runs[n][m]),
                             "timed_skipped": sum(x["timed_skipped"] for x in runs[n][m]),
                             **{k: last[k] for k in ("low_ops", "casts", "casts_per_low_op", "tuning")}}
    from _report import host_info  # benchmarks/ is on sys.path when run as a script
    return {"host": host_info(), "load_before": load, "load_after": os.getloadavg(), "rounds": rounds,
            "warmup": warmup, "steps": steps, "tiny": tiny, "interleaved": True, "summary": summary, "runs": runs}


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def format_interleaved(doc: Dict[str, Any]) -> str:
    from _report import threads_text  # benchmarks/ is on sys.path when run as a script
    lines = [f"{'net':<15} {'mode':<18} {'ran':<18} {'FP32 ms':>8} {'AMP ms':>8} {'vs FP32':>8} "
             f"{'low ops':>8} {'casts':>6}  per process"]
    for n, modes in doc["summary"].items():
        for m, s in modes.items():
            if not s["ran"]:
                lines.append(f"{n:<15} {m:<18} not run: {s['why_not']}")
                continue
            speed = "-" if s["vs_fp32"] is None else f"{s['vs_fp32']:.3f}x"
            lines.append(f"{n:<15} {m:<18} {s['ran']:<18} {_ms(s['fp32_sec_per_step']):>8} "
                         f"{_ms(s['sec_per_step']):>8} {speed:>8} {s['low_ops']:>8} {s['casts']:>6}  "
                         + " ".join(f"{v:.3f}" + "*" * led for v, led in zip(s["per_process"], s["amp_led"]))
                         + (f"  ({s['timed_skipped']} pair(s) the scaler skipped, left out)"
                            if s["timed_skipped"] else ""))
    h = doc["host"]
    lines.append(f"host flags {' '.join(h['flags'])}, {h['cpus']} CPUs, {threads_text(h)}, "
                 f"DNNL_MAX_CPU_ISA={h['DNNL_MAX_CPU_ISA']}, load {doc['load_before'][0]:.2f} before, "
                 f"{doc['load_after'][0]:.2f} after; vs FP32: median over {doc['rounds']} process(es) of FP32's "
                 f"step time over the AMP step's beside it, each process's median pair ({doc['warmup']} untimed, "
                 f"{doc['steps']} timed pairs; *: AMP took the process's first step)"
                 + (", tiny sizes" if doc["tiny"] else ""))
    return "\n".join(lines)


def summarize(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """Per net and mode: it/s (median over rounds of each process's median step), the fastest
    step's it/s (less sensitive to other jobs on the machine), both against FP32's."""
    summary: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for n in runs:
        summary[n] = {}
        for m in runs[n]:
            last = runs[n][m][-1]
            if not last["ran"]:
                summary[n][m] = {"ran": None, "why_not": last["why_not"]}
                continue
            sec = statistics.median(x["sec_per_step"] for x in runs[n][m])
            summary[n][m] = {"ran": last["ran"], "it_per_s": 1 / sec,
                             "best_it_per_s": 1 / min(t for x in runs[n][m] for t in x["step_seconds"]),
                             "cpu_it_per_s": 1 / statistics.median(x["cpu_sec_per_step"] for x in runs[n][m]),
                             "per_round_it_per_s": [1 / x["sec_per_step"] for x in runs[n][m]],
                             "low_ops": last["low_ops"], "casts": last["casts"],
                             "casts_per_low_op": last["casts_per_low_op"], "tuning": last["tuning"],
                             "last_loss": last["losses"][-1]}
        base = summary[n]["fp32"]
        for s in summary[n].values():
            if s["ran"]:
                s["vs_fp32"] = s["it_per_s"] / base["it_per_s"]
                s["best_vs_fp32"] = s["best_it_per_s"] / base["best_it_per_s"]
                s["cpu_vs_fp32"] = s["cpu_it_per_s"] / base["cpu_it_per_s"]
    return summary


def format_table(doc: Dict[str, Any]) -> str:
    from _report import threads_text  # benchmarks/ is on sys.path when run as a script
    lines = [f"{'net':<15} {'mode':<18} {'ran':<18} {'it/s':>7} {'vs FP32':>8} {'best':>7} {'vs FP32':>8} "
             f"{'CPU it/s':>8} {'vs FP32':>8} {'low ops':>8} {'casts':>6} {'casts/low op':>12}"]
    why_not: Dict[str, int] = {}
    for n, modes in doc["summary"].items():
        for m, s in modes.items():
            if not s["ran"]:
                k = why_not.setdefault(s["why_not"], len(why_not) + 1)
                lines.append(f"{n:<15} {m:<18} not run [{k}]")
                continue
            cpl = "-" if s["casts_per_low_op"] is None else f"{s['casts_per_low_op']:.2f}"
            lines.append(f"{n:<15} {m:<18} {s['ran']:<18} {s['it_per_s']:>7.2f} {s['vs_fp32']:>7.2f}x "
                         f"{s['best_it_per_s']:>7.2f} {s['best_vs_fp32']:>7.2f}x {s['cpu_it_per_s']:>8.2f} "
                         f"{s['cpu_vs_fp32']:>7.2f}x {s['low_ops']:>8} {s['casts']:>6} {cpl:>12}")
    tuning = {f"{n} {m}: {s['tuning']}" for n, modes in doc["summary"].items() for m, s in modes.items()
              if s.get("tuning")}
    lines += [f"tuning: {t}" for t in sorted(tuning)]
    lines += [f"[{k}] {why}" for why, k in why_not.items()]
    h = doc["host"]
    lines.append(f"host flags {' '.join(h['flags'])}, {h['cpus']} CPUs, {threads_text(h)}, "
                 f"DNNL_MAX_CPU_ISA={h['DNNL_MAX_CPU_ISA']}, "
                 f"load {doc['load_before'][0]:.2f} before, {doc['load_after'][0]:.2f} after; it/s: median over "
                 f"{doc['rounds']} round(s) of each process's median step ({doc['warmup']} untimed, "
                 f"{doc['steps']} timed steps); best: the fastest step; "
                 "CPU it/s: by the process's CPU time" + (", tiny sizes" if doc["tiny"] else ""))
    return "\n".join(lines)


def _csv(value: str, allowed: Tuple[str, ...], what: str) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what} {', '.join(bad) or repr(value)} unknown; choose from "
                                         f"{', '.join(allowed)} (comma separated)")
    return items


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default=None, type=lambda v: _csv(v, NETS, "net"),
                   help=f"comma separated, from {', '.join(NETS)} (default {','.join(DEFAULT_NETS)}; "
                        "deepar is lstm_forecaster where GluonTS is not installed)")
    p.add_argument("--mode", default=["default"], type=lambda v: _csv(v, tuple(MODES), "mode"),
                   help="comma separated AMP modes to compare with FP32: default (init() as a user calls it), "
                        "bfloat16 (native, forced), emulated-bfloat16, emulated-float16; fp32, with "
                        "--interleaved: the control, a second FP32 net (what the harness alone gives)")
    p.add_argument("--rounds", type=int, default=3, help="processes per (net, mode), modes back to back")
    p.add_argument("--warmup", type=int, default=STEPS[0], help="untimed steps per process")
    p.add_argument("--steps", type=int, default=STEPS[1], help="timed steps per process")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the smoke test's)")
    p.add_argument("--json", metavar="PATH", help="also write the full JSON document here")
    p.add_argument("--interleaved", action="store_true",
                   help="FP32 and each mode in one process, steps alternating: time ratios on a noisy machine")
    p.add_argument("--child", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--child-interleaved", nargs=2, metavar=("NET", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--amp-leads", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.child:
        print(json.dumps(child(*args.child, args.warmup, args.steps, args.tiny)))
        return None
    if args.child_interleaved:
        print(json.dumps(child_interleaved(*args.child_interleaved, args.warmup, args.steps, args.tiny,
                                           args.amp_leads)))
        return None
    nets = args.nets or list(DEFAULT_NETS)
    if "deepar" in nets and not gluonts_available():
        print("model_families: GluonTS is not installed (make test installs it: the Makefile's CLIENTS); "
              "deepar runs as lstm_forecaster, this file's network of DeepAR's shape", file=sys.stderr)
        nets = list(dict.fromkeys("lstm_forecaster" if n == "deepar" else n for n in nets))
    from _report import emit  # benchmarks/ is on sys.path when run as a script
    if args.interleaved:
        doc = run_interleaved(nets, args.mode, args.rounds, args.warmup, args.steps, args.tiny)
        emit(doc, format_interleaved(doc), args.json)
    else:
        doc = run(nets, args.mode, args.rounds, args.warmup, args.steps, args.tiny)
        emit(doc, format_table(doc), args.json)
    return doc


if __name__ == "__main__":
    main()
