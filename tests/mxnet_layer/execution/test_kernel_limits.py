"""A bfloat16 kernel that fails at some shapes runs in float32 there, on every path: ``init``
(imperative and hybridized), a conversion with ``input_shapes``, and any plan where it is bound
(gluon_amp_core.shape_limits, native_run.within_kernel_limits).

The fact behind the table's rule: oneDNN 2.4.4's AMX bfloat16 convolution corrupts the heap for a
plain 1x1 kernel (1-, 2- or 3-d) whose output map has 27, 33, 36, 39, 42, 45 or 48 pixels (input
channels a multiple of 32). ResNets at 256x192 meet it in their last stage (8x6)."""
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gluon_amp
import gluon_amp_core.table
import mxnet as mx
from mxnet.gluon import nn

from gluon_amp import runtime
from gluon_amp.execution import plan_dtypes
from gluon_amp.native_run import within_kernel_limits
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.decide import users_casts
from gluon_amp_core.retype import in_float32
from gluon_amp_core.shape_limits import keeps_fp32, output_spatial

#: the rule's map (48 pixels) and its neighbours, which the kernel runs
AT, BESIDE = (8, 6), (7, 7)


def test_output_spatial_is_what_mxnet_infers():
    rng = random.Random(7)
    for _ in range(200):
        dims = rng.choice([1, 2, 3])
        spatial = tuple(rng.randint(1, 20) for _ in range(dims))
        kernel = tuple(rng.randint(1, 5) for _ in range(dims))
        stride = tuple(rng.randint(1, 3) for _ in range(dims))
        dilate = tuple(rng.randint(1, 2) for _ in range(dims))
        pad = tuple(rng.randint(0, 2) for _ in range(dims))
        if any(x + 2 * p < d * (k - 1) + 1 for x, k, p, d in zip(spatial, kernel, pad, dilate)):
            continue  # MXNet refuses a kernel larger than the padded input
        sym = mx.sym.Convolution(mx.sym.var("x"), kernel=kernel, stride=stride, dilate=dilate, pad=pad,
                                 num_filter=4, no_bias=True)
        _, (out,), _ = sym.infer_shape(x=(1, 3) + spatial)
        attrs = json.loads(sym.tojson())["nodes"][-1]["attrs"]  # as MXNet writes them
        assert output_spatial(spatial, kernel, attrs) == tuple(out[2:]), (spatial, attrs)


class _Tail(nn.HybridBlock):
    """A ResNet bottleneck's shape: 1x1 (64 -> 32), 3x3, 1x1 (32 -> 64), batch norms, a residual add."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.reduce = nn.Conv2D(32, 1, use_bias=False, in_channels=64)
            self.bn1 = nn.BatchNorm(in_channels=32)
            self.mid = nn.Conv2D(32, 3, padding=1, use_bias=False, in_channels=32)
            self.expand = nn.Conv2D(64, 1, use_bias=False, in_channels=32)
            self.bn2 = nn.BatchNorm(in_channels=64)

    def hybrid_forward(self, F, x):
        y = F.relu(self.bn1(self.reduce(x)))
        return F.relu(self.bn2(self.expand(F.relu(self.mid(y)))) + x)


def _net():
    mx.random.seed(3)
    net = _Tail()
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize()
    return net


def _conv_rows(block):
    return {r.name: (r.dtype, r.reason) for r in gluon_amp.report(block).rows if r.op == "Convolution"}


@pytest.mark.simulated_native
def test_a_converted_plan_bound_at_those_shapes_runs_them_float32_and_still_type_checks():
    net = _net()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 64) + AT)
    net(x)
    converted = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")
    plan = converted._converted
    known = {"data": "float32", **gluon_amp.mxnet_internals.param_dtypes(converted)}
    typed = plan_dtypes(plan, known)
    convs = sorted(k[0] for k, t in typed.items() if k[0].endswith("_fwd") and "conv" in k[0] and t == "bfloat16")
    assert len(convs) == 3, typed  # the plan runs all three low, whatever the shapes

    run, run_typed = within_kernel_limits(plan, typed, {"data": (2, 64) + AT})
    assert infer_dtypes(run, known) is not None, "the run graph does not type-check"
    low = {name for (name, k), t in run_typed.items() if k == 0 and t == "bfloat16" and name in convs}
    assert low == {c for c in convs if "conv1" in c}, run_typed  # the 3x3 stays low; both 1x1 run float32
    _, plan_out, _ = plan.infer_type_partial(data="float32")
    _, run_out, _ = run.infer_type_partial(data="float32")
    assert run_out == plan_out  # its readers, and its caller, get what they had
    assert json.loads(plan.tojson(remove_amp_cast=False)) != json.loads(run.tojson(remove_amp_cast=False))

    same, same_typed = within_kernel_limits(plan, typed, {"data": (2, 64) + BESIDE})
    assert same is plan and same_typed is typed


def _downsampling_block():
    """ResNet v1's first bottleneck of a stage (convolutions with biases, a strided 1x1 and a
    strided 1x1 shortcut, a residual add), whose last 1x1 convolution the rule keeps float32 at
    16x12 inputs (an 8x6 map, 32 channels in)."""
    from mxnet.gluon.model_zoo.vision.resnet import BottleneckV1
    mx.random.seed(5)
    block = BottleneckV1(128, 2, downsample=True, in_channels=64)
    block.initialize(mx.init.Xavier(magnitude=2))
    block.hybridize()
    return block


@pytest.mark.simulated_native
def test_the_float32_values_flow_on_so_that_mxnets_fusion_still_partitions_the_graph():
    """Cast back at once, the residual add moves into the shortcut convolution's fusion and
    MXNet 1.9.1's partitioner then feeds another fused convolution the wrong arrays."""
    block = _downsampling_block()
    x = mx.nd.random.uniform(-1, 1, shape=(1, 64, 16, 12))
    block(x)
    converted = gluon_amp.convert_hybrid_block(block, target_dtype="bfloat16")
    plan = converted._converted
    known = {"data": "float32", **gluon_amp.mxnet_internals.param_dtypes(converted)}
    typed = plan_dtypes(plan, known)
    run, run_typed = within_kernel_limits(plan, typed, {"data": x.shape})
    assert run is not plan
    params = {p.name: p.data() for p in converted.collect_params().values()}

    def partition(sym):
        args = {**{k: v for k, v in params.items() if k in sym.list_arguments()}, "data": x}
        aux = {k: v for k, v in params.items() if k in sym.list_auxiliary_states()}
        return sym.optimize_for("MKLDNN", args, aux, mx.cpu())  # infers shapes and types; runs nothing

    fused = json.loads(partition(run).tojson(remove_amp_cast=False))["nodes"]
    inner = [[m["op"] for m in n["subgraphs"][0]["nodes"] if m["op"] != "null"]
             for n in fused if n["op"] == "_sg_mkldnn_conv"]
    assert ["Convolution", "BatchNorm", "elemwise_add", "Activation"] in inner, inner

    graph = json.loads(plan.tojson(remove_amp_cast=False))
    limited = [n for (n, k), t in typed.items() if k == 0 and t == "bfloat16" and n not in
               {m for (m, j), u in run_typed.items() if j == 0 and u == "bfloat16"} and n.endswith("_fwd")
               and "conv" in n]
    island = mx.sym.load_json(json.dumps(in_float32(graph, {limited[0]}, typed, users_casts(graph))))
    with pytest.raises(mx.base.MXNetError, match="Shape inconsistent"):
        partition(island)  # what the following avoids


@pytest.mark.simulated_native
def test_a_conversion_given_input_shapes_types_its_plan_so():
    net = _net()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 64) + AT)
    net(x)
    rows = _conv_rows(gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", tune=False,
                                                     input_shapes={"data": (2, 64) + AT}))
    assert sorted(rows.values()) == [("bfloat16", "low_precision"), ("float32", "narrow_input"),
                                     ("float32", "narrow_input")], rows
    rows = _conv_rows(gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", tune=False,
                                                     input_shapes={"data": (2, 64) + BESIDE}))
    assert {d for d, _ in rows.values()} == {"bfloat16"}, rows


def test_init_keeps_them_float32_imperative_and_hybridized(native_host):
    gluon_amp.init(target_dtype="bfloat16")
    w = mx.nd.random.uniform(-1, 1, shape=(64, 64, 1, 1))
    for (h, w_), channels in itertools.product([AT, BESIDE, (6, 8), (3, 9)], [64, 48]):
        x = mx.nd.random.uniform(-1, 1, shape=(1, channels, h, w_))
        y = mx.nd.Convolution(x, w[:, :channels], kernel=(1, 1), num_filter=64, no_bias=True)
        want = "float32" if h * w_ in (48, 27) and channels == 64 else "bfloat16"
        assert gluon_amp.mxnet_internals.FLOAT_NAMES.get(y.dtype) == want, ((h, w_), channels)
    net = _net()
    net(mx.nd.random.uniform(-1, 1, shape=(2, 64) + BESIDE))
    assert {d for d, _ in _conv_rows(net).values()} == {"bfloat16"}
    with mx.autograd.record():
        loss = net(mx.nd.random.uniform(-1, 1, shape=(2, 64) + AT)).mean()
    loss.backward()
    assert sorted(_conv_rows(net).values()) == [("bfloat16", "low_precision"), ("float32", "narrow_input"),
                                                ("float32", "narrow_input")]


def test_init_keeps_a_plain_conv1d_or_conv3d_float32_and_a_grouped_one_low(native_host):
    gluon_amp.init(target_dtype="bfloat16")
    for shape, attrs, want in [((2, 64, 36), {}, "float32"), ((2, 64, 35), {}, "bfloat16"),
                               ((1, 64, 3, 4, 4), {}, "float32"), ((1, 64, 3, 4, 5), {}, "bfloat16"),
                               ((1, 64) + AT, {"num_group": 2}, "bfloat16"),
                               ((1, 64) + AT, {"dilate": (2, 2)}, "bfloat16"),
                               ((1, 64, 6, 4), {"pad": (1, 1)}, "bfloat16"),  # 8x6 out, padded
                               ((1, 64) + AT, {"num_group": 1, "dilate": (1, 1), "pad": (0, 0)}, "float32")]:
        ones = (1,) * (len(shape) - 2)
        w = mx.nd.random.uniform(-1, 1, shape=(64, 64 // attrs.get("num_group", 1)) + ones)
        y = mx.nd.Convolution(mx.nd.random.uniform(-1, 1, shape=shape), w, kernel=ones, num_filter=64,
                              no_bias=True, **attrs)
        assert gluon_amp.mxnet_internals.FLOAT_NAMES.get(y.dtype) == want, (shape, attrs)


_RUN = textwrap.dedent("""
    import os, sys
    import gluon_amp, mxnet as mx, numpy as np
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    from test_kernel_limits import _net, AT
    from helpers import bf16_train_step
    net = _net()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 64) + AT)
    path = sys.argv[1]
    with mx.autograd.record(train_mode=path == "init"):  # training: batch statistics
        ref = net(x).asnumpy()
    if path == "init":
        out = bf16_train_step(net, x).asnumpy()
    else:
        kw = {{"unfused": dict(fuse=False), "shapes": dict(input_shapes={{"data": x.shape}})}}.get(path, {{}})
        converted = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", **kw)
        converted(x)
        out = converted(x).asnumpy()
    print("REL", float(np.abs(out - ref).max() / np.abs(ref).max()))
""")

_RAW = textwrap.dedent("""
    import json, sys
    import gluon_amp, mxnet as mx
    from gluon_amp.mxnet_internals import BFLOAT16
    shape, attrs = json.loads(sys.argv[1])
    group = int(attrs.get("num_group", 1))
    ones = (1,) * (len(shape) - 2)
    x = mx.nd.amp_cast(mx.nd.random.uniform(shape=shape), dtype=BFLOAT16)
    k = mx.nd.amp_cast(mx.nd.random.uniform(shape=(64, shape[1] // group) + ones), dtype=BFLOAT16)
    for _ in range(3):
        mx.nd.Convolution(x, k, kernel=ones, num_filter=64, no_bias=True, **attrs).wait_to_read()
    print("RAN")
""")


def _run(code, *args, timeout=300):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONFAULTHANDLER=""))


def _survives(shape, attrs):
    """True when one bfloat16 1x1 convolution (64 filters) on an input of ``shape`` with ``attrs``
    runs to its end in a process of its own: a corrupted heap aborts, faults, or hangs in
    ``malloc`` (a minute is twenty times what it takes)."""
    try:
        r = _run(_RAW, json.dumps([shape, attrs]), timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and "RAN" in r.stdout


@pytest.mark.bf16_kernels
def test_the_kernel_fails_there_on_amx_only_as_the_rule_says():
    """What this CPU's kernels give: on AMX the process dies at the rule's shapes, and runs
    beside them; without AMX (AVX512-BF16 kernels) it runs everywhere. If MXNet's kernel is
    ever fixed, this fails, and the rule can go."""
    amx = runtime.amx_active()
    rules = gluon_amp_core.table.default_table("bfloat16").narrow_fp32["Convolution"]
    cases = [((1, 64, 8, 6), {}), ((1, 32, 1, 27), {}), ((1, 96, 3, 11), {}),  # the rule's
             ((1, 64, 36), {}), ((2, 64, 3, 4, 3), {}),  # Conv1D and Conv3D at 36 pixels
             ((1, 64, 7, 7), {}), ((1, 48, 8, 6), {}), ((1, 64, 5, 6), {}), ((1, 64, 35), {}),  # beside
             ((1, 64, 8, 6), {"num_group": 2}), ((1, 64, 4, 6), {"pad": (1, 1)}),  # 48 pixels, not plain
             ((1, 64, 8, 6), {"dilate": (2, 2)})]
    for shape, attrs in cases:
        dies = keeps_fp32(rules, shape, {"kernel": str((1,) * (len(shape) - 2)), **attrs})
        assert _survives(shape, attrs) is not (amx and dies), (shape, attrs, dies)


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("path", ["converted", "unfused", "shapes", "init"])
def test_a_network_at_those_shapes_runs_on_every_path(path):
    r = _run(_RUN.format(here=os.path.dirname(os.path.abspath(__file__))), path)
    assert r.returncode == 0, r.stderr[-2000:]
    rel = float(r.stdout.split("REL")[-1])
    assert rel < 0.05, rel  # bfloat16's error through three convolutions, not garbage
    assert np.isfinite(rel)
