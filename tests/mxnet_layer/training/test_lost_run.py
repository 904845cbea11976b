"""Deploy, train in FP32, then fine-tune natively in bfloat16, in one process (issue 27, item 1).

oneDNN 2.4's bfloat16 weight-gradient kernel for a strided convolution splits the input's
width into stride phases; a phase that holds no input column (a map narrower than the
stride) gets no padding written, and the kernel reads that memory as padding. Whatever the
heap held there goes into the gradient of the taps that only see padding: after a
deployment and an FP32 run it is often NaN or inf, and every step of the bfloat16 run is
skipped. The heap's history decides it, so these tests fill every new heap block with one
garbage byte while they run (glibc's ``M_PERTURB``, what ``MALLOC_PERTURB_`` sets) to make
the unwritten memory garbage every time rather than in most runs.
"""
import contextlib
import ctypes

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp

_M_PERTURB = -6  # glibc's mallopt parameter


@contextlib.contextmanager
def dirty_heap():
    """While inside, glibc fills each new heap block with 0xFE bytes (a bfloat16 of -1.7e38)."""
    mallopt = ctypes.CDLL(None).mallopt
    assert mallopt(_M_PERTURB, 0x01) == 1, "glibc's mallopt(M_PERTURB) is needed to dirty the heap"
    try:
        yield
    finally:
        mallopt(_M_PERTURB, 0)


def narrow_net(seed):
    """Three stride-2 3x3 convolutions: 4x4 -> 2x2 -> 1x1 -> 1x1; the last runs on a map
    narrower than its stride (as SSD's last extra layer at 256x256), and its 1x1 output
    reaches the loss with a non-zero gradient."""
    mx.random.seed(seed)
    net = nn.HybridSequential()
    for _ in range(3):
        net.add(nn.Conv2D(32, 3, strides=2, padding=1), nn.Activation("relu"))
    net.add(nn.Flatten(), nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    return net


X = mx.nd.random.uniform(-1, 1, shape=(4, 4, 4, 4), ctx=mx.cpu())
Y = mx.nd.array([1, 3, 5, 7])
NARROW_CONV = 2  # index in narrow_net of the convolution on the 1x1 map


def train(net, steps, scaled):
    """``steps`` SGD steps with a loss scaler attached; the losses and the scaler."""
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                            update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(X), Y).mean()
            if scaled:
                with gluon_amp.scale_loss(loss, trainer) as s:
                    autograd.backward(s)
            else:
                loss.backward()
        losses.append(float(loss.asscalar()))
        trainer.step(1)
    return losses, scaler


def padding_only_taps(weight_grad):
    """The gradient of the narrow convolution's taps that only ever see its padding (the
    input is 1x1, so every tap but the centre)."""
    g = weight_grad.asnumpy().copy()
    g[:, :, 1, 1] = 0
    return g


def test_deploy_then_fp32_then_bf16_finetune_loses_no_step(native_host):
    with dirty_heap():
        # 1. deploy: a bfloat16 conversion of a small trained-shaped net, run once
        fp32 = narrow_net(0)
        fp32(X)
        deployed = gluon_amp.convert_hybrid_block(fp32, "bfloat16", cast_optional_params=True)
        deployed(X).wait_to_read()
        # 2. train in FP32, a loss scaler attached, AMP off
        fp32_losses, _ = train(narrow_net(1), 3, scaled=True)
        # 3. fine-tune a fresh net natively in bfloat16
        gluon_amp.init(target_dtype="bfloat16")
        net = narrow_net(1)
        losses, scaler = train(net, 5, scaled=True)
        grads = {p.name: p.grad().asnumpy() for p in net.collect_params().values()}
        taps = padding_only_taps(net[NARROW_CONV * 2].weight.grad())
    assert scaler.skipped_steps == 0, f"{scaler.skipped_steps} of {scaler.total_steps} steps skipped: {scaler}"
    bad = sorted(n for n, g in grads.items() if not np.isfinite(g).all())
    assert not bad, f"non-finite gradients: {bad}"
    assert not taps.any(), f"taps that only see padding got gradient up to {np.abs(taps).max():g}"
    assert losses[-1] < losses[0], losses  # it learns
    assert np.isfinite(fp32_losses).all()


def conv_plan(net):
    """(dtype, reason) of ``net``'s convolutions in graph order, as the precision report says."""
    return [(r.dtype, r.reason) for r in gluon_amp.report(net).rows if r.op == "Convolution"]


def test_imperative_narrow_convolution_gets_a_clean_weight_gradient(native_host):
    with dirty_heap():
        gluon_amp.init(target_dtype="bfloat16")
        mx.random.seed(2)
        x = mx.nd.random.uniform(-1, 1, shape=(4, 32, 1, 1))
        w = mx.nd.random.normal(0, 0.1, shape=(32, 32, 3, 3))
        w.attach_grad()
        with autograd.record():
            y = mx.nd.Convolution(x, w, kernel=(3, 3), stride=(2, 2), pad=(1, 1), num_filter=32, no_bias=True)
        y.backward(mx.nd.ones_like(y))
        grad = w.grad.asnumpy()
    assert np.isfinite(grad).all()
    assert not padding_only_taps(w.grad).any()
    # the centre tap sees the input: the float32 gradient, sum over the batch
    np.testing.assert_allclose(grad[0, :, 1, 1], x.asnumpy().sum(axis=(0, 2, 3)), rtol=1e-5)


def test_a_block_called_narrower_later_is_rebuilt_and_loses_no_step(native_host):
    gluon_amp.init(target_dtype="bfloat16")
    net = narrow_net(1)
    net(mx.nd.ones((2, 4, 8, 8)))  # 8 -> 4 -> 2 -> 1: no map narrower than a stride
    assert {dtype for dtype, _ in conv_plan(net)} == {"bfloat16"}
    with dirty_heap():
        losses, scaler = train(net, 3, scaled=True)  # 4x4 inputs: the last convolution is narrow
    assert scaler.skipped_steps == 0, scaler
    assert conv_plan(net)[NARROW_CONV] == ("float32", "narrow_input")


@pytest.mark.parametrize("emulate", [False, True])
def test_narrow_convolutions_run_float32_in_the_plan(emulate):
    if not emulate and not gluon_amp.runtime.executable("bfloat16", "cpu"):
        emulate = True  # the plan is the same; without bf16 kernels only emulation runs it
    gluon_amp.init(target_dtype="bfloat16", emulate=emulate)
    net = narrow_net(3)
    net(X)
    assert [dtype for dtype, _ in conv_plan(net)] == ["bfloat16", "bfloat16", "float32"]


def test_o2_training_on_a_narrow_map_loses_no_step(native_host):
    """Natively, the narrow-map kernel (module docstring); simulated as well, the O2 plan and
    ``report()`` of the O2 network, whose graph declares float32 parameters stored bfloat16."""
    net = narrow_net(4)
    net(X)  # O2 needs the parameter shapes
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                            update_on_kvstore=False)
    gluon_amp.initialize(net, trainer, "O2", target_dtype="bfloat16")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with dirty_heap():
        for _ in range(3):
            with autograd.record():
                with gluon_amp.scale_loss(loss_fn(net(X), Y).mean(), trainer) as s:
                    autograd.backward(s)
            trainer.step(1)
    scaler = gluon_amp.get_scaler(trainer)
    assert scaler.skipped_steps == 0, scaler
    assert conv_plan(net)[NARROW_CONV][0] == "float32"
