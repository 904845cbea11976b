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
