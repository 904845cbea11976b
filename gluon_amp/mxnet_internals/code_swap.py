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
_REGIONS_KW = "_gluon_amp_regions"
_IDENT_KW = "_gluon_amp_ident"
_ROUTES_KW = "_gluon_amp_routes"
_ORIG_KW = "_gluon_amp_orig"


def _trampoline(*args: Any, _gluon_amp_impl: Callable, _gluon_amp_regions: dict, _gluon_amp_ident: Callable,
                _gluon_amp_routes: dict, _gluon_amp_orig: Callable, **kwargs: Any) -> Any:
    # The code every redirected function runs, in MXNet's module globals (hence all by
    # keyword-only defaults). The hot path is one dict truth test: the dict of open regions
    # (thread ident -> frame) is empty while no thread is in one. Otherwise the calling
    # thread's frame names the region whose wrapper runs.
    if _gluon_amp_regions:
        frame = _gluon_amp_regions.get(_gluon_amp_ident())
        if frame is not None:
            return _gluon_amp_routes.get(frame.region, _gluon_amp_orig)(*args, **kwargs)
    return _gluon_amp_impl(*args, **kwargs)


_TRAMPOLINE_CODE = _trampoline.__code__
_NOT_SET = object()
#: redirected function -> its original code, for op_of_function while AMP is on
_original_code: "weakref.WeakKeyDictionary[types.FunctionType, types.CodeType]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SavedFunction:
    """What :func:`redirect` changes on ``function``, taken before it changes anything
    (:func:`saved_state`); :func:`restore` puts it back.

    ``function`` stays MXNet's own object: every module attribute and every reference taken
    before (``from mxnet.symbol.contrib import SyncBatchNorm``) still names it, and calls
    through any of them reach the wrapper :func:`redirect` and :func:`retarget` chose.
    ``routes`` is the function's own table of wrappers by region (see :func:`redirect`), which
    also tells that the function is gluon_amp's (:func:`is_redirected_to`). ``site`` is where
    it was first found (``'mxnet.symbol.Convolution'``), for messages.
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
    if fn.__closure__ and "_wrap_symbol_functions" in fn.__qualname__:
        # MXNet 1.9.1's own AMP: its init() replaces each op function with a closure of that name
        raise RuntimeError(
            f"gluon_amp cannot patch MXNet's op functions: MXNet's own AMP was initialized in this process "
            f"first (its amp.init() wrapped them, e.g. {fn.__qualname__}). Use one of the two per process: "
            "import gluon_amp before MXNet's AMP initializes, or run the program under "
            "`python -m gluon_amp.run [options] SCRIPT`, which answers the program's own AMP calls.")
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


def saved_state(fn: types.FunctionType, routes: dict, site: str) -> SavedFunction:
    """What :func:`redirect` will change on ``fn`` (changes nothing). Keep it before redirecting:
    whatever lands during or after :func:`redirect`, :func:`restore` can then undo it."""
    return SavedFunction(fn, routes, fn.__code__, fn.__defaults__, fn.__kwdefaults__,
                         fn.__dict__.get("__wrapped__", _NOT_SET), site)


def redirect(saved: SavedFunction, wrapper: Callable, *, regions: dict, ident: Callable[[], int],
             original: Callable) -> None:
    """Make every call of ``saved.function`` (through any reference) call ``wrapper`` instead,
    unless the calling thread has a frame in ``regions`` (``ident()`` -> frame; the dict is
    read per call, the thread's entry only while it is not empty): then
    ``saved.routes[frame.region]``, and ``original`` where the routes have none. The routes
    are kept by reference: entries added later are used.

    ``fn`` keeps its identity, name and doc; ``fn.__wrapped__`` is ``original``, so
    ``inspect.signature`` reaches the original signature. The order of the assignments keeps
    ``fn`` callable between them (a thread may call it meanwhile), and the first one marks it
    as gluon_amp's (:func:`is_redirected_to`), so an exception anywhere leaves a state
    :func:`restore` undoes.
    """
    fn = saved.function
    _original_code[fn] = saved.code
    # first: marks fn as ours; the original code has no keyword-only parameters and ignores it
    fn.__kwdefaults__ = {_IMPL_KW: wrapper, _REGIONS_KW: regions, _IDENT_KW: ident,
                         _ROUTES_KW: saved.routes, _ORIG_KW: original}
    fn.__code__ = _TRAMPOLINE_CODE
    fn.__defaults__ = None  # ignored by the trampoline
    fn.__wrapped__ = original


def retarget(saved: SavedFunction, wrapper: Callable) -> None:
    """Calls of ``saved.function`` outside any region go to ``wrapper`` from now on."""
    fn = saved.function
    if fn.__code__ is _TRAMPOLINE_CODE and is_redirected_to(fn, saved.routes):
        fn.__kwdefaults__ = {**fn.__kwdefaults__, _IMPL_KW: wrapper}  # one assignment: atomic for callers


def is_redirected_to(fn: types.FunctionType, routes: dict) -> bool:
    """True while ``fn`` is (even partly) redirected through ``routes`` by :func:`redirect` and
    nobody else changed its code since: :func:`restore` puts it back."""
    return ((fn.__kwdefaults__ or {}).get(_ROUTES_KW) is routes
            and (fn.__code__ is _TRAMPOLINE_CODE or fn.__code__ is _original_code.get(fn)))


def is_untouched(saved: SavedFunction) -> bool:
    """True while ``saved.function`` is as :func:`saved_state` found it (not redirected, and
    nobody changed its code)."""
    fn = saved.function
    return fn.__code__ is saved.code and not is_redirected_to(fn, saved.routes)


def restore(saved: SavedFunction) -> None:
    """Undo :func:`redirect` (callers check :func:`is_redirected_to` first). Idempotent: after
    an exception anywhere in it, calling it again finishes the job; the mark goes last."""
    fn = saved.function
    if saved.wrapped is _NOT_SET:
        fn.__dict__.pop("__wrapped__", None)
    else:
        fn.__wrapped__ = saved.wrapped
    fn.__defaults__ = saved.defaults  # before the code: the trampoline ignores them, the original needs them
    fn.__code__ = saved.code
    fn.__kwdefaults__ = saved.kwdefaults  # last: the mark
    _original_code.pop(fn, None)


def original_function(fn: types.FunctionType) -> types.FunctionType:
    """MXNet's own implementation of ``fn`` whatever :func:`redirect` did to it: ``fn``
    itself where it is not redirected, else the original the trampoline falls back to. For
    gluon_amp's own measurements (the capability probe), which must see what MXNet does, not
    what AMP makes of it."""
    if fn.__code__ is not _TRAMPOLINE_CODE:
        return fn
    return (fn.__kwdefaults__ or {}).get(_ORIG_KW, fn)
