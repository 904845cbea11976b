"""Float32 master copies of low-precision weights, kept inside the optimizer state.

MXNet 1.9.1's optimizers keep a float32 master copy only for float16 weights
(``multi_precision=True``); a bfloat16 weight is updated in bfloat16, and every update
smaller than half its last bit (1/256 of the weight) is lost. Here the Trainer's updaters
are replaced by :class:`MasterWeightUpdater`: for a weight in the low-precision dtype the
optimizer state becomes ``MasterState(master, inner)``, the wrapped optimizer's ordinary
update runs on the float32 ``master`` with a float32 gradient, and the result is cast back
into the weight. Any optimizer whose ``update`` works on float32 arrays is covered (SGD,
NAG, Adam, ...), with no change to the optimizer object the user built.

The master copies live in the updater's ``states``, which ``Trainer.save_states`` pickles
and ``Trainer.load_states`` restores, so checkpoints (and ``gluon_amp.save_states``) carry
them and a resumed run continues bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import Trainer
from mxnet.optimizer import Optimizer, Updater

from .. import mxnet_internals as mxi
from gluon_amp_core.dtypes import dtype_name
from ..mxnet_internals import to_mx_dtype, trainer_params

__all__ = ["MasterState", "MasterWeightUpdater", "install", "master_copies"]


# MXNet internals (optimizer, updaters) come from mxnet_internals.



@dataclass
class MasterState:
    """Optimizer state of one low-precision weight: its float32 copy and the inner state."""

    master: mx.nd.NDArray
    inner: Any


def _as_lists(index: Any, grad: Any, weight: Any) -> Tuple[list, list, list]:
    if isinstance(index, (list, tuple)):
        return list(index), [mxi.legacy(g) for g in grad], [mxi.legacy(w) for w in weight]
    return [index], [mxi.legacy(grad)], [mxi.legacy(weight)]


class MasterWeightUpdater(Updater):
    """An ``mxnet.optimizer.Updater`` that keeps float32 master copies of ``dtype`` weights.

    Weights of any other dtype take MXNet's ordinary path, unchanged.

    Parameters
    ----------
    optimizer : mxnet.optimizer.Optimizer
        The trainer's optimizer; its ``update`` runs on the float32 copies.
    dtype : str
        The low-precision weight dtype, ``'bfloat16'`` (or ``'float16'``).
    keep_master : bool
        ``False`` keeps no copy: each step computes the update in float32 from the
        low-precision weight and rounds it back (O3). MXNet 1.9.1 has no bfloat16 optimizer
        kernels, so a bfloat16 weight needs this even without master weights.
    """

    def __init__(self, optimizer: Optimizer, dtype: str, keep_master: bool = True) -> None:
        super().__init__(optimizer)
        self.dtype = dtype_name(dtype)
        self.keep_master = keep_master

    def __call__(self, index: Any, grad: Any, weight: Any) -> None:
        indices, grads, weights = _as_lists(index, grad, weight)
        low = [k for k, w in enumerate(weights) if dtype_name(w.dtype) == self.dtype]
        if len(low) < len(indices):
            keep = sorted(set(range(len(indices))) - set(low))
            super().__call__([indices[k] for k in keep], [grads[k] for k in keep],
                             [weights[k] for k in keep])
        if low:
            self._update_low([indices[k] for k in low], [grads[k] for k in low],
                             [weights[k] for k in low])

    def _state_for(self, idx: Any, weight: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Any]:
        """The float32 weight to update and the inner optimizer state, for one weight."""
        state = self.states.get(idx)
        if state is not None and not self.states_synced.get(idx, True):
            state = self.sync_state_context(state, weight.ctx)
        if isinstance(state, MasterState):
            master, inner = (state.master, state.inner) if self.keep_master else (None, state.inner)
        else:
            # New weight, a state saved without master copies (an O1 or O3 checkpoint
            # resumed under O2), or no master kept (O3): start from the weight itself.
            master, inner = None, state
        if master is None:
            master = mx.nd.amp_cast(weight, dtype="float32")
        if inner is None and idx not in self.states:
            inner = self.optimizer.create_state_multi_precision(idx, master)
        self.states[idx] = MasterState(master, inner) if self.keep_master else inner
        self.states_synced[idx] = True
        return master, inner

    def _update_low(self, indices: list, grads: list, weights: list) -> None:
        opt = self.optimizer
        mxi.set_optimizer_context(opt, weights[0].ctx)
        with autograd.pause():
            pairs = [self._state_for(i, w) for i, w in zip(indices, weights)]
            masters = [m for m, _ in pairs]
            inners = [st for _, st in pairs]
            grads32 = [mx.nd.amp_cast(g, dtype="float32") for g in grads]
            step = max(int(opt.aggregate_num), 1) if self.aggregate_updates else 1
            for s in range(0, len(indices), step):
                if step == 1:
                    opt.update_multi_precision(indices[s], masters[s], grads32[s], inners[s])
                else:
                    sl = slice(s, s + step)
                    opt.update_multi_precision(indices[sl], masters[sl], grads32[sl], inners[sl])
            low = to_mx_dtype(self.dtype)
            for m, w in zip(masters, weights):
                mx.nd.amp_cast(m, dtype=low, out=w)

    def sync_state_context(self, state: Any, context: mx.Context) -> Any:
        if isinstance(state, MasterState):
            return MasterState(state.master.as_in_context(context),
                               super().sync_state_context(state.inner, context))
        return super().sync_state_context(state, context)


def install(trainer: Trainer, dtype: str, keep_master: bool = True) -> None:
    """Make ``trainer`` update its ``dtype`` weights in float32.

    With ``keep_master``, float16 uses MXNet's own ``multi_precision`` and bfloat16 (which
    MXNet does not cover) a :class:`MasterWeightUpdater`. Without it, float16 is left to
    MXNet's float16 kernels and bfloat16 gets a :class:`MasterWeightUpdater` that keeps no
    copy. Call it before the first ``trainer.step``.
    """
    name = dtype_name(dtype)
    opt = mxi.trainer_optimizer(trainer)
    if name == "float16":
        if keep_master:
            opt.multi_precision = True
        return
    mxi.set_trainer_updaters(trainer, [MasterWeightUpdater(opt, name, keep_master)
                                   for _ in mxi.trainer_updaters(trainer)])


def master_copies(trainer: Trainer) -> Dict[str, mx.nd.NDArray]:
    """``{parameter name: float32 master copy}`` kept by :class:`MasterWeightUpdater`.

    First context only; empty before the first step and for float16 (whose copies live in
    MXNet's own ``multi_precision`` state).
    """
    params = trainer_params(trainer)
    return {params[idx].name: state.master
            for idx, state in mxi.trainer_updaters(trainer)[0].states.items()
            if isinstance(state, MasterState)}
