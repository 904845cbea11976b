"""``mx.autograd.grad`` with a check before a gradient of a gradient.

1.9.1 mxnet/autograd.py: ``grad(heads, variables, head_grads=None, retain_graph=None,
create_graph=False, train_mode=True)`` is the only way to record a gradient's own graph
(``backward`` has no ``create_graph``). A program differentiates that graph later, with
``backward``: that is where MXNet fails on an op whose backward has no gradient, long after the
call that could say why. The hook replaces the module's attribute, so calls through
``mx.autograd.grad`` and ``from mxnet import autograd; autograd.grad`` reach it; a reference
taken before it was installed (``from mxnet.autograd import grad``) does not.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import mxnet.autograd as _autograd

from .gluon import MethodHook, _install_method

__all__ = ["install_grad_hook"]

_GRAD = _autograd.grad
#: ``create_graph``'s position in ``grad``'s parameters
_CREATE_GRAPH_AT = 4


def install_grad_hook(before_create_graph: Callable[[], None]) -> MethodHook:
    """Until :func:`remove_method_hook`: ``mx.autograd.grad(..., create_graph=True)`` calls
    ``before_create_graph()`` first (it may raise); every call then reaches MXNet's ``grad``
    with its arguments as given."""
    @functools.wraps(_GRAD)
    def grad(*args: Any, **kwargs: Any) -> Any:
        create = kwargs["create_graph"] if "create_graph" in kwargs else (
            args[_CREATE_GRAPH_AT] if len(args) > _CREATE_GRAPH_AT else False)
        if create:
            before_create_graph()
        return _GRAD(*args, **kwargs)

    return _install_method(_autograd, "grad", _GRAD, grad)  # type: ignore[arg-type]
