"""Small networks and data shared by the tests."""
import numpy as np
import mxnet as mx
from mxnet.gluon import nn


class MixedNet(nn.HybridBlock):
    """conv -> BN -> relu -> dense -> softmax, plus a residual add of a low-precision
    branch and a float32 branch (softmax output)."""

    def __init__(self, channels=8, classes=10, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv = nn.Conv2D(channels, 3, padding=1)
            self.bn = nn.BatchNorm()
            self.side = nn.Conv2D(channels, 1)
            self.dense = nn.Dense(classes)

    def hybrid_forward(self, F, x):
        low = F.relu(self.bn(self.conv(x)))
        fp32 = F.softmax(self.side(x), axis=1)
        mixed = low + fp32
        return F.softmax(self.dense(mixed))


def make_net(seed=0, hybridize=True):
    mx.random.seed(seed)
    net = MixedNet()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    return net


def internal_types(sym, **input_types):
    """{output name: dtype name} for every node of ``sym``."""
    from gluon_amp_core.dtypes import dtype_name
    internals = sym.get_internals()
    _, out_types, _ = internals.infer_type(**input_types)
    return {n: dtype_name(t) for n, t in zip(internals.list_outputs(), out_types)}


def blobs(n=512, seed=0):
    """Two classes of 8x8 images: a bright blob top-left vs bottom-right, plus noise."""
    # (seeded) of 8x8 images: a bright blob top-left vs bottom-right, plus noise
    rng = np.random.RandomState(seed)
    x = rng.normal(0, 1, size=(n, 1, 8, 8)).astype("float32")
    y = rng.randint(0, 2, size=n)
    for i in range(n):
        r = slice(0, 4) if y[i] == 0 else slice(4, 8)
        x[i, 0, r, r] += 1.0
    return mx.nd.array(x), mx.nd.array(y)


