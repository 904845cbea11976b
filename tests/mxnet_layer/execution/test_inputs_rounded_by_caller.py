"""An emulated block reads an input it only rounds as a graph input, the block's CachedOp fed the
call's array rounded (gluon_amp_core.emulate.lift_input_roundings,
gluon_amp.execution._inputs_rounded_by_caller): the first convolution then computes no data
gradient for an image that needs none, and every value and gradient stays as before."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon

from gluon_amp import emulation_kernel, execution
from gluon_amp.mxnet_internals.padded_inputs import PaddedInputs


class Stem(gluon.HybridBlock):
    def __init__(self, channels=4):  # bfloat16 keeps a convolution on 3 in float32 (odd channels)
        super().__init__()
        with self.name_scope():
            self.conv = gluon.nn.Conv2D(8, 3, padding=1, in_channels=channels)
            self.bn = gluon.nn.BatchNorm(in_channels=8)
            self.head = gluon.nn.Dense(4, in_units=8 * 6 * 6)

    def hybrid_forward(self, F, x):
        return self.head(F.relu(self.bn(self.conv(x))))


class Body(gluon.HybridBlock):
    """A second block, fed the first's output: its input needs a gradient."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.fc = gluon.nn.Dense(3, in_units=4)

    def hybrid_forward(self, F, x):
        return self.fc(x)


def _run(dtype, lifted, image_grad, chained):
    """One recorded forward and backward under emulation: outputs, gradients, the graphs run."""
    assert emulation_kernel.load().path == "kernel", emulation_kernel.status().why
    mx.random.seed(0)
    nets = [Stem()] + ([Body()] if chained else [])
    for net in nets:
        net.initialize(mx.init.Xavier())
        net.hybridize()
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 4, 6, 6)))
    if image_grad:
        x.attach_grad()
    original = execution._inputs_rounded_by_caller
    if not lifted:
        execution._inputs_rounded_by_caller = lambda block, run, data: run
    try:
        with gluon_amp.autocast(target_dtype=dtype, emulate=True):
            with autograd.record():
                y = x
                for net in nets:
                    y = net(y)
                loss = (y * y).sum()
            loss.backward()
    finally:
        execution._inputs_rounded_by_caller = original
    grads = {p.name.split("_", 1)[1]: p.grad().asnumpy() for net in nets for p in net.collect_params().values()
             if p.grad_req != "null"}
    if image_grad:
        grads["image"] = x.grad.asnumpy()
    return y.asnumpy(), grads, nets


def _reads(net):
    """The ops that read each graph input of ``net``'s executed graph, by input name."""
    graph = json.loads(execution.executed_graph(net).tojson())
    nodes = graph["nodes"]
    return {nodes[e[0]]["name"]: sorted({n["op"] for n in nodes if e in [i for i in n["inputs"]]})
            for e in [[j, 0, 0] for j in graph["arg_nodes"]]}


def _fed_rounded(net):
    op = net._cached_op
    return isinstance(getattr(op, "training", op), PaddedInputs)


@pytest.mark.parametrize("chained", [False, True], ids=["one block", "two blocks"])
@pytest.mark.parametrize("image_grad", [False, True], ids=["image", "image with a gradient"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_caller_rounds_the_image_and_every_value_stays(dtype, image_grad, chained):
    y, grads, nets = _run(dtype, True, image_grad, chained)
    y0, grads0, nets0 = _run(dtype, False, image_grad, chained)
    assert _fed_rounded(nets[0]) and not _fed_rounded(nets0[0])
    assert _reads(nets[0])["data"] == ["Convolution"]  # a graph input: no data gradient where none is needed
    assert _reads(nets0[0])["data"] == [emulation_kernel.OP_NAME]
    if chained:  # the second block's input is the first's output, rounded by the caller as a recorded op
        assert _fed_rounded(nets[1]) and _reads(nets[1])["data"] == ["FullyConnected"]
    assert np.array_equal(y, y0)
    assert sorted(grads) == sorted(grads0) and len(grads) >= 6
    for name in grads:
        assert np.array_equal(grads[name], grads0[name]), name
    assert all(np.abs(g).sum() > 0 for g in grads.values())  # every gradient reached its array


def test_an_image_read_unrounded_too_stays_rounded_in_the_graph():
    class Both(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.conv = gluon.nn.Conv2D(4, 3, padding=1, in_channels=3)

        def hybrid_forward(self, F, x):
            return self.conv(x).sum() + F.exp(x).sum()  # exp: float32 in both tables

    net = Both()
    net.initialize()
    net.hybridize()
    with gluon_amp.autocast(target_dtype="float16", emulate=True):
        with autograd.record():
            net(mx.nd.ones((1, 3, 4, 4))).backward()
    assert not _fed_rounded(net)
    assert emulation_kernel.OP_NAME in _reads(net)["data"]
