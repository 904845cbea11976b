"""A step that dispatches its update before the overflow verdict, and undoes it if skipped.

Checking the gradients before the update makes Python wait for the backward pass, and
only then dispatch the updates: the engine idles while it does. On a small model that is
most of AMP's cost (a GluonTS-style LSTM: 0.87x FP32). So for a trainer whose weights and
optimizer states are small (:data:`MAX_BYTES`), a step dispatches, in this order: the
sums of squares of its float32 gradients (one ``multi_sum_sq`` per context), a copy of
every weight and optimizer state, and MXNet's own updates; then it reads the sums on the
host while the engine updates. A finite sum proves its gradients finite; otherwise, and
for gradients of other dtypes, the values are checked one by one (:mod:`.overflow`). A
skipped step gets its copies back, its optimizer's update counts and its arrays' fresh
gradient flags: bit for bit what a step that never updated leaves.

Only where the undo is exact and local (:func:`begin` lists the conditions); every other
trainer waits for its verdict as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np
from mxnet import autograd
from mxnet.gluon import Parameter, Trainer

from .. import mxnet_internals as mxi
from . import overflow

#: Weights and optimizer states (bytes) up to which a step updates before its verdict. Each
#: step copies them (one more copy held in memory). Measured on a 2-core AMD EPYC (flags
#: avx2; ``Dense`` stacks, SGD with momentum, early against waiting in one process): 0.5 MB
#: 1.31x faster, 2 MB 0.95x, 6 MB 0.90x, 16 MB 0.75x: the copies outgrow the wait they save.
MAX_BYTES = 1 << 20
#: arrays per ``multi_sum_sq`` call
_CHUNK = 256
#: plans kept per trainer or module: a BucketingModule's buckets share their weights' memory
#: but each holds its own NDArrays, so switching bucket would otherwise build a plan and its
#: copies again (about 1 ms for 36 arrays, as much as the wait it saves)
PLANS_KEPT = 8
#: MXNet's own ops, not AMP's patched ones (bookkeeping, not the model's compute)
_SUM_SQ = mxi.original_function(mx.nd.multi_sum_sq)
_MULTICAST = mxi.original_function(mx.nd.amp_multicast)

class Saved:
    """The copies of one context's arrays of one dtype. float32 ones are copied by one
    ``amp_multicast`` (a copy per array costs a dispatch each, 30 us, more than the copy);
    MXNet's operator reads and writes them whatever oneDNN layout they are in (a reshaped
    view would not follow an array that inference reordered in place). Other dtypes (whose
    ``amp_multicast`` on a CPU goes to oneDNN, which has no float16) one copy each."""

    def __init__(self, live: Sequence[mx.nd.NDArray]) -> None:
        self.live = list(live)
        self.copies = [mx.nd.empty(a.shape, ctx=a.ctx, dtype=a.dtype) for a in self.live]
        self.together = self.live[0].dtype == np.float32

    def save(self) -> None:
        self._copy(self.live, self.copies)

    def restore(self) -> None:
        self._copy(self.copies, self.live)

    def _copy(self, src: List[mx.nd.NDArray], dst: List[mx.nd.NDArray]) -> None:
        if self.together:
            _MULTICAST(*src, num_outputs=len(src), out=dst)
        else:
            for a, b in zip(src, dst):
                a.copyto(b)


class Plan:
    """What a trainer's early steps dispatch, built once for its arrays (each NDArray
    property read is a C call: a step reads none of them while the arrays stay the same):
    the float32 gradients summed per context, the other gradients, the copies."""

    def __init__(self, weights: Sequence[mx.nd.NDArray], grads: Sequence[mx.nd.NDArray],
                 states: Sequence[mx.nd.NDArray]) -> None:
        self.arrays = (tuple(weights), tuple(grads), tuple(states))  # alive while kept: their ids key it
        # MXNet's legacy ops below refuse numpy-mode (npx.set_np) arrays: zero-copy views
        weights, grads, states = ([mxi.legacy(a) for a in arrays] for arrays in self.arrays)
        live = list(weights) + list(states)
        self.usable = all(a.stype == "default" for a in live + list(grads))
        self.nbytes = sum(a.size * np.dtype(a.dtype).itemsize for a in live) if self.usable else 0
        self.sums: List[List[mx.nd.NDArray]] = []
        self.others: Dict[mx.Context, List[mx.nd.NDArray]] = {}
        by_ctx: Dict[mx.Context, List[mx.nd.NDArray]] = {}
        for g in grads if self.usable else ():
            if g.dtype == np.float32 and g.size:
                by_ctx.setdefault(g.ctx, []).append(g)
            else:
                self.others.setdefault(g.ctx, []).append(g)
        for plain in by_ctx.values():
            self.sums += [plain[i:i + _CHUNK] for i in range(0, len(plain), _CHUNK)]
        self._groups: Dict[Tuple[mx.Context, str], List[mx.nd.NDArray]] = {}
        for a in live if self.usable else ():
            if a.size:
                self._groups.setdefault((a.ctx, np.dtype(a.dtype).name), []).append(a)
        self._saved: Optional[List[Saved]] = None

    @property
    def saved(self) -> List[Saved]:
        """The copies, allocated at the first step that makes them."""
        if self._saved is None:
            self._saved = [Saved(arrays) for arrays in self._groups.values()]
        return self._saved


def _key(weights: Sequence[mx.nd.NDArray], grads: Sequence[mx.nd.NDArray],
         states: Sequence[mx.nd.NDArray]) -> Tuple[Tuple[int, ...], ...]:
    """The arrays' identities: a kept plan holds its arrays, so no other array takes their ids."""
    return tuple(map(id, weights)), tuple(map(id, grads)), tuple(map(id, states))


@dataclass
class Early:
    """One step's update in flight: what proves it finite and what undoes it."""

    sums: List[mx.nd.NDArray]
    sums_of: List[List[mx.nd.NDArray]]
    others: Dict[mx.Context, List[mx.nd.NDArray]]
    saved: List[Saved]
    optimizer: object
    counters: object
    fresh: List[mx.nd.NDArray]

    def finite(self) -> bool:
        """Whether every gradient of the step is finite (waits for the sums only)."""
        for sums, grads in zip(self.sums, self.sums_of):
            with np.errstate(all="ignore"):
                if not np.isfinite(sums.asnumpy()).all() and not overflow.arrays_finite({grads[0].ctx: grads}):
                    return False
        return not self.others or overflow.arrays_finite(self.others)

    def undo(self, fresh: bool = True) -> None:
        """Put back what the update changed (idempotent: it may run again after an interrupt);
        the fresh gradient flags too unless ``fresh`` is False (the step raised in MXNet's loop,
        which clears each one it passes: as without AMP, those gradients are spent)."""
        with autograd.pause():
            for saved in self.saved:
                saved.restore()
        mxi.set_optimizer_counters(self.optimizer, self.counters)
        for array in self.fresh if fresh else ():
            mxi.set_fresh_grad(array, True)


def begin(trainer: Trainer, params: Sequence[Parameter], plans: Dict[str, Any]) -> Optional[Early]:
    """Dispatch the sums and the copies of a step that updates before its verdict, and return
    it; None (nothing dispatched) where the step must wait for its verdict instead: a dist
    kvstore or Horovod (the verdict is every worker's), an optimizer or updater whose update cannot
    be undone exactly, states not made or not yet on their context, sparse arrays, or more
    than :data:`MAX_BYTES` to copy. ``plans`` keeps, between steps, the trainer's plans
    (``"plans"``; dropped, with their copies, where there is none) or that it is too big."""
    known = plans.get("too big")
    if known is not None and known == (id(params), len(params), MAX_BYTES):
        return None  # a trainer too big for its copies stays so (checked again if that changes)
    arrays = _arrays(trainer, params)
    if arrays is None:
        plans.clear()
        return None
    early = _dispatch(*arrays, mxi.trainer_optimizer(trainer), plans)
    if early is None and not plans.get("plans") and plans.get("size") is not None:
        plans["too big"] = (id(params), len(params), MAX_BYTES)
    return early


def begin_module(module: Any, plans: Dict[str, Any]) -> Optional[Early]:
    """:func:`begin` for a ``mx.mod.Module``'s ``update``: the same conditions (no kvstore;
    MXNet's optimizer and ``Updater``; states made; dense; small), and not an SVRGModule,
    whose update mixes in another module's gradients."""
    mxm = mxi.module
    found = mxm.module_update_arrays(module)
    opt = mxm.module_optimizer(module)
    updater = mxm.module_updater(module) if found is not None else None
    if (found is None or mxm.auxiliary_modules(module) or not mxi.undoable_optimizer(opt)
            or type(updater) is not mx.optimizer.Updater):
        plans.clear()
        return None
    weights, grads, indices = found
    ready = mxi.ready_states(updater, indices)
    if ready is None:
        plans.clear()
        return None
    states: List[mx.nd.NDArray] = []
    _leaves(ready, states)
    return _dispatch(weights, grads, states, opt, plans, fresh=False)


def _dispatch(weights: List[mx.nd.NDArray], grads: List[mx.nd.NDArray], states: List[mx.nd.NDArray],
              opt: Any, plans: Dict[str, Any], fresh: bool = True) -> Optional[Early]:
    """The sums and copies of the plan for these arrays (``plans["plans"]``: the last
    :data:`PLANS_KEPT` used, by their arrays' identities; made if new); None where it cannot
    run early (``plans["size"]`` then says whether size was the reason)."""
    plans.pop("size", None)
    kept: Dict[Tuple[Tuple[int, ...], ...], Plan] = plans.setdefault("plans", {})
    key = _key(weights, grads, states)
    plan = kept.pop(key, None)
    if plan is None:
        plan = Plan(weights, grads, states)
        if not plan.usable:
            return None
        if plan.nbytes > MAX_BYTES:
            plans["size"] = plan.nbytes
            return None
        while len(kept) >= PLANS_KEPT:
            del kept[next(iter(kept))]  # the least recently used, with its copies
    if plan.nbytes > MAX_BYTES:
        plans.clear()
        return None
    kept[key] = plan  # the most recently used last
    with autograd.pause():
        sums = [_SUM_SQ(*chunk, num_arrays=len(chunk)) for chunk in plan.sums]
        for saved in plan.saved:
            saved.save()
    flags = [w for w in weights if mxi.fresh_grad(w)] if fresh else []
    return Early(sums, plan.sums, plan.others, plan.saved, opt, mxi.optimizer_counters(opt), flags)


def _arrays(trainer: Trainer, params: Sequence[Parameter]) -> Optional[Tuple[List[mx.nd.NDArray], ...]]:
    """(weights, gradients, optimizer states) an update reads or writes, or None where an
    early step cannot undo it exactly."""
    kv = mxi.trainer_kvstore(trainer)
    # a local kvstore only sums the devices' gradients before the update (the trainer updates on
    # the worker: init_trainer sees to it); a dist one's verdict is every worker's
    if ((kv is not None and (not isinstance(kv, mx.kvstore.KVStore) or "dist" in kv.type))
            or mxi.horovod_process_set(trainer) is not None
            or not mxi.undoable_optimizer(mxi.trainer_optimizer(trainer)) or not mxi.plain_updaters(trainer)):
        return None
    indices = [i for i, p in enumerate(params) if mxi.has_grad(p)]
    weights: List[mx.nd.NDArray] = []
    grads: List[mx.nd.NDArray] = []
    for i in indices:
        weights.extend(params[i].list_data())
        grads.extend(params[i].list_grad())
    states: List[mx.nd.NDArray] = []
    for updater in mxi.trainer_updaters(trainer):
        ready = mxi.ready_states(updater, indices)
        if ready is None:
            return None
        _leaves(ready, states)
    return weights, grads, states


def _leaves(state: object, out: List[mx.nd.NDArray]) -> None:
    if isinstance(state, mx.nd.NDArray):
        out.append(state)
    elif isinstance(state, (list, tuple)):
        for s in state:
            _leaves(s, out)
