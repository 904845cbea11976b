"""Every use gluon_amp makes of MXNet internals, in one place.

Each function names the MXNet version it was checked against (1.9.1) and what breaks if
MXNet changes it. Everything else in gluon_amp uses MXNet's public API only.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call, mx_uint, py_str
from mxnet.gluon import HybridBlock, Parameter, Trainer
from mxnet.symbol import Symbol

#: MXNet 1.x spells bfloat16 as this structured NumPy dtype (1.9.1: mxnet/ndarray/ndarray.py
#: ``bfloat16``). If MXNet gains a real bfloat16 dtype, casts to bf16 need the new object.
BFLOAT16 = np.dtype([("bfloat16", np.uint16)])


#: MXNet's float dtype objects -> names: ``NDArray.dtype`` is a NumPy scalar type (or
#: BFLOAT16), ``mx.np`` arrays give ``np.dtype`` instances, which hash differently. A dict
#: lookup, because patched ops read it on every call.
FLOAT_NAMES = {np.float16: "float16", np.float32: "float32", np.float64: "float64",
               BFLOAT16: "bfloat16", np.dtype("float16"): "float16",
               np.dtype("float32"): "float32", np.dtype("float64"): "float64"}


def to_mx_dtype(name: str) -> Any:
    """The object MXNet accepts as ``dtype=`` for a canonical dtype name."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class OpInfo:
    """One registered name: its canonical op and declared tensor inputs."""

    name: str
    canonical: str
    inputs: Tuple[str, ...]
    variadic: bool


@functools.lru_cache(maxsize=None)
def op_infos() -> Mapping[str, OpInfo]:
    """Every registered op name (aliases included) -> ``OpInfo``."""
    plist = ctypes.POINTER(ctypes.c_char_p)()
    size = ctypes.c_uint()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    names = [py_str(plist[i]) for i in range(size.value)]
    out: Dict[str, OpInfo] = {}
    for name in names:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        real, desc, key_var = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
        num_args, ret = mx_uint(), ctypes.c_char_p()
        arg_names = ctypes.POINTER(ctypes.c_char_p)()
        arg_types = ctypes.POINTER(ctypes.c_char_p)()
        arg_descs = ctypes.POINTER(ctypes.c_char_p)()
        check_call(_LIB.MXSymbolGetAtomicSymbolInfo(
            handle, ctypes.byref(real), ctypes.byref(desc), ctypes.byref(num_args),
            ctypes.byref(arg_names), ctypes.byref(arg_types), ctypes.byref(arg_descs),
            ctypes.byref(key_var), ctypes.byref(ret)))
        inputs = tuple(py_str(arg_names[i]) for i in range(num_args.value)
                       if py_str(arg_types[i]).split(",")[0].split(" ")[0]
                       in ("NDArray-or-Symbol", "Symbol", "NDArray"))
        out[name] = OpInfo(name, py_str(real.value), inputs, bool(key_var.value))
    return types.MappingProxyType(out)


@functools.lru_cache(maxsize=None)
def aliases() -> Mapping[str, str]:
    """Alias -> canonical op name, for names that are not canonical."""
    return types.MappingProxyType(
        {n: i.canonical for n, i in op_infos().items() if n != i.canonical})


@functools.lru_cache(maxsize=None)
def _handle_to_name() -> Dict[int, str]:
    out = {}
    for name, info in op_infos().items():
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        out[handle.value] = info.canonical
    return out


def op_of_function(fn: object) -> Tuple[str, str] | None:
    """``(canonical op, 'ndarray'|'symbol')`` for an MXNet-generated op function, else None.

    A function redirected by :func:`redirect` is read through its original code."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    code = _original_code.get(fn, code) if code is _TRAMPOLINE_CODE else code
    if "_imperative_invoke" in code.co_names:
        kind = "ndarray"
    elif "_symbol_creator" in code.co_names:
        kind = "symbol"
    else:
        return None
    table = _handle_to_name()
    for const in code.co_consts:
        if isinstance(const, int) and not isinstance(const, bool) and const in table:
            return table[const], kind
    return None


# Namespaces whose op functions AMP patches (``op`` modules included, so ``F.X`` in
# ``hybrid_forward`` is covered). Scanned by prefix so contrib/linalg/random/image/sparse,
# ``_internal`` and the numpy front ends are all found.
_ROOTS = ("mxnet.ndarray", "mxnet.symbol", "mxnet.numpy", "mxnet.numpy_extension")


def op_function_sites() -> Iterator[Tuple[types.ModuleType, str, object, str, str]]:
    """Yield ``(module, attribute, function, op, kind)`` for every op function in scope."""
    import mxnet.ndarray.numpy_extension  # noqa: F401  make sure the np front ends are loaded
    import mxnet.symbol.numpy_extension  # noqa: F401
    for mod_name, module in sorted(sys.modules.items()):
        if module is None or not any(mod_name == r or mod_name.startswith(r + ".") for r in _ROOTS):
            continue
        for attr, value in list(vars(module).items()):
            if not isinstance(value, types.FunctionType):
                continue
            found = op_of_function(value)
            if found is not None:
                yield module, attr, value, found[0], found[1]


# -- registry: ctypes calls of the C API (1.9.1: MXListAllOpNames, NNGetOpHandle,
#    MXSymbolGetAtomicSymbolInfo). If their signatures change, op_infos() fails at init.
#    op_of_function reads the op handle MXNet's code generator bakes into each generated
#    function's constants (1.9.1: mxnet/ndarray/register.py, mxnet/symbol/register.py);
#    if that changes, init patches nothing and the patching tests fail.


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


def _trampoline(*args: Any, _gluon_amp_impl: Callable, **kwargs: Any) -> Any:
    return _gluon_amp_impl(*args, **kwargs)


_TRAMPOLINE_CODE = _trampoline.__code__
_NOT_SET = object()
#: redirected function -> its original code, for op_of_function while AMP is on
_original_code: "weakref.WeakKeyDictionary[types.FunctionType, types.CodeType]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SavedFunction:
    """What :func:`redirect` changed on ``function``; :func:`restore` puts it back.

    ``function`` stays MXNet's own object: every module attribute and every reference taken
    before (``from mxnet.symbol.contrib import SyncBatchNorm``) still names it, and calls
    through any of them reach ``wrapper``. ``site`` is where it was first found
    (``'mxnet.symbol.Convolution'``), for messages.
    """

    function: types.FunctionType
    wrapper: Callable
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


def redirect(fn: types.FunctionType, wrapper: Callable, site: str = "") -> SavedFunction:
    """Make every call of ``fn`` (through any reference) call ``wrapper`` instead.

    ``fn`` keeps its identity, name and doc; ``fn.__wrapped__`` is ``wrapper``, so
    ``inspect.signature`` reaches the original signature. The order of the assignments
    keeps ``fn`` callable between them (a thread may call it meanwhile).
    """
    saved = SavedFunction(fn, wrapper, fn.__code__, fn.__defaults__, fn.__kwdefaults__,
                          fn.__dict__.get("__wrapped__", _NOT_SET), site)
    _original_code[fn] = saved.code
    fn.__kwdefaults__ = {_IMPL_KW: wrapper}  # ignored by the original code
    fn.__code__ = _TRAMPOLINE_CODE
    fn.__defaults__ = None  # ignored by the trampoline
    fn.__wrapped__ = wrapper
    return saved


def is_redirected_to(fn: types.FunctionType, wrapper: Callable) -> bool:
    """True while ``fn`` still trampolines into ``wrapper`` (nobody changed it since)."""
    return fn.__code__ is _TRAMPOLINE_CODE and (fn.__kwdefaults__ or {}).get(_IMPL_KW) is wrapper


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


# -- gluon blocks --------------------------------------------------------------------

def cached_graph(block: HybridBlock, caller: str) -> Tuple[Sequence[Symbol], Symbol]:
    """``(input symbols, output symbol)`` a hybridized block recorded on its first call.

    1.9.1: ``HybridBlock._cached_graph`` is ``()`` until the first call, then that pair.
    If renamed, converting or reporting a block raises the RuntimeError below.
    """
    cached = getattr(block, "_cached_graph", ())
    if not cached:
        raise RuntimeError(f"{caller}: the block has no cached graph: call block.hybridize() and run "
                           "one forward pass (e.g. block(x)) first.")
    return cached[0], cached[1]


def has_cached_graph(block: Any) -> bool:
    """True for a hybridized block that already recorded its graph (see :func:`cached_graph`)."""
    return isinstance(block, HybridBlock) and bool(getattr(block, "_cached_graph", ()))


# -- symbols -------------------------------------------------------------------------

#: 1.9.1: the numpy-frontend Symbol class; amp_cast is a legacy op, so np symbols are
#: converted through ``as_nd_ndarray``. If moved, importing gluon_amp fails here.
NP_SYMBOL = mx.sym.np._Symbol


def pin_float32(var: Symbol) -> None:
    """Declare a variable float32 (``__dtype__='0'``). 1.9.1: ``Symbol._set_attr``; the
    public ``var(dtype=)`` cannot change an existing variable."""
    var._set_attr(__dtype__="0")


def rebuild_op(sym: Symbol, inputs: List[Symbol]) -> Symbol:
    """The op node ``sym`` applied to new ``inputs`` under the same name and attributes.

    1.9.1: ``Symbol._gen_atomic_symbol`` makes an unbound copy of the head op. Used when
    MXNet created an op's weights itself and casts must be wired in after the fact.
    """
    return sym._gen_atomic_symbol()(*inputs, name=sym.name)


# -- trainer -------------------------------------------------------------------------
# 1.9.1 mxnet/gluon/trainer.py: ``_update`` calls ``self._amp_loss_scaler.has_overflow(params)``
# when that attribute exists and skips the update if it returns True; ``_scale`` is the
# factor ``rescale_grad`` is built from on each step; ``_kvstore_params`` holds the
# constructor's ``update_on_kvstore`` until the kvstore is initialised, after which
# ``_update_on_kvstore`` holds the decision. If any of this changes, the trainer tests fail.

def set_step_hook(trainer: Trainer, hook: Any) -> None:
    trainer._amp_loss_scaler = hook


def get_step_hook(trainer: Trainer) -> Any:
    return getattr(trainer, "_amp_loss_scaler", None)


def grad_scale(trainer: Trainer) -> float:
    return trainer._scale


def set_grad_scale(trainer: Trainer, value: float) -> None:
    trainer._scale = value


def trainer_params(trainer: Trainer) -> List[Parameter]:
    return trainer._params


def updates_on_kvstore(trainer: Trainer) -> Optional[bool]:
    """True/False once decided or asked for; None when left to MXNet."""
    wanted = trainer._kvstore_params.get("update_on_kvstore")
    if trainer._kv_initialized:
        return bool(trainer._update_on_kvstore)
    return wanted


def force_update_on_worker(trainer: Trainer) -> None:
    trainer._kvstore_params["update_on_kvstore"] = False


def trainer_kvstore(trainer: Trainer) -> Any:
    """1.9.1: ``Trainer._kvstore``, None until the first step (or :func:`init_kvstore_now`)."""
    return trainer._kvstore


def trainer_optimizer(trainer: Trainer) -> Any:
    """1.9.1: ``Trainer._optimizer``, the optimizer object the updaters call."""
    return trainer._optimizer


def compression_params(trainer: Trainer) -> Any:
    """1.9.1: ``Trainer._compression_params``, the constructor's ``compression_params``."""
    return trainer._compression_params


def horovod_process_set(trainer: Trainer) -> Any:
    """Horovod 0.28.1's ``DistributedTrainer._process_set``; None for other trainers."""
    return getattr(trainer, "_process_set", None)


def deferred_param_names(trainer: Trainer) -> List[str]:
    """Parameters whose shapes are still unknown (1.9.1: ``Parameter._deferred_init``)."""
    return [p.name for p in trainer._params if p._deferred_init]


def init_kvstore_now(trainer: Trainer) -> None:
    """What 1.9.1's ``Trainer`` does lazily in its first step: create the kvstore
    (``_init_kvstore``) and broadcast the initial weights (``_init_params``)."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()


# -- parameters ----------------------------------------------------------------------

def has_grad(p: Parameter) -> bool:
    """1.9.1: ``Parameter._grad`` is None until the parameter is initialised with a grad
    (``list_grad`` raises instead). If renamed, every step would look gradient-free."""
    return p.grad_req != "null" and p._grad is not None


# -- optimizer state (master weights) --------------------------------------------------
# 1.9.1: Trainer keeps one ``Updater`` per context in ``_updaters`` (built in
# ``_init_optimizer``, re-pointed by ``load_states``), and ``Updater.__call__`` calls
# ``optimizer._set_current_context``. If renamed, installing master weights fails with
# AttributeError (the opt-level tests fail).

def trainer_updaters(trainer: Trainer) -> List[Any]:
    return list(trainer._updaters)


def set_trainer_updaters(trainer: Trainer, updaters: Sequence[Any]) -> None:
    trainer._updaters = list(updaters)


def has_optimizer_state(trainer: Trainer) -> bool:
    """True once the trainer has stepped (or loaded optimizer states)."""
    opt = trainer._optimizer
    return bool(any(u.states for u in trainer._updaters) or opt.num_update > opt.begin_num_update)


def set_optimizer_context(opt: Any, ctx: mx.Context) -> None:
    opt._set_current_context(ctx.device_id)


def drop_cached_graph(block: Any) -> None:
    """Forget a hybridized block's recorded graph (1.9.1: ``_clear_cached_op``; also what
    ``HybridBlock.cast`` calls). The next call traces it again."""
    if isinstance(block, HybridBlock):
        block._clear_cached_op()


def bucketing_module_options(mod: Any) -> Dict[str, Any]:
    """Constructor options a ``BucketingModule`` keeps only privately (1.9.1: ``_sym_gen``,
    ``_default_bucket_key``, ``_context``, ...), to build an equivalent module. If renamed,
    convert_bucketing_module fails with AttributeError (the bucketing tests fail)."""
    return {"sym_gen": mod._sym_gen, "default_bucket_key": mod._default_bucket_key,
            "context": mod._context, "work_load_list": mod._work_load_list,
            "fixed_param_names": mod._fixed_param_names, "state_names": mod._state_names,
            "group2ctxs": mod._group2ctxs, "compression_params": mod._compression_params}


def bucketing_buckets(mod: Any) -> Dict[Any, Any]:
    """Bucket key -> bound Module (1.9.1: ``BucketingModule._buckets``)."""
    return mod._buckets


# -- block hooks ---------------------------------------------------------------------
# 1.9.1 mxnet/gluon/block.py: ``HybridBlock._get_graph(*args)`` builds the block's graph
# once (``self._cached_graph = (inputs, out)``) and returns it; ``_build_cache``,
# ``infer_shape`` and ``export`` read it from there. ``_call_cached_op(*args)`` runs every
# hybridized call. Rewriting the graph on its first build changes what the CachedOp runs.
# If either method is renamed, init fails here.

_GET_GRAPH = HybridBlock._get_graph
_CALL_CACHED_OP = HybridBlock._call_cached_op


@dataclass(frozen=True)
class BlockHooks:
    """The two methods :func:`install_block_hooks` put on HybridBlock."""

    get_graph: Callable
    call_cached_op: Callable


def install_block_hooks(rewrite: Callable[[HybridBlock, tuple, Sequence[Symbol], Symbol], Symbol],
                        stale: Callable[[HybridBlock], None]) -> BlockHooks:
    """Until :func:`remove_block_hooks`: every HybridBlock's freshly built graph passes
    through ``rewrite(block, args, inputs, out)``, and a block that runs a graph it built
    before (without the hooks) is passed to ``stale`` once. Costs a set lookup per call,
    whatever the size of the heap."""
    built: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()

    def _get_graph(self: HybridBlock, *args: Any) -> Any:
        fresh = not self._cached_graph
        inputs, out = _GET_GRAPH(self, *args)
        if fresh:
            self._cached_graph = (inputs, rewrite(self, args, inputs, out))
            built.add(self)
        return self._cached_graph

    def _call_cached_op(self: HybridBlock, *args: Any) -> Any:
        if self._cached_graph and self not in built:
            built.add(self)  # said once per block
            stale(self)
        return _CALL_CACHED_OP(self, *args)

    HybridBlock._get_graph, HybridBlock._call_cached_op = _get_graph, _call_cached_op
    return BlockHooks(_get_graph, _call_cached_op)


def remove_block_hooks(hooks: BlockHooks) -> None:
    """Put MXNet's methods back, where ``hooks`` are still the ones in place."""
    if HybridBlock.__dict__.get("_get_graph") is hooks.get_graph:
        HybridBlock._get_graph = _GET_GRAPH
    if HybridBlock.__dict__.get("_call_cached_op") is hooks.call_cached_op:
        HybridBlock._call_cached_op = _CALL_CACHED_OP


def full_op_name(name: Any) -> Optional[str]:
    """The node name an op built now with ``name=`` gets (Gluon's prefix applied), or
    ``None`` when MXNet will make one up. 1.9.1: ``NameManager.current.get(name, hint)``
    returns ``name`` (prefixed under ``Prefix``) without side effects when ``name`` is set."""
    if not name or not isinstance(name, str):
        return None
    return mx.name.NameManager.current.get(name, None)


# -- executors -----------------------------------------------------------------------
# 1.9.1 src/executor/graph_executor.cc: Symbol.bind partitions the graph with the subgraph
# backend named by MXNET_SUBGRAPH_BACKEND, read on every bind, MKLDNN by default on CPU
# ("Subgraph backend MKLDNN is activated"). Fused nodes hide their inner outputs.

@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """MXNet's C++ log lines (written to fd 2) are dropped inside the block; Python
    exceptions still propagate."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def unfused_binds() -> Iterator[None]:
    """Symbol.bind inside the block partitions nothing: every op's own output stays readable.
    (MXNet logs a line per such bind; it is dropped.)"""
    old = os.environ.get("MXNET_SUBGRAPH_BACKEND")
    os.environ["MXNET_SUBGRAPH_BACKEND"] = "NONE"
    try:
        with quiet_stderr():
            yield
    finally:
        if old is None:
            os.environ.pop("MXNET_SUBGRAPH_BACKEND", None)
        else:
            os.environ["MXNET_SUBGRAPH_BACKEND"] = old


# -- updater states ------------------------------------------------------------------
# 1.9.1 mxnet/optimizer/optimizer.py ``Updater``: ``states`` maps a parameter index to its
# optimizer state (NDArrays, tuples of them, None); ``states_synced[index] = False`` makes
# the next update move the state to the weight's context. ``Trainer.load_states`` sets the
# same states on every updater and points the optimizer's ``param_dict`` at the trainer's
# parameters.

def updater_states(updater: Any) -> Dict[Any, Any]:
    return updater.states


def set_updater_states(trainer: Trainer, make_states: Callable[[], Dict[Any, Any]]) -> None:
    """Give every updater of ``trainer`` its own ``make_states()``, synced lazily to its context."""
    init_kvstore_now(trainer)
    for updater in trainer._updaters:
        updater.states = make_states()
        updater.states_synced = dict.fromkeys(updater.states.keys(), False)
    trainer._optimizer.param_dict = dict(enumerate(trainer._params))


# -- host views ----------------------------------------------------------------------
# MXNet 1.9.1 NDArray.to_dlpack_for_read() waits for pending writes and exports the
# array's memory (no copy); NumPy >= 1.22 reads it through np.from_dlpack. NumPy has no
# bfloat16, so those arrays have no host view.

class _DLPack:
    def __init__(self, array: mx.nd.NDArray) -> None:
        self.array = array

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.array.to_dlpack_for_read()

    def __dlpack_device__(self) -> Tuple[int, int]:
        return 1, 0  # kDLCPU


def host_view(array: mx.nd.NDArray) -> Optional[np.ndarray]:
    """A read-only NumPy view of a CPU float32/float16 array's memory (after its pending
    writes), or None where there is none (other devices, dtypes, storage types)."""
    if (array.context.device_type != "cpu" or array.stype != "default"
            or FLOAT_NAMES.get(array.dtype) not in ("float32", "float16")):
        return None
    return np.from_dlpack(_DLPack(array))
