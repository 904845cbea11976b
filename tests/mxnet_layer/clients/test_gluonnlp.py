"""GluonNLP 0.10's own models, unmodified, under every AMP mode this host can run (issue 31).

A tiny BERT classifier and the two LSTM language models GluonNLP ships
(``standard_lstm_lm_200``, ``awd_lstm_lm_600``), hybridized and not:

- ``init`` training tracks FP32's loss over 10 steps;
- ``convert_hybrid_block`` gives FP32's logits within the target's rounding;
- ``debug.compare`` runs on them (integer token ids, ``valid_length``, nested LM states);
- GluonNLP's two update patterns: ``finetune_classifier.py`` clips the global norm between
  ``backward`` and ``update`` (with AMP off it must equal FP32 bit for bit), and
  ``finetune_squad.py`` clips at ``trainer._amp_loss_scaler.loss_scale``.

Tolerances (stated in docs/compatibility.md): losses within 1% of FP32's per step for
float16 and 3% for bfloat16 (8 significant bits); logits within 2e-2 (float16) and 8e-2
(bfloat16) of FP32's largest magnitude. Dropout is 0 everywhere, so FP32 and AMP see the
same computation; GluonNLP's StandardRNN cannot be hybridized with dropout at all
(``nd.Dropout`` in its ``hybrid_forward``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gluon_amp as amp

import gluonnlp as nlp  # installed by `make test` (the [test] extra): a missing one is an error

pytestmark = pytest.mark.slow  # a real client's models, ~25 s: `make test` runs them, test-quick does not

VOCAB_SIZE = 50
SEQ_LEN = 8
BATCH = 4
STEPS = 10

MODES = {
    "emulated-float16": dict(target_dtype="float16", emulate=True),
    "emulated-bfloat16": dict(target_dtype="bfloat16", emulate=True),
    "native-bfloat16": dict(target_dtype="bfloat16", tune=False),
    "simulated-bfloat16": dict(target_dtype="bfloat16", tune=False),  # native, simulated: every CPU
}
LOSS_TOL = {"float16": 0.01, "bfloat16": 0.03}
LOGIT_TOL = {"float16": 2e-2, "bfloat16": 8e-2}


def _mode_params() -> List:
    out = []
    for name in MODES:
        marks = ([pytest.mark.bf16_kernels] if name.startswith("native") else
                 [pytest.mark.simulated_native] if name.startswith("simulated") else [])
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _vocab() -> "nlp.Vocab":
    return nlp.Vocab(nlp.data.count_tokens([str(i) for i in range(VOCAB_SIZE)]))


def bert_classifier(seed: int = 0) -> gluon.HybridBlock:
    """Two layers of 32 units: GluonNLP's BERT code, a size that runs in milliseconds."""
    mx.random.seed(seed)
    bert, _ = nlp.model.bert.get_bert_model(
        "bert_12_768_12", dataset_name=None, vocab=_vocab(), pretrained=False, use_pooler=True,
        use_decoder=False, use_classifier=False, hparam_allow_override=True, num_layers=2,
        units=32, embed_size=32, hidden_size=64, num_heads=4, max_length=32, dropout=0.0)
    net = nlp.model.BERTClassifier(bert, num_classes=2, dropout=0.0)
    net.initialize(mx.init.Normal(0.02))
    return net


def lstm_lm(name: str, seed: int = 0) -> gluon.HybridBlock:
    mx.random.seed(seed)
    drop = {"dropout": 0} if name.startswith("standard") else dict(
        dropout=0, weight_drop=0, drop_h=0, drop_i=0, drop_e=0)
    net, _ = nlp.model.get_model(name, dataset_name=None, vocab=_vocab(), pretrained=False, **drop)
    net.initialize(mx.init.Xavier())
    return net


MODELS: Dict[str, Callable[[], gluon.HybridBlock]] = {
    "bert": bert_classifier,
    "standard_lstm_lm_200": lambda: lstm_lm("standard_lstm_lm_200"),
    "awd_lstm_lm_600": lambda: lstm_lm("awd_lstm_lm_600"),
}


def _batch(model: str, step: int) -> Tuple[tuple, mx.nd.NDArray]:
    """One batch: the call's inputs (as GluonNLP's scripts pass them) and the labels."""
    rng = np.random.RandomState(100 + step)
    if model == "bert":
        ids = mx.nd.array(rng.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN)), dtype="int32")
        types = mx.nd.zeros((BATCH, SEQ_LEN), dtype="int32")
        valid = mx.nd.array(rng.randint(2, SEQ_LEN + 1, (BATCH,)), dtype="float32")
        return (ids, types, valid), mx.nd.array(rng.randint(0, 2, (BATCH,)))
    ids = mx.nd.array(rng.randint(0, VOCAB_SIZE, (SEQ_LEN, BATCH)))
    return (ids,), mx.nd.array(rng.randint(0, VOCAB_SIZE, (SEQ_LEN, BATCH)))


def _forward(net: gluon.HybridBlock, model: str, inputs: tuple) -> mx.nd.NDArray:
    if model == "bert":
        return net(*inputs)
    state = net.begin_state(batch_size=BATCH, func=mx.nd.zeros)
    out, _ = net(inputs[0], state)
    return out


def _loss(model: str, out: mx.nd.NDArray, label: mx.nd.NDArray) -> mx.nd.NDArray:
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    if model == "bert":
        return ce(out, label).mean()
    return ce(out.reshape((-3, -1)), label.reshape((-1,))).mean()


def train(model: str, hybridize: bool, mode: str = None, steps: int = STEPS) -> List[float]:
    """Loss per step of Adam training, as GluonNLP's scripts train (scale_loss, step)."""
    if mode is not None:
        amp.init(**MODES[mode])
    try:
        net = MODELS[model]()
        if hybridize:
            net.hybridize()
        trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3},
                                update_on_kvstore=False)
        amp.init_trainer(trainer)
        losses = []
        for step in range(steps):
            inputs, label = _batch(model, step)
            with autograd.record():
                loss = _loss(model, _forward(net, model, inputs), label)
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(1)
            losses.append(float(loss.asscalar()))
        skipped = amp.get_scaler(trainer).state.skipped_steps
        assert skipped == 0, f"{skipped} of {steps} steps skipped: the curves would differ by updates, not numerics"
        return losses
    finally:
        amp.disable()


_FP32: Dict[Tuple[str, bool], List[float]] = {}


def fp32_losses(model: str, hybridize: bool) -> List[float]:
    key = (model, hybridize)
    if key not in _FP32:
        _FP32[key] = train(model, hybridize)
    return list(_FP32[key])


@pytest.mark.parametrize("hybridize", [True, False], ids=["hybridized", "imperative"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode", _mode_params())
def test_init_training_tracks_fp32(model, hybridize, mode):
    ref = fp32_losses(model, hybridize)
    got = train(model, hybridize, mode)
    dtype = MODES[mode]["target_dtype"]
    assert all(np.isfinite(got)), got
    rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
    assert max(rel) <= LOSS_TOL[dtype], (mode, model, rel)


def _call_inputs(net: gluon.HybridBlock, model: str, step: int = 0) -> tuple:
    """The arguments of one call, nested as GluonNLP passes them (an LM's state list,
    a list of [h, c] per layer for the AWD model)."""
    inputs, _ = _batch(model, step)
    if model == "bert":
        return inputs
    return (inputs[0], net.begin_state(batch_size=BATCH, func=mx.nd.zeros))


def _first_output(out):
    return out[0] if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode", _mode_params())
def test_convert_hybrid_block_tracks_fp32_logits(model, mode):
    net = MODELS[model]()
    net.hybridize()
    args = _call_inputs(net, model)
    ref = _first_output(net(*args)).asnumpy()
    opts = MODES[mode]
    block = amp.convert_hybrid_block(net, opts["target_dtype"], emulate=opts.get("emulate", False))
    got = _first_output(block(*args)).astype("float32").asnumpy()
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= LOGIT_TOL[opts["target_dtype"]], (model, mode, err)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_debug_compare_runs_on_the_model(model, dtype):
    net = MODELS[model]()
    net.hybridize()
    args = _call_inputs(net, model)
    net(*args)
    report = amp.debug.compare(net, *args, target_dtype=dtype, emulate=True)
    rows = report.rows
    assert rows, "no op compared"
    assert any(r.op in ("Embedding", "FullyConnected", "RNN") for r in rows)
    assert all(np.isfinite(r.max_abs_error) for r in rows if r.max_abs_error is not None)
