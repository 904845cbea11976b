"""A hybridized block's calls that record nothing, under ``init``, run on parameter casts made
once (``gluon_amp.mxnet_internals.forward_only``), on a native host (``native_host``: the
simulated one on every CPU, the real one where the CPU has bfloat16 kernels).

Each check compares the block's output with a twin's that shares its parameters and records
its call (``autograd.record(train_mode=False)``), so runs the training graph, which casts the
parameters as they are now: equal to the bit, after every way a parameter can change.
"""
import random
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon, npx

from gluon_amp.mxnet_internals import ForwardOnly


def _make(params=None):
    net = gluon.nn.HybridSequential(prefix="fo_", params=params)
    with net.name_scope():
        net.add(gluon.nn.Conv2D(6, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
                gluon.nn.Dense(5))
    return net


def _pair(static):
    """(the block under test, its twin on the same parameters), both hybridized."""
    mx.random.seed(0)
    net = _make()
    net.initialize(mx.init.Xavier())
    twin = _make(net.collect_params())
    flags = {"static_alloc": True, "static_shape": True} if static else {}
    net.hybridize(**flags)
    twin.hybridize(**flags)
    return net, twin


def _init():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(target_dtype="bfloat16")


def _recorded(block, x):
    with autograd.record(train_mode=False):
        return block(x)


def _stored(block) -> int:
    op = block._cached_op
    return op.stored if isinstance(op, ForwardOnly) else 0


def _weights(net):
    return [p for name, p in sorted(net.collect_params().items()) if name.endswith("weight")]


def _change(rng, net, twin, trainer, x, tmp_path):
    """One way a parameter changes, picked by ``rng``; returns its name."""
    how = rng.choice(["step", "set_data", "in place", "view", "load", "reinit", "nothing"])
    p = rng.choice(_weights(net))
    if how == "step":
        with autograd.record():
            loss = twin(x).mean()
        loss.backward()
        trainer.step(1)
    elif how == "set_data":
        p.set_data(mx.nd.random.uniform(-1, 1, shape=p.shape))
    elif how == "in place":
        p.data()[:] = p.data() * 0.5
    elif how == "view":
        flat = p.data().reshape((-1,))
        flat[:3] = flat[:3] * -3 - 1
    elif how == "load":
        path = str(tmp_path / "p.params")
        saved = {n: q.data().copy() for n, q in net.collect_params().items()}
        for q in _weights(net):
            q.data()[:] = q.data() + 1.0
        net.save_parameters(path)
        for n, q in net.collect_params().items():
            q.set_data(saved[n])
        net.load_parameters(path)
    elif how == "reinit":
        net.initialize(mx.init.Uniform(0.3), force_reinit=True)
    return how


@pytest.mark.parametrize("static", [True, False], ids=["static_alloc", "dynamic"])
def test_calls_that_record_nothing_see_every_change_of_a_parameter(native_host, tmp_path, static):
    """Generated sequences of parameter changes (a trainer's step, ``set_data``, writes in place
    and through a view, ``load_parameters``, re-initialisation, none): after each, the block's
    call that records nothing gives what the training graph gives now, to the bit, and runs on
    stored casts (one per weight and bias a bfloat16 op reads)."""
    _init()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    visible = {}
    for seed in range(4):
        rng = random.Random(seed)
        net, twin = _pair(static)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, update_on_kvstore=False)
        gluon_amp.init_trainer(trainer)
        before = net(x).asnumpy()
        assert isinstance(net._cached_op, ForwardOnly) and _stored(net) == 4  # conv and dense: weight, bias
        for _ in range(6):
            how = _change(rng, net, twin, trainer, x, tmp_path)
            out, ref = net(x).asnumpy(), _recorded(twin, x).asnumpy()
            np.testing.assert_array_equal(out, ref, err_msg=f"seed {seed}, after {how}")
            visible[how] = visible.get(how, 0) + (not np.array_equal(out, before))
            before = out
        assert _stored(net) == 4
    # each kind of change showed in the output at least once (a change to a few weights can
    # vanish under a ReLU or bfloat16's rounding of a large output), so a stale cast would have
    visible.pop("nothing", None)
    assert set(visible) == {"step", "set_data", "in place", "view", "load", "reinit"} and all(visible.values()), \
        visible


def test_the_first_call_that_records_ends_the_stored_casts(native_host):
    """From the first call that records, every call runs the training graph: a block that trains
    holds one graph's memory, as without init."""
    _init()
    net, twin = _pair(True)
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    first = net(x).asnumpy()
    assert _stored(net) == 4
    np.testing.assert_array_equal(_recorded(net, x).asnumpy(), first)
    assert _stored(net) == 0 and net._cached_op._run is None
    np.testing.assert_array_equal(net(x).asnumpy(), first)
    assert _stored(net) == 0


def test_a_block_without_init_or_converted_low_stores_nothing(native_host):
    """Without a policy there is no cast to store; a block converted with its parameters
    stored low reads none through a cast."""
    net, _ = _pair(True)
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    net(x)
    assert not isinstance(net._cached_op, ForwardOnly)
    converted = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", cast_optional_params=True)
    converted(x)
    assert not isinstance(converted._cached_op, ForwardOnly)


def _residual(prefix):
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.Activation("relu"), gluon.nn.Conv2D(8, 3, padding=1), gluon.nn.Dense(5))
    return net


@pytest.mark.parametrize("numpy_mode", [True, False], ids=["numpy", "legacy"])
def test_a_converted_block_on_float32_weights_runs_on_their_stored_casts(native_host, numpy_mode):
    """A converter's result that keeps float32 weights (numpy mode's default: 1.9.1's mx.np has
    no bfloat16; or ``cast_optional_params=False``) casts them once for the calls that record
    nothing, fused or not, and again once one is written. Its twin, another conversion of the
    same block, runs its training graph (a recording call), which casts them at every call."""
    if numpy_mode:
        npx.set_np()
    try:
        mx.random.seed(0)
        net = _residual("fc_")
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True, static_shape=True)
        rand = np.random.RandomState(0).uniform(-1, 1, (2, 4, 8, 8)).astype("float32")
        x = mx.np.array(rand) if numpy_mode else mx.nd.array(rand)
        net(x)
        kept = {} if numpy_mode else {"cast_optional_params": False}
        block, twin = (gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", **kept) for _ in range(2))
        for _ in range(2):  # the twin's first recording call ends its own stored casts
            out = block(x)
            assert isinstance(out, mx.np.ndarray if numpy_mode else mx.nd.NDArray)
            assert isinstance(block._cached_op, ForwardOnly)
            assert _stored(block) == len([n for n in block.collect_params().keys() if "batchnorm" not in n])
            np.testing.assert_allclose(out.asnumpy(), _recorded(twin, x).asnumpy(), rtol=1e-6, atol=1e-6)
            for b in (block, twin):  # a weight written: its cast is made again
                w = b.collect_params()[sorted(n for n in b.collect_params().keys() if n.endswith("weight"))[0]]
                w.set_data(w.data() * -2)
    finally:
        npx.reset_np()


def test_numpy_mode_gives_numpy_arrays_from_stored_casts(native_host):
    """d2l's numpy mode: the graph for calls that record nothing is a numpy graph too."""
    _init()
    npx.set_np()
    try:
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, activation="relu"), gluon.nn.Dense(3))
        net.initialize(mx.init.Xavier())
        net.hybridize()
        x = mx.np.array(np.random.RandomState(0).randn(4, 5).astype("float32"))
        out = net(x)
        assert isinstance(out, mx.np.ndarray) and out.dtype == np.float32
        assert _stored(net) == 4
        with autograd.record(train_mode=False):
            ref = net(x)
        np.testing.assert_array_equal(out.asnumpy(), ref.asnumpy())
    finally:
        npx.reset_np()


def test_a_monitored_block_runs_the_graph_its_hook_was_given(native_host):
    """``register_op_hook`` hooks the training CachedOp: a monitored block's calls run it, and
    the hook sees every call."""
    _init()
    net, _ = _pair(False)
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    seen = []
    net.register_op_hook(lambda name, op, arr: seen.append(op))
    first = net(x).asnumpy()
    ops = len(seen)
    assert ops and _stored(net) == 0
    np.testing.assert_array_equal(net(x).asnumpy(), first)
    assert len(seen) == 2 * ops


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_environment_turns_stored_casts_off(native_host, monkeypatch, value):
    """``GLUON_AMP_STORED_CASTS=0``: blocks bound from then on cast their parameters at every
    call (less memory: no second graph, no stored copy)."""
    _init()
    monkeypatch.setenv("GLUON_AMP_STORED_CASTS", value)
    net, twin = _pair(True)
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    out = net(x)
    assert not isinstance(net._cached_op, ForwardOnly)
    np.testing.assert_array_equal(out.asnumpy(), _recorded(twin, x).asnumpy())


def test_a_block_bound_with_stored_casts_is_freed(native_host):
    """Nothing gluon_amp keeps holds the block: once the user drops it, it is collected, before
    and after its first call that records nothing."""
    import gc
    import weakref
    _init()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    for calls in (0, 2):
        net, twin = _pair(True)
        _recorded(twin, x)  # the twin binds; its graph was made under init too
        net(x) if calls else net._build_cache(x)
        for _ in range(calls - 1):
            net(x)
        assert isinstance(net._cached_op, ForwardOnly)
        gone = weakref.ref(net), weakref.ref(twin)
        del net, twin
        gc.collect()
        assert gone[0]() is None and gone[1]() is None, calls


def test_a_graph_that_cannot_be_made_leaves_the_calls_on_the_training_graph(native_host, monkeypatch):
    """Where the graph for calls that record nothing fails to build, the call runs the training
    graph (the same values) and says so once, naming the switch."""
    from gluon_amp import execution

    def fails(*_a, **_k):
        raise ValueError("planted failure")
    monkeypatch.setattr(execution, "_forward_only_graph", fails)
    _init()
    net, twin = _pair(True)
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    with pytest.warns(RuntimeWarning, match="planted failure.*GLUON_AMP_STORED_CASTS=0") as said:
        out = net(x)
    assert len([w for w in said if "planted failure" in str(w.message)]) == 1 and _stored(net) == 0
    np.testing.assert_array_equal(out.asnumpy(), _recorded(twin, x).asnumpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(x)
