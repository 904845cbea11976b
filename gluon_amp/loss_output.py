"""Loss-output ops (SoftmaxOutput, the *RegressionOutput ops) under loss scaling.

Their backward ignores the gradient ``scale_loss`` multiplies and starts from their
``grad_scale`` attribute, so the loss scale has to be put there when the op is called.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable


def nd_wrapper(fn: Callable, op: str, loss_scale: Callable[[str], float]) -> Callable:
    """Multiply ``grad_scale`` by ``loss_scale(op)``, the scale of the attached scaler."""
    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        kwargs["grad_scale"] = float(kwargs.get("grad_scale", 1.0)) * loss_scale(op)
        return fn(*args, **kwargs)
    return amp_op


def sym_wrapper(fn: Callable, op: str) -> Callable:
    """A graph cannot follow a dynamic scale: say so when the op is put in one."""
    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{op} in a symbolic or hybridized graph starts its backward from grad_scale, "
                      "which a dynamic loss scale cannot reach: use a gluon.loss block, or a static "
                      "LossScaler and grad_scale=<scale>.", RuntimeWarning, stacklevel=2)
        return fn(*args, **kwargs)
    return amp_op
