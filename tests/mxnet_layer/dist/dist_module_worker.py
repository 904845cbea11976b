"""A Module trained with dynamic loss scaling: one worker of a 2-worker ``dist_sync`` job, one
of 2 Horovod processes whose optimizer is ``hvd.DistributedOptimizer`` (``--engine horovod``,
as MXNet's example/distributed_training-horovod/module_mnist.py trains), or (``--workers 1``)
the single process on the whole global batch it is compared with.

Float32 with an explicit LossScaler that scales every step (fp32 kernels run on every CPU).
Worker ``POISON_RANK``'s shard holds an inf at ``POISON_STEP``: every worker must skip that
step, halve the scale, and end with the weights of the single process. Writes
``<out>/module-rank<r>.json``.
"""
from __future__ import annotations

import argparse
import json
import os

import gluon_amp
import mxnet as mx
import numpy as np

IN_UNITS, HIDDEN, CLASSES = 8, 16, 4
GLOBAL_BATCH, STEPS = 8, 7
POISON_STEP, POISON_RANK = 2, 1
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 10, 2


def symbol() -> mx.sym.Symbol:
    data, label = mx.sym.var("data"), mx.sym.var("softmax_label")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=HIDDEN, name="fc1"), act_type="relu")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=CLASSES, name="fc2"), label, name="softmax")


def global_batch(step: int):
    rng = np.random.RandomState(100 + step)
    x = rng.randn(GLOBAL_BATCH, IN_UNITS).astype("float32")
    if step == POISON_STEP:  # in POISON_RANK's shard of a 2-worker job
        x[POISON_RANK * GLOBAL_BATCH // 2, 0] = np.inf
    return x, rng.randint(0, CLASSES, GLOBAL_BATCH).astype("float32")


def train(kvstore: str, rank: int, workers: int, wrap=None) -> dict:
    per = GLOBAL_BATCH // workers
    mod = mx.mod.Module(symbol(), context=mx.cpu())
    mod.bind(data_shapes=[("data", (per, IN_UNITS))], label_shapes=[("softmax_label", (per,))])
    rng = np.random.RandomState(0)
    shapes = dict(zip(symbol().list_arguments(), symbol().infer_shape(data=(per, IN_UNITS))[0]))
    args = {n: mx.nd.array(rng.normal(0, 0.3, shapes[n])) for n in sorted(shapes) if n not in ("data", "softmax_label")}
    mod.init_params(arg_params=args)
    if wrap is None:
        mod.init_optimizer(kvstore=kvstore, optimizer="sgd", optimizer_params={"learning_rate": 0.1, "momentum": 0.9})
    else:  # the wrapper's update allreduces (averages) the gradients; each worker normalises by its batch
        mod.init_optimizer(kvstore=kvstore, optimizer=wrap(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                                            rescale_grad=1.0 / per)))
    try:
        scaler = gluon_amp.init_trainer(mod, gluon_amp.LossScaler(init_scale=INIT_SCALE,
                                                                  growth_interval=GROWTH_INTERVAL))
    except RuntimeError as err:  # what a worker whose optimizer runs on the servers gets
        return {"rank": rank, "workers": workers, "refused": str(err), "update_on_kvstore": bool(mod._update_on_kvstore)}
    skipped, scales = [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(x[rank * per:(rank + 1) * per])],
                                             [mx.nd.array(y[rank * per:(rank + 1) * per])]))
        mod.update()
        skipped.append(bool(scaler.last_step_skipped))
        scales.append(float(scaler.loss_scale))
    params = {k: v.asnumpy().tolist() for k, v in mod.get_params()[0].items()}
    return {"rank": rank, "workers": workers, "skipped": skipped, "scale": scales, "params": params,
            "update_on_kvstore": bool(mod._update_on_kvstore)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--engine", choices=["dist_sync", "horovod"], default="dist_sync")
    a = parser.parse_args()
    if a.workers == 1:
        result = train("local", 0, 1)
    elif a.engine == "horovod":
        import horovod.mxnet as hvd
        hvd.init()
        result = train(None, hvd.rank(), hvd.size(), wrap=hvd.DistributedOptimizer)
    else:
        kv = mx.kv.create("dist_sync")
        result = train(kv, kv.rank, kv.num_workers)
    with open(os.path.join(a.out, f"module-rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
