"""Float32 master weights for bfloat16 (which MXNet's optimizers do not cover).

These run the updater on raw arrays: float32 optimizer kernels and casts, no bfloat16
convolution, so they need no hardware marker.
"""
import pickle

import numpy as np
import mxnet as mx
import pytest
from mxnet import gluon
from mxnet.optimizer import Updater

from gluon_amp.training import master_weights as mw
from gluon_amp import mxnet_internals as mxi
from gluon_amp.mxnet_internals import BFLOAT16

OPTIMIZERS = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
    ("sgd", {"learning_rate": 0.1}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9}),
    ("adam", {"learning_rate": 0.01}),
]


def _bf16(x):
    return mx.nd.amp_cast(mx.nd.array(x, dtype="float32"), dtype=BFLOAT16)


def _f32(x):
    return mx.nd.amp_cast(x, dtype="float32").asnumpy()


def _grads(step, n, shape):
    # values exactly representable in bfloat16, so casting them loses nothing
    rng = np.random.RandomState(step)
    return [np.round(rng.uniform(-4, 4, size=shape) * 8) / 8 for _ in range(n)]


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS)
def test_master_update_equals_float32_training(name, kwargs):
    """The master copy follows a float32 run exactly; the weight is its rounding."""
    n, shape = 5, (3, 4)  # 5 weights: SGD aggregates 4 at a time, then 1
    rng = np.random.RandomState(0)
    init = [rng.uniform(-1, 1, size=shape).astype("float32") for _ in range(n)]
    ref_w = [mx.nd.array(_f32(_bf16(w))) for w in init]  # the float32 run starts where bf16 does
    low_w = [_bf16(w) for w in init]
    ref = Updater(mx.optimizer.create(name, **kwargs))
    upd = mw.MasterWeightUpdater(mx.optimizer.create(name, **kwargs), "bfloat16")
    for step in range(6):
        g = _grads(step, n, shape)
        ref(list(range(n)), [mx.nd.array(x) for x in g], ref_w)
        upd(list(range(n)), [_bf16(x) for x in g], low_w)
    for i in range(n):
        state = upd.states[i]
        assert isinstance(state, mw.MasterState)
        assert state.master.dtype == np.float32
        np.testing.assert_array_equal(state.master.asnumpy(), ref_w[i].asnumpy())
        np.testing.assert_array_equal(_f32(low_w[i]), _f32(mx.nd.amp_cast(ref_w[i], dtype=BFLOAT16)))


def test_small_updates_survive_only_with_master_weights():
    # 1 - 1e-3: below half of bfloat16's spacing at 1.0 (2**-8), so a bf16 update rounds back
    kept, dropped = _bf16([1.0, 1.0]), _bf16([1.0, 1.0])
    with_master = mw.MasterWeightUpdater(mx.optimizer.create("sgd", learning_rate=1e-3), "bfloat16")
    without = mw.MasterWeightUpdater(mx.optimizer.create("sgd", learning_rate=1e-3), "bfloat16",
                                     keep_master=False)
    for _ in range(10):
        with_master(0, _bf16([1.0, 1.0]), kept)
        without(0, _bf16([1.0, 1.0]), dropped)
    np.testing.assert_allclose(with_master.states[0].master.asnumpy(), [0.99, 0.99], rtol=0, atol=1e-6)
    assert (_f32(kept) < 1.0).all()
    np.testing.assert_array_equal(_f32(dropped), [1.0, 1.0])
    assert not isinstance(without.states[0], mw.MasterState)


def test_mxnet_keeps_no_master_copy_for_bfloat16():
    """Why this module exists: multi_precision covers float16 only."""
    opt = mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, multi_precision=True)
    state16 = opt.create_state_multi_precision(0, mx.nd.ones((2,), dtype="float16"))
    state_bf = opt.create_state_multi_precision(0, _bf16([1.0, 1.0]))
    assert any(isinstance(s, mx.nd.NDArray) and s.dtype == np.float32 for s in state16)
    assert not isinstance(state_bf, tuple) and state_bf.dtype == BFLOAT16


def test_other_dtypes_take_mxnets_path():
    upd = mw.MasterWeightUpdater(mx.optimizer.create("sgd", learning_rate=0.5), "bfloat16")
    w32, wbf = mx.nd.ones((2,)), _bf16([1.0, 1.0])
    upd([0, 1], [mx.nd.ones((2,)), _bf16([1.0, 1.0])], [w32, wbf])
    np.testing.assert_array_equal(w32.asnumpy(), [0.5, 0.5])
    np.testing.assert_array_equal(_f32(wbf), [0.5, 0.5])
    assert not isinstance(upd.states[0], mw.MasterState)
    assert isinstance(upd.states[1], mw.MasterState)


def test_states_pickle_with_master_copies():
    upd = mw.MasterWeightUpdater(mx.optimizer.create("sgd", learning_rate=1e-3, momentum=0.9), "bfloat16")
    w = _bf16([1.0, 2.0])
    upd(0, _bf16([1.0, 1.0]), w)
    blob = upd.get_states(dump_optimizer=True)
    fresh = mw.MasterWeightUpdater(mx.optimizer.create("sgd"), "bfloat16")
    fresh.set_states(blob)
    st = fresh.sync_state_context(fresh.states[0], mx.cpu())
    assert isinstance(st, mw.MasterState)
    np.testing.assert_array_equal(st.master.asnumpy(), upd.states[0].master.asnumpy())
    np.testing.assert_array_equal(st.inner.asnumpy(), upd.states[0].inner.asnumpy())
    assert fresh.optimizer.momentum == 0.9
    # continuing from the loaded state gives the same next step as continuing the original
    w2 = w.copy()
    upd(0, _bf16([1.0, 1.0]), w)
    fresh(0, _bf16([1.0, 1.0]), w2)
    np.testing.assert_array_equal(fresh.states[0].master.asnumpy(), upd.states[0].master.asnumpy())
    assert pickle.loads(pickle.dumps(upd.states[0])).master.dtype == np.float32


def _trainer(dtype):
    p = gluon.Parameter("w", shape=(2,))
    p.initialize(ctx=mx.cpu())
    p.cast(dtype)
    return gluon.Trainer([p], "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)


def test_install_bfloat16_replaces_updaters():
    tr = _trainer(BFLOAT16)
    opt = tr.optimizer
    mw.install(tr, "bfloat16")
    assert all(isinstance(u, mw.MasterWeightUpdater) and u.keep_master for u in mxi.trainer_updaters(tr))
    assert tr.optimizer is opt and not opt.multi_precision  # the user's optimizer is kept as is
    assert mw.master_copies(tr) == {}


def test_install_float16_uses_multi_precision():
    tr = _trainer("float16")
    before = mxi.trainer_updaters(tr)
    mw.install(tr, "float16")
    assert tr.optimizer.multi_precision is True
    assert mxi.trainer_updaters(tr) == before


def test_install_without_master_for_float16_changes_nothing():
    tr = _trainer("float16")
    mw.install(tr, "float16", keep_master=False)
    assert tr.optimizer.multi_precision is False
    assert not any(isinstance(u, mw.MasterWeightUpdater) for u in mxi.trainer_updaters(tr))
