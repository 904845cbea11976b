"""A converted block trains with every parameter's gradient (issue 46: the converted
``Conv2D -> Conv2DTranspose`` trained natively in bfloat16 lagged its emulated plan by 6%).

``convert_hybrid_block`` fuses by default on a CPU with oneDNN (MXNet's subgraph backend,
float32 and bfloat16 alike). MXNet's fused ops (``_sg_mkldnn_conv``) are inference kernels
with no gradient: a fused block trained gets zero gradients, silently, for every parameter
they read. Emulation never fuses, so only a native run (or the float32 default here) met it.
These run on every CPU: the default target is float32 where bfloat16 is not native, and the
fusion is the same.
"""
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon


def _net():
    mx.random.seed(0)
    net = gluon.nn.HybridSequential(prefix="net_")
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1), gluon.nn.Conv2DTranspose(8, 2, strides=2))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


X = mx.nd.array(np.random.RandomState(1).uniform(size=(4, 8, 6, 6)))


def _grads(block):
    with autograd.record():
        loss = block(X).astype("float32").square().mean()
    loss.backward()
    return {p.name: p.grad().astype("float32").asnumpy() for p in block.collect_params().values()}


def _converted(**kwargs):
    net = _net()
    net(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return net, gluon_amp.convert_hybrid_block(net, **kwargs)


def test_a_block_converted_with_the_default_fusion_trains_unfused_with_every_gradient():
    net, converted = _converted()
    assert converted.fuse_backend == "MKLDNN"  # the default on a CPU: the case this is about
    want = _grads(net)
    with pytest.warns(RuntimeWarning, match="runs unfused from now on"):
        got = _grads(converted)
    assert set(got) == set(want)
    low = gluon_amp.report(converted).low_ops > 0  # bfloat16 where it is native
    for name, g in got.items():
        scale = np.abs(want[name]).max()
        assert scale > 0 and np.abs(g - want[name]).max() <= (3e-2 if low else 1e-5) * scale, name
    # inference after training keeps running unfused, and a second step warns no more
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grads(converted)
    assert converted.fuse_backend is None


def test_a_fusion_asked_for_refuses_to_train_with_zero_gradients():
    _, converted = _converted(fuse=True)
    converted(X)  # inference: fused, as asked
    with pytest.raises(RuntimeError, match=r"no gradient.*convert with fuse=False"):
        _grads(converted)
    _, unfused = _converted(fuse=False)  # what the message says
    assert all(np.abs(g).max() > 0 for g in _grads(unfused).values())


def test_weights_the_default_stored_low_train_in_float32(native_host):
    """A fused conversion stores the weights only low ops read in bfloat16 by default; trained,
    they are float32 again (read through casts), so an update below bfloat16's rounding lands
    instead of being rounded away. Inference runs first, so the fused graph was built."""
    _, converted = _converted(target_dtype="bfloat16")
    stored_low = set(converted.stored_low_by_default)
    params = {p.name: p for p in converted.collect_params().values()}
    assert stored_low and all(params[n].data().dtype != np.float32 for n in stored_low)
    converted(X)
    before = {n: params[n].data().astype("float32").asnumpy() for n in stored_low}
    trainer = gluon.Trainer(converted.collect_params(), "sgd", {"learning_rate": 1e-6})
    with pytest.warns(RuntimeWarning, match="runs unfused from now on"):
        _grads(converted)
    trainer.step(1)
    for name in stored_low:
        after = params[name].data()
        assert after.dtype == np.float32 and params[name].grad().dtype == np.float32, name
        moved = np.abs(after.asnumpy() - before[name])
        scale = np.abs(before[name]).max()  # the biases start at zero
        assert 0 < moved.max() < (1e-3 * scale if scale else 1e-6), name  # below bfloat16's step
    assert not converted.stored_low_by_default
