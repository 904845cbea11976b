"""One small training run, shared by the 2-worker jobs, the in-process device run and the
single-process reference they are compared with.

Float32 on purpose: loss scaling works the same in fp32, and fp32 kernels exist on every CPU.
A worker trains on its shard of a fixed global batch; worker ``POISON_RANK`` gets an inf
gradient at ``POISON_STEP``; before ``RESUME_STEP`` rank 0 checkpoints, every rank scrambles
its state and restores it from rank 0's files.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import LossScaler

IN_UNITS, HIDDEN, CLASSES = 8, 16, 4
GLOBAL_BATCH = 8
STEPS = 8
POISON_STEP, POISON_RANK = 2, 1
RESUME_STEP = 5
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 10, 2
OPTIMIZER, OPTIMIZER_PARAMS = "sgd", {"learning_rate": 0.1, "momentum": 0.9}

Batch = List[Tuple[mx.nd.NDArray, mx.nd.NDArray]]


def make_net(ctxs: Sequence[mx.Context]) -> nn.HybridSequential:
    """A 2-layer MLP whose weights come from a fixed seed (same on every rank)."""
    net = nn.HybridSequential()
    net.add(nn.Dense(HIDDEN, activation="relu", in_units=IN_UNITS), nn.Dense(CLASSES, in_units=HIDDEN))
    net.initialize(ctx=list(ctxs))
    rng = np.random.RandomState(0)
    for _, p in sorted(net._collect_params_with_prefix().items()):
        p.set_data(mx.nd.array(rng.normal(0, 0.3, p.shape), dtype="float32"))
    net.hybridize()
    return net


def make_scaler() -> LossScaler:
    return LossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def global_batch(step: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(100 + step)
    x = rng.normal(0, 1, (GLOBAL_BATCH, IN_UNITS)).astype("float32")
    return x, rng.randint(0, CLASSES, GLOBAL_BATCH).astype("float32")


def shard(step: int, part: int, parts: int, ctx: mx.Context) -> Tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Part ``part`` of ``parts`` equal slices of the global batch, on ``ctx``."""
    x, y = global_batch(step)
    n = GLOBAL_BATCH // parts
    sl = slice(part * n, (part + 1) * n)
    return mx.nd.array(x[sl], ctx=ctx), mx.nd.array(y[sl], ctx=ctx)


def backward(net: gluon.Block, trainer: gluon.Trainer, batch: Batch) -> None:
    """Summed cross-entropy on every (x, y) of ``batch``, scaled, backward."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        losses = [loss_fn(net(x), y).sum() for x, y in batch]
        with gluon_amp.scale_loss(losses, trainer) as scaled:
            autograd.backward(scaled)


def poison(net: gluon.Block, ctx: mx.Context) -> None:
    """Put an inf into one gradient, on ``ctx`` only."""
    net._collect_params_with_prefix()["0.weight"].grad(ctx)[0, 0] = float("inf")


def scramble(net: gluon.Block, trainer: gluon.Trainer) -> None:
    """Overwrite weights, momentum and loss scale, so a resume must restore all three."""
    for p in net.collect_params().values():
        p.set_data(mx.nd.full(p.shape, 0.5))
    for updater in trainer._updaters:
        for state in updater.states.values():
            state[:] = 0.25
    gluon_amp.get_scaler(trainer).load_state_dict(LossScaler(init_scale=8.0).state_dict())


def finite_by_ctx(net: gluon.Block) -> List[bool]:
    """Whether this process's gradients are finite, per context (numpy: independent of gluon_amp)."""
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return [all(bool(np.isfinite(p.grad(c).asnumpy()).all()) for p in params)
            for c in params[0].list_ctx()]


def params_of(net: gluon.Block, ctx: mx.Context) -> Dict[str, list]:
    return {name: p.data(ctx).asnumpy().tolist()
            for name, p in sorted(net._collect_params_with_prefix().items())}


def train(net: gluon.Block, trainer: gluon.Trainer, batch_of: Callable[[int], Batch],
          update: Callable[[], None], poison_ctx: Callable[[int], Optional[mx.Context]],
          resume: Optional[Callable[[], None]] = None) -> Dict[str, list]:
    """Run ``STEPS`` steps; return per-step finiteness per context, skip decisions and scales.

    ``update`` applies one step (``trainer.step`` or ``allreduce_grads`` + ``update``);
    ``poison_ctx(step)`` names the context to put an inf on, if any; ``resume`` runs
    before ``RESUME_STEP``.
    """
    scaler = gluon_amp.get_scaler(trainer)
    record: Dict[str, list] = {"finite_by_ctx": [], "skipped": [], "scale": []}
    for step in range(STEPS):
        if step == RESUME_STEP and resume is not None:
            resume()
        backward(net, trainer, batch_of(step))
        ctx = poison_ctx(step)
        if ctx is not None:
            poison(net, ctx)
        record["finite_by_ctx"].append(finite_by_ctx(net))
        update()
        record["skipped"].append(scaler.last_step_skipped)
        record["scale"].append(scaler.loss_scale)
    mx.nd.waitall()
    return record


def reference() -> Dict[str, object]:
    """One process, one context, the whole global batch, no checkpoint."""
    ctx = mx.cpu()
    net = make_net([ctx])
    trainer = gluon.Trainer(net.collect_params(), OPTIMIZER, dict(OPTIMIZER_PARAMS), kvstore=None,
                            update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, make_scaler())
    record = train(net, trainer, lambda s: [shard(s, 0, 1, ctx)], lambda: trainer.step(GLOBAL_BATCH),
                   lambda s: ctx if s == POISON_STEP else None)
    return {**record, "params": params_of(net, ctx)}
