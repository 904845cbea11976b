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
