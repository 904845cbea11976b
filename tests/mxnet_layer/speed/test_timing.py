"""gluon_amp.speed.timing: what measuring leaves behind in the user's process."""
import numpy as np
import mxnet as mx

from gluon_amp.speed import timing
from helpers import MixedNet


def _next_draw(seed, between):
    mx.random.seed(seed)
    between()
    return mx.nd.random.uniform(shape=(8,)).asnumpy()


def test_timing_leaves_mxnet_random_generator_where_the_user_seeded_it():
    """Tuning runs inside a user's first forward, before deferred weights are drawn: a draw
    from MXNet's generator there gave the tuning run other weights than later runs."""
    net = MixedNet()
    sym = net(mx.sym.var("data"))
    untouched = _next_draw(3, lambda: None)
    assert timing.time_graph(sym, {"data": (2, 3, 8, 8)}, train=True) is not None
    assert np.array_equal(_next_draw(3, lambda: timing.time_graph(sym, {"data": (2, 3, 8, 8)}, train=True)),
                          untouched)
    assert np.array_equal(_next_draw(3, lambda: timing.time_op(
        "FullyConnected", {"num_hidden": "4"}, [(2, 8), (4, 8), (4,)], ["float32"] * 3, True)), untouched)
    # the check can fail: one draw in between moves the generator
    assert not np.array_equal(_next_draw(3, lambda: mx.nd.random.uniform(shape=(1,))), untouched)


def _conv1d_net() -> mx.sym.Symbol:
    x = mx.sym.var("data")
    h = mx.sym.tanh(mx.sym.Convolution(x, kernel=(2,), num_filter=8, name="dilated"))
    return mx.sym.Convolution(h, kernel=(1,), num_filter=4, name="skip")


def test_a_graph_with_a_1d_convolution_is_timed_as_a_whole():
    """A float32 Conv1D leaves its weight in oneDNN's layout after an inference call, and
    MXNet refuses to copy values into it: trial graphs got their values that way, so a
    WaveNet-style graph could not be timed and its tuning never reached a verdict."""
    sym = _conv1d_net()
    for train in (True, False):
        got = timing.time_graphs([sym, sym], {"data": (2, 4, 16)}, train=train)
        assert got is not None and len(got) == 2 and all(t > 0 for t in got)


def test_trial_values_follow_each_parameter_kind():
    rng = np.random.default_rng(0)
    init = timing._TrialInit(rng)
    got = {}
    for name in ("bn_gamma", "bn_running_var", "bn_beta", "fc_bias", "conv_weight"):
        arr = mx.nd.full((4, 3), 5.0)
        init(mx.init.InitDesc(name), arr)
        got[name] = arr.asnumpy()
    assert (got["bn_gamma"] == 1).all() and (got["bn_running_var"] == 1).all()
    assert (got["bn_beta"] == 0).all() and (got["fc_bias"] == 0).all()
    w = got["conv_weight"]
    assert np.abs(w).max() <= 0.07 and len(np.unique(w)) > 1
