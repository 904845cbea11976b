"""Fewer casts in a plan (gluon_amp/tuning/casts.py over gluon_amp_core/fewer_casts.py): the
converters and init's training graphs, on an unrolled LSTM, with the same values."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon

import gluon_amp
from gluon_amp.tuning import casts


class _LSTM(gluon.HybridBlock):
    """Two LSTM cells unrolled over 6 steps (NTC), then a dense head: DeepAR's shape, small."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.rnn = gluon.rnn.HybridSequentialRNNCell()
            for _ in range(2):
                self.rnn.add(gluon.rnn.LSTMCell(8))
            self.out = gluon.nn.Dense(2, flatten=False)

    def hybrid_forward(self, F, x):
        first = F.slice_axis(F.slice_axis(x, axis=1, begin=0, end=1), axis=2, begin=0, end=1).reshape((-1, 1))
        zero = F.broadcast_axis(F.zeros_like(first), axis=1, size=8)
        out, _ = self.rnn.unroll(6, x, begin_state=[zero] * 4, layout="NTC", merge_outputs=True)
        return self.out(out)


def _net():
    mx.random.seed(3)
    net = _LSTM()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


X = mx.nd.random.uniform(-1, 1, shape=(4, 6, 3), ctx=mx.cpu())


@pytest.fixture
def without_the_pass(monkeypatch):
    def off():
        monkeypatch.setattr(casts, "fewer_casts", lambda graph, dtypes, table, keep=(): (graph, dict(dtypes), 0))
    return off


def test_a_converted_lstm_casts_less_per_low_op_and_computes_the_same(without_the_pass):
    net = _net()
    net(X)
    fewer = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=False, emulate=True)
    got = fewer(X).asnumpy()
    without_the_pass()
    plain = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=False, emulate=True)
    want = plain(X).asnumpy()
    a, b = gluon_amp.report(fewer), gluon_amp.report(plain)
    assert a.casts < 0.6 * b.casts and a.casts_per_low_op < b.casts_per_low_op, (a.casts, a.low_ops, b.casts, b.low_ops)
    assert f"{a.casts_per_low_op:.2f} per low-precision op" in str(a)
    assert np.array_equal(got, want)  # the moved casts round nothing differently


def test_an_lstm_trained_under_init_casts_less_per_low_op_and_computes_the_same(without_the_pass):
    def step():
        net = _net()
        with autograd.record():
            y = net(X)
        y.backward()
        return gluon_amp.report(net), y.asnumpy(), net.out.weight.grad().asnumpy()

    gluon_amp.init("bfloat16", emulate=True)
    rep, y, grad = step()
    without_the_pass()
    rep0, y0, grad0 = step()
    assert rep.casts_per_low_op < 0.5 * rep0.casts_per_low_op, (rep.casts, rep.low_ops, rep0.casts, rep0.low_ops)
    assert np.array_equal(y, y0) and np.array_equal(grad, grad0)
