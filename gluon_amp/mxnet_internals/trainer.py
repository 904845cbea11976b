"""Gluon Trainer, parameter and optimizer-updater internals (MXNet 1.9.1)."""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import mxnet as mx
from mxnet.gluon import Parameter, Trainer

from gluon_amp_core.dtypes import dtype_name


# -- trainer -------------------------------------------------------------------------
# 1.9.1 mxnet/gluon/trainer.py: ``_update`` calls ``self._amp_loss_scaler.has_overflow(params)``
# when that attribute exists and skips the update if it returns True (``step`` and ``update``
# both go through ``_update``, which training/trainer.py wraps to read an early verdict); ``_scale`` is the
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


def has_sparse_weights(trainer: Trainer) -> bool:
    """1.9.1: ``Trainer._contains_sparse_weight``: some parameter is stored ``row_sparse``, and
    MXNet then updates on the kvstore only ("Cannot set update_on_kvstore=False when sparse
    weights are present")."""
    return bool(getattr(trainer, "_contains_sparse_weight", False))


def stored_sparse(param: Parameter) -> bool:
    """1.9.1: ``Parameter._stype``, the storage of its data (``'row_sparse'``, or ``'default'``)."""
    return getattr(param, "_stype", "default") != "default"


def sparse_initialized(param: Parameter) -> Optional[bool]:
    """For a parameter stored sparse, whether it is initialized (1.9.1: ``_data`` set; deferred:
    ``_deferred_init`` pending, None); its ``list_data`` raises for sparse storage either way."""
    if param._data is not None:
        return True
    return None if param._deferred_init else False


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


def fresh_params(params: Sequence[Parameter]) -> List[Parameter]:
    """The parameters 1.9.1's ``Trainer._update(ignore_stale_grad=True)`` updates: those with
    a gradient, written by a backward since their last update on some context (``_fresh_grad``
    of each of its data arrays; the others keep an old gradient, and are left alone)."""
    return [p for p in params if has_grad(p) and any(fresh_grad(a) for a in p.list_data())]


def stale_params(params: Sequence[Parameter]) -> List[Parameter]:
    """The parameters with a gradient that no backward wrote since their last update on some
    context: 1.9.1's ``Trainer._update(ignore_stale_grad=False)`` raises a UserWarning for each."""
    return [p for p in params if has_grad(p) and not all(fresh_grad(a) for a in p.list_data())]


def spend_grads(params: Sequence[Parameter]) -> None:
    """Mark the gradients of ``params`` used, as ``Trainer._update`` does with those it applies."""
    for p in params:
        if has_grad(p):
            for a in p.list_data():
                set_fresh_grad(a, False)


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
        states = make_states()
        vars(updater).update(states=states, states_synced=dict.fromkeys(states.keys(), False))
    trainer._optimizer.param_dict = dict(enumerate(trainer._params))


# -- who holds a trainer -------------------------------------------------------------
# 1.9.1 ``Parameter._set_trainer`` keeps a strong ``_trainer`` on each parameter, and the
# trainer keeps its ``_params``: a cycle, freed only by Python's cyclic GC, and a trainer that
# lived through some training sits in its oldest generation. A trainer held by nothing but
# those back-references is one the program dropped: nothing can call its ``step``.

def held_elsewhere(ref: "weakref.ref[Trainer]") -> bool:
    """True when the trainer ``ref`` points to is held by something other than its own
    parameters' ``_trainer`` (CPython reference counts: the program, a frame running its step)."""
    trainer = ref()
    if trainer is None:
        return False
    held = sys.getrefcount(trainer) - 2  # this frame's name, getrefcount's argument
    for p in trainer._params:
        if getattr(p, "_trainer", None) is trainer:
            held -= 1
    return held > 0


def correct_rescale_grad(trainer: Trainer, wanted_scale: float) -> None:
    """Make this step's update divide as if ``trainer._scale`` were ``wanted_scale``: 1.9.1
    ``Trainer.step``/``update`` set ``optimizer.rescale_grad = _scale / batch_size`` before
    ``_update`` calls the step hook, and the next step sets it afresh."""
    used = trainer._scale
    if used != wanted_scale:
        trainer._optimizer.rescale_grad = trainer._optimizer.rescale_grad * (wanted_scale / used)


def param_specs(trainer: Trainer) -> List[Any]:
    """(name, shape, dtype name) of each parameter, in the order of the optimizer's indices."""
    return [(p.name, tuple(p.shape or ()), dtype_name(p.dtype)) for p in trainer._params]


def updaters_snapshot(trainer: Trainer) -> List[Any]:
    """What :func:`set_updater_states` changes, to put back (:func:`restore_updaters`)."""
    return [(u, u.states, u.states_synced) for u in trainer._updaters]


def restore_updaters(trainer: Trainer, snapshot: List[Any]) -> None:
    for u, states, synced in snapshot:
        vars(u).update(states=states, states_synced=synced)


# -- a step that updates before its verdict (training/early_update.py) --------------------
# 1.9.1 ``Optimizer._update_count`` raises ``num_update`` and the per-device dicts of
# ``_all_index_update_counts`` (``_index_update_count`` points at the current device's one);
# the optimizers in UNDOABLE keep no other Python-side state between updates (Nadam's
# ``m_schedule``, SGLD's random draws and LBSGD's/DCASGD's extra state do). ``Updater``
# creates a state on an index's first update and moves it to the weight's context where
# ``states_synced`` is False; ``Trainer._update`` clears ``_fresh_grad`` of each array it
# updates. If any of this changes, the early-update tests fail.

#: MXNet's optimizer classes (exact types) whose update an early step can undo
UNDOABLE = ("SGD", "Signum", "FTML", "NAG", "Adam", "AdaGrad", "RMSProp", "AdaDelta", "Ftrl", "Adamax",
            "LAMB")


def undoable_optimizer(opt: Any) -> bool:
    return type(opt).__module__ == mx.optimizer.optimizer.__name__ and type(opt).__name__ in UNDOABLE


def plain_updaters(trainer: Trainer) -> bool:
    """Every updater of ``trainer`` is MXNet's own ``Updater`` (not a subclass or a stand-in)."""
    return all(type(u) is mx.optimizer.Updater for u in trainer._updaters)


def ready_states(updater: Any, indices: Sequence[int]) -> Optional[List[Any]]:
    """The states of ``indices``, each already on its weight's context; None if any index
    has none yet or will be moved by its next update (that update would replace it)."""
    states, synced = updater.states, updater.states_synced
    if any(i not in states or not synced.get(i, False) for i in indices):
        return None
    return [states[i] for i in indices]


def optimizer_counters(opt: Any) -> Any:
    """The optimizer's update counts, to put back with :func:`set_optimizer_counters`."""
    return opt.num_update, {dev: dict(counts) for dev, counts in opt._all_index_update_counts.items()}


def set_optimizer_counters(opt: Any, counters: Any) -> None:
    num_update, per_device = counters
    for dev, counts in per_device.items():
        live = opt._all_index_update_counts.setdefault(dev, {})
        live.clear()  # in place: _index_update_count points at one of them
        live.update(counts)
    opt.num_update = num_update


def fresh_grad(array: mx.nd.NDArray) -> bool:
    """Whether a backward wrote ``array``'s gradient since its last update (1.9.1 ``_fresh_grad``)."""
    return bool(array._fresh_grad)


def set_fresh_grad(array: mx.nd.NDArray, value: bool) -> None:
    array._fresh_grad = value

