"""Attach a loss scaler to a Gluon ``Trainer``: init_trainer, scale_loss, unscale, checkpoints.

Integration uses the hook MXNet's ``Trainer._update`` already calls before each update
(see :mod:`gluon_amp.mxnet_internals`), and the trainer's gradient scale, which
``scale_loss`` sets so that unscaling folds into the optimizer's ``rescale_grad`` (no
extra pass over the gradients). Per-trainer stages and rounds live in the LossScaler.

The scale a step uses is decided when it is used, by the first ``scale_loss`` of the step
(from the scaler and the dtype the step computes in, which ``init``, ``disable`` and
``autocast`` may have changed since ``init_trainer``), and kept until the step.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import tempfile
import threading
import warnings
import weakref
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import Trainer

from gluon_amp_core.dtypes import FLOAT16_SMALLEST_NORMAL, dtype_name
from gluon_amp_core.loss_scale import LossScaler, Stage, asks_for, loss_scaler_from

from .. import state
from . import checkpoint, distributed, early_update, overflow
from . import module as module_scaling
from .. import mxnet_internals as mxi


class _Hook:
    """What ``Trainer._update`` calls before updating: the overflow check of one trainer.

    The hook is the trainer's member token in its :class:`LossScaler`, which keeps the
    trainer's stage (ready, unscaled, stepped) and the round. It is also what code written
    for MXNet's own AMP module (the peer) finds as ``trainer._amp_loss_scaler``, so it answers that
    scaler's attributes (:attr:`loss_scale`, ``_scale_seq_len``...).
    """

    def __init__(self, trainer: Trainer, scaler: LossScaler) -> None:
        self._trainer = weakref.ref(trainer)
        self.scaler = scaler
        self.original_scale = mxi.grad_scale(trainer)
        self._warned = False
        #: a scaled step without scale_loss was said (once per trainer)
        self._said_unscaled = False
        #: (compute dtype, scale, the scaler's step count of this trainer) fixed by the step's
        #: first scale_loss: valid while the count stays (an interrupted step records nothing)
        self._decided: Optional[Tuple[str, float, int]] = None
        #: state.policy_serial() when the last step ended: the policies since are this step's
        self._since = state.policy_serial()
        #: this step is checked whatever it computed in (clip_global_norm found a non-finite norm)
        self._must_check = False
        #: set by the patched ``Trainer._update`` around MXNet's: the step may update before its verdict
        self._armed = False
        #: likewise: the step was called with ``ignore_stale_grad=True``, so MXNet updates only the
        #: parameters with a fresh gradient, and only theirs decide whether it is skipped
        self._ignore_stale = False
        #: a step updated before its verdict: (its undo, dtype, scaled, the count before it, params);
        #: once the count has moved past it, a recorded step's, kept until the next step reads it
        self._early: Optional[Tuple[early_update.Early, str, bool, int, Sequence[Any]]] = None
        self._plans: Dict[str, Any] = {}
        #: the ``loss_scale`` argument the scaler was made from (``init_trainer`` asked again),
        #: and whether ``initialize`` chose it for its opt level
        self.requested: Any = None
        self.by_initialize = False
        scaler.attach(self)

    @property
    def _step(self) -> Optional[Tuple[str, float]]:
        """(compute dtype, scale) of the current step if its first ``scale_loss`` ran, else None."""
        decided = self._decided
        if decided is None or decided[2] != self.scaler.steps_of(self):
            return None
        return decided[0], decided[1]

    def represents(self, obj: Any) -> bool:
        """Whether ``obj`` is this hook's trainer (``scaler.stage(trainer)``)."""
        return obj is not None and self._trainer() is obj

    def attached(self) -> bool:
        """Whether this trainer still counts (for the loss-output ops and the scaler's rounds):
        False once the program holds it no more, without waiting for the cyclic GC (MXNet's
        parameters point back at their trainer, so it is freed only by the GC), or once the
        trainer has another hook."""
        trainer = self._trainer()
        if trainer is None or mxi.get_step_hook(trainer) is not self:
            return False
        del trainer  # held_elsewhere counts references: none of ours
        return mxi.held_elsewhere(self._trainer)

    def _compute_dtype(self) -> str:
        trainer = self._trainer()
        params = mxi.trainer_params(trainer) if trainer is not None else ()
        return _compute_dtype([p.dtype for p in params], self._since)

    def decide(self) -> Tuple[str, float]:
        """The current step's compute dtype and scale. Where a parameter accumulates
        (``grad_req='add'``) the first ``scale_loss`` since the last step decides, and later
        ones share it (accumulated gradients share one scale). Where every backward replaces
        the gradients (``'write'``), each ``scale_loss`` decides afresh: nothing earlier shares
        its scale, and a step that raised after its backward (a Ctrl-C in ``trainer.step``)
        does not hand its decision to the next forward, which may run another policy."""
        step = self._step
        trainer = self._trainer()
        params = mxi.trainer_params(trainer) if trainer is not None else ()
        kinds = {(p.dtype, p.grad_req) for p in params}  # one pass over the parameters, every step
        if step is None or not any(req == "add" for _, req in kinds):
            dtype = _compute_dtype([d for d, _ in kinds], self._since)
            new = (dtype, self.scaler.scale_for(dtype))
            if new != step:
                self._decided = (*new, self.scaler.steps_of(self))
            step = new
        return step

    def take_scale(self, scale: float) -> None:
        """This step's loss was multiplied by ``scale`` (``scale_loss`` over several trainers,
        decided by the first): the step divides by it, whatever this trainer decided before."""
        self._decided = (self._compute_dtype(), scale, self.scaler.steps_of(self))

    # The peer's scaler fields, read and assigned as clients do (Sockeye saves and restores
    # ``(_loss_scale, _next_loss_scale, _unskipped)`` by pickle). Each reads from, and an
    # assignment replaces, the LossScaler's explicit state. gluon_amp moves the scale at the
    # step that decides it (the peer one step later), so between steps both scales read the
    # one the next step uses, and an assignment of either sets it.

    @property
    def loss_scale(self) -> float:
        """The scale this step's loss was multiplied by; before the step's first
        ``scale_loss``, the one it will use (the peer's ``LossScaler.loss_scale``). Assigning
        sets the scaler's scale from the next step on (this step keeps the one its loss used);
        assigning the value it reads changes nothing (a step that is not scaled reads 1)."""
        return self._step[1] if self._step is not None else self.scaler.scale_for(self._compute_dtype())

    @loss_scale.setter
    def loss_scale(self, scale: float) -> None:
        self._assign_scale(scale, self.loss_scale)

    _loss_scale = loss_scale  # the peer's private name for it

    @property
    def _next_loss_scale(self) -> float:
        """The scale the next step uses unless this step's check moves it (the peer's field);
        assigning sets it, as for :attr:`loss_scale`."""
        return self.scaler.scale_for(self._compute_dtype())

    @_next_loss_scale.setter
    def _next_loss_scale(self, scale: float) -> None:
        self._assign_scale(scale, self._next_loss_scale)

    def _assign_scale(self, scale: float, reads: float) -> None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"trainer._amp_loss_scaler: the loss scale must be a number, got {scale!r}")
        if float(scale) != reads:  # the value it reads (1 where not scaled) is the state as it is
            self.scaler.assign(scale=scale)

    @property
    def _unskipped(self) -> int:
        """Finite steps in a row since the scale last changed (the peer's field); assigning
        sets the count, and the scale grows after ``growth_interval`` of them."""
        return self.scaler.state.growth_tracker

    @_unskipped.setter
    def _unskipped(self, steps: int) -> None:
        self.scaler.assign(growth_tracker=steps)

    @property
    def _max_loss_scale(self) -> float:
        return self.scaler.max_scale

    @property
    def _scale_seq_len(self) -> int:
        return self.scaler.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"_scale_seq_len (the loss scaler's growth_interval) must be a positive int, "
                             f"got {steps!r}")
        self.scaler.growth_interval = steps

    def has_overflow(self, params: Sequence[mx.gluon.Parameter]) -> bool:
        # All or nothing under an exception or a Ctrl-C at any bytecode: what runs before the
        # commit only reads, or sets what is derived (trainer._scale, rescale_grad: the next
        # step sets them afresh and checks them against its own decision); record_step's last
        # statement commits the step, round and scale at once; after it, only a skipped step
        # runs more code (it does not update either way).
        try:
            if autograd.is_recording():
                # MXNet's update then fails with "Assigning to NDArrays that are already in a
                # computational graph", step after step: say why first, before the round counts it
                raise RuntimeError(
                    "trainer.step was called while autograd is recording: move it out of "
                    "'with autograd.record():'. If no such block is open, a Ctrl-C that landed in an "
                    "autograd.record() block's exit left recording on (MXNet's scope is not "
                    "interrupt-safe): call mx.autograd.set_recording(False) after catching it.")
            steps = self.scaler.steps_of(self)
            if self._early is not None and self._early[3] != steps:
                self._early = None  # the last step's, recorded (finish_early leaves it)
            trainer = self._trainer()
            if trainer is not None and mxi.has_sparse_weights(trainer):
                # the kvstore updated in step()'s push already, unscaled (scale_loss refuses a
                # scale here): nothing a check could skip
                return False
            step = self._step
            if trainer is not None and step is not None and _must_unscale_first(trainer, self, step[1]):
                self._unscale_instead_of_folding(trainer)
            dtype = step[0] if step is not None else self._compute_dtype()
            armed, self._armed = self._armed, False
            ignore_stale, self._ignore_stale = self._ignore_stale, False
            stale_left = False
            if ignore_stale:
                # a gradient MXNet will not apply (an unused head's, inf from a step it skipped)
                # must not skip the steps of the parameters it does apply
                fresh = mxi.fresh_params(params)
                stale_left = len(fresh) < len(params)
                params = fresh if stale_left else params
            scaled = self.scaler.scales(dtype)
            if step is None and scaled and not self._said_unscaled:
                self._say_unscaled(dtype)
            checked = self.scaler.checks(dtype, scaled) or (self.scaler.enabled and self._must_check)
            early = None
            if checked and armed and trainer is not None and not stale_left:
                # (an early update's undo indexes the optimizer's states by the trainer's whole
                # parameter list: a step that leaves some out waits for its verdict)
                early = early_update.begin(trainer, params, self._plans)
            finite = True if not checked or early is not None else overflow.all_finite(params)
            if trainer is not None:
                finite = distributed.agree_finite(trainer, self.scaler, finite)
                divisor = step[1] if step is not None and self.scaler.stage(self) is not Stage.UNSCALED else 1.0
                # the update divides by this step's own scale, whatever a fault left in trainer._scale
                mxi.correct_rescale_grad(trainer, self.original_scale / divisor)
                mxi.set_grad_scale(trainer, self.original_scale)  # unscaled unless scale_loss runs again
            self._since = state.policy_serial()
            self._must_check = False
            if early is not None:  # the verdict comes after the update (finish_early)
                self._early = (early, dtype, scaled, steps, params)
                return False
            if not finite and armed and not ignore_stale and mxi.stale_params(params):
                # MXNet's update refuses a gradient no backward wrote since the last step, as it
                # does without AMP (its UserWarning; the step is then abandoned, not recorded).
                # Skipped instead, such a step would read the same stale inf at every retry.
                return False
            return self.scaler.record_step(self, finite, scaled=scaled) and self._skipped(dtype, params)
        except BaseException:
            # a shared round does not wait for a step that never counted (steps unset: it stopped
            # at the first line)
            self.scaler.abandon(self, locals().get("steps"))
            raise

    def _unscale_instead_of_folding(self, trainer: Trainer) -> None:
        """Divide this step's gradients by the scale now, and the update by the batch only."""
        used = mxi.grad_scale(trainer)  # what MXNet's step folded into rescale_grad
        unscale(trainer)
        mxi.set_grad_scale(trainer, used)  # so that the correction below divides the fold back out

    def _say_unscaled(self, dtype: str) -> None:
        """A step whose dtype the scaler scales, with no ``scale_loss`` since the last step: its
        gradients were not multiplied by the scale (a loop written without it, Gluon
        Estimator's default ``fit_batch``), so they are FP32's, unprotected from float16's
        underflow; a loss-output op's ``grad_scale`` was multiplied and is not divided back."""
        scale = self.scaler.scale_for(dtype)
        if scale == 1.0:
            return
        self._said_unscaled = True
        warnings.warn(
            f"gluon_amp: trainer.step ran a {dtype} step whose backward did not go through "
            f"gluon_amp.scale_loss(loss, trainer): its gradients were not multiplied by the loss scale "
            f"({scale:g}), so small ones can underflow to zero in {dtype}. Call backward on what "
            "`with gluon_amp.scale_loss(loss, trainer) as scaled:` yields (for a gluon Estimator, a "
            "BatchProcessor whose fit_batch does), or pass loss_scale=None to init_trainer for no "
            "scaling. (Said once per trainer.)",
            RuntimeWarning, stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))

    def finish_early(self) -> None:
        """After MXNet's updates of a step that did not wait for its verdict: read it, undo a
        skipped step's update, and record the step (:mod:`.early_update`)."""
        pending = self._early
        if pending is None:
            return
        early, dtype, scaled, steps, params = pending
        if self.scaler.steps_of(self) != steps:  # recorded already: its step is over
            self._early = None
            return
        finite = early.finite()
        if not finite:
            early.undo()
        # The commit is record_step's last statement, and a finite step runs no line of ours
        # after it: a Ctrl-C lands before it (nothing happened) or never. The pending update
        # stays set, and is dropped as recorded by the next step or abort_step.
        if self.scaler.record_step(self, finite, scaled=scaled):
            self._skipped(dtype, params)

    def abort_step(self, steps: Optional[int]) -> None:
        """The step raised (a Ctrl-C included) in ``Trainer._update``, its count ``steps``
        when it began (None: before it read it). If it was not recorded, it did not happen: an
        update dispatched before its verdict is undone, and the round does not wait for it.
        A recorded step stays as recorded. The fresh gradient flags stay as MXNet's loop left
        them (its stale-gradient UserWarning clears those before the stale one): a later
        ``step(ignore_stale_grad=True)`` applies what it would without AMP."""
        self._armed = self._ignore_stale = False
        pending = self._early
        if pending is not None and self.scaler.steps_of(self) == pending[3]:  # this step's, unrecorded
            steps = pending[3]
            pending[0].undo(fresh=False)
        self._early = None
        self.scaler.abandon(self, steps)

    def _skipped(self, dtype: str, params: Sequence[mx.gluon.Parameter]) -> bool:
        """A step was skipped (and recorded): its gradients are spent as an update's would be,
        say why once, stop a collapsed run; True."""
        # MXNet's update marks each gradient it applies as used; a skipped step returns before
        # it, so a parameter no later backward reaches (an unused head) kept its inf gradient as
        # fresh, and every later step read it again and was skipped too
        mxi.spend_grads(params)
        if not self._warned and dtype != "float16":
            self._warned = True
            warnings.warn(
                f"gluon_amp: a training step was skipped for inf/NaN gradients while AMP runs "
                f"{_dtype_now()}, whose exponent range is float32's: the loss scale is not the cause. "
                "Parameters with inf/NaN gradients: "
                f"{overflow.non_finite_names(params) or 'none now (it came from the loss)'}. "
                "Check the data, the loss and the learning rate; gluon_amp stops the run after "
                f"{self.scaler.max_consecutive_skips} skips in a row. (Said once per trainer.)",
                RuntimeWarning, stacklevel=5)
        if self.scaler.collapsed():
            raise RuntimeError(
                f"{self.scaler.state.consecutive_skips} steps in a row had non-finite gradients "
                f"(loss scale now {self.scaler.scale_for(dtype):g}); this is not an fp16 range problem. "
                "Parameters with inf/NaN gradients: "
                f"{overflow.non_finite_names(params) or 'none now (inf/NaN came from the loss)'}. "
                "Check the learning rate, the data and the loss, or raise max_consecutive_skips.")
        return True


def _compute_dtype(param_dtypes: Sequence[Any], since: int) -> str:
    """The dtype whose range a step's gradients pass through: float16 when AMP ran it (real
    or emulated) at any time since the trainer's last step (serial ``since``: a forward pass
    under ``autocast`` and its ``scale_loss`` after the scope count alike) or a parameter is
    float16 (``param_dtypes``: the trainer's parameters' dtypes), else bfloat16 likewise,
    else float32."""
    dtypes = set(state.dtypes_since(since))
    dtypes.update(dtype_name(d) for d in set(param_dtypes))  # named once per distinct dtype
    return next((d for d in ("float16", "bfloat16") if d in dtypes), "float32")


def _dtype_now() -> str:
    policy = state.current_policy()
    return policy.target_dtype + " (emulated)" * policy.emulate if policy is not None else "float32 (AMP off)"


def _one_trainer(trainer: Any, optimizer_or_trainer: Any, caller: str) -> Any:
    """The trainer given either as ``trainer`` or as ``optimizer_or_trainer=`` (the name older AMP code uses)."""
    if trainer is not None and optimizer_or_trainer is not None:
        raise TypeError(f"{caller}: pass the trainer once, as trainer or as optimizer_or_trainer, not both")
    if trainer is None and optimizer_or_trainer is None:
        raise TypeError(f"{caller}: missing the trainer (first argument, or optimizer_or_trainer=)")
    return trainer if trainer is not None else optimizer_or_trainer


def init_trainer(trainer: Union[Trainer, "mx.mod.BaseModule", None] = None,
                 loss_scale: Union[str, float, LossScaler, None] = "dynamic", *,
                 optimizer_or_trainer: Optional[Trainer] = None) -> LossScaler:
    """Attach loss scaling to ``trainer`` (or to a Module); return its :class:`LossScaler`.

    ``trainer`` may be a ``mx.mod.Module`` or ``BucketingModule``: its loss heads' backward
    and its ``update`` are scaled, checked and skipped on inf/NaN as a trainer's step is
    (:mod:`gluon_amp.training.module`; no ``scale_loss`` needed: ``fit`` and
    ``forward_backward``/``update`` loops work as written).

    The trainer must update on the worker, not the kvstore: build it with
    ``update_on_kvstore=False``. If it was left at ``None``, it is set to False here. A trainer
    holding sparse (``row_sparse``) weights, which MXNet updates on the kvstore only, keeps that:
    its float32 and bfloat16 steps run as without AMP, and a float16 step that would scale the
    loss is refused (no check can come before the kvstore's update).

    Asked again with the same ``loss_scale``, it returns the scaler the trainer has; another
    ``loss_scale`` for a trainer that has one is a ``RuntimeError``.

    Parameters
    ----------
    trainer : mxnet.gluon.Trainer
    loss_scale : 'dynamic', float, None or LossScaler
        ``'dynamic'`` (default) makes a new dynamic scaler for float16 steps (real or
        emulated), checked and skipped on inf/NaN gradients; steps in bfloat16 or float32
        (AMP off) are neither scaled nor checked, as FP32 updates them. A number makes a
        static scaler and a ``LossScaler`` is used as given: both scale and check every
        step, float32 included (``1.0`` checks without scaling). ``None`` turns scaling
        and skip-on-overflow off. Pass the same ``LossScaler`` to several trainers to share
        one scale.
    optimizer_or_trainer : mxnet.gluon.Trainer
        The peer's name for ``trainer``; give one of the two.
    """
    trainer = _one_trainer(trainer, optimizer_or_trainer, "init_trainer")
    if module_scaling.is_module(trainer):
        return module_scaling.init_module(trainer, loss_scale)
    if not isinstance(trainer, Trainer):
        raise TypeError(f"init_trainer expects a mxnet.gluon.Trainer, or a mx.mod.Module / BucketingModule, "
                        f"got {type(trainer).__name__}")
    scaler = loss_scaler_from(loss_scale)  # first: a bad argument is a ValueError, attached or not
    with _attaching:  # two threads asking at once: one attaches, the other gets its scaler
        if attached_scaler(trainer) is not None:
            hook = mxi.get_step_hook(trainer)
            if asks_for(hook.scaler, hook.requested, loss_scale, chose_default=hook.by_initialize):
                # asked again as before (scripts written for the peer call it per run or per epoch):
                # the scaler it has, its scale kept (the peer put in a fresh one, back at 2**16)
                return hook.scaler
            raise RuntimeError(f"this Trainer already has a loss scaler (from loss_scale={hook.requested!r}"
                               f"{', by gluon_amp.initialize' * hook.by_initialize}), and loss_scale="
                               f"{loss_scale!r} asks for another; use gluon_amp.get_scaler(trainer) to read or "
                               "change the one it has, or build a new Trainer.")
        on_kvstore = mxi.updates_on_kvstore(trainer)
        if mxi.has_sparse_weights(trainer):
            _check_kvstore_scaling(trainer, loss_scale)  # MXNet updates them on the kvstore only
        elif on_kvstore:
            raise ValueError("loss scaling needs the update on the worker: create the Trainer with "
                             "update_on_kvstore=False (got update_on_kvstore=True).")
        elif on_kvstore is None:
            _refuse_shared_accumulator(trainer)
            mxi.force_update_on_worker(trainer)
        hook = _Hook(trainer, scaler)
        hook.requested = loss_scale
        _update_patch.hold("trainers")
        mxi.set_step_hook(trainer, hook)
        state.register_scaler(hook)  # loss-output ops read the scale the step will use from it
    return scaler


#: held from the check that a trainer has no scaler to its attachment
_attaching = threading.Lock()


def _sparse_weights(trainer: Trainer) -> str:
    names = [p.name for p in mxi.trainer_params(trainer) if mxi.stored_sparse(p)]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _check_kvstore_scaling(trainer: Trainer, loss_scale: Any) -> None:
    """A trainer with sparse weights updates on the kvstore, inside ``step``'s push, before any
    check of the gradients could skip it: only the default scaler, which scales and checks
    float16 steps alone, may be attached (``scale_loss`` refuses a float16 step)."""
    if isinstance(loss_scale, str) and loss_scale == "dynamic" or loss_scale is None:
        return
    raise ValueError(
        f"init_trainer: this Trainer holds sparse weights ({_sparse_weights(trainer)}), which MXNet updates on "
        f"the kvstore inside step(), before a check could skip the update; loss_scale={loss_scale!r} checks "
        "every step. Use the default loss_scale='dynamic' (float32 and bfloat16 steps run as without AMP) "
        "or loss_scale=None, or give those layers dense weights (nn.Embedding(sparse_grad=True) keeps a "
        "dense weight).")


def _wrap_update(original: Any) -> Any:
    def _update(self: Trainer, ignore_stale_grad: bool = False) -> None:
        try:  # first: a Ctrl-C at any line after it is answered by _abort_update
            hook = mxi.get_step_hook(self)
            if not isinstance(hook, _Hook):
                return original(self, ignore_stale_grad)
            steps = hook.scaler.steps_of(hook)
            hook._armed, hook._ignore_stale = True, bool(ignore_stale_grad)
            original(self, ignore_stale_grad)
            hook._armed = hook._ignore_stale = False
            hook.finish_early()
        except BaseException:
            _abort_update(self, locals().get("steps"))
            raise

    _update.__wrapped__ = original
    return _update


def _abort_update(trainer: Trainer, steps: Optional[int]) -> None:
    hook = mxi.get_step_hook(trainer)
    if isinstance(hook, _Hook):
        hook.abort_step(steps)


#: ``Trainer._update`` wrapped while a trainer has a scaler (released by ``state.reset``): it
#: arms the step hook to update before its verdict, and reads that verdict after the update
_update_patch = state.Held(lambda: mxi.module.patch_methods(Trainer, {"_update": _wrap_update}),
                           mxi.module.restore_methods)
state.register_extension(state.Extension(lambda policy: None, lambda: None,
                                         lambda: _update_patch.release("trainers")))


def _hook_of(trainer: Trainer, caller: str) -> _Hook:
    if attached_scaler(trainer) is None:
        if _trainer_list(trainer):
            raise TypeError(f"{caller} takes one trainer, got a {type(trainer).__name__} of {len(trainer)} "
                            "(only scale_loss takes several: one loss over the networks of trainers that "
                            "share a scaler)")
        if not isinstance(trainer, Trainer):
            several = " (or a list of trainers that share one scaler)" if caller == "scale_loss" else ""
            raise TypeError(f"{caller} expects a mxnet.gluon.Trainer{several}, got {type(trainer).__name__} "
                            f"{_short(trainer)[len(type(trainer).__name__) + 1:]}")
        raise RuntimeError(f"{caller}: this Trainer has no loss scaler; call gluon_amp.init_trainer(trainer) first.")
    return mxi.get_step_hook(trainer)


def get_scaler(trainer: Trainer) -> LossScaler:
    """The :class:`LossScaler` attached to ``trainer`` (or a Module); ``RuntimeError`` if there is none."""
    if module_scaling.is_module(trainer):
        return module_scaling._checked_hook(trainer, "get_scaler").scaler
    return _hook_of(trainer, "get_scaler").scaler


def attached_scaler(trainer: Any) -> Optional[LossScaler]:
    """The :class:`LossScaler` attached to ``trainer``, or ``None``: the one place that asks."""
    if module_scaling.is_module(trainer):
        return module_scaling.attached_scaler(trainer)
    hook = mxi.get_step_hook(trainer) if isinstance(trainer, Trainer) else None
    return hook.scaler if isinstance(hook, _Hook) else None


@contextlib.contextmanager
def scale_loss(loss: Any, trainer: Union[Trainer, Sequence[Trainer], None] = None, *,
               optimizer_or_trainer: Optional[Trainer] = None) -> Iterator[Any]:
    """Yield ``loss`` (an NDArray or a list of them) multiplied by the step's loss scale.

    Call ``backward`` on what it yields. The next ``trainer.step`` divides the gradients by
    the same scale (folded into ``rescale_grad``), checks them and skips the update on
    inf/NaN. Several ``scale_loss``/``backward`` calls may precede one ``step``
    (gradient accumulation with ``grad_req='add'``); they share the scale the first chose.
    Where the scale is 1 (the default scaler outside float16) ``loss`` itself is yielded,
    so the gradients are exactly those of ``loss.backward()``.

    ``trainer`` may be a list or tuple of trainers that share one scaler (one loss over their
    networks, as PyTorch's one ``GradScaler`` with several optimizers): the first decides the
    scale, and each divides its gradients by it at its next ``step``.
    """
    trainer = _one_trainer(trainer, optimizer_or_trainer, "scale_loss")
    trainers = list(trainer) if _trainer_list(trainer) else [trainer]
    hooks = [_hook_of(t, "scale_loss") for t in trainers]
    _check_loss(loss)
    _check_one_scaler(hooks, trainers)
    if any(h.scaler.stage(h) is Stage.UNSCALED for h in hooks):
        raise RuntimeError("scale_loss after unscale(trainer) in the same step: the new gradients "
                           "would not be unscaled. Call unscale after the last backward.")
    hook, trainer = hooks[0], trainers[0]
    # All or nothing: a scale_loss whose block raises (a Ctrl-C included, wherever it lands)
    # is as if it never ran, as a batch skipped: the step's decision and the trainers' gradient
    # scales go back to what they were, so a later step without scale_loss is not divided by a
    # stale scale (the step also checks, see _Hook.has_overflow).
    before = [(h._decided, mxi.grad_scale(t)) for h, t in zip(hooks, trainers)]
    try:
        _, scale = hook.decide()
        if scale != 1.0:
            _refuse_kvstore_updates(trainers)
        state.register_scaler(hook)  # AMP turned on after init_trainer: loss-output ops find it from now on
        mxi.set_grad_scale(trainer, hook.original_scale / scale if scale != 1.0 else hook.original_scale)
        for other, other_trainer in zip(hooks[1:], trainers[1:]):
            other.take_scale(scale)
            mxi.set_grad_scale(other_trainer, other.original_scale / scale if scale != 1.0
                               else other.original_scale)
        if scale == 1.0:
            yield loss
        else:
            yield _scaled(loss, scale)  # after the block, no line of this function runs: none can be interrupted
    except BaseException:
        for h, t, (decided, grad_scale) in zip(hooks, trainers, before):
            h._decided = decided
            mxi.set_grad_scale(t, grad_scale)
        raise


def _refuse_kvstore_updates(trainers: Sequence[Trainer]) -> None:
    for t in trainers:
        if mxi.has_sparse_weights(t):
            raise RuntimeError(
                f"scale_loss: this step runs in float16 and scales the loss, but the Trainer holds sparse weights "
                f"({_sparse_weights(t)}), which MXNet updates on the kvstore inside step(), before a check of "
                "the gradients could unscale them or skip the update. Give those layers dense weights "
                "(nn.Embedding(sparse_grad=True) keeps a dense weight), train them in bfloat16 or float32, or "
                "attach the trainer with init_trainer(trainer, loss_scale=None) and call backward on the loss "
                "itself.")


def _trainer_list(trainer: Any) -> bool:
    return isinstance(trainer, (list, tuple)) and bool(trainer) and all(isinstance(t, Trainer) for t in trainer)


def _check_one_scaler(hooks: Sequence["_Hook"], trainers: Sequence[Trainer]) -> None:
    """``ValueError`` unless the trainers given together share one scaler (a loss has one scale)."""
    if len({id(h.scaler) for h in hooks}) > 1:
        raise ValueError(
            f"scale_loss: the {len(trainers)} trainers given have {len({id(h.scaler) for h in hooks})} "
            "loss scalers, and one loss has one scale. Give them one: scaler = gluon_amp.init_trainer(t0), "
            "then gluon_amp.init_trainer(t1, loss_scale=scaler) (before their first step); or scale each "
            "trainer's own loss through it.")
    if len(set(map(id, trainers))) < len(trainers):
        raise ValueError("scale_loss: a trainer is given twice in the list; give each once.")


def _check_loss(loss: Any) -> None:
    """A TypeError naming ``loss`` unless it is an array or a flat list or tuple of arrays (what
    ``backward`` takes), whatever the scale: a wrong loss fails in float32 as in float16."""
    items = loss if isinstance(loss, (list, tuple)) and loss else [loss]
    for item in items:
        if not isinstance(item, mx.nd.NDArray):  # mx.np.ndarray is a subclass
            where = "" if item is loss else f" (an item of the {type(loss).__name__} given: {type(item).__name__})"
            raise TypeError(
                f"scale_loss: the loss must be an NDArray (or mx.np.ndarray), or a list or tuple of them, "
                f"got {_short(loss)}{where}. Pass the loss array(s) your backward would take, computed inside "
                "autograd.record(): `with gluon_amp.scale_loss(loss, trainer) as scaled: scaled.backward()`.")


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _scaled(loss: Any, scale: float) -> Any:
    """``loss`` (an array, or a list or tuple of them) times ``scale``, recorded where ``loss``
    was: MXNet lets ``backward`` run outside ``autograd.record()`` on a loss recorded inside, and
    so must the scaled one (a multiplication made outside was no node of the graph: "Cannot
    differentiate node because it is not in a computational graph", in float16 only)."""
    with contextlib.nullcontext() if autograd.is_recording() else autograd.record(autograd.is_training()):
        if isinstance(loss, (list, tuple)):
            return type(loss)(x * scale for x in loss)
        return loss * scale


@contextlib.contextmanager
def _in_float32(grads: Sequence[mx.nd.NDArray]) -> Iterator[List[mx.nd.NDArray]]:
    """float32 stand-ins for bfloat16 gradients (O2/O3 weights), written back on exit.

    MXNet 1.9.1 has no bfloat16 kernel for in-place scaling or norms, and the op table's
    float32 casts break ``out=`` ("Type inconsistent, Provided = bfloat16").
    """
    grads = [mxi.legacy(g) for g in grads]  # amp_cast refuses numpy-mode arrays (views: writes shared)
    work = [mx.nd.amp_cast(g, dtype="float32") if g.dtype == mxi.BFLOAT16 else g for g in grads]
    yield work
    for g, w in zip(grads, work):
        if w is not g:
            mx.nd.amp_cast(w, dtype=mxi.BFLOAT16, out=g)


def _refuse_shared_accumulator(trainer: Trainer) -> None:
    """``ValueError`` for LBSGD with ``batch_scale > 1`` on several devices, where updating on
    the worker (what loss scaling needs, and ``init_trainer`` sets) breaks it: 1.9.1's LBSGD
    keys the gradients it sums by parameter index, so the devices' updaters share one sum, and
    one device's copy of the weights never updates while another's updates every step."""
    opt = mxi.trainer_optimizer(trainer)
    if not (isinstance(opt, mx.optimizer.LBSGD) and getattr(opt, "batch_scale", 1) > 1):
        return
    devices = {str(c) for p in mxi.trainer_params(trainer) for c in mxi.param_contexts(p)}
    if len(devices) > 1:
        raise ValueError(
            f"init_trainer: LBSGD with batch_scale={opt.batch_scale} on {len(devices)} devices "
            f"({', '.join(sorted(devices))}): loss scaling updates on the worker, where MXNet 1.9.1's "
            "LBSGD sums every device's gradients into one accumulator, so one device's weights never "
            "update. Train it on one device, or with batch_scale=1 (accumulate with grad_req='add' instead), "
            "or leave init_trainer out (bfloat16 and float32 steps need no loss scaling; the Trainer then "
            "updates on its kvstore).")


def _must_unscale_first(trainer: Trainer, hook: _Hook, scale: float) -> bool:
    """Whether this step's loss scale cannot fold into ``rescale_grad``, so that the step
    unscales its gradients instead (the peer folds it always):

    - LBSGD with ``batch_scale > 1`` (1.9.1) sums raw gradients over its macro-batch and
      divides once by the last step's ``rescale_grad``: a scale that moved in between (a
      skipped step, a growth) weighed the steps unequally, 3% off FP32 in 6 steps;
    - MXNet's kernels updating a float16 weight without a float32 master copy take
      ``rescale_grad`` as a float16 value, and ``1 / (65536 * 1024)`` is 0 there: every step
      lost, silently."""
    if scale == 1.0 or hook.scaler.stage(hook) is Stage.UNSCALED:
        return False
    from .master_weights import MasterWeightUpdater
    opt = mxi.trainer_optimizer(trainer)
    if isinstance(opt, mx.optimizer.LBSGD) and getattr(opt, "batch_scale", 1) > 1:
        return True
    if getattr(opt, "multi_precision", False) or not opt.rescale_grad < FLOAT16_SMALLEST_NORMAL:
        return False
    if any(isinstance(u, MasterWeightUpdater) for u in mxi.trainer_updaters(trainer)):
        return False  # O2's updates run on float32 masters
    return any(dtype_name(p.dtype) == "float16" for p in mxi.trainer_params(trainer) if p.grad_req != "null")


def unscale(trainer: Optional[Trainer] = None, *, optimizer_or_trainer: Optional[Trainer] = None) -> None:
    """Divide the gradients by the loss scale now, in place (e.g. before clipping).

    Once per step: a second call before ``trainer.step`` raises ``RuntimeError``.
    """
    trainer = _one_trainer(trainer, optimizer_or_trainer, "unscale")
    hook = _hook_of(trainer, "unscale")
    step = hook._step
    hook.scaler.mark_unscaled(hook)
    inv = 1.0 / step[1] if step is not None else 1.0  # 1/loss_scale when scale_loss ran, else 1
    if inv != 1.0:
        with autograd.pause():
            for grads in overflow.grads_by_context(mxi.trainer_params(trainer), stored=False).values():
                with _in_float32(grads) as work:
                    for g in work:
                        g *= inv  # a sparse gradient in place too (its .data is a copy)
    mxi.set_grad_scale(trainer, hook.original_scale)


def clip_global_norm(trainer: Trainer, max_norm: float) -> float:
    """Unscale (if not done yet) and clip all gradients to a global L2 norm ``max_norm``.

    Each context's gradient copy is clipped on its own. Returns the largest norm before
    clipping; a non-finite norm leaves the gradients alone for ``step`` to skip (a step AMP kept
    all in float32, which is otherwise not checked, included).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    hook = _hook_of(trainer, "clip_global_norm")
    if hook.scaler.stage(hook) is not Stage.UNSCALED:
        unscale(trainer)
    norms: List[float] = []
    with autograd.pause():
        for grads in overflow.grads_by_context(mxi.trainer_params(trainer), stored=False).values():
            with _in_float32(grads) as work:
                norm = mx.gluon.utils.clip_global_norm(work, max_norm, check_isfinite=False)
            norms.append(float(norm.asscalar() if isinstance(norm, mx.nd.NDArray) else norm))
    if not all(math.isfinite(n) for n in norms):
        hook._must_check = True  # what this function promises: step skips it
    return max(norms) if norms else 0.0


def record_opt_level(trainer: Trainer, level: str, chose_scale: bool = True) -> None:
    """Remember the opt level ``gluon_amp.initialize`` set ``trainer`` up at (checkpoints'
    metadata); ``chose_scale``: the level chose its loss scale (none was given)."""
    state.trainer_record(trainer).opt_level = level
    hook = mxi.get_step_hook(trainer)
    if isinstance(hook, _Hook) and chose_scale:  # the level's scaler: init_trainer(trainer) asked later returns it
        hook.by_initialize = True


def _mode(trainer: Trainer) -> Dict[str, Any]:
    """The mixed-precision mode a checkpoint was written in."""
    from .master_weights import MasterWeightUpdater
    policy = state.current_policy()
    updater = mxi.trainer_updaters(trainer)[0] if mxi.trainer_updaters(trainer) else None
    master = ({"dtype": updater.dtype, "keep_master": updater.keep_master}
              if isinstance(updater, MasterWeightUpdater) else None)
    return {"target_dtype": policy.target_dtype if policy else None, "emulate": bool(policy and policy.emulate),
            "master_weights": master, "opt_level": state.trainer_record(trainer).opt_level}


def save_states(trainer: Trainer, fname: str) -> None:
    """Save the trainer's optimizer states, its optimizer's settings and its loss scaler to
    one file (see :mod:`gluon_amp.training.checkpoint`: no pickle, written atomically).
    A Module's: :func:`gluon_amp.training.module.save_states`."""
    if module_scaling.is_module(trainer):
        return module_scaling.save_states(trainer, fname)
    hook = _hook_of(trainer, "save_states")
    mxi.init_kvstore_now(trainer)
    updater = mxi.trainer_updaters(trainer)[0]
    checkpoint.write(fname, {"scaler": hook.scaler.state_dict(), "mode": _mode(trainer)},
                     mxi.updater_states(updater), mxi.trainer_optimizer(trainer), mxi.param_specs(trainer))


def load_states(trainer: Trainer, fname: str, *, trusted: bool = False) -> None:
    """Load what :func:`save_states` wrote into ``trainer`` and its scaler.

    Nothing from the file is executed. Files written by older gluon_amp versions are
    pickles: they load only with ``trusted=True`` (it runs pickle; only for files you
    trust), or after ``python -m gluon_amp.training.checkpoint upgrade OLD NEW``.
    """
    if module_scaling.is_module(trainer):
        return module_scaling.load_states(trainer, fname)
    hook = _hook_of(trainer, "load_states")
    if not isinstance(trusted, bool):
        raise TypeError(f"trusted must be True or False, got {trusted!r}")
    fname = checkpoint.checked_path(fname, "load_states")
    if trusted and os.path.isfile(fname) and not zipfile.is_zipfile(fname):
        with tempfile.TemporaryDirectory() as tmp:
            # read once, trusted, as the upgrade command reads it; then checked as any current file
            upgraded = os.path.join(tmp, "upgraded.states")
            checkpoint.upgrade(fname, upgraded)
            _load_checked(trainer, hook, checkpoint.read(upgraded), fname)
        return
    _load_checked(trainer, hook, checkpoint.read(fname), fname)


def _load_checked(trainer: Trainer, hook: _Hook, ck: Any, fname: str) -> None:
    """Load ``ck`` (read from ``fname``) into ``trainer`` and its scaler, all or nothing:
    everything is checked first (the scaler's values, the state tree against this trainer's
    parameters, the optimizer and the mode); then the optimizer, the updaters' states and the
    scaler change, undone if that is interrupted."""
    _check_mode(trainer, ck.meta.get("mode") or {}, fname)
    scaler = checkpoint.checked_scaler_state(hook.scaler, ck.meta["scaler"], fname)
    moved = checkpoint.check_params(ck, fname, mxi.param_specs(trainer), build_order=True)
    fields = checkpoint.reindexed_fields(
        checkpoint.check_optimizer(mxi.trainer_optimizer(trainer), ck.meta["optimizer"], fname), moved)
    if ck.holds_optimizer_arrays:  # on the first parameter's device (read only then: it may be uninitialized)
        params = mxi.trainer_params(trainer)
        fields["optimizer"].update(ck.optimizer_arrays(params[0].list_ctx()[0] if params else mx.cpu(), moved))
    mxi.init_kvstore_now(trainer)  # what the first step does anyway; the updaters exist from here
    states = iter([checkpoint.reindexed(ck.states(mx.cpu()), moved) for _ in mxi.trainer_updaters(trainer)])
    opt = mxi.trainer_optimizer(trainer)
    undo = checkpoint.Undo(opt, hook.scaler, mxi.updaters_snapshot(trainer))
    try:
        checkpoint.restore_optimizer(opt, fields)
        mxi.set_updater_states(trainer, lambda: next(states))
        vars(hook.scaler).update(scaler)
    except BaseException:
        undo(trainer)
        raise


def _check_mode(trainer: Trainer, saved: Dict[str, Any], fname: str) -> None:
    from .master_weights import MasterWeightUpdater
    if saved.get("module"):
        raise checkpoint.CheckpointError(
            f"{fname!r} holds a Module's optimizer state (gluon_amp.save_states(module, ...)); a Gluon "
            "Trainer cannot load it: load it into the Module, or a checkpoint saved from a Trainer")
    master = saved.get("master_weights")
    if master and master.get("keep_master") and not isinstance(mxi.trainer_updaters(trainer)[0], MasterWeightUpdater):
        raise checkpoint.CheckpointError(
            f"{fname!r} was saved with float32 master weights ({saved.get('opt_level') or 'O2'}, "
            f"{master['dtype']}); set the trainer up the same way (gluon_amp.initialize(net, trainer, "
            f"{saved.get('opt_level') or 'O2'!r}, ...)) before load_states")
