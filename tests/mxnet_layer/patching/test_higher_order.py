"""A gradient of a gradient (``autograd.grad(..., create_graph=True)``, then ``backward``: a
gradient penalty) through a plan's casts.

MXNet 1.9.1's ``amp_cast`` and ``amp_multicast`` have backward ops with no gradient: a penalty
under a native plan (or emulation without its kernel) ended in "_backward_amp_cast is
non-differentiable" at the ``backward``. The kernel library gives them one (rounding.cc); the
``grad`` hook loads it first, or refuses with gluon_amp's error there.
"""
import contextlib
import inspect
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd
from mxnet.autograd import grad as grad_taken_before_init

import gluon_amp
from gluon_amp import emulation_kernel
from gluon_amp.emulation_kernel import KernelStatus

_rng = np.random.RandomState(5)
X = _rng.uniform(-1, 1, (4, 6)).astype(np.float32)
W1 = _rng.uniform(-0.4, 0.4, (5, 6)).astype(np.float32)
W2 = _rng.uniform(-0.4, 0.4, (3, 5)).astype(np.float32)
SKIP = _rng.uniform(-0.4, 0.4, (4, 5)).astype(np.float32)


def _penalty(create_graph_by_position=False, grad=None, forward_region=None):
    """tanh(FC) -> + a float32 array (a widest-type op: the low product meets float32) -> FC ->
    tanh; the input gradient squared and summed, then its gradients with respect to both
    weights. Returns (penalty, dW1, dW2)."""
    x, w1, w2 = mx.nd.array(X), mx.nd.array(W1), mx.nd.array(W2)
    for a in (x, w1, w2):
        a.attach_grad()
    grad = grad or autograd.grad
    with autograd.record():
        with forward_region or contextlib.nullcontext():
            h = mx.nd.tanh(mx.nd.FullyConnected(x, w1, no_bias=True, num_hidden=5))
            h = mx.nd.elemwise_add(h, mx.nd.array(SKIP))
            y = mx.nd.tanh(mx.nd.FullyConnected(h, w2, no_bias=True, num_hidden=3))
        ones = mx.nd.ones_like(y)
        if create_graph_by_position:
            g = grad(y, [x], ones, True, True)[0]
        else:
            g = grad(y, [x], head_grads=ones, retain_graph=True, create_graph=True)[0]
        penalty = (g * g).sum()
    penalty.backward()
    return penalty.asscalar(), w1.grad.asnumpy(), w2.grad.asnumpy()


FP32 = _penalty()
#: how far a rounded run may land from FP32's (relative): the dtype's rounding on the way
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2}


def _close_to_fp32(got, dtype):
    penalty, dw1, dw2 = got
    tol = TOLERANCE[dtype]
    assert abs(penalty - FP32[0]) <= tol * abs(FP32[0]), (penalty, FP32[0])
    for d, want in ((dw1, FP32[1]), (dw2, FP32[2])):
        assert d.dtype == np.float32 and np.isfinite(d).all()
        assert np.abs(d - want).max() <= 4 * tol * np.abs(want).max(), (d, want)
    assert not np.array_equal(dw1, FP32[1])  # rounded somewhere on the way: the plan ran


def test_a_gradient_penalty_under_a_native_plan_runs(native_host):
    """The plan casts with MXNet's amp_cast/amp_multicast (no emulation): their backward's
    gradient comes from the kernel library, loaded by the grad call."""
    gluon_amp.init(target_dtype="bfloat16")
    _close_to_fp32(_penalty(), "bfloat16")
    assert emulation_kernel.cast_gradients().path == "kernel"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_gradient_penalty_runs_emulated(dtype):
    gluon_amp.init(target_dtype=dtype, emulate=True)
    _close_to_fp32(_penalty(), dtype)


def test_create_graph_given_by_position_is_seen(native_host, monkeypatch):
    """``grad(heads, variables, head_grads, retain_graph, create_graph)`` by position: the
    hook finds create_graph there too (a missing library is refused, not left to MXNet)."""
    monkeypatch.setattr(emulation_kernel, "cast_gradients", lambda: KernelStatus("fallback", "planted: no compiler"))
    gluon_amp.init(target_dtype="bfloat16")
    with pytest.raises(RuntimeError, match="planted: no compiler"):
        _penalty(create_graph_by_position=True)


def test_without_the_library_gluon_amps_error_comes_first(native_host, monkeypatch):
    """No kernel library (no compiler, or GLUON_AMP_EMULATION_KERNEL=0): the grad call says
    why and what to do, before MXNet's "non-differentiable" at the backward."""
    monkeypatch.setattr(emulation_kernel, "cast_gradients", lambda: KernelStatus("fallback", "planted: no compiler"))
    gluon_amp.init(target_dtype="bfloat16")
    with pytest.raises(RuntimeError) as err:
        _penalty()
    message = str(err.value)
    for words in ("create_graph=True", "bfloat16", "planted: no compiler", "C++ compiler",
                  emulation_kernel.ENV, "autocast(enabled=False)"):
        assert words in message, (words, message)
    # the way out it names: the same program in a float32 region gives FP32's numbers exactly
    with gluon_amp.autocast(enabled=False):
        got = _penalty()
    assert got[0] == FP32[0] and np.array_equal(got[1], FP32[1]) and np.array_equal(got[2], FP32[2])


def test_a_first_order_grad_never_asks_for_the_library(native_host, monkeypatch):
    def refuse():
        raise AssertionError("cast_gradients called without create_graph")

    monkeypatch.setattr(emulation_kernel, "cast_gradients", refuse)
    gluon_amp.init(target_dtype="bfloat16")
    x = mx.nd.array(X)
    x.attach_grad()
    with autograd.record():
        y = mx.nd.FullyConnected(x, mx.nd.array(W1), no_bias=True, num_hidden=5)
    g = autograd.grad(y, [x], head_grads=mx.nd.ones_like(y))[0]
    assert g.shape == X.shape and np.isfinite(g.asnumpy()).all()


def test_a_reference_taken_before_init_and_a_region_ended_before_grad(native_host):
    """``from mxnet.autograd import grad`` at import (the function is redirected in place), and
    a forward recorded in an ``autocast`` region that ended before the ``grad`` call."""
    _close_to_fp32(_penalty(grad=grad_taken_before_init,
                            forward_region=gluon_amp.autocast(target_dtype="bfloat16")), "bfloat16")


def test_the_hook_is_mxnets_grad_again_after_disable():
    fn, code, signature = mx.autograd.grad, mx.autograd.grad.__code__, inspect.signature(mx.autograd.grad)
    gluon_amp.init(target_dtype="bfloat16", emulate=True)
    assert mx.autograd.grad is fn is grad_taken_before_init and fn.__code__ is not code
    assert inspect.signature(fn) == signature and fn.__name__ == "grad"
    gluon_amp.disable()
    assert mx.autograd.grad is fn and fn.__code__ is code and not hasattr(fn, "__wrapped__")
    assert inspect.signature(fn) == signature and fn.__kwdefaults__ is None


def test_without_the_library_after_a_region_only_a_warning(native_host, monkeypatch):
    """No library, and the policy ended before the call: the graph may hold casts or not. A
    graph recorded in float32 differentiates (FP32's numbers), after one warning saying why a
    graph recorded under the policy would not."""
    monkeypatch.setattr(emulation_kernel, "cast_gradients", lambda: KernelStatus("fallback", "planted: no compiler"))
    with gluon_amp.autocast(target_dtype="bfloat16"):
        mx.nd.FullyConnected(mx.nd.array(X), mx.nd.array(W1), no_bias=True, num_hidden=5).wait_to_read()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _penalty()
    assert got[0] == FP32[0] and np.array_equal(got[1], FP32[1])
    said = [str(w.message) for w in seen if "create_graph=True" in str(w.message)]
    assert len(said) == 1 and "planted: no compiler" in said[0] and "may record" in said[0], said


def test_a_thread_never_under_a_low_policy_never_asks(monkeypatch):
    """The hook is in place (another thread's region patched MXNet), but no low policy was ever
    in force on this thread: MXNet's own behaviour, the library not asked for."""
    import threading

    def refuse():
        raise AssertionError("cast_gradients called without a policy")

    monkeypatch.setattr(emulation_kernel, "cast_gradients", refuse)
    code = mx.autograd.grad.__code__
    inside, done = threading.Event(), threading.Event()

    def other():
        with gluon_amp.autocast(target_dtype="float16", emulate=True):
            inside.set()
            done.wait(60)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(60)
        assert mx.autograd.grad.__code__ is not code  # hooked
        got = _penalty()
    finally:
        done.set()
        t.join(60)
    assert got[0] == FP32[0] and np.array_equal(got[1], FP32[1])


def test_the_selftest_check_fails_without_the_casts_gradients():
    """The kernel's selftest check can fail: in a process without the library, MXNet's casts
    have no second gradient and the check's penalty raises MXNet's error."""
    import subprocess
    import sys
    code = ("import gluon_amp, mxnet as mx\n"
            "from gluon_amp.emulation_kernel.selftest import check_cast_gradients\n"
            "try:\n    print(check_cast_gradients())\n"
            "except mx.base.MXNetError as e:\n    print('non-differentiable' in str(e))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "True", r.stdout
