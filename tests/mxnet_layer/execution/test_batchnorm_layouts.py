"""On an AMX host a bfloat16 batch norm next to a convolution with 16-channel blocks gets a plain
input, so that its backward pass meets one oneDNN layout, not two (gluon_amp_core.layout_guards,
native_run.with_layout_guards)."""
import contextlib
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon

from gluon_amp import execution, runtime
from gluon_amp.policy_builder import make_policy
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.layout_guards import GUARD_SUFFIX


def _net(channels=16):
    """conv (16) -> BN -> relu -> conv (32, stride 2) -> BN -> relu -> dense: GluonCV's CIFAR
    ResNets' first stage and its transition."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(channels, 3, padding=1, use_bias=False, in_channels=4),
            gluon.nn.BatchNorm(in_channels=channels), gluon.nn.Activation("relu"),
            gluon.nn.Conv2D(32, 1, strides=2, use_bias=False, in_channels=channels),
            gluon.nn.BatchNorm(in_channels=32), gluon.nn.Activation("relu"), gluon.nn.Dense(4, in_units=32 * 8 * 8))
    net.initialize(mx.init.Xavier())
    return net


def _plan(channels=16):
    net = _net(channels)
    sym = net(mx.sym.var("data"))
    params = {k: v.data() for k, v in net.collect_params().items() if "running" not in k}
    aux = {k: v.data() for k, v in net.collect_params().items() if "running" in k}
    plan, _, _ = gluon_amp.convert_model(sym, params, aux, target_dtype="bfloat16")
    return plan


def _run(plan, monkeypatch, amx, pair=True):
    monkeypatch.setattr(runtime, "executable", lambda dtype, device: True)
    monkeypatch.setattr(runtime, "simulated", lambda: False)
    monkeypatch.setattr(runtime, "amx_active", lambda: amx)
    return execution.graph_to_run(plan, {"data": "float32"}, {"data": (2, 4, 16, 16)}, ["cpu"],
                                  make_policy("bfloat16"), "a test's plan", pair=pair, accumulating=frozenset())


def test_an_amx_host_runs_each_batch_norm_at_risk_on_a_plain_input(monkeypatch):
    """A planted AMX host (any CPU): both batch norms are next to a 16-channel convolution."""
    plan = _plan()
    before = plan.tojson()
    run = _run(plan, monkeypatch, amx=True)
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    bns = [n for n in nodes if n["op"] == "BatchNorm"]
    assert len(bns) == 2
    for bn in bns:
        guard = nodes[bn["inputs"][0][0]]
        assert guard["name"] == bn["name"] + GUARD_SUFFIX and guard["op"] == "Reshape"
        conv = nodes[guard["inputs"][0][0]]
        if conv["op"] == "slice_axis":  # AMX trains 16 filters on a whole block of 32 (filter_blocks)
            conv = nodes[conv["inputs"][0][0]]
        assert conv["op"] == "Convolution"
    plan_types = infer_dtypes(plan, {"data": "float32"})
    run_types = infer_dtypes(run, {"data": "float32"})
    plan_nodes = json.loads(plan.tojson(remove_amp_cast=False))["nodes"]
    ops = {n["name"] for n in plan_nodes if n["op"] not in ("null", "amp_cast", "amp_multicast")}
    assert {k: v for k, v in run_types.items() if k[0] in ops} == {k: v for k, v in plan_types.items() if k[0] in ops}
    assert plan.tojson() == before  # the plan (what export writes) is left as it is


@pytest.mark.parametrize("case", ["no AMX", "inference graph", "32 channels"])
def test_no_guard_where_no_mixed_layouts_can_meet(monkeypatch, case):
    plan = _plan(32 if case == "32 channels" else 16)
    run = _run(plan, monkeypatch, amx=case != "no AMX", pair=case != "inference graph")
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    guarded = [n["name"] for n in nodes if n["name"].endswith(GUARD_SUFFIX)]
    # 32 channels: the first batch norm's neighbours all take 32-channel blocks; the transition's
    # 1x1 convolution reads 32 channels and gives 32
    assert guarded == []


def _grads(mode: str, monkeypatch):
    """The loss and gradients of one step from the same weights: ``mode`` 'guarded',
    'unguarded' (bfloat16) or 'float32'."""
    monkeypatch.setattr(runtime, "amx_active", lambda: mode == "guarded")
    mx.random.seed(0)
    net = _net()
    net.hybridize(static_alloc=True)
    x = mx.nd.array(np.random.RandomState(1).normal(size=(8, 4, 16, 16)))
    with gluon_amp.autocast("bfloat16") if mode != "float32" else contextlib.nullcontext():
        with autograd.record():
            loss = net(x).square().mean()
        loss.backward()
        guards = 0
        if mode != "float32":
            nodes = json.loads(execution.executed_graph(net).tojson(remove_amp_cast=False))["nodes"]
            guards = sum(n["name"].endswith(GUARD_SUFFIX) for n in nodes)
    grads = np.concatenate([p.grad().asnumpy().ravel() for p in net.collect_params().values()
                            if p.grad_req != "null"])
    return float(loss.asscalar()), grads, guards


@pytest.mark.bf16_kernels
def test_training_with_the_guards_gives_the_plans_values_to_bfloat16s_precision(monkeypatch):
    """The guard moves the batch norm to oneDNN's plain-layout kernel, whose sums run in
    another order: guarded and unguarded bfloat16 differ from each other by less than each
    differs from float32."""
    loss, g, n = _grads("guarded", monkeypatch)
    loss0, g0, n0 = _grads("unguarded", monkeypatch)
    loss32, g32, _ = _grads("float32", monkeypatch)
    assert (n, n0) == (2, 0)
    assert abs(loss - loss0) <= max(abs(loss - loss32), abs(loss0 - loss32))
    assert np.linalg.norm(g - g0) <= 0.5 * max(np.linalg.norm(g - g32), np.linalg.norm(g0 - g32)), \
        (np.linalg.norm(g - g0), np.linalg.norm(g - g32), np.linalg.norm(g0 - g32))
