"""Where a block is bound, a slow add (numpy's, ``broadcast_add``) of two same-shape bfloat16
values runs as ``elemwise_add`` in bfloat16 (gluon_amp.same_shape_run), on a native host
(simulated on every CPU, real where it has bfloat16 kernels): converted and under ``init``; and a
call at shapes where those inputs differ is bound again, never refused."""
import json
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import gluon, npx

from gluon_amp.same_shape_run import twins_of


class _Residual(gluon.HybridBlock):
    """d2l's residual block: ``relu(bn(conv(relu(bn(conv(X))))) + X)``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.conv1 = gluon.nn.Conv2D(8, 3, padding=1)
            self.conv2 = gluon.nn.Conv2D(8, 3, padding=1)
            self.bn1, self.bn2 = gluon.nn.BatchNorm(), gluon.nn.BatchNorm()

    def hybrid_forward(self, F, X):
        Y = F.npx.relu(self.bn1(self.conv1(X)))
        return F.npx.relu(self.bn2(self.conv2(Y)) + X)


class _Net(gluon.HybridBlock):
    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.stem = gluon.nn.Conv2D(8, 3, padding=1)
            self.blocks = gluon.nn.HybridSequential()
            self.blocks.add(_Residual(), _Residual())

    def hybrid_forward(self, F, x):
        return self.blocks(self.stem(x))


class _TwoBranches(gluon.HybridBlock):
    """``dense1(x) + dense2(z)``: one shape where both batches are 1, a broadcast otherwise."""

    def __init__(self, how, **kw):
        super().__init__(**kw)
        self.how = how
        with self.name_scope():
            self.d1, self.d2 = gluon.nn.Dense(8), gluon.nn.Dense(8)

    def hybrid_forward(self, F, x, z):
        a, b = self.d1(x), self.d2(z)
        if self.how == "float32 branch":
            b = F.npx.softmax(b)  # a float32 op: its value is float32 in the plan
        if self.how == "broadcast_add":
            return F.broadcast_add(a, b)
        return a + b


def _array(numpy_mode, values):
    return mx.np.array(values) if numpy_mode else mx.nd.array(values)


def _float32(net, *xs):
    return net(*xs).asnumpy()


@pytest.fixture
def numpy_mode():
    npx.set_np()
    yield True
    npx.reset_np()


def _convert(net):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", tune=False)


def test_a_numpy_mode_residual_net_converted_runs_its_adds_as_elemwise_add(native_host, numpy_mode):
    mx.random.seed(0)
    net = _Net()
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    x = _array(True, np.random.RandomState(0).uniform(-1, 1, (2, 4, 8, 8)).astype("float32"))
    ref = _float32(net, x)
    block = _convert(net)
    out = block(x).asnumpy()
    # both blocks' sums and every relu (numpy's relu is a slow loop too): the second block's
    # shortcut is bfloat16 once the first's last relu runs as Activation
    assert sorted(n.split("_")[-1] for n in twins_of(block)) == ["add0"] * 2 + ["relu0", "relu0", "relu1", "relu1"]
    plan = json.loads(block._cached_graph[1].tojson())  # what export writes keeps numpy's ops
    kept = sorted(n["op"] for n in plan["nodes"] if n["op"] in ("_npi_add", "_npx_relu"))
    assert kept == ["_npi_add"] * 2 + ["_npx_relu"] * 4
    np.testing.assert_allclose(out, ref, rtol=0.1, atol=0.1)


def test_a_bound_block_with_twins_reads_only_its_call_s_shapes(native_host, monkeypatch):
    """Each call of a block running twins checks its input shapes still fit them: from the
    call's arrays, not by collecting the block's parameters (what a ResNet-50 pays 20 ms for)."""
    net = _two_branches("broadcast_add")
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (1, 16)))
    net(x, x)
    block = _convert(net)
    block(x, x).wait_to_read()
    assert twins_of(block)
    collected = []
    collect = gluon.Block.collect_params
    monkeypatch.setattr(gluon.Block, "collect_params", lambda self, *a: collected.append(self) or collect(self, *a))
    for _ in range(3):
        block(x, x).wait_to_read()
    assert collected == [] and twins_of(block)


@pytest.mark.parametrize("how", ["numpy add", "broadcast_add"])
def test_a_call_whose_sum_broadcasts_is_bound_again(native_host, how):
    """Bound at batch 1, where the sum's inputs have one shape, then called at batch 4, where
    they broadcast."""
    numpy_mode = how == "numpy add"
    if numpy_mode:
        npx.set_np()
    try:
        rng = np.random.RandomState(1)
        xs = [rng.uniform(-1, 1, (n, 16)).astype("float32") for n in (1, 4, 1)]
        z = _array(numpy_mode, rng.uniform(-1, 1, (1, 16)).astype("float32"))
        net = _two_branches(how)
        refs = [_float32(net, _array(numpy_mode, x), z) for x in xs]
        block = _convert(net)
        for k, (x, ref) in enumerate(zip(xs, refs)):
            out = block(_array(numpy_mode, x), z).asnumpy()
            assert out.shape == ref.shape
            np.testing.assert_allclose(out, ref, rtol=0.05, atol=0.05)
            assert bool(twins_of(block)) is (k == 0), k  # bound again at batch 4, and kept
    finally:
        if numpy_mode:
            npx.reset_np()


def _two_branches(how):
    mx.random.seed(0)
    net = _TwoBranches(how)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def test_a_sum_with_a_float32_value_keeps_numpys_add(native_host, numpy_mode):
    net = _two_branches("float32 branch")
    x = _array(True, np.random.RandomState(2).uniform(-1, 1, (1, 16)).astype("float32"))
    ref = _float32(net, x, x)
    block = _convert(net)
    np.testing.assert_allclose(block(x, x).asnumpy(), ref, rtol=0.05, atol=0.05)
    assert not twins_of(block)


def test_the_report_says_which_ops_run_as_their_twin(native_host, numpy_mode):
    net = _two_branches("numpy add")
    x = _array(True, np.random.RandomState(3).uniform(-1, 1, (1, 16)).astype("float32"))
    net(x, x)
    block = _convert(net)
    block(x, x)
    text = str(gluon_amp.report(block))
    (name,) = twins_of(block)
    assert name in text and "runs as elemwise_add in bfloat16" in text, text


def test_a_graph_that_trains_keeps_the_plan(native_host, numpy_mode):
    """Under ``init``, and a converted block first called under ``autograd.record``: no twin."""
    x = _array(True, np.random.RandomState(4).uniform(-1, 1, (2, 4, 8, 8)).astype("float32"))
    mx.random.seed(0)
    net = _Net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(x)
    block = _convert(net)
    with mx.autograd.record():
        block(x)
    assert not twins_of(block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(target_dtype="bfloat16")
    net = _Net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(x)
    assert not twins_of(net)
