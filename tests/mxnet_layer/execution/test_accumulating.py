"""Gradients that accumulate (``grad_req='add'``) under native bfloat16: MXNet 1.9.1's CPU
``amp_cast``/``amp_multicast`` drop what they add, so a cast of such a leaf reads it through
an identity (gluon_amp_core.accumulating_casts, native_run.with_accumulating_casts, and the
imperative wrappers' casts)."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon

from gluon_amp import execution, runtime
from gluon_amp import mxnet_internals as mxi
from gluon_amp.policy_builder import make_policy
from gluon_amp_core.accumulating_casts import IDENTITY_SUFFIX
from gluon_amp_core.paired_casts import PAIRED_SUFFIX


def _mlp():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=8), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Xavier(), force_reinit=True)
    return net


def _x():
    return mx.nd.array(np.random.RandomState(3).normal(size=(6, 8)))


def _grads(frontend: str, grad_req: str, passes: int, switch_after_first_call: bool = False):
    """The parameters' gradients after ``passes`` backward passes of one batch under
    ``autocast('bfloat16')``, from the same weights."""
    mx.random.seed(0)
    with gluon_amp.autocast("bfloat16"):
        if frontend == "module":
            data = mx.sym.var("data")
            out = mx.sym.FullyConnected(mx.sym.relu(mx.sym.FullyConnected(data, num_hidden=16, name="fc0")),
                                        num_hidden=4, name="fc1")
            mod = mx.mod.Module(mx.sym.make_loss(mx.sym.sum(mx.sym.square(out))), data_names=["data"],
                                label_names=None, context=mx.cpu())
            mod.bind(data_shapes=[("data", (6, 8))], grad_req=grad_req)
            mx.random.seed(0)
            mod.init_params(mx.init.Xavier())
            batch = mx.io.DataBatch([_x()])
            for _ in range(passes):
                mod.forward(batch, is_train=True)
                mod.backward()
            return {i: g[0].asnumpy() for i, g in enumerate(mod._exec_group.grad_arrays)}
        net = _mlp()
        if frontend == "hybridized":
            net.hybridize(static_alloc=True)
        first = grad_req
        if switch_after_first_call:  # the CachedOp is built for 'write', then the script switches
            first = "write"
        for p in net.collect_params().values():
            p.grad_req = first
        if switch_after_first_call:
            with autograd.record():
                net(_x()).square().sum().backward()
            for p in net.collect_params().values():
                p.grad_req = grad_req
                p.zero_grad()
        for _ in range(passes):
            with autograd.record():
                loss = net(_x()).square().sum()
            loss.backward()
        return {i: p.grad().asnumpy() for i, p in enumerate(net.collect_params().values())}


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("frontend", ["hybridized", "imperative", "module"])
def test_gradients_added_twice_are_twice_the_written_ones(frontend):
    written = _grads(frontend, "write", 1)
    added = _grads(frontend, "add", 2)
    assert written.keys() == added.keys() and len(written) == 4
    for k, g in written.items():
        assert np.abs(g).sum() > 0, k
        np.testing.assert_array_equal(added[k], 2 * g, err_msg=k)  # bfloat16 gradients, sums exact in float32


@pytest.mark.bf16_kernels
def test_a_block_switched_to_add_after_its_first_call_accumulates():
    """GluonNLP's scripts set ``grad_req='add'`` after building the net; a script may do it late."""
    written = _grads("hybridized", "write", 1)
    added = _grads("hybridized", "add", 2, switch_after_first_call=True)
    for k, g in written.items():
        np.testing.assert_array_equal(added[k], 2 * g, err_msg=k)


def test_the_graph_run_natively_casts_accumulating_parameters_through_an_identity(monkeypatch):
    """A planted native host (any CPU): what MXNet would bind for a bfloat16 plan, with two of
    its parameters accumulating; the others stay paired with their op's data."""
    monkeypatch.setattr(runtime, "executable", lambda dtype, device: True)
    monkeypatch.setattr(runtime, "simulated", lambda: False)
    monkeypatch.setattr(runtime, "amx_active", lambda: False)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=4), gluon.nn.Activation("relu"),
            gluon.nn.Conv2D(8, 3, in_channels=8))
    net.initialize()
    sym = net(mx.sym.var("data"))
    params = {k: v.data() for k, v in net.collect_params().items()}
    plan, _, _ = gluon_amp.convert_model(sym, params, {}, target_dtype="bfloat16")
    names = sorted(params)
    adding = {names[0], names[2]}  # a bias and a weight
    run = execution.graph_to_run(plan, {"data": "float32"}, {"data": (2, 4, 8, 8)}, ["cpu"],
                                 make_policy("bfloat16"), "a test's plan", accumulating=adding)
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    by_name = {n["name"]: n for n in nodes}
    for name in names:
        readers = [n for n in nodes if any(nodes[e[0]]["name"] == name for e in n["inputs"])]
        if name in adding:
            assert [r["op"] for r in readers] == ["_copy"] and readers[0]["name"] == name + IDENTITY_SUFFIX
            assert {r["op"] for r in nodes if any(nodes[e[0]]["name"] == readers[0]["name"] for e in r["inputs"])} \
                <= {"amp_cast", "amp_multicast"}
        else:  # cast with its op's data, as without accumulation
            assert [r["name"].endswith(PAIRED_SUFFIX) for r in readers] == [True], name
    assert not any(n["op"] == "Cast" for n in by_name.values())
    plain = execution.graph_to_run(plan, {"data": "float32"}, {"data": (2, 4, 8, 8)}, ["cpu"],
                                   make_policy("bfloat16"), "a test's plan", accumulating=frozenset())
    assert not any(n["name"].endswith(IDENTITY_SUFFIX) for n in json.loads(plain.tojson())["nodes"])


@pytest.mark.simulated_native
def test_setting_grad_req_to_or_from_add_rebuilds_the_blocks_that_hold_the_parameter():
    with gluon_amp.autocast("bfloat16"):
        net, other = _mlp(), _mlp()
        for n in (net, other):
            n.hybridize()
            n(_x()).wait_to_read()
        assert net._cached_op is not None and other._cached_op is not None
        first = list(net.collect_params().values())[0]
        first.grad_req = "write"  # no change: nothing rebuilt
        assert net._cached_op is not None
        first.grad_req = "add"
        assert net._cached_op is None and other._cached_op is not None
        net(_x()).wait_to_read()
        assert mxi.accumulating_params(net) == {first.name}
        first.grad_req = "null"  # from 'add': rebuilt again
        assert net._cached_op is None
        net(_x()).wait_to_read()
        assert mxi.accumulating_params(net) == frozenset()
    # (that disable puts MXNet's property back: tests/mxnet_layer/patching/test_region_interrupts.py)
