"""Loss-output ops (SoftmaxOutput, the *RegressionOutput ops) under loss scaling.

Their backward ignores the gradient ``scale_loss`` multiplies and starts from their
``grad_scale`` attribute, so the loss scale has to be put there when the op is called.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from ... import mxnet_internals as mxi, state
from ...mxnet_internals import Signature


def nd_wrapper(fn: Callable, op: str, sig: Signature, loss_scale: Callable[[str], float]) -> Callable:
    """Multiply ``grad_scale`` (by keyword or by position, as ``sig`` places it) by
    ``loss_scale(op)``, the scale the attached trainer's next ``scale_loss`` uses; where
    that is 1 the call passes through untouched."""
    at = sig.params.index("grad_scale") if "grad_scale" in sig.params else len(sig.params)

    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        scale = loss_scale(op)
        if scale == 1.0:
            return fn(*args, **kwargs)
        if len(args) > at:
            args = (*args[:at], _scaled(args[at], scale), *args[at + 1:])
        else:
            kwargs["grad_scale"] = _scaled(kwargs.get("grad_scale", 1.0), scale)
        return fn(*args, **kwargs)
    return amp_op


def _scaled(grad_scale: Any, scale: float) -> Any:
    """``grad_scale * scale``; a value that is not a number goes to MXNet as it is (it rejects it)."""
    try:
        return float(grad_scale) * scale
    except (TypeError, ValueError):
        return grad_scale


def sym_wrapper(fn: Callable, op: str) -> Callable:
    """A hybridized Gluon graph cannot follow a dynamic scale: say so when a block's trace puts
    the op in its graph, naming the user's line. A symbol built outside any block (a Module's,
    which ``gluon_amp.training.module`` scales where it binds it) passes without a word."""
    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        if mxi.inside_block_call():
            mxi.warn_outside(
                f"{op} in a hybridized Gluon block starts its backward from grad_scale, which the "
                "block's dynamic loss scale cannot reach: compute the loss with a gluon.loss block, or use "
                "a static LossScaler and grad_scale=<its scale>. (mx.mod.Module / BucketingModule training "
                "scales it: init_trainer(module), or under init.)", RuntimeWarning, stacklevel=2)
        return fn(*args, **kwargs)
    return amp_op


class ScalerRegistry:
    """The trainers' step hooks attached (``init_trainer``; kept in :mod:`gluon_amp.state`).

    Loss-output ops start their backward from ``grad_scale``, so they need the scale the
    step of their loss uses (a hook's ``loss_scale``: the same decision ``scale_loss``
    makes); the registry gives it, or refuses when ambiguous.
    """

    def scale(self, op: str) -> float:
        """The scale ``op`` multiplies its ``grad_scale`` by: the attached trainers' one."""
        scales = {s.loss_scale for s in list(state.process.scalers) if _counts(s)}
        if len(scales) > 1:
            raise RuntimeError(
                f"{op} starts its backward from grad_scale, and {len(scales)} loss scalers with different "
                f"scales {sorted(scales)} are attached: gluon_amp cannot tell which one this loss belongs "
                "to. Share one LossScaler between the trainers, or compute this loss with a gluon.loss block.")
        return scales.pop() if scales else 1.0


def _counts(hook: Any) -> bool:
    """A hook whose trainer the program dropped does not count (``attached()``: at once,
    without waiting for the cyclic GC)."""
    attached = getattr(hook, "attached", None)
    return attached() if callable(attached) else True
