"""A block instance called twice in one hybridized graph, under every AMP mode.

Gluon names a block's ops by its scope, so a block reused in one trace gives two nodes one
name, and a ``(name, output)`` dtype cannot tell them apart. Found by GluonNLP 0.10's
decomposable-attention model (one ``Dropout`` added to several ``HybridSequential``\\ s): under
``init`` its first training call failed in MXNet ("expected float32, got bfloat16" at a Dense's
weight), the cast of its data dropped as if it were a cast to its own dtype. Generated over
the reused block, where it is reused, and the dtype: each graph must give the outputs and
gradients of the same net built with distinct instances, the same weights.
"""
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd
from mxnet.gluon import nn

import gluon_amp

REUSED = {
    "relu": lambda: nn.Activation("relu"),
    "lambda": lambda: nn.HybridLambda(lambda F, x: F.identity(x)),
    "dropout0": lambda: nn.Dropout(0.0),
}


def _net(kind, where, shared):
    """Dense layers with the block ``kind`` before each: one instance (``shared``) or one
    each; ``where``: all in one sequential, or each Dense in a child sequential of its own."""
    one = REUSED[kind]()
    block = (lambda: one) if shared else REUSED[kind]
    net = nn.HybridSequential()
    for units, in_units in ((8, 8), (8, 8), (4, 8)):
        layers = [block(), nn.Dense(units, in_units=in_units)]
        if where == "children":
            child = nn.HybridSequential()
            child.add(*layers)
            layers = [child]
        net.add(*layers)
    net.initialize(mx.init.Normal(0.5))
    net.hybridize()
    return net


def _run(net, x):
    with autograd.record():
        out = net(x)
        loss = out.sum()
    loss.backward()
    grads = [p.grad().asnumpy() for p in net.collect_params().values()]
    return out.asnumpy(), grads


def _same_as_distinct(kind, where):
    shared, distinct = _net(kind, where, True), _net(kind, where, False)
    for a, b in zip(shared.collect_params().values(), distinct.collect_params().values()):
        b.set_data(a.data())
    x = mx.nd.array(np.random.RandomState(0).randn(2, 8).astype("float32"))
    got, want = _run(shared, x), _run(distinct, x)
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(g, w)
    assert np.isfinite(got[0]).all()


@pytest.mark.parametrize("where", ["one sequential", "children"])
@pytest.mark.parametrize("kind", sorted(REUSED))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_reused_block_trains_emulated_as_distinct_blocks_do(dtype, kind, where):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(dtype, emulate=True, tune=False)
    _same_as_distinct(kind, where)


@pytest.mark.parametrize("where", ["one sequential", "children"])
@pytest.mark.parametrize("kind", sorted(REUSED))
def test_a_reused_block_trains_natively_as_distinct_blocks_do(native_host, kind, where):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=False)
    _same_as_distinct(kind, where)
