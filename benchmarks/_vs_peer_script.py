"""A plain MXNet training script, with no AMP in it, for ``vs_peer.py``'s launcher row.

A GluonTS WaveNet-style model: a causal stack of dilated ``Conv1D`` layers with gated
activations and residual/skip connections, trained with SGD on a synthetic series. Prints its
step times and peak RSS as one ``VS_PEER_RESULT {json}`` line.
"""
import argparse
import json
import time

import _numpy_shim  # noqa: F401  numpy aliases MXNet 1.9.1 needs (benchmarks/ is on sys.path)
import mxnet as mx
from mxnet import autograd, gluon


class Residual(gluon.HybridBlock):
    def __init__(self, channels, dilation):
        super().__init__()
        with self.name_scope():
            self.conv = gluon.nn.Conv1D(2 * channels, 2, dilation=dilation, padding=dilation, in_channels=channels)
            self.res = gluon.nn.Conv1D(channels, 1, in_channels=channels)
            self.skip = gluon.nn.Conv1D(channels, 1, in_channels=channels)
        self.dilation = dilation

    def hybrid_forward(self, F, x):
        u = self.conv(x).slice_axis(axis=-1, begin=0, end=-self.dilation)  # causal: drop the look-ahead
        a, b = F.split(u, num_outputs=2, axis=1)
        z = F.tanh(a) * F.sigmoid(b)
        return x + self.res(z), self.skip(z)


class WaveNet(gluon.HybridBlock):
    def __init__(self, channels, layers):
        super().__init__()
        with self.name_scope():
            self.inp = gluon.nn.Conv1D(channels, 1, in_channels=1)
            self.blocks = gluon.nn.HybridSequential()
            for i in range(layers):
                self.blocks.add(Residual(channels, 2 ** (i % 8)))
            self.out = gluon.nn.Conv1D(1, 1, in_channels=channels)

    def hybrid_forward(self, F, x):
        h = self.inp(x)
        skips = []
        for blk in self.blocks:
            h, s = blk(h)
            skips.append(s)
        return self.out(F.relu(F.add_n(*skips) + h))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="keep timing past --iters until the timed steps add up to this (at most 2000 steps)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    mx.random.seed(0)
    batch, length, channels, layers = (4, 64, 16, 4) if a.quick else (32, 512, 64, 16)
    net = WaveNet(channels, layers)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.uniform(-1, 1, shape=(batch, 1, length))
    y = mx.nd.random.uniform(-1, 1, shape=(batch, 1, length))
    loss_fn = gluon.loss.L2Loss()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-3, "momentum": 0.9})
    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
        mx.nd.waitall()

    for _ in range(1 + a.warmup):
        step()
    ms = []
    while len(ms) < 2000 and (len(ms) < a.iters or sum(ms) < 1e3 * a.min_seconds):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:"))
    print("VS_PEER_RESULT " + json.dumps({"ms": ms, "peak_rss_mb": round(peak, 1)}), flush=True)


if __name__ == "__main__":
    main()
