"""Swapping an op function's code in place, and back (MXNet 1.9.1's generated functions)."""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional


# -- op functions patched in place ----------------------------------------------------
# init() must change what *every* reference to an op function does, including references
# taken before init: GluonCV's nn/feature.py does ``from mxnet.symbol.contrib import
# SyncBatchNorm`` at import and later tests ``norm_layer is SyncBatchNorm`` against
# ``mx.sym.contrib.SyncBatchNorm``, and MXNet's optimizers import ``sgd_update`` & co by
# name. Replacing module attributes breaks the first and misses the second, so the
# function objects stay where they are and only their code is swapped for a trampoline
# into the AMP wrapper; a copy of the function (same code, globals and defaults) is the
# original implementation the wrapper calls. 1.9.1: the generated op functions
# (mxnet/ndarray/register.py, mxnet/symbol/register.py, via ``exec``) have no closure and
# no keyword-only defaults; redirect() refuses any function that does.

_IMPL_KW = "_gluon_amp_impl"
_GATE_KW = "_gluon_amp_gate"
_ROUTES_KW = "_gluon_amp_routes"
_ORIG_KW = "_gluon_amp_orig"


def _trampoline(*args: Any, _gluon_amp_impl: Callable, _gluon_amp_gate: Any, _gluon_amp_routes: dict,
                _gluon_amp_orig: Callable, **kwargs: Any) -> Any:
    # The code every redirected function runs, in MXNet's module globals (hence all by
    # keyword-only defaults). The hot path is one plain attribute read; the thread-local is
    # read only while some thread is inside a region.
    if _gluon_amp_gate.open:
        region = _gluon_amp_gate.scope.override
        if region is not None:
            return _gluon_amp_routes.get(region, _gluon_amp_orig)(*args, **kwargs)
    return _gluon_amp_impl(*args, **kwargs)


_TRAMPOLINE_CODE = _trampoline.__code__
_NOT_SET = object()
#: redirected function -> its original code, for op_of_function while AMP is on
_original_code: "weakref.WeakKeyDictionary[types.FunctionType, types.CodeType]" = weakref.WeakKeyDictionary()
#: redirected function -> what redirect() changed on it, for original_function


@dataclass(frozen=True)
class SavedFunction:
    """What :func:`redirect` changed on ``function``; :func:`restore` puts it back.

    ``function`` stays MXNet's own object: every module attribute and every reference taken
    before (``from mxnet.symbol.contrib import SyncBatchNorm``) still names it, and calls
    through any of them reach the wrapper :func:`redirect` and :func:`retarget` chose.
    ``routes`` is the function's own table of wrappers by region (see :func:`redirect`), which
    also tells that the function is still redirected by gluon_amp. ``site`` is where it was
    first found (``'mxnet.symbol.Convolution'``), for messages.
    """

    function: types.FunctionType
    routes: dict
    code: types.CodeType
    defaults: Optional[tuple]
    kwdefaults: Optional[dict]
    wrapped: Any  # the prior ``__wrapped__`` attribute, or _NOT_SET
    site: str = ""


def copy_function(fn: types.FunctionType) -> types.FunctionType:
    """A new function object running ``fn``'s current code: its original implementation."""
    if fn.__closure__ or fn.__kwdefaults__ or fn.__code__ is _TRAMPOLINE_CODE:
        raise RuntimeError(f"gluon_amp cannot patch {fn.__module__}.{fn.__qualname__} in place: it has a "
                           "closure or keyword-only defaults, or is patched already (MXNet changed how it "
                           "generates op functions?)")
    impl = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    impl.__kwdefaults__ = fn.__kwdefaults__
    impl.__dict__.update(fn.__dict__)
    impl.__doc__, impl.__qualname__, impl.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    impl.__annotations__ = dict(fn.__annotations__)
    return impl


def redirect(fn: types.FunctionType, wrapper: Callable, site: str, *, scope: Any, routes: dict,
             original: Callable) -> SavedFunction:
    """Make every call of ``fn`` (through any reference) call ``wrapper`` instead, unless
    ``scope.open`` (a plain attribute, read per call) and ``scope.scope.override`` (the calling
    thread's, read only then) is set: then ``routes[override]``, and ``original`` where
    ``routes`` has none. ``routes`` is kept by reference: entries added
    later are used.

    ``fn`` keeps its identity, name and doc; ``fn.__wrapped__`` is ``original``, so
    ``inspect.signature`` reaches the original signature. The order of the assignments
    keeps ``fn`` callable between them (a thread may call it meanwhile).
    """
    saved = SavedFunction(fn, routes, fn.__code__, fn.__defaults__, fn.__kwdefaults__,
                          fn.__dict__.get("__wrapped__", _NOT_SET), site)
    _original_code[fn] = saved.code
    # ignored by the original code
    fn.__kwdefaults__ = {_IMPL_KW: wrapper, _GATE_KW: scope, _ROUTES_KW: routes, _ORIG_KW: original}
    fn.__code__ = _TRAMPOLINE_CODE
    fn.__defaults__ = None  # ignored by the trampoline
    fn.__wrapped__ = original
    return saved


def retarget(saved: SavedFunction, wrapper: Callable) -> None:
    """Calls of ``saved.function`` outside any override go to ``wrapper`` from now on."""
    fn = saved.function
    if is_redirected_to(fn, saved.routes):
        fn.__kwdefaults__ = {**fn.__kwdefaults__, _IMPL_KW: wrapper}  # one assignment: atomic for callers


def is_redirected_to(fn: types.FunctionType, routes: dict) -> bool:
    """True while ``fn`` still trampolines through ``routes`` (nobody changed it since)."""
    return fn.__code__ is _TRAMPOLINE_CODE and (fn.__kwdefaults__ or {}).get(_ROUTES_KW) is routes


def restore(saved: SavedFunction) -> None:
    """Undo :func:`redirect` (callers check :func:`is_redirected_to` first)."""
    fn = saved.function
    if saved.wrapped is _NOT_SET:
        fn.__dict__.pop("__wrapped__", None)
    else:
        fn.__wrapped__ = saved.wrapped
    fn.__defaults__ = saved.defaults
    fn.__code__ = saved.code
    fn.__kwdefaults__ = saved.kwdefaults
    _original_code.pop(fn, None)


def original_function(fn: types.FunctionType) -> types.FunctionType:
    """MXNet's own implementation of ``fn`` whatever :func:`redirect` did to it: ``fn``
    itself where it is not redirected, else the original the trampoline falls back to. For
    gluon_amp's own measurements (the capability probe), which must see what MXNet does, not
    what AMP makes of it."""
    if fn.__code__ is not _TRAMPOLINE_CODE:
        return fn
    return (fn.__kwdefaults__ or {}).get(_ORIG_KW, fn)
