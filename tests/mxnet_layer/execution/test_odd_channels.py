"""A convolution on an odd number of channels below 16 (an image's 3) runs float32, with the
batch norm and pooling after it, on every path: ``init`` (hybridized, training), a conversion
with ``input_shapes``, and a converted plan where it is bound
(gluon_amp_core.shape_limits.OddChannelsRule, native_run.within_kernel_limits).

The fact behind the table's rule: oneDNN 2.4.4's bfloat16 convolution (AVX512-BF16 without AMX) runs a GEMM
on plain arrays for such channel counts, where its float32 kernel blocks them, and the batch norm
reading it then runs oneDNN's reference kernel: SSD-512's first layers took 3.5x their float32
time in training."""
import json
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest

import gluon_amp
import mxnet as mx
from mxnet.gluon import nn

from gluon_amp.execution import plan_dtypes
from gluon_amp.native_run import within_kernel_limits
from gluon_amp_core.shape_limits import OddChannelsRule
from gluon_amp_core.table import default_table

RULE = default_table("bfloat16").narrow_fp32["Convolution"]
#: channel counts the rule runs float32 (an image's 3, 1, 15) and beside it
KEPT, LOW = (1, 3, 15), (4, 16, 24)


class _Stem(nn.HybridBlock):
    """An image network's first layers: convolution, batch norm, ReLU, max pooling, then a
    second convolution on 16 channels."""

    def __init__(self, channels):
        super().__init__()
        with self.name_scope():
            self.conv0 = nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=channels)
            self.bn0 = nn.BatchNorm(in_channels=16)
            self.pool = nn.MaxPool2D(2)
            self.conv1 = nn.Conv2D(16, 3, padding=1, use_bias=False, in_channels=16)

    def hybrid_forward(self, F, x):
        return self.conv1(self.pool(F.relu(self.bn0(self.conv0(x)))))


def _stem(channels):
    mx.random.seed(channels)
    net = _Stem(channels)
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize()
    return net


def _rows(block):
    return {r.op + ("0" if "conv0" in r.name or "batchnorm" in r.name else "1" if "conv1" in r.name else ""):
            (r.dtype, r.reason) for r in gluon_amp.report(block).rows if r.op in ("Convolution", "BatchNorm")}


def test_the_bfloat16_table_has_the_rule_and_float16_none():
    assert OddChannelsRule(16) in RULE
    assert "Convolution" not in default_table("float16").narrow_fp32


@pytest.mark.parametrize("channels", KEPT + LOW)
def test_init_trains_such_a_first_convolution_and_its_batch_norm_float32(native_host, channels):
    gluon_amp.init(target_dtype="bfloat16", tune=False)
    net = _stem(channels)
    with mx.autograd.record():
        loss = net(mx.nd.random.uniform(-1, 1, shape=(2, channels, 8, 8))).mean()
    loss.backward()
    kept = channels in KEPT
    rows = _rows(net)
    assert rows["Convolution0"] == (("float32", "narrow_input") if kept else ("bfloat16", "low_precision")), rows
    assert rows["BatchNorm0"][0] == ("float32" if kept else "bfloat16"), rows  # it follows its input
    assert rows["Convolution1"] == ("bfloat16", "low_precision"), rows
    weight = net.conv0.weight
    assert weight.grad().dtype == weight.data().dtype and mx.nd.norm(weight.grad()).asscalar() > 0


@pytest.mark.simulated_native
@pytest.mark.parametrize("channels", KEPT + LOW)
def test_a_conversion_given_input_shapes_types_it_so(channels):
    net = _stem(channels)
    x = mx.nd.random.uniform(-1, 1, shape=(1, channels, 8, 8))
    net(x)
    converted = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", tune=False,
                                               input_shapes={"data": x.shape})
    rows = _rows(converted)
    assert rows["Convolution0"][0] == ("float32" if channels in KEPT else "bfloat16"), rows
    assert rows["Convolution1"][0] == "bfloat16", rows


@pytest.mark.simulated_native
@pytest.mark.parametrize("channels", KEPT + LOW)
def test_a_conversion_without_input_shapes_reads_the_channels_from_the_weights(channels):
    """The plan carries the rule, so what ``export`` writes runs as the block does, anywhere."""
    net = _stem(channels)
    net(mx.nd.random.uniform(-1, 1, shape=(1, channels, 8, 8)))
    rows = _rows(gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", tune=False))
    assert rows["Convolution0"] == (("float32", "narrow_input") if channels in KEPT
                                    else ("bfloat16", "low_precision")), rows


@pytest.mark.simulated_native
def test_a_symbol_converted_without_weights_runs_it_float32_where_it_is_bound():
    """``convert_symbol`` knows no weight: its plan runs the convolution low, and the bind at an
    input of 3 channels runs it float32, its readers typed as before."""
    plan = gluon_amp.convert_symbol(_stem(3)(mx.sym.var("data")), target_dtype="bfloat16")
    known = {"data": "float32"}
    typed = plan_dtypes(plan, known)
    conv0 = next(n for (n, k), t in typed.items() if "conv0" in n and n.endswith("_fwd") and k == 0)
    assert typed[(conv0, 0)] == "bfloat16"
    run, run_typed = within_kernel_limits(plan, typed, {"data": (1, 3, 8, 8)})
    assert run_typed[(conv0, 0)] == "float32"
    _, plan_out, _ = plan.infer_type_partial(data="float32")
    _, run_out, _ = run.infer_type_partial(data="float32")
    assert run_out == plan_out
    same, same_typed = within_kernel_limits(plan, typed, {"data": (1, 4, 8, 8)})
    assert same is plan and same_typed is typed


_IMPLS = textwrap.dedent("""
    import json, sys
    import mxnet as mx
    from gluon_amp.mxnet_internals import BFLOAT16
    for channels in json.loads(sys.argv[1]):
        for dtype in ("float32", BFLOAT16):
            x = mx.nd.amp_cast(mx.nd.random.uniform(shape=(2, channels, 32, 32)), dtype=dtype)
            w = mx.nd.amp_cast(mx.nd.random.uniform(shape=(64, channels, 3, 3)), dtype=dtype)
            for grad in (False, True):  # oneDNN's inference and training kernels differ
                for a in (x, w):
                    a.attach_grad()
                with mx.autograd.record(train_mode=grad):
                    y = mx.nd.Convolution(x, w, kernel=(3, 3), pad=(1, 1), num_filter=64, no_bias=True)
                (y.backward() if grad else y.wait_to_read())
                mx.nd.waitall()
""")


def _forward_kernels(channel_counts):
    """(channels, dtype, prop kind) -> the oneDNN implementation of its forward convolution
    (inference and training), from ``DNNL_VERBOSE``."""
    env = dict(os.environ, DNNL_VERBOSE="1")
    r = subprocess.run([sys.executable, "-c", _IMPLS, json.dumps(channel_counts)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    impls = {}
    for line in r.stdout.splitlines():  # oneDNN's own stdout: each line names its dtype and shape
        found = re.match(r"dnnl_verbose,exec,cpu,convolution,([^,]+),(forward_\w+),src_(f32|bf16):.*_ic(\d+)oc",
                         line)
        if found:
            impl, prop, dtype, c = found.groups()
            impls[(int(c), "float32" if dtype == "f32" else "bfloat16", prop)] = impl
    return impls


@pytest.mark.bf16_kernels
def test_the_rule_is_where_bfloat16s_kernel_runs_a_gemm_and_float32s_blocks():
    """What oneDNN picks on this CPU, for inference and training: if a later oneDNN blocks these
    channels in bfloat16, this fails, and the rule can go.

    Where oneDNN runs AMX (a Xeon with ``amx_bf16``, measured on 2026-11-28), its AMX kernel
    takes 3 channels in inference, not the GEMM: the rule's reason is AVX512-BF16's, and a plan
    typed anywhere keeps it (it runs 1.65x FP32 in SSD-512's training there, the rule applied;
    the rule's own gain there is not measured)."""
    if gluon_amp.runtime.amx_active():
        impl = _forward_kernels([3])[(3, "bfloat16", "forward_inference")]
        assert "amx" in impl and "gemm" not in impl, impl
        return
    rng = random.Random(11)
    counts = sorted({1, 2, 3, 15, 16} | set(rng.sample(range(4, 15), 5)))
    impls = _forward_kernels(counts)
    for c in counts:
        kept = any(rule.applies((2, c, 32, 32), {"kernel": "(3, 3)"}) for rule in RULE)
        for prop in ("forward_inference", "forward_training"):
            gemm = {d: "gemm" in impls[(c, d, prop)] for d in ("float32", "bfloat16")}
            assert kept is (gemm["bfloat16"] and not gemm["float32"]), (c, prop, impls[(c, "float32", prop)],
                                                                          impls[(c, "bfloat16", prop)])


@pytest.mark.simulated_native
def test_input_shapes_checked_once_are_not_checked_again(monkeypatch):
    """Each call with other input shapes than the last asked the rules again: the graph's
    shapes and decisions, about a ResNet-50 call's time, at every call of a program whose
    image sizes alternate. Shapes found to keep nothing more are remembered per block; a
    shape that keeps more still rebuilds the graph."""
    from gluon_amp.patching.shape_rules import ShapeRules
    asked = []
    narrow = ShapeRules._narrow
    monkeypatch.setattr(ShapeRules, "_narrow", lambda self, graph, out, shapes: asked.append(
        dict(shapes)) or narrow(self, graph, out, shapes))
    with gluon_amp.runtime.simulate_native_bf16():
        gluon_amp.init(target_dtype="bfloat16", tune=False)
        net = _stem(16)
        images = [mx.nd.ones((2, 16, s, s)) for s in (8, 6, 10)]
        for k in [0, 1, 2] * 3:
            net(images[k]).wait_to_read()
        assert len(asked) == 3, asked  # the trace's, then one for each other shape
        assert _rows(net)["Convolution0"] == ("bfloat16", "low_precision")
        strided = nn.Conv2D(4, 1, strides=2, in_channels=16)
        strided.initialize()
        strided.hybridize()
        for width in (8, 4, 8, 1):  # narrower than the stride: kept float32, the graph rebuilt
            strided(mx.nd.ones((2, 16, 8, width))).wait_to_read()
        assert [(r.dtype, r.reason) for r in gluon_amp.report(strided).rows if r.op == "Convolution"] == [
            ("float32", "narrow_input")]
