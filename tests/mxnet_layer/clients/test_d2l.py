"""d2l 1.0.3 (``from d2l import mxnet as d2l``, MXNet's numpy mode) under every AMP mode
(issue 47): its Transformer encoder hybridized, its GRU language model (``d2l.RNNLM`` over
``d2l.GRU``: ``rnn.GRU`` without ``input_size``, deferred initialization) and its BERT
(``d2l.BERTModel`` through d2l's own ``_get_batch_loss_bert``), each trained a few steps on
generated data. Before 2905b22 the first two died at their first call in every mode.

Each mode's losses must be within ``RTOL`` of FP32's, taken in this process with the same
weights and batches (``|l - fp32| <= rtol * |fp32|``); an emulated mode's must also differ from
FP32's (its rounding took effect). Measured on a Zen 4 (2 loaded cores): at most 2.2e-3
(float16), 9.5e-3 (bfloat16) over 30-40 steps under the launcher (docs/compatibility.md).
d2l is installed with ``--no-deps`` (the Makefile's CLIENTS); none of its code is copied here.
"""
import functools
import warnings
from typing import Any, Callable, Dict, List

import numpy as onp
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon, init, npx

# d2l is one of the Makefile's CLIENTS, which `make test` installs and `make test-quick` (-m "not
# slow") does not: slow as the other clients, and imported when a test runs, not when collected
pytestmark = pytest.mark.slow
RTOL = {"float16": 1e-2, "bfloat16": 3e-2}
STEPS = 4
EMULATED = [pytest.param({"target_dtype": "float16", "emulate": True}, id="emulated-float16"),
            pytest.param({"target_dtype": "bfloat16", "emulate": True}, id="emulated-bfloat16")]


def _seed() -> onp.random.RandomState:
    mx.random.seed(0)
    return onp.random.RandomState(0)


def _train(net: Any, loss_of: Callable, batches: List[tuple], optimizer: str, opts: Dict[str, Any]) -> List[float]:
    trainer = gluon.Trainer(net.collect_params(), optimizer, opts)
    losses = []
    for batch in batches:
        with autograd.record():
            loss = loss_of(net, batch)
        loss.backward()
        trainer.step(1)
        assert isinstance(loss, mx.np.ndarray), type(loss)
        losses.append(float(loss))
    return losses


def _d2l() -> Any:
    from d2l import mxnet as d2l
    return d2l


def transformer_encoder() -> List[float]:
    d2l, rs = _d2l(), _seed()
    vocab, steps, batch, hidden = 20, 8, 4, 32
    encoder = d2l.TransformerEncoder(vocab, hidden, 64, 4, 2, 0.0)  # no bias in its attention
    head = gluon.nn.Dense(vocab, flatten=False)
    head.initialize()
    encoder.hybridize()
    head.hybridize()
    ce = gluon.loss.SoftmaxCELoss()
    batches = [(mx.np.array(rs.randint(1, vocab, size=(batch, steps))),
                mx.np.array(rs.randint(steps // 2, steps + 1, size=(batch,)).astype("float32")))
               for _ in range(STEPS)]
    net = gluon.nn.Sequential()  # holds both for the trainer
    net.register_child(encoder)
    net.register_child(head)
    return _train(net, lambda n, b: ce(head(encoder(b[0], b[1])), b[0][:, ::-1]).mean(), batches,
                  "adam", {"learning_rate": 0.01})


def gru_language_model() -> List[float]:
    d2l, rs = _d2l(), _seed()
    vocab, steps, batch = 28, 10, 8
    model = d2l.RNNLM(d2l.GRU(num_hiddens=32, num_layers=1), vocab_size=vocab, lr=1)
    batches = []
    for _ in range(STEPS):
        x = rs.randint(0, vocab, size=(batch, steps + 1))
        batches.append((mx.np.array(x[:, :-1]), mx.np.array(x[:, 1:])))
    return _train(model, lambda m, b: m.loss(m(b[0]), b[1]), batches, "sgd", {"learning_rate": 1})


def bert() -> List[float]:
    d2l, rs = _d2l(), _seed()
    vocab, length, batch, preds = 50, 16, 4, 3
    net = d2l.BERTModel(vocab, num_hiddens=32, ffn_num_hiddens=64, num_heads=2, num_blks=1, dropout=0.0,
                        max_len=length)
    net.initialize(init.Xavier())
    ce = gluon.loss.SoftmaxCELoss()
    batches = []
    for _ in range(STEPS):
        tokens = rs.randint(5, vocab, size=(batch, length))
        segments = onp.zeros((batch, length), dtype="float32")  # float32 as d2l's _pad_bert_inputs makes them
        segments[:, length // 2:] = 1
        valid = rs.randint(length // 2, length + 1, size=(batch,)).astype("float32")
        positions = onp.stack([rs.choice(onp.arange(1, length // 2), preds, replace=False) for _ in range(batch)])
        labels = onp.stack([tokens[b, positions[b]] for b in range(batch)]).astype("float32")
        batches.append([mx.np.array(a) for a in (tokens, segments, valid, positions,
                                                  onp.ones((batch, preds), dtype="float32"),
                                                  labels, (tokens[:, 1] % 2).astype("float32"))])

    def loss_of(n: Any, b: list) -> Any:
        return d2l._get_batch_loss_bert(n, ce, vocab, *[[a] for a in b])[2][0]
    return _train(net, loss_of, batches, "adam", {"learning_rate": 0.002})


PROGRAMS = {"transformer-encoder": transformer_encoder, "gru-lm": gru_language_model, "bert": bert}


@functools.lru_cache(maxsize=None)
def fp32(name: str) -> List[float]:
    """FP32's losses, taken with AMP off and then numpy mode off again."""
    assert gluon_amp.state.current_policy() is None
    npx.set_np()
    try:
        return PROGRAMS[name]()
    finally:
        npx.reset_np()


@pytest.fixture(scope="module")
def references() -> Dict[str, List[float]]:
    """Taken before any test's mode (or simulated host) is set up."""
    return {name: fp32(name) for name in PROGRAMS}


def _run_under(kwargs: Dict[str, Any], name: str, ref: List[float], emulated: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(**kwargs)
    npx.set_np()
    try:
        got = PROGRAMS[name]()
    finally:
        npx.reset_np()
    rtol = RTOL[kwargs["target_dtype"]]
    assert all(abs(g - r) <= rtol * abs(r) for g, r in zip(got, ref)), (name, got, ref)
    assert not emulated or got != ref, (name, "the emulated rounding changed nothing", got)


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("kwargs", EMULATED)
def test_d2l_trains_emulated_as_fp32_does(references, kwargs, name):
    _run_under(kwargs, name, references[name], emulated=True)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_d2l_trains_on_a_native_bfloat16_host_as_fp32_does(references, native_host, name):
    _run_under({"target_dtype": "bfloat16"}, name, references[name], emulated=False)
