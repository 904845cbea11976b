"""Keep workers in step: one reduced finite flag and loss-scale check per step.

With ``Trainer.step`` the gradients are already reduced when the overflow check runs, so
every worker sees the same inf/NaN. That stops being true when the check sees gradients
before they meet (``trainer.update()`` without ``allreduce_grads()``) or when one scaler
serves a distributed and a local trainer. :func:`agree_finite` makes the decision a
collective one: each worker sends ``[not finite, scale, scale**2]``, one tiny sum comes
back, and every worker skips if any worker saw inf/NaN. The two scale sums also reveal
workers whose scales differ (a checkpoint restored on one rank only), which would
otherwise mix gradients multiplied by different scales without a sign.
"""
from __future__ import annotations

import sys
import warnings

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mxnet as mx
import numpy as np
from mxnet.gluon import Trainer

from .. import mxnet_internals as mxi, state

# A dist kvstore key of our own. ps-lite picks the server with ``key * 9973`` in a C int,
# so the key must stay below 2**31 / 9973; Trainer uses keys 0..len(params)-1.
FLAG_KEY = 214_000
# Module's kvstore keys are its parameter names, and a kvstore refuses mixed key types.
MODULE_FLAG_KEY = "gluon_amp_finite_flag"

_EPS32 = float(np.finfo(np.float32).eps)
_Reduce = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Engine:
    """How a trainer's gradients meet across processes."""

    name: str
    workers: int
    reduce: _Reduce  # sums a small float32 vector over the workers; same result on each
    kvstore: bool = False


def _kvstore_reduce(kv: Any, key: Any = FLAG_KEY) -> _Reduce:
    def reduce(values: np.ndarray) -> np.ndarray:
        # float32, like the gradients: on MXNet 1.9.1's dist_sync server a float64 key
        # corrupted the summed float32 gradients of the other keys.
        arr = mx.nd.array(values, dtype="float32")
        if kv not in state.process.done:  # collective: every worker reaches here on the same step
            kv.init(key, mx.nd.zeros_like(arr))
            state.process.done.add(kv)
        kv.pushpull(key, arr, out=arr)
        return arr.asnumpy()
    return reduce


def _horovod_reduce(hvd: Any, process_set: Any) -> _Reduce:
    def reduce(values: np.ndarray) -> np.ndarray:
        out = hvd.allreduce(mx.nd.array(values, dtype="float32"), op=hvd.Sum,
                            name="gluon_amp.agree_finite", process_set=process_set)
        return out.asnumpy()
    return reduce


def _from_horovod(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "horovod"


def engine_of(trainer: Trainer) -> Optional[Engine]:
    """The cross-process engine of ``trainer``, or None when its gradients stay in this process.

    Recognised: a native ``dist_*`` kvstore with more than one worker, and Horovod's
    ``DistributedTrainer`` with more than one process in its process set.
    """
    kv = mxi.trainer_kvstore(trainer)
    if isinstance(kv, mx.kvstore.KVStore) and "dist" in kv.type and kv.num_workers > 1:
        return Engine(f"the {kv.type} kvstore", kv.num_workers, _kvstore_reduce(kv), kvstore=True)
    process_set = mxi.horovod_process_set(trainer)
    if _from_horovod(trainer) and process_set is not None and "horovod.mxnet" in sys.modules:
        if process_set.size() > 1 and process_set.included():
            hvd = sys.modules["horovod.mxnet"]
            return Engine("Horovod", process_set.size(), _horovod_reduce(hvd, process_set))
    return None


def init_kvstore(trainer: Trainer) -> None:
    """Create ``trainer``'s kvstore and broadcast rank 0's weights now, then wait for them.

    Call it once on every worker after the parameters are initialised and before the first
    ``trainer.step``, whenever the kvstore is ``dist_sync``/``dist_device_sync``. Otherwise
    MXNet 1.9.1 broadcasts the weights inside the first step, and that pull races with the
    first gradient push of the same key: a server that has summed the gradients first
    answers the pull with that sum, and every worker silently starts from the summed
    gradients instead of the weights (3 of 32 runs with 2 workers on loopback here).
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"init_kvstore expects a mxnet.gluon.Trainer, got {type(trainer).__name__}")
    deferred = mxi.deferred_param_names(trainer)
    if deferred:
        raise RuntimeError(f"init_kvstore: parameters {deferred} are not initialised yet (deferred "
                           "shapes); run one forward pass, then call init_kvstore before backward.")
    mxi.init_kvstore_now(trainer)
    mx.nd.waitall()
    state.trainer_record(trainer).kvstore_ready = True


def _refuse_horovod_optimizer(trainer: Trainer) -> None:
    opt = mxi.trainer_optimizer(trainer)
    if _from_horovod(opt) and type(opt).__name__ == "DistributedOptimizer":
        raise RuntimeError(
            "gluon_amp cannot scale losses through horovod.mxnet.DistributedOptimizer inside a "
            "gluon Trainer: the Trainer sets rescale_grad on the wrapper, not on the optimizer it "
            "wraps, so gradients would stay multiplied by the loss scale (and by the batch size), "
            "and its allreduce runs after the overflow check. Use "
            "hvd.DistributedTrainer(params, optimizer, optimizer_params) instead.")


def _check_shared_scaler(trainer: Trainer, scaler: Any, engine: Optional[Engine]) -> None:
    record, kind = state.trainer_record(trainer), (engine.name if engine else "local", scaler)
    if record.kind is not None and record.kind[0] == kind[0] and record.kind[1] is scaler:
        # checked when this trainer's kind was set, and by every trainer's since: a conflict
        # needs a new kind, and its own first step raises
        return
    record.kind = kind
    kinds = {r.kind[0] for r in list(state.process.trainers.values()) if r.kind is not None and r.kind[1] is scaler}
    if "local" in kinds and len(kinds) > 1:
        spread = sorted(kinds - {"local"})
        raise RuntimeError(
            f"one LossScaler is shared by a trainer that reduces gradients over {', '.join(spread)} "
            "and by a trainer whose gradients stay in this process: the local trainer's overflows "
            "would move the scale on one worker only. Give the local trainer its own scaler "
            "(gluon_amp.init_trainer(trainer) without passing the shared one) or build it on the "
            "same distributed kvstore.")


def _check_kvstore(trainer: Trainer) -> None:
    if mxi.compression_params(trainer):
        raise RuntimeError(
            f"loss scaling cannot run over a kvstore with gradient compression "
            f"({mxi.compression_params(trainer)!r}): 2-bit compression turns the inf/NaN the overflow "
            "check looks for into +-threshold, and would quantise the workers' finite flags too. "
            "Create the Trainer without compression_params, or without loss scaling "
            "(gluon_amp.init_trainer(trainer, None)).")
    record = state.trainer_record(trainer)
    if not record.kvstore_ready:
        record.kvstore_ready = True  # warn once
        # stacklevel: agree_finite <- has_overflow <- Trainer._update <- step/update <- user
        warnings.warn("this Trainer's first step broadcast the weights over a dist kvstore while "
                      "pushing gradients; MXNet 1.9.1 can answer that broadcast with the summed "
                      "gradients. Call gluon_amp.init_kvstore(trainer) before the first "
                      "step.", RuntimeWarning, stacklevel=6)


def _check_same_scale(engine: Engine, scale: float, total: float, squares: float) -> None:
    # All scales equal <=> n * sum(s^2) == (sum s)^2 (exact for powers of two; the tolerance
    # covers float32 rounding of other static scales). Every worker reaches the same verdict.
    n = engine.workers
    if abs(n * squares - total * total) > 8 * n * _EPS32 * total * total:
        raise RuntimeError(
            f"the loss scale differs between the {n} workers of {engine.name} (this worker: "
            f"{scale:g}, mean: {total / n:g}); their gradients would be summed at different scales. "
            "Restore checkpoints on every rank with gluon_amp.load_states(trainer, fname) and give "
            "every rank the same LossScaler settings.")


def agree_finite(trainer: Trainer, scaler: Any, finite: bool) -> bool:
    """Return whether every worker of ``trainer`` (whose loss scaler is ``scaler``) saw finite
    gradients this step.

    Collective for distributed trainers: all workers must call it on the same step (every
    ``trainer.step``/``update`` does). Raises ``RuntimeError`` when the workers' loss scales
    differ, when one scaler mixes distributed and local trainers, for a dist kvstore with
    gradient compression, and for Horovod's ``DistributedOptimizer`` (use ``DistributedTrainer``).
    """
    if not scaler.enabled:  # nothing is checked or skipped, so there is nothing to agree on
        return bool(finite)
    _refuse_horovod_optimizer(trainer)
    engine = engine_of(trainer)
    _check_shared_scaler(trainer, scaler, engine)
    if engine is None:
        return bool(finite)
    if engine.kvstore:
        _check_kvstore(trainer)
    return _agree(engine, float(scaler.loss_scale), finite)


def _agree(engine: Engine, scale: float, finite: bool) -> bool:
    sums = engine.reduce(np.array([0.0 if finite else 1.0, scale, scale * scale], dtype="float32"))
    bad, total, squares = (float(v) for v in sums)
    _check_same_scale(engine, scale, total, squares)
    return bad == 0


def module_engine(module: Any) -> Optional[Engine]:
    """The cross-process engine of a Module: a native ``dist_*`` kvstore with more than one
    worker, or Horovod's ``DistributedOptimizer`` (its update allreduces the gradients) over
    more than one process; else None."""
    kv = mxi.module.module_kvstore(module)
    if isinstance(kv, mx.kvstore.KVStore) and "dist" in kv.type and kv.num_workers > 1:
        return Engine(f"the {kv.type} kvstore", kv.num_workers, _kvstore_reduce(kv, MODULE_FLAG_KEY), kvstore=True)
    process_set = mxi.module.horovod_optimizer_process_set(mxi.module.module_optimizer(module))
    if process_set is not None and "horovod.mxnet" in sys.modules and process_set.size() > 1 and process_set.included():
        return Engine("Horovod", process_set.size(), _horovod_reduce(sys.modules["horovod.mxnet"], process_set))
    return None


def agree_module_finite(module: Any, scale: float, finite: bool) -> bool:
    """Return whether every worker of ``module`` saw finite gradients this step, its
    gradients multiplied by ``scale``. Collective across the workers (every ``Module.update``
    calls it before its gradients meet: :func:`module_engine`); raises ``RuntimeError`` when
    the workers' scales differ."""
    engine = module_engine(module)
    return bool(finite) if engine is None else _agree(engine, float(scale), finite)
