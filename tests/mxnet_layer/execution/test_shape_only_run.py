"""A value a training graph reads only for its shape (SSD's anchors: ``slice_like(anchors,
feature * 0)``) gets no gradient pass where MXNet binds the graph (gluon_amp_core.shape_only,
native_run.with_shape_only_stops): the same values and gradients, and the feature's gradient sum
stays oneDNN's. Without it, the path's zeros, a plain array, sent the sum to MXNet's loop,
which converts each bfloat16 input to float32 and back: SSD-512's add_n took 392 ms of a batch-8
step, 39 with it."""
import json
import re
import textwrap

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from helpers import train_bound, verbose_run

from gluon_amp import native_run
from gluon_amp.execution import plan_dtypes
from gluon_amp.mxnet_internals import symbol_graph
from gluon_amp_core.shape_only import STOP_SUFFIX, stop_shape_only_gradients


def _anchors(feature_channels=16):
    """conv -> relu (a feature) -> conv (a prediction), and slice_like(anchors, feature * 0)."""
    x = mx.sym.Convolution(mx.sym.var("data"), kernel=(3, 3), pad=(1, 1), num_filter=feature_channels, name="c0")
    f = mx.sym.Activation(x, act_type="relu", name="feature")
    pred = mx.sym.Convolution(f, kernel=(1, 1), num_filter=16, name="pred")
    anchors = mx.sym.slice_like(mx.sym.var("anchors"), f * 0, axes=(2, 3), name="anchors_like")
    return mx.sym.Group([pred, anchors])


def test_the_stopped_graph_gives_the_same_values_and_gradients():
    sym = _anchors()
    rng = np.random.RandomState(0)
    shapes = {"data": (2, 8, 6, 6), "anchors": (1, 4, 9, 9)}
    arg_shapes, out_shapes, _ = sym.infer_shape(**shapes)
    arrays = {k: mx.nd.array(rng.uniform(-1, 1, s)) for k, s in zip(sym.list_arguments(), arg_shapes)}
    graph, stopped = stop_shape_only_gradients(symbol_graph(sym))
    assert stopped == 1
    run = mx.sym.load_json(json.dumps(graph))
    assert run.list_arguments() == sym.list_arguments() and run.list_outputs() == sym.list_outputs()
    out_grads = [mx.nd.array(rng.uniform(-1, 1, s)) for s in out_shapes]
    outs, grads = train_bound(sym, arrays, out_grads)
    run_outs, run_grads = train_bound(run, arrays, out_grads)
    for a, b in zip(outs, run_outs):
        np.testing.assert_array_equal(b, a)
    assert set(run_grads) == set(grads)
    for k in grads:  # a sum less an exact zero
        np.testing.assert_array_equal(run_grads[k], grads[k], err_msg=k)


def _stops(run):
    return [n["name"] for n in symbol_graph(run)["nodes"] if n["op"] == "BlockGrad" and STOP_SUFFIX in n["name"]]


def test_training_graphs_on_a_cpu_get_it_and_nothing_else_does():
    plan = gluon_amp.convert_symbol(_anchors(), target_dtype="bfloat16")
    typed = plan_dtypes(plan, {"data": "float32", "anchors": "float32"})
    shapes = {"data": (2, 8, 6, 6), "anchors": (1, 4, 9, 9)}
    train = native_run.native_passes(plan, typed, shapes, {"cpu"}, pair=True, accumulating=None)
    assert len(_stops(train)) == 1
    _, plan_types, _ = plan.infer_type_partial(data="float32", anchors="float32")
    _, train_types, _ = train.infer_type_partial(data="float32", anchors="float32")
    assert train_types == plan_types
    assert _stops(native_run.native_passes(plan, typed, shapes, {"cpu"}, pair=False, accumulating=None)) == []
    assert _stops(native_run.native_passes(plan, typed, shapes, {"gpu"}, pair=True, accumulating=None)) == []
    assert _stops(plan) == []  # the plan (what export writes) keeps the path


_TRAIN = textwrap.dedent("""
    import json, sys
    import mxnet as mx
    import gluon_amp
    from gluon_amp import native_run
    from mxnet.gluon import nn
    if not json.loads(sys.argv[1]):
        native_run.with_shape_only_stops = lambda plan: plan
    gluon_amp.init(target_dtype="bfloat16", tune=False)

    class Net(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.c0 = nn.Conv2D(64, 3, padding=1, in_channels=32)
                self.pred = nn.Conv2D(64, 1, in_channels=64)
                self.anchors = self.params.get_constant("anchors", mx.nd.ones((1, 4, 64, 64)))

        def hybrid_forward(self, F, x, anchors):
            f = F.Activation(self.c0(x), act_type="relu")
            return self.pred(f), F.slice_like(anchors, f * 0, axes=(2, 3))

    mx.random.seed(0)
    net = Net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 32, 24, 24))
    for _ in range(2):
        with mx.autograd.record():
            y, a = net(x)
            loss = (y * y).mean() + a.sum()
        loss.backward()
    mx.nd.waitall()
    print("@@" + json.dumps({"dw": net.c0.weight.grad().asnumpy().ravel()[:64].tolist()}))
""")


def _trained(stopped):
    """c0's weight gradient and the oneDNN reorders of the feature's shape into float32, training
    under ``init`` in a process of its own (``DNNL_VERBOSE``)."""
    lines, values = verbose_run(_TRAIN, stopped)
    to_float32 = [line for line in lines
                  if re.match(r"dnnl_verbose,exec,cpu,reorder,.*src_bf16:.*dst_f32:.*,2x64x24x24,", line)]
    return values, to_float32


@pytest.mark.bf16_kernels
def test_init_keeps_the_features_gradient_sum_in_bfloat16():
    """On this CPU, under ``init``: without the stop, the feature's gradient sum converts its
    bfloat16 inputs to float32 (MXNet's loop); with it, there is no sum, and the gradients are
    the same."""
    plain, plain_reorders = _trained(False)
    stopped, stopped_reorders = _trained(True)
    # both convert the feature for the float32 ``* 0`` (forward); without the stop, each of
    # the 2 steps' gradient sums converts its 2 inputs to float32 as well
    assert len(plain_reorders) >= len(stopped_reorders) + 2 * 2, (len(plain_reorders), len(stopped_reorders))
    np.testing.assert_array_equal(stopped["dw"], plain["dw"])
