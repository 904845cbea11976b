"""``mx.autograd.grad`` with a check before a gradient of a gradient.

1.9.1 mxnet/autograd.py: ``grad(heads, variables, head_grads=None, retain_graph=None,
create_graph=False, train_mode=True)`` is the only way to record a gradient's own graph
(``backward`` has no ``create_graph``). A program differentiates that graph later, with
``backward``: that is where MXNet fails on an op whose backward has no gradient, long after the
call that could say why. ``grad`` is redirected in place, as the op functions are
(:mod:`.code_swap`): a reference taken before (``from mxnet.autograd import grad``) reaches the
check too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import mxnet.autograd as _autograd

from .code_swap import SavedFunction, copy_function, is_redirected_to, redirect, restore, saved_state

__all__ = ["install_grad_hook", "remove_grad_hook"]

#: ``create_graph``'s position in ``grad``'s parameters (checked when the hook is installed)
_CREATE_GRAPH_AT = 4
#: no region ever routes ``grad`` elsewhere: every call reaches the hook
_NO_REGIONS: dict = {}


def install_grad_hook(before_create_graph: Callable[[], None]) -> SavedFunction:
    """Until :func:`remove_grad_hook`: ``mx.autograd.grad(..., create_graph=True)`` (through
    any reference) calls ``before_create_graph()`` first (it may raise); every call then runs
    MXNet's ``grad`` with its arguments as given."""
    fn = _autograd.grad
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    if names[_CREATE_GRAPH_AT:_CREATE_GRAPH_AT + 1] != ("create_graph",):
        raise RuntimeError(f"gluon_amp cannot hook mxnet.autograd.grad: its parameters are {names}, "
                           "not MXNet 1.9.1's (heads, variables, head_grads, retain_graph, create_graph, ...)")
    impl = copy_function(fn)

    def grad(*args: Any, **kwargs: Any) -> Any:
        create = kwargs["create_graph"] if "create_graph" in kwargs else (
            args[_CREATE_GRAPH_AT] if len(args) > _CREATE_GRAPH_AT else False)
        if create:
            before_create_graph()
        return impl(*args, **kwargs)

    saved = saved_state(fn, {}, "mxnet.autograd.grad")
    redirect(saved, grad, regions=_NO_REGIONS, ident=threading.get_ident, original=impl)
    return saved


def remove_grad_hook(saved: SavedFunction) -> None:
    """MXNet's ``grad`` back, where the hook is still the one in place (idempotent)."""
    if is_redirected_to(saved.function, saved.routes):
        restore(saved)
