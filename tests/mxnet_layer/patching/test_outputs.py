"""What a block called from outside any block returns (gluon_amp/patching/outputs.py).

Generated over block shapes (a Dense stack, a conv net with batch norm, blocks returning a
tuple, a list and a namedtuple), hybridized or not, legacy and numpy mode, on a native
bfloat16 host (simulated everywhere; real where the kernels are). Found by a GluonCV script run
un-hybridized: its network's bfloat16 output reached ``mx.metric.Accuracy``, whose
``asnumpy()`` read raw 16-bit words, and the accuracy was 0 at every epoch. Float32 code gets
float32: the values the block's low-precision output holds, the same gradients, the metric
FP32's argmax gives; code that feeds bfloat16 gets bfloat16; leaving AMP puts
``Block.__call__`` back by identity.
"""
import collections
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, npx
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import mxnet_internals as mxi
from gluon_amp.mxnet_internals import gluon as mxi_gluon

Pair = collections.namedtuple("Pair", ["scores", "features"])


class _Many(nn.HybridBlock):
    """Returns its scores and features in a container of ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.body = nn.Dense(8, activation="relu")
        self.head = nn.Dense(5)

    def hybrid_forward(self, F, x):
        features = self.body(x)
        scores = self.head(features)
        if self.kind == "tuple":
            return scores, features
        if self.kind == "list":
            return [scores, features]
        return Pair(scores, features)


def _net(kind):
    mx.random.seed(0)
    if kind == "dense":
        net = nn.HybridSequential()
        net.add(nn.Dense(16, activation="relu"), nn.Dense(5))
    elif kind == "conv":
        net = nn.HybridSequential()
        net.add(nn.Conv2D(4, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"), nn.GlobalAvgPool2D(),
                nn.Dense(5))
    else:
        net = _Many(kind)
    net.initialize(mx.init.Xavier())
    return net


def _x(kind, frontend):
    rng = np.random.RandomState(1)
    x = rng.randn(8, 3, 6, 6) if kind == "conv" else rng.randn(8, 12)
    return (mx.np if frontend == "numpy" else mx.nd).array(x.astype("float32"))


def _arrays(out):
    return [out] if isinstance(out, mx.nd.NDArray) else list(out)


def _raw(net, x):
    """What the block gives inside another block's call: its outputs as its ops left them."""
    with mxi_gluon._calls.inside():
        return net(x)


@pytest.fixture(params=["legacy", "numpy"])
def frontend(request):
    if request.param == "numpy":
        npx.set_np()
    yield request.param
    if request.param == "numpy":
        npx.reset_np()


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
@pytest.mark.parametrize("kind", ["dense", "conv", "tuple", "list", "namedtuple"])
def test_float32_code_gets_float32_outputs_with_the_values_gradients_and_metric_of_the_blocks_own(
        native_host, frontend, kind, hybridize):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=False)
    net = _net(kind)
    if hybridize:
        net.hybridize()
    x = _x(kind, frontend)
    out = net(x)
    raw = _raw(net, x)
    assert type(out) is type(raw)
    if hasattr(raw, "_fields"):  # a hybridized block's CachedOp regroups outputs as MXNet does
        assert out._fields == raw._fields
    for got, inner in zip(_arrays(out), _arrays(raw)):
        assert mxi.FLOAT_NAMES[got.dtype] == "float32"
        assert isinstance(got, mx.np.ndarray) == (frontend == "numpy")
        np.testing.assert_array_equal(got.asnumpy(), inner.astype("float32").asnumpy())
    if not hybridize:  # the case the outer cast exists for: the last op left bfloat16 (mx.np
        # holds no bfloat16: there each low-precision op gives float32, test_numpy_mode_ops_...)
        assert mxi.FLOAT_NAMES[_arrays(raw)[0].dtype] == ("bfloat16" if frontend == "legacy" else "float32")

    labels = mx.nd.array(np.arange(8) % 5)
    metric = mx.metric.Accuracy()
    metric.update([labels], [_arrays(out)[0].as_nd_ndarray() if frontend == "numpy" else _arrays(out)[0]])
    want = (_arrays(raw)[0].astype("float32").asnumpy().argmax(axis=1) == labels.asnumpy()).mean()
    assert metric.get()[1] == pytest.approx(want)

    grads = []
    for run in (lambda: net(x), lambda: _raw(net, x)):
        with autograd.record():
            scores = _arrays(run())[0]
            loss = (scores.astype("float32") ** 2).sum()
        loss.backward()
        grads.append([p.grad().asnumpy() for p in net.collect_params().values() if p.grad_req != "null"])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_code_that_feeds_bfloat16_gets_bfloat16(native_host):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=False)
    net = _net("dense")
    net(_x("dense", "legacy"))  # deferred initialization in float32: MXNet samples no bfloat16
    net.cast(mxi.to_mx_dtype("bfloat16"))
    out = net(_x("dense", "legacy").astype(mxi.to_mx_dtype("bfloat16")))
    assert mxi.FLOAT_NAMES[out.dtype] == "bfloat16"


def test_emulation_and_amp_off_return_what_the_block_gives():
    net = _net("dense")
    x = _x("dense", "legacy")
    assert net(x) is not None and mxi_gluon.Block.__call__ is mxi_gluon._BLOCK_CALL  # AMP never on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", emulate=True, tune=False)
    assert mxi_gluon.Block.__call__ is not mxi_gluon._BLOCK_CALL
    out, raw = net(x), _raw(net, x)
    assert mxi.FLOAT_NAMES[out.dtype] == "float32"
    np.testing.assert_array_equal(out.asnumpy(), raw.asnumpy())
    gluon_amp.disable()
    assert mxi_gluon.Block.__call__ is mxi_gluon._BLOCK_CALL  # put back by identity


def test_a_block_that_raises_leaves_the_next_call_outermost(native_host):
    """A fault (a Ctrl-C included) inside a block's forward: the thread is outside every block
    again, so the next call's outputs still come back float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=False)
    net = _net("dense")
    x = _x("dense", "legacy")

    class Failing(nn.Block):
        def forward(self, x):
            net(x)
            raise KeyboardInterrupt("inside a block")

    with pytest.raises(KeyboardInterrupt):
        Failing()(x)
    assert mxi_gluon._calls.depth == 0
    assert mxi.FLOAT_NAMES[net(x).dtype] == "float32"


@pytest.mark.parametrize("call", [lambda net, x: net(x, foo=1), lambda net, x: net()], ids=["keyword", "no-args"])
def test_a_wrong_block_call_is_named_as_mxnet_names_it(call):
    """A caller's wrong keyword was "install_block_hooks.<locals>.__call__() got an unexpected
    keyword argument 'foo'": a gluon_amp internal blamed for the user's mistake."""
    net = _net("dense")
    x = _x("dense", "legacy")
    errors = []
    for amp in (False, True):
        if amp:
            gluon_amp.init("float16", emulate=True, tune=False)
        try:
            call(net, x)
        except TypeError as exc:
            errors.append(str(exc).replace(net.name, "NET"))
    assert len(errors) == 2 and errors[0] == errors[1], errors


class _Tensordot(nn.HybridBlock):
    """An inner Dense's output into ``np.tensordot``: a hand-written mx.np function (1.9.1: it
    calls ``_api_internal.tensordot``), which no op-function patch reaches."""

    def __init__(self):
        super().__init__()
        self.feat = nn.Dense(6, in_units=3, flatten=False)

    def hybrid_forward(self, F, x):
        return F.np.tensordot(self.feat(x), F.np.ones((6,)), axes=1)


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_numpy_mode_ops_give_float32_code_float32_on_a_native_bfloat16_host(native_host, hybridize):
    """mx.np holds no bfloat16 arrays (1.9.1): a bare ``npx.fully_connected`` returned one, whose
    ``asnumpy()`` gave raw 16-bit words, and an un-hybridized block's inner bfloat16 output met
    ``np.tensordot``, which has no bfloat16 kernel ("Incompatible attr ... expected bfloat16").
    Each low-precision op of the numpy front end now gives float32 code float32, holding the
    values its bfloat16 kernel computed. Legacy ``mx.nd`` keeps bfloat16, as the peer gives it."""
    rng = np.random.RandomState(0)
    xs, ws = rng.randn(2, 3).astype("float32"), rng.randn(4, 3).astype("float32")
    npx.set_np()
    try:
        net = _Tensordot()
        net.initialize(mx.init.Xavier())
        if hybridize:
            net.hybridize()
        x = mx.np.array(rng.randn(2, 5, 3).astype("float32"))
        want = net(x).asnumpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gluon_amp.init("bfloat16", tune=False)
        got = net(x)
        assert isinstance(got, mx.np.ndarray) and mxi.FLOAT_NAMES[got.dtype] == "float32"
        np.testing.assert_allclose(got.asnumpy(), want, rtol=0.03, atol=0.03)  # bfloat16's 8 bits

        y = npx.fully_connected(mx.np.array(xs), mx.np.array(ws), no_bias=True, num_hidden=4)
        assert isinstance(y, mx.np.ndarray) and mxi.FLOAT_NAMES[y.dtype] == "float32"

        def low(a):
            return mx.nd.array(a).astype(mxi.to_mx_dtype("bfloat16")).astype("float32").asnumpy()
        exact = low(low(xs) @ low(ws).T)  # bfloat16 inputs, float32 accumulation, bfloat16 output
        np.testing.assert_allclose(y.asnumpy(), exact, rtol=0.01, atol=1e-6)
        assert y.tolist()[0][0] == pytest.approx(float(exact[0, 0]), rel=0.01)
    finally:
        npx.reset_np()
        gluon_amp.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=False)
    try:
        legacy = mx.nd.FullyConnected(mx.nd.array(xs), mx.nd.array(ws), no_bias=True, num_hidden=4)
        assert mxi.FLOAT_NAMES[legacy.dtype] == "bfloat16"
    finally:
        gluon_amp.disable()
