"""Where MXNet's oneDNN fusion partitions a plan, a batch norm after a convolution whose weight the
graph casts stays out of that convolution's fusion, which would fold it again on every call
(gluon_amp_core.fusion_barriers, native_run.with_batchnorms_apart)."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet.gluon import nn

from gluon_amp import execution, runtime
from gluon_amp.policy_builder import make_policy
from gluon_amp_core.fusion_barriers import BARRIER_SUFFIX


class _SplitNet(nn.HybridBlock):
    """A grouped convolution (its weight stays float32 in a bfloat16 plan: oneDNN 2.4 cannot
    reorder it stored bfloat16 unfused) and a plain one, each with a batch norm: ResNeSt's unit."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.grouped = nn.Conv2D(16, 3, padding=1, groups=2, use_bias=False, in_channels=8)
            self.bn1 = nn.BatchNorm(in_channels=16)
            self.plain = nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=16)
            self.bn2 = nn.BatchNorm(in_channels=16)

    def hybrid_forward(self, F, x):
        return F.relu(self.bn2(self.plain(F.relu(self.bn1(self.grouped(x))))))


SMALL, LARGE = (1, 8, 4, 4), (8, 8, 8, 8)  # the grouped weight (576) larger than its output (256), and not


def _converted(shape=SMALL):
    net = _SplitNet()
    net.initialize(mx.init.Xavier(magnitude=2))
    for p in net.collect_params(".*running_var").values():
        p.set_data(mx.nd.random.uniform(0.5, 2.0, shape=p.shape))
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.uniform(-1, 1, shape=shape)
    net(x)
    return net, x, gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")


def _fused_ops(sym):
    """``(op, the conv's name inside, with_bn)`` of each node MXNet's MKLDNN partition gives."""
    nodes = json.loads(sym.get_backend_symbol("MKLDNN").tojson(remove_amp_cast=False))["nodes"]
    out = []
    for n in nodes:
        if n["op"] == "_sg_mkldnn_conv":
            inner = [m["name"] for m in n["subgraphs"][0]["nodes"] if m["op"] == "Convolution"]
            out.append(("conv", inner[0], n.get("attrs", {}).get("with_bn") == "true"))
        elif n["op"] == "BatchNorm":
            out.append(("bn", n["name"], False))
    return out


@pytest.mark.parametrize("fused, shape", [(True, SMALL), (False, SMALL), (True, LARGE)])
def test_a_fused_run_folds_only_the_batch_norms_of_stored_weights(monkeypatch, fused, shape):
    net, _, block = _converted(shape)
    plan_json = json.dumps(block.amp_result.graph)
    plan = mx.sym.load_json(plan_json)
    fed = {"data": "float32", **{k: str(v) for k, v in block.amp_result.param_dtypes.items()}}
    assert fed[net.grouped.weight.name] == "float32" and fed[net.plain.weight.name] == "bfloat16"
    monkeypatch.setattr(runtime, "executable", lambda dtype, device: True)  # any CPU: nothing runs here
    monkeypatch.setattr(runtime, "simulated", lambda: False)
    run = execution.graph_to_run(plan, fed, {"data": shape}, ["cpu"], make_policy("bfloat16"),
                                 "a test's plan", pair=False, fused=fused)
    fused = fused and shape == SMALL  # a batch norm is kept apart only where its fold costs more
    nodes = json.loads(run.tojson(remove_amp_cast=False))["nodes"]
    barriers = [n["name"] for n in nodes if n["name"].endswith(BARRIER_SUFFIX)]
    assert barriers == ([net.grouped.name + "_fwd" + BARRIER_SUFFIX] if fused else [])
    ops = _fused_ops(run)
    grouped = [o for o in ops if o[0] == "conv" and o[1].startswith(net.grouped.name)]
    plain = [o for o in ops if o[0] == "conv" and o[1].startswith(net.plain.name)]
    assert grouped and plain and plain[0][2]  # the stored weight's batch norm is folded either way
    assert grouped[0][2] is not fused  # the cast weight's only without the barrier
    assert [o[1] for o in ops if o[0] == "bn"] == ([net.bn1.name + "_fwd"] if fused else [])
    assert json.dumps(block.amp_result.graph) == plan_json  # the plan (what export writes) is as it was


@pytest.mark.bf16_kernels
def test_the_converted_block_runs_its_batch_norms_apart_and_gives_the_plans_values():
    net, x, block = _converted()
    want = net(x).asnumpy()
    got = block(x).asnumpy()
    run = execution.executed_graph(block)
    assert run is not None and net.grouped.name + "_fwd" + BARRIER_SUFFIX in run.tojson(remove_amp_cast=False)
    unfused = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", fuse=False)(x).asnumpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 0.05 * scale and np.abs(unfused - want).max() <= 0.05 * scale
    for _ in range(2):  # the same values on each call: nothing is folded again
        assert np.array_equal(block(x).asnumpy(), got)


# -- a symbol bound without gradients (Module.bind(for_training=False)) under init -------------

def _conv_bn_symbol():
    x = mx.sym.var("data")
    for i in range(2):
        x = mx.sym.Convolution(x, num_filter=16, kernel=(3, 3), pad=(1, 1), no_bias=True, name=f"c{i}")
        x = mx.sym.Activation(mx.sym.BatchNorm(x, name=f"bn{i}"), act_type="relu")
    return x


@pytest.mark.parametrize("backend", [None, "MKLDNN", "NONE"])
@pytest.mark.parametrize("grad_req", ["null", "write", {"data": "null"}, {"c0_weight": "write"}])
def test_partitioned_when_bound_says_what_mxnet_does(monkeypatch, backend, grad_req):
    """The oracle: whether the executor MXNet binds runs a fused ``_sg_mkldnn_conv``."""
    if backend is None:
        monkeypatch.delenv("MXNET_SUBGRAPH_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MXNET_SUBGRAPH_BACKEND", backend)
    sym = _conv_bn_symbol()
    exe = sym.simple_bind(mx.cpu(), data=(1, 8, 5, 5), grad_req=grad_req)
    ops = {n["op"] for n in json.loads(exe.get_optimized_symbol().tojson())["nodes"]}
    trains = gluon_amp.mxnet_internals.gluon._with_gradients(grad_req, sym.list_arguments())
    assert gluon_amp.mxnet_internals.partitioned_when_bound({"cpu"}, trains) == ("_sg_mkldnn_conv" in ops)


def _module_outputs(x, params, for_training):
    mod = mx.mod.Module(_conv_bn_symbol(), data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", x.shape)], for_training=for_training)
    mod.set_params(*params)
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    return mod, mod.get_outputs()[0].asnumpy()


def test_a_module_bound_for_inference_keeps_its_batch_norms_out_of_the_fusion(native_host, monkeypatch):
    """Bound without gradients, MXNet fuses each convolution with its batch norm, and the fused op
    folds the batch norm into the weight the plan casts anew at each call (an 8-layer stack of
    3x3 convolutions at batch 1 ran 20x FP32's time): the batch norm stays apart where its weight
    is larger than its output, and the values are the plan's. A training bind is not partitioned,
    and pairs its weight casts as before. (A simulated host runs the plan emulated: there the
    binding's decision is checked; real kernels run it.)"""
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.uniform(-1, 1, (1, 8, 5, 5)))
    sym = _conv_bn_symbol()
    arg_shapes, _, aux_shapes = sym.infer_shape(data=x.shape)
    args = {n: mx.nd.array(rng.uniform(-0.5, 0.5, s)) for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}
    aux = {n: mx.nd.array(rng.uniform(0.5, 2.0, s)) for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    _, expect = _module_outputs(x, (args, aux), for_training=False)
    asked = []
    real = execution.graph_to_run

    def recording(*a, **k):
        asked.append((k.get("fused"), k.get("pair")))
        return real(*a, **k)

    monkeypatch.setattr(execution, "graph_to_run", recording)
    gluon_amp.init("bfloat16", tune=False)
    mod, got = _module_outputs(x, (args, aux), for_training=False)
    np.testing.assert_allclose(got, expect, rtol=0.05, atol=0.05)
    assert not np.array_equal(got, expect)  # it ran the bfloat16 plan
    assert asked == [(True, False)]
    if not runtime.simulated():
        run = mod._exec_group.execs[0]._symbol
        names = [n["name"] for n in json.loads(run.tojson(remove_amp_cast=False))["nodes"]]
        assert any(name.endswith(BARRIER_SUFFIX) for name in names), names
        fused = _fused_ops(run)
        assert ("bn", "bn0", False) in fused and ("bn", "bn1", False) in fused, fused
    _module_outputs(x, (args, aux), for_training=True)
    assert asked[1:] == [(False, True)]
