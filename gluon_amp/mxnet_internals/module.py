"""``mx.mod.Module``, ``BucketingModule`` and executor-group internals (MXNet 1.9.1, mxnet/module/).

What gluon_amp relies on, and what breaks if MXNet changes it:

- ``Module.bind`` builds its ``DataParallelExecutorGroup`` from ``self._symbol`` and reads
  that attribute nowhere else; ``save_checkpoint`` and ``Module.symbol`` read it later. The
  executors get gluon_amp's copy by a swap of that attribute around the original ``bind``
  (:func:`binding_symbol`). If ``bind`` read it elsewhere, the module tests' checkpoint and
  bind checks fail.
- The executor group's ``execs`` (one executor per context, ``arg_dict`` by name) and
  ``grad_arrays`` (per parameter, per context; ``None`` for a fixed parameter), and
  ``input_grad_arrays`` likewise for the data inputs (``None`` unless ``inputs_need_grad``).
- ``_optimizer`` / ``_updater`` / ``_kvstore`` / ``_update_on_kvstore`` as
  ``init_optimizer`` sets them; with ``update_on_kvstore`` the updater is the kvstore's
  ``_updater`` (a local kvstore calls the module's own optimizer object).
- ``_data_shapes``, ``_label_shapes``, ``for_training``, ``inputs_need_grad``, ``_grad_req``:
  what ``bind`` was given, to bind again; ``_params_dirty`` / ``_sync_params_from_devices``.
- ``BucketingModule._buckets`` (key -> Module), ``_default_bucket_key``, ``_curr_module``.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mxnet as mx
from mxnet.module import BucketingModule, Module, SequentialModule

__all__ = [
    "Module", "BucketingModule", "MethodPatch", "patch_methods", "restore_methods", "binding_symbol",
    "module_symbol", "module_executors", "module_grad_arrays", "module_optimizer", "module_updater",
    "optimizer_on_server", "module_compression", "module_kvstore", "bind_arguments", "rebind", "bucket_modules",
    "call_arguments",
    "set_module_updater_states", "module_param_specs", "module_devices", "module_update_arrays",
]


# -- class methods, patched reversibly -------------------------------------------------

@dataclass
class MethodPatch:
    cls: type
    name: str
    original: Any
    wrapper: Any


def patch_methods(cls: type, wrappers: Dict[str, Callable[[Callable], Callable]]) -> List[MethodPatch]:
    """Replace ``cls.<name>`` by ``make(original)`` for each entry; undo with :func:`restore_methods`.

    All or nothing: the wrappers are made first, and if anything fails while they are set, the
    methods already replaced are put back before the exception goes on (a half-patched class
    would be wrapped twice by the next call)."""
    patches = [MethodPatch(cls, name, cls.__dict__[name], None) for name in wrappers]
    for p in patches:
        p.wrapper = wrappers[p.name](p.original)
    done: List[MethodPatch] = []
    try:
        for p in patches:
            done.append(p)
            setattr(cls, p.name, p.wrapper)
    except BaseException:
        restore_methods(done)
        raise
    return patches


def restore_methods(patches: List[MethodPatch]) -> List[str]:
    """Put back each method still holding gluon_amp's wrapper (checked by identity); return
    the names of those someone else replaced meanwhile (left as they are)."""
    changed = []
    for p in reversed(patches):
        now = p.cls.__dict__.get(p.name)
        if now is p.wrapper:
            setattr(p.cls, p.name, p.original)
        elif now is not p.original:  # restored already (a removal finished again) is no change
            changed.append(f"{p.cls.__module__}.{p.cls.__name__}.{p.name}")
    return changed


def call_arguments(function: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """A call's arguments by name, defaults filled in (``self`` included)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# -- the symbol the executors get --------------------------------------------------------

@contextlib.contextmanager
def binding_symbol(module: Module, symbol: mx.sym.Symbol) -> Iterator[None]:
    """Inside the block, ``module``'s ``bind`` builds its executors from ``symbol``; the
    module's own symbol (``save_checkpoint``, ``Module.symbol``) is back afterwards."""
    own = module._symbol
    module._symbol = symbol
    try:
        yield
    finally:
        module._symbol = own


def module_symbol(module: Module) -> mx.sym.Symbol:
    return module._symbol


def module_executors(module: Module) -> List[Any]:
    """The executors of a bound module (one per context); ``[]`` when not bound."""
    group = module._exec_group
    return list(group.execs) if group is not None else []


def bound_symbols(module: Module) -> List[mx.sym.Symbol]:
    """The graph each executor of a bound module runs (1.9.1's ``Executor._symbol``: what was
    bound, a copy); ``[]`` when not bound."""
    return [ex._symbol for ex in module_executors(module) if getattr(ex, "_symbol", None) is not None]


def module_grad_arrays(module: Module) -> List[mx.nd.NDArray]:
    """Every gradient array the next ``update`` reads (all parameters, all contexts)."""
    group = module._exec_group
    if group is None or not getattr(group, "grad_arrays", None):
        return []
    return [g for per_ctx in group.grad_arrays for g in per_ctx if g is not None]


def module_input_grads(module: Module) -> List[mx.nd.NDArray]:
    """The gradients of the data inputs a backward pass writes (``inputs_need_grad=True``)."""
    group = module._exec_group
    if group is None or not module.inputs_need_grad:
        return []
    return [g for per_ctx in (group.input_grad_arrays or []) for g in per_ctx if g is not None]


# 1.9.1 ``mxnet.contrib.svrg_optimization.svrg_module.SVRGModule`` (a Module) keeps a second
# Module in ``_mod_aux``, binds it with itself, and mixes its gradients (per batch, and averaged
# over the data at the epoch's start) into its own before each update.

def auxiliary_modules(module: Any) -> List[Module]:
    """The modules whose gradients ``module``'s update mixes into its own (an SVRGModule's
    ``_mod_aux``); ``[]`` for any other module."""
    try:
        from mxnet.contrib.svrg_optimization.svrg_module import SVRGModule
    except ImportError:  # pragma: no cover - part of every 1.9.1 wheel
        return []
    aux = getattr(module, "_mod_aux", None) if isinstance(module, SVRGModule) else None
    return [aux] if isinstance(aux, Module) else []


def module_update_arrays(module: Module) -> Optional[Tuple[List[mx.nd.NDArray], List[mx.nd.NDArray], List[int]]]:
    """(weights, gradients, updater indices) of what the next ``update`` writes and reads, or
    None where it goes through a kvstore. 1.9.1 ``model._update_params`` updates parameter
    ``i``'s copy on device ``k`` under index ``i * num_device + k``, and skips parameters
    without a gradient."""
    if module._kvstore is not None or module._update_on_kvstore or module._exec_group is None:
        return None
    group, n = module._exec_group, len(module._context)
    weights: List[mx.nd.NDArray] = []
    grads: List[mx.nd.NDArray] = []
    indices: List[int] = []
    for i, (ws, gs) in enumerate(zip(group.param_arrays, group.grad_arrays)):
        if gs[0] is None:
            continue
        for k, (w, g) in enumerate(zip(ws, gs)):
            weights.append(w)
            grads.append(g)
            indices.append(i * n + k)
    return weights, grads, indices


def module_optimizer(module: Module) -> Any:
    return module._optimizer


def updating_optimizer(opt: Any) -> Any:
    """The optimizer whose ``rescale_grad`` an update reads: ``opt``, or the one a delegating
    wrapper holds. Horovod 0.28.1's ``DistributedOptimizer`` keeps it as ``_optimizer`` without
    an ``Optimizer.__init__`` of its own: reads of ``rescale_grad`` go through its
    ``__getattr__`` to the inner optimizer, a write lands on the wrapper and is never read."""
    for _ in range(8):  # wrappers of wrappers; a cycle cannot hold us
        attrs = getattr(opt, "__dict__", {})
        inner = attrs.get("_optimizer")
        if "rescale_grad" in attrs or not isinstance(inner, mx.optimizer.Optimizer):
            return opt
        opt = inner
    return opt


def horovod_optimizer_process_set(opt: Any) -> Any:
    """The process set of Horovod 0.28.1's ``DistributedOptimizer`` (``_process_set``: its
    ``update`` allreduces each gradient over it); None for other optimizers."""
    return getattr(opt, "__dict__", {}).get("_process_set") if type(opt).__module__.startswith("horovod.") else None


def module_kvstore(module: Module) -> Any:
    return module._kvstore


def module_compression(module: Module) -> Any:
    """The ``compression_params`` the module's kvstore was given (1.9.1: ``Module._compression_params``)."""
    return getattr(module, "_compression_params", None)


def optimizer_on_server(module: Module) -> bool:
    """True when the update runs on a distributed kvstore's servers (a copy of the optimizer)."""
    kv = module._kvstore
    return bool(kv is not None and module._update_on_kvstore and "dist" in kv.type)


def module_updater(module: Module) -> Any:
    """The ``mx.optimizer.Updater`` whose ``states`` hold the optimizer state."""
    if module._update_on_kvstore:
        return module._kvstore._updater
    return module._updater


def set_module_updater_states(module: Module, states: Dict[Any, Any]) -> None:
    """Give the module's updater ``states`` (1.9.1 ``Updater.states``), moved to each weight's
    context on its next update (``states_synced`` False), as ``Updater.set_states`` does."""
    vars(module_updater(module)).update(states=states, states_synced=dict.fromkeys(states.keys(), False))


# -- binding again ---------------------------------------------------------------------

def bind_arguments(module: Module) -> Dict[str, Any]:
    """What the module's last ``bind`` was given."""
    return {"data_shapes": module._data_shapes, "label_shapes": module._label_shapes,
            "for_training": module.for_training, "inputs_need_grad": module.inputs_need_grad,
            "grad_req": module._grad_req}


def rebind(module: Module, shared_module: Optional[Module] = None) -> None:
    """Bind ``module`` again with the shapes it has, keeping its current weights (synced
    from the devices first) and its optimizer."""
    if module.params_initialized and module._params_dirty:
        module._sync_params_from_devices()
    module.bind(force_rebind=True, shared_module=shared_module, **bind_arguments(module))


def sequential_modules(module: SequentialModule) -> List[Module]:
    """The ``Module`` stages of a SequentialModule (1.9.1 ``_modules``; other BaseModules, such
    as a ``PythonLossModule``, left out)."""
    return [m for m in module._modules if isinstance(m, Module)]


def bucket_modules(module: BucketingModule) -> Tuple[Any, Dict[Any, Module]]:
    """``(default bucket key, {key: Module})`` of a BucketingModule (empty before bind)."""
    return module._default_bucket_key, dict(module._buckets)


def module_param_specs(module: Module) -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, shape, dtype name) of each parameter a bound module updates, in the order of the
    updater's indices (1.9.1 ``model._update_params``: ``index * num_device + device``)."""
    from gluon_amp_core.dtypes import dtype_name
    group = module._exec_group
    if group is None:
        return []
    return [(name, tuple(arrays[0].shape), dtype_name(arrays[0].dtype))
            for name, arrays in zip(group.param_names, group.param_arrays)]


def module_contexts(module: Module) -> List[mx.Context]:
    """The devices a module binds its executors on (``context=`` at construction)."""
    return list(module._context)


def module_state_names(module: Module) -> Optional[List[str]]:
    """The parameter names, in :func:`module_param_specs`' order, where the module's updater
    keys its states by name: 1.9.1 updates a module on several devices in its local kvstore
    (``update_on_kvstore``), whose updater MXNet calls with each parameter's name. None where
    the keys are optimizer indices. The kvstore may hold other keys: 1.9.1's SVRGModule pushes
    each parameter's full gradient to ``<name>_full``, whose ``_AssignmentOptimizer`` keeps no
    state (``None``)."""
    if not module._update_on_kvstore or module._exec_group is None:
        return None
    return list(module._exec_group.param_names)


def module_devices(module: Module) -> int:
    """How many updater indices each parameter has (one per device)."""
    return len(module._context)
