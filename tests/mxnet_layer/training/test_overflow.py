"""gluon_amp.training.overflow.all_finite: one read pass, exact for inf, NaN and huge finite values."""
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon

from gluon_amp import mxnet_internals as mxi
from gluon_amp.training import overflow


def _params(dtype="float32", ctxs=(mx.cpu(),), n=5):
    params = []
    for i in range(n):
        p = gluon.Parameter(f"p{i}", shape=(1000 * (i + 1),), dtype=dtype)
        p.initialize(mx.init.Zero(), ctx=list(ctxs))
        for g in p.list_grad():
            g[:] = mx.nd.random.normal(shape=g.shape).astype(g.dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_single_non_finite_value_anywhere_is_found(dtype, value):
    params = _params(dtype, ctxs=(mx.cpu(0), mx.cpu(1)))
    assert overflow.all_finite(params)
    with warnings.catch_warnings():  # scoped: the filter must not outlive the test
        warnings.simplefilter("error", RuntimeWarning)  # finding inf/NaN is the job, not a warning
        for p in (params[0], params[-1]):
            g = p.list_grad()[1]
            g[3] = value
            assert not overflow.all_finite(params)
            g[3] = 0
    assert overflow.all_finite(params)


def test_huge_finite_values_whose_sum_overflows_are_still_finite():
    params = _params()
    params[2].grad()[:] = 3e38  # every value finite; their sum is not
    assert overflow.all_finite(params)


def test_the_host_read_is_in_place_and_skips_what_numpy_cannot_hold():
    g = mx.nd.ones((4,))
    g[1] = 7.0  # pending in MXNet's engine
    view = mxi.host_view(g)
    assert view[1] == 7.0  # read after the pending write
    assert mxi.host_view(g).ctypes.data == view.ctypes.data  # the array's own memory, no copy
    bf16 = mx.nd.amp_cast(mx.nd.ones((4,)), dtype=mxi.BFLOAT16)
    assert mxi.host_view(bf16) is None and mxi.host_view(mx.nd.ones((2,), dtype="int32")) is None


def test_bfloat16_gradients_take_the_chained_check():
    p = gluon.Parameter("b", shape=(64,), dtype=mxi.BFLOAT16)
    p.initialize(mx.init.Zero())
    assert overflow.all_finite([p])
    p.grad()[:] = mx.nd.amp_cast(mx.nd.array([np.inf] * 64), dtype=mxi.BFLOAT16)
    assert not overflow.all_finite([p]) and overflow.non_finite_names([p]) == ["b"]


def test_a_ctrl_c_in_a_context_lookup_comes_out_as_keyboardinterrupt():
    """A KeyboardInterrupt raised inside ``mx.Context.__hash__``/``__eq__`` (Python code the
    check runs for its per-context grouping) at each of their calls in turn comes out as
    itself: an OrderedDict's iteration swallowed it and raised ``KeyError: cpu(0)`` (seen
    under real SIGINTs in test_step_interrupts.py)."""
    import sys
    params = _params(ctxs=(mx.cpu(0), mx.cpu(1)))
    context_file = mx.context.__file__
    counted, n = 0, 0
    while True:
        n += 1
        calls = [0]

        def tracer(frame, event, arg, n=n, calls=calls):
            if event == "call" and frame.f_code.co_filename == context_file \
                    and frame.f_code.co_name in ("__hash__", "__eq__"):
                calls[0] += 1
                if calls[0] == n:
                    raise KeyboardInterrupt(f"call {n}")
            return None

        sys.settrace(tracer)
        try:
            result = overflow.all_finite(params)
        except KeyboardInterrupt:
            counted += 1
            continue
        finally:
            sys.settrace(None)
        assert result is True
        break
    assert counted >= 4, counted  # the grouping and the check did call them: interrupts did land
