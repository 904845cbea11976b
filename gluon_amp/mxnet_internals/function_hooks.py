"""Two functions of MXNet's that gluon_amp follows, redirected in place as the op functions
are (:mod:`.code_swap`), so a reference taken before (``from mxnet.autograd import grad``)
reaches the hook too.

- 1.9.1 mxnet/autograd.py: ``grad(heads, variables, head_grads=None, retain_graph=None,
  create_graph=False, train_mode=True)`` is the only way to record a gradient's own graph
  (``backward`` has no ``create_graph``). A program differentiates that graph later, with
  ``backward``: that is where MXNet fails on an op whose backward has no gradient, long after
  the call that could say why.
- 1.9.1 mxnet/library.py: ``load(path, verbose=True)`` loads an extension library, then
  generates every ``mx.nd`` and ``mx.sym`` op function again (``_init_op_module``) and puts the
  new objects in the modules: the redirected ones are no longer what ``mx.nd.X`` names.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import mxnet.autograd as _autograd
import mxnet.library as _library

from .code_swap import SavedFunction, copy_function, is_redirected_to, redirect, restore, saved_state
from .registry import module_op_functions, note_superseded

__all__ = ["install_grad_hook", "install_library_hook", "remove_function_hook"]

#: ``create_graph``'s position in ``grad``'s parameters (checked when the hook is installed)
_CREATE_GRAPH_AT = 4
#: no region ever routes these functions elsewhere: every call reaches the hook
_NO_REGIONS: dict = {}


def _redirect(module: Any, name: str, make: Callable[[Callable], Callable]) -> SavedFunction:
    """``module.name`` redirected in place to ``make(original)``."""
    fn = getattr(module, name)
    impl = copy_function(fn)
    saved = saved_state(fn, {}, f"{module.__name__}.{name}")
    redirect(saved, make(impl), regions=_NO_REGIONS, ident=threading.get_ident, original=impl)
    return saved


def install_grad_hook(before_create_graph: Callable[[], None]) -> SavedFunction:
    """Until :func:`remove_function_hook`: ``mx.autograd.grad(..., create_graph=True)`` calls
    ``before_create_graph()`` first (it may raise); every call then runs MXNet's ``grad`` with
    its arguments as given."""
    code = _autograd.grad.__code__
    names = code.co_varnames[:code.co_argcount]
    if names[_CREATE_GRAPH_AT:_CREATE_GRAPH_AT + 1] != ("create_graph",):
        raise RuntimeError(f"gluon_amp cannot hook mxnet.autograd.grad: its parameters are {names}, "
                           "not MXNet 1.9.1's (heads, variables, head_grads, retain_graph, create_graph, ...)")

    def make(impl: Callable) -> Callable:
        def grad(*args: Any, **kwargs: Any) -> Any:
            create = kwargs["create_graph"] if "create_graph" in kwargs else (
                args[_CREATE_GRAPH_AT] if len(args) > _CREATE_GRAPH_AT else False)
            if create:
                before_create_graph()
            return impl(*args, **kwargs)
        return grad

    return _redirect(_autograd, "grad", make)


def install_library_hook(after_load: Callable[[], None]) -> SavedFunction:
    """Until :func:`remove_function_hook`: ``mx.library.load(...)`` notes the op functions the
    load supersedes (:func:`.registry.note_superseded`: references taken before still call
    them), then calls ``after_load()``, once MXNet has generated its op functions again."""
    def make(impl: Callable) -> Callable:
        def load(*args: Any, **kwargs: Any) -> Any:
            before = module_op_functions()
            result = impl(*args, **kwargs)
            note_superseded(before)
            after_load()
            return result
        return load

    return _redirect(_library, "load", make)


def remove_function_hook(saved: SavedFunction) -> None:
    """MXNet's function back, where the hook is still the one in place (idempotent)."""
    if is_redirected_to(saved.function, saved.routes):
        restore(saved)
