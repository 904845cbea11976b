"""A natively run bfloat16 graph casts each weight together with its op's data
(gluon_amp_core.paired_casts, gluon_amp.native_run.with_paired_casts)."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon

from gluon_amp import execution, native_run, runtime
from gluon_amp.policy_builder import make_policy
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.filter_blocks import PADDED_SUFFIX as WHOLE_BLOCKS
from gluon_amp_core.paired_casts import PAIRED_SUFFIX


class Residual(gluon.HybridBlock):
    """A convolution with a bias, a block whose input two ops read, and a dense head."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.stem = gluon.nn.Conv2D(8, 3, padding=1, in_channels=4)
            self.body = gluon.nn.Conv2D(8, 3, padding=1, in_channels=8, use_bias=False)
            self.short = gluon.nn.Conv2D(8, 1, in_channels=8, use_bias=False)
            self.head = gluon.nn.Dense(4, in_units=8 * 8 * 8)

    def hybrid_forward(self, F, x):
        h = F.relu(self.stem(x))
        return self.head(F.relu(self.body(h)) + self.short(h))


def _plan():
    net = Residual()
    net.initialize(mx.init.Xavier())
    sym = net(mx.sym.var("data"))
    params = {k: v.data() for k, v in net.collect_params().items()}
    plan, _, _ = gluon_amp.convert_model(sym, params, {}, target_dtype="bfloat16")
    return plan


def test_a_plan_run_natively_pairs_each_weight_cast_and_mxnet_types_it_as_the_plan(monkeypatch):
    """A planted native host (any CPU): what MXNet would bind for a bfloat16 plan."""
    monkeypatch.setattr(runtime, "executable", lambda dtype, device: True)
    monkeypatch.setattr(runtime, "simulated", lambda: False)
    plan = _plan()
    before = plan.tojson()
    run = execution.graph_to_run(plan, {"data": "float32"}, {"data": (2, 4, 8, 8)}, ["cpu"],
                                 make_policy("bfloat16"), "a test's plan", accumulating=frozenset())
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    paired = {n["name"][:-len(PAIRED_SUFFIX)]: n for n in nodes if n["name"].endswith(PAIRED_SUFFIX)}
    # a convolution on whole blocks of filters keeps its name on the slice of its output
    low_ops = [n["name"].removesuffix(WHOLE_BLOCKS) for n in nodes if n["op"] in ("Convolution", "FullyConnected")]
    assert sorted(paired) == sorted(low_ops)  # the stem's data is its own cast of the input
    assert {n["op"] for n in paired.values()} == {"amp_multicast"}
    plan_types = infer_dtypes(plan, {"data": "float32"})
    run_types = infer_dtypes(run, {"data": "float32"})
    planned = {n["name"] for n in json.loads(plan.tojson())["nodes"]}
    ops = {n["name"] for n in nodes if n["op"] not in ("null", "amp_cast", "amp_multicast")} & planned
    assert {k: v for k, v in run_types.items() if k[0] in ops} == {k: v for k, v in plan_types.items() if k[0] in ops}
    assert plan.tojson() == before  # the plan itself is left as it is


def _train(paired: bool, monkeypatch, grad_req: str = "write"):
    counted = []
    real = native_run.pair_param_casts

    def spy(graph, dtypes, low):
        out, n = real(graph, dtypes, low) if paired else (graph, 0)
        counted.append(n)
        return out, n

    monkeypatch.setattr(native_run, "pair_param_casts", spy)
    mx.random.seed(0)
    net = Residual()
    net.initialize(mx.init.Xavier())
    for name, p in net.collect_params().items():
        # "frozen stem": no gradient for the stem ("add" pairs nothing: test_accumulating.py)
        p.grad_req = ("null" if "conv0" in name else "write") if grad_req == "frozen stem" else grad_req
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            update_on_kvstore=False)
    x = mx.nd.array(np.random.RandomState(1).normal(size=(2, 4, 8, 8)))
    with gluon_amp.autocast("bfloat16"):
        gluon_amp.init_trainer(trainer)
        for _ in range(2):
            with autograd.record():
                loss = net(x).square().mean()
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(1)
        grads = {k.split("_", 1)[1]: v.grad().asnumpy() for k, v in net.collect_params().items()
                 if v.grad_req != "null"}
        weights = {k.split("_", 1)[1]: v.data().asnumpy() for k, v in net.collect_params().items()}
    return loss.asnumpy(), grads, weights, sum(counted)


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("grad_req", ["write", "frozen stem"])
def test_training_with_paired_casts_gives_the_plans_values_bit_for_bit(monkeypatch, grad_req):
    loss, grads, weights, n = _train(True, monkeypatch, grad_req)
    loss0, grads0, weights0, n0 = _train(False, monkeypatch, grad_req)
    assert n >= 4 and n0 == 0, (n, n0)
    np.testing.assert_array_equal(loss, loss0)
    assert grads.keys() == grads0.keys() and weights.keys() == weights0.keys()
    for k in grads0:
        np.testing.assert_array_equal(grads[k], grads0[k], err_msg=k)
    for k in weights0:
        np.testing.assert_array_equal(weights[k], weights0[k], err_msg=k)


@pytest.mark.bf16_kernels
def test_a_converters_result_runs_its_plan_unpaired_and_an_init_block_paired(monkeypatch):
    """A converter's result is an inference graph: pairing would save nothing there. An init
    block's graph is paired; its graph for calls that record nothing (on stored casts) is not."""
    flags = []
    real = execution.graph_to_run
    monkeypatch.setattr(execution, "graph_to_run", lambda *a, **k: flags.append(k.get("pair")) or real(*a, **k))
    x = mx.nd.ones((2, 4, 8, 8))
    net = Residual()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(x)
    block = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")
    block(x).wait_to_read()
    assert flags and set(flags) == {False}
    del flags[:]
    sym = net(mx.sym.var("data"))
    params = {k: v.data() for k, v in net.collect_params().items()}
    converted, args, _ = gluon_amp.convert_model(sym, params, {}, target_dtype="bfloat16")
    converted.bind(mx.cpu(), {"data": x, **args}).forward()[0].wait_to_read()
    assert flags == [False]
    del flags[:]
    with gluon_amp.autocast("bfloat16"):
        fresh = Residual()
        fresh.initialize(mx.init.Xavier())
        fresh.hybridize()
        fresh(x).wait_to_read()
    assert flags == [True, False]
