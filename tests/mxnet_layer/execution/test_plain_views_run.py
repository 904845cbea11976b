"""A reshape of a 5-d bfloat16 value reads a plain copy of it, where MXNet binds a plan
(native_run.with_plain_views; gluon_amp_core.plain_views): MXNet 1.9.1 cannot use the reshaped
view of a oneDNN 5-d bfloat16 array.

The fact: a bound graph with a bfloat16 3-d convolution, then a ``Reshape``, ``Flatten``,
``expand_dims``, ``reshape_like`` or numpy ``reshape`` to another shape, then an op that must
reorder the view (``amp_cast`` to float32, ``Concat``, an addition), fails with
"could not create a primitive descriptor for a reorder primitive" (or "for a sum primitive").
GluonCV's C3D and non-local I3D networks meet it."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet.gluon import nn

from helpers import bf16_train_step
from gluon_amp.execution import plan_dtypes
from gluon_amp.mxnet_internals import BFLOAT16
from gluon_amp.native_run import native_passes, with_plain_views
from gluon_amp.type_inference import infer_dtypes

S = mx.sym
VIEWS = {
    "Reshape": lambda y: S.Reshape(y, shape=(0, -1)),
    "Flatten": S.Flatten,
    "expand_dims": lambda y: S.expand_dims(y, axis=1),
    "reshape_like": lambda y: S.reshape_like(y, S.var("like")),
    "_np_reshape": lambda y: S.np.reshape(y.as_np_ndarray(), (2, -1)).as_nd_ndarray(),  # numpy mode's
    "_npx_reshape": lambda y: S.npx.reshape(y.as_np_ndarray(), (2, -1)).as_nd_ndarray(),
}


#: what a plan has read a bfloat16 view: a float32 op (through a cast), or ops that run in their
#: inputs' dtype (the table's widest and neutral classes)
READERS = {
    "cast": lambda v: S.amp_cast(v, dtype="float32"),
    "concat": lambda v: S.amp_cast(S.concat(v, v, dim=1), dtype="float32"),
    "add": lambda v: S.amp_cast(S.elemwise_add(v, v), dtype="float32"),
    "relu": lambda v: S.amp_cast(S.relu(v), dtype="float32"),
}


def _plan(view, spatial=(4, 4, 4), reader="cast"):
    """data -> bfloat16 convolution -> ``view`` -> ``reader`` -> float32 -> mean: a plan as the
    converter types one."""
    k = (3,) * len(spatial)
    y = S.Convolution(S.amp_cast(S.var("data"), dtype=BFLOAT16), S.amp_cast(S.var("w"), dtype=BFLOAT16),
                      kernel=k, pad=(1,) * len(spatial), num_filter=32, no_bias=True)
    return S.mean(READERS[reader](VIEWS[view](y)), axis=0), (2, 16) + spatial, (32, 16) + k


def _args(data, weight):
    rng = np.random.RandomState(0)
    return {"data": mx.nd.array(rng.uniform(-1, 1, data)), "w": mx.nd.array(rng.uniform(-1, 1, weight)),
            "like": mx.nd.zeros((2, 1, int(np.prod(data[2:])) * 32))}


def _typed(plan):
    return plan_dtypes(plan, {"data": "float32", "w": "float32", "like": "float32"})


def _shapes(plan, data, weight):
    return {k: v for k, v in {"data": data, "w": weight, "like": (2, 1, int(np.prod(data[2:])) * 32)}.items()
            if k in plan.list_arguments()}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_the_run_graph_reshapes_a_plain_copy_and_types_as_the_plan(view):
    plan, data, weight = _plan(view)
    before = plan.tojson(remove_amp_cast=False)
    run = with_plain_views(plan, _typed(plan), _shapes(plan, data, weight))
    assert run is not plan and plan.tojson(remove_amp_cast=False) == before
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    views = [n for n in nodes if n["op"] == view]
    assert len(views) == 1 and nodes[views[0]["inputs"][0][0]]["op"] == "slice_axis"  # the view reads the copy
    assert nodes[nodes[views[0]["inputs"][0][0]]["inputs"][0][0]]["op"] == "Convolution"
    known = {"data": "float32", "w": "float32", "like": "float32"}
    typed = infer_dtypes(run, known)
    assert typed[(nodes[-1]["name"], 0)] == "float32" and typed[(views[0]["name"], 0)] == "bfloat16"
    shapes = _shapes(plan, data, weight)
    assert run.infer_shape(**shapes)[1] == plan.infer_shape(**shapes)[1]
    # and native_passes, the graph every bound plan runs, includes it
    passed = native_passes(plan, _typed(plan), shapes, ("cpu",), False, frozenset())
    assert [n["op"] for n in json.loads(passed.tojson(remove_amp_cast=False))["nodes"]] == [n["op"] for n in nodes]


def test_a_4d_value_keeps_its_graph():
    plan, data, weight = _plan("Reshape", spatial=(4, 4))
    assert with_plain_views(plan, _typed(plan), _shapes(plan, data, weight)) is plan


def _bind_forward(sym, data, weight):
    args = {k: v for k, v in _args(data, weight).items() if k in sym.list_arguments()}
    return sym.bind(mx.cpu(), args, grad_req="null").forward()[0].asnumpy()


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("view, reader", [(v, "cast") for v in sorted(VIEWS)] + [("Reshape", r) for r in READERS])
def test_mxnet_fails_on_the_plan_and_runs_the_graph_with_the_copy(view, reader):
    plan, data, weight = _plan(view, reader=reader)
    with pytest.raises(mx.base.MXNetError, match="primitive descriptor for a (reorder|sum) primitive"):
        _bind_forward(plan, data, weight)
    got = _bind_forward(with_plain_views(plan, _typed(plan), _shapes(plan, data, weight)), data, weight)
    k = (3, 3, 3)
    ref = S.mean(READERS[reader](VIEWS[view](S.Convolution(S.var("data"), S.var("w"), kernel=k, pad=(1, 1, 1),
                                                           num_filter=32, no_bias=True))), axis=0)
    want = _bind_forward(ref, data, weight)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()  # bfloat16's rounding, not garbage


class _Consensus(nn.HybridBlock):
    """C3D's tail: a 3-d convolution, a 3-d max pool, a reshape to segments, a mean, a dense layer."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.conv = nn.Conv3D(64, 3, padding=1, in_channels=16)
            self.pool = nn.MaxPool3D(2, 2)
            self.fc = nn.Dense(10, in_units=64 * 2 * 4 * 4)

    def hybrid_forward(self, F, x):
        y = F.reshape(self.pool(F.relu(self.conv(x))), shape=(-1, 1, 64 * 2 * 4 * 4))
        return self.fc(F.mean(y, axis=1))


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("path", ["init", "converted"])
def test_such_a_network_trains_under_init_and_runs_converted(path):
    mx.random.seed(2)
    net = _Consensus()
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 16, 4, 8, 8))
    ref = net(x).asnumpy()
    if path == "init":
        y = bf16_train_step(net, x)
        assert np.isfinite(net.conv.weight.grad().asnumpy()).all()
    else:
        y = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")(x)
    out = y.asnumpy()
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
