"""The neutral path of ops with several inputs (patching/wrappers/follow.py): a call MXNet
accepts goes to it as it is, without a slot lookup; mixed float inputs it refuses are made to
agree, passed positionally or by keyword, and its other errors are its own."""
import numpy as np
import mxnet as mx
import pytest

import gluon_amp
from gluon_amp.patching.wrappers import follow

PAIRS = [("float32", "float32"), ("float16", "float16"), ("float32", "float16"), ("float16", "float32")]


@pytest.mark.parametrize("by_keyword", [False, True])
@pytest.mark.parametrize("dtypes", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_inputs_agree_and_one_dtype_takes_the_fast_path(dtypes, by_keyword, monkeypatch):
    """``sgd_update`` (neutral, two float inputs): MXNet refuses a float16 gradient for a
    float32 weight; under a policy the gradient takes the weight's dtype."""
    w = mx.nd.array(np.linspace(-1, 1, 6).reshape(2, 3), dtype=dtypes[0])
    g = mx.nd.array(np.linspace(1, 2, 6).reshape(2, 3), dtype=dtypes[1])
    want = w.asnumpy().astype("float32") - 0.5 * g.asnumpy().astype("float32")
    if dtypes[0] != dtypes[1]:
        with pytest.raises(mx.base.MXNetError):  # what the wrapper is for
            mx.nd.sgd_update(w, g, lr=0.5).wait_to_read()
    slow = []
    real = follow._tensor_slots
    monkeypatch.setattr(follow, "_tensor_slots", lambda *x: slow.append(1) or real(*x))
    gluon_amp.init(target_dtype="float16", emulate=True)
    out = mx.nd.sgd_update(weight=w, grad=g, lr=0.5) if by_keyword else mx.nd.sgd_update(w, g, lr=0.5)
    assert out.dtype == np.dtype(dtypes[0])  # the first float input's dtype decides
    np.testing.assert_allclose(out.asnumpy().astype("float32"), want, rtol=2e-3, atol=1e-3)
    assert bool(slow) is (dtypes[0] != dtypes[1])


def test_an_optimizer_update_of_one_dtype_goes_straight_to_mxnet(monkeypatch):
    w, g, m, v = (mx.nd.ones((3, 4)) * k for k in (1.0, 0.5, 0.0, 0.0))
    ref = [x.copy() for x in (w, g, m, v)]
    mx.nd.adam_update(*ref, out=ref[0], lr=0.1, wd=0.0, rescale_grad=1.0)
    slow = []
    real = follow._tensor_slots
    monkeypatch.setattr(follow, "_tensor_slots", lambda *x: slow.append(1) or real(*x))
    gluon_amp.init(target_dtype="float16", emulate=True)
    mx.nd.adam_update(w, g, m, v, out=w, lr=0.1, wd=0.0, rescale_grad=1.0)
    assert not slow
    for x, r in zip((w, m, v), (ref[0], ref[2], ref[3])):
        np.testing.assert_array_equal(x.asnumpy(), r.asnumpy())


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float32", "float16")], ids=["one-dtype", "mixed"])
def test_an_error_that_is_not_the_dtypes_is_mxnets_own(dtypes):
    """A gradient of the wrong shape: the wrapper tries no cast that would not help, and the
    user reads the error MXNet gives without AMP."""
    w = mx.nd.ones((2, 3), dtype=dtypes[0])
    g = mx.nd.ones((3, 2), dtype=dtypes[1])
    with pytest.raises(mx.base.MXNetError) as plain:
        mx.nd.sgd_update(w, g.astype(dtypes[0]), lr=0.5)
    gluon_amp.init(target_dtype="float16", emulate=True)
    with pytest.raises(mx.base.MXNetError) as amp:
        mx.nd.sgd_update(w, g, lr=0.5)
    assert "got [3,2]" in str(amp.value)
    assert str(amp.value).splitlines()[-1] == str(plain.value).splitlines()[-1]
