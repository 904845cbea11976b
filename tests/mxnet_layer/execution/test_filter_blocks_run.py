"""A bfloat16 convolution whose filter count is not a multiple of oneDNN's block (16, or 32 with
AMX) trains on whole blocks of filters (gluon_amp_core.filter_blocks,
native_run.with_whole_filter_blocks): the same values and gradients, where MXNet binds it, in a
training graph on a CPU.

The facts behind it: oneDNN 2.4.4 (AVX512-BF16) runs such a convolution as a GEMM on plain
arrays, since MXNet 1.9.1 refuses its padded layouts; SSD-512's class predictors (324 and 486
filters) spent 1.8 s of an 8 s training step at batch 8 so. With AMX, a count that is a
multiple of 16 but not of 32 (48, 336) gets its data gradient off AMX (336: 1,888 ms against
247 at 352)."""
import json
import random
import re
import textwrap

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from helpers import TWO_STEPS, train_bound, verbose_run

from gluon_amp import native_run, runtime
from gluon_amp.execution import plan_dtypes
from gluon_amp.type_inference import infer_shapes
from gluon_amp.mxnet_internals import symbol_graph
from gluon_amp_core.filter_blocks import PADDED_SUFFIX, whole_filter_blocks

_FILTERS = sorted({20, 324} | set(random.Random(3).sample(range(1, 100), 3)))


def _net(filters, bias):
    """relu -> a predictor of ``filters`` filters (transposed, as SSD's) and a convolution of 16
    beside it, both reading the relu."""
    x = mx.sym.Activation(mx.sym.var("data"), act_type="relu", name="relu")
    pred = mx.sym.Convolution(x, kernel=(3, 3), pad=(1, 1), num_filter=filters, no_bias=not bias, name="pred")
    other = mx.sym.Convolution(x, kernel=(1, 1), num_filter=16, no_bias=True, name="other")
    return mx.sym.Group([mx.sym.transpose(pred, axes=(0, 2, 3, 1)), other])


@pytest.mark.parametrize("filters", _FILTERS)
@pytest.mark.parametrize("bias", [True, False])
def test_whole_blocks_give_the_same_values_and_gradients(filters, bias):
    """In float32 (any CPU): the pass's graph is a graph MXNet types, binds and trains, and its
    outputs and every gradient (data, weight, bias) are the convolution's own."""
    sym = _net(filters, bias)
    rng = np.random.RandomState(filters)
    shapes = {"data": (2, 8, 6, 6)}
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    arrays = {k: mx.nd.array(rng.uniform(-1, 1, s)) for k, s in zip(sym.list_arguments(), arg_shapes)}
    typed = plan_dtypes(sym, {"data": "float32"})
    graph, padded = whole_filter_blocks(symbol_graph(sym), typed,
                                        infer_shapes(sym, shapes), "float32")
    assert padded == (["pred"] if filters % 16 else [])
    run = mx.sym.load_json(json.dumps(graph))
    assert run.list_arguments() == sym.list_arguments() and run.list_outputs() == sym.list_outputs()
    _, out_shapes, _ = sym.infer_shape(**shapes)
    out_grads = [mx.nd.array(rng.uniform(-1, 1, s)) for s in out_shapes]
    outs, grads = train_bound(sym, arrays, out_grads)
    run_outs, run_grads = train_bound(run, arrays, out_grads)
    for a, b in zip(outs, run_outs):  # float32 sums in another order: to float32's precision
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    assert set(run_grads) == set(grads)
    for k in grads:
        np.testing.assert_allclose(run_grads[k], grads[k], rtol=1e-5, atol=1e-6 * np.abs(grads[k]).max(), err_msg=k)


def _plan(filters):
    sym = _net(filters, True)
    plan = gluon_amp.convert_symbol(sym, target_dtype="bfloat16")
    return plan, plan_dtypes(plan, {"data": "float32"}), {"data": (2, 8, 6, 6)}


def _padded_convs(run):
    return [n["name"] for n in symbol_graph(run)["nodes"]
            if n["op"] == "Convolution" and n["name"].endswith(PADDED_SUFFIX)]


def _filters_run(run):
    return {n["name"]: int(n["attrs"]["num_filter"]) for n in symbol_graph(run)["nodes"] if n["op"] == "Convolution"}


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("filters", [20, 48])
def test_training_graphs_on_a_cpu_run_them_and_nothing_else_does(monkeypatch, amx, filters):
    """20 filters run 32 with AMX and without; 48 run 64 where oneDNN runs AMX, 48 elsewhere;
    the 16 beside them 32 with AMX."""
    plan, typed, shapes = _plan(filters)
    assert any(t == "bfloat16" for t in typed.values())
    monkeypatch.setattr(runtime, "amx_active", lambda: amx)
    train = native_run.native_passes(plan, typed, shapes, {"cpu"}, pair=True, accumulating=None)
    padded = filters == 20 or amx
    other = {"other" + PADDED_SUFFIX: 32} if amx else {"other": 16}
    assert _filters_run(train) == ({"pred" + PADDED_SUFFIX: filters + (-filters % 32), **other} if padded
                                   else {"pred": filters, **other})
    _, plan_types, _ = plan.infer_type_partial(data="float32")
    _, train_types, _ = train.infer_type_partial(data="float32")
    assert train_types == plan_types  # its outputs as before
    assert _padded_convs(native_run.native_passes(plan, typed, shapes, {"cpu"}, pair=False, accumulating=None)) == []
    assert _padded_convs(native_run.native_passes(plan, typed, shapes, {"gpu"}, pair=True, accumulating=None)) == []
    assert _padded_convs(plan) == []  # the plan (what export writes) keeps its convolution


_TRAIN = textwrap.dedent("""
    import json, sys
    import gluon_amp  # first: MXNet imported first leaves AMX to a timing, which load can fool
    import mxnet as mx
    from gluon_amp import native_run
    from mxnet.gluon import nn
    filters, whole = json.loads(sys.argv[1])
    if not whole:
        native_run.pads_filters = lambda pair, devices: False
    gluon_amp.init(target_dtype="bfloat16", tune=False)
    mx.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(64, 3, padding=1, in_channels=32), nn.Activation("relu"),
            nn.Conv2D(filters, 3, padding=1, in_channels=64))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 32, 16, 16))
""") + TWO_STEPS + textwrap.dedent("""
    print("@@" + json.dumps({"y": y.astype("float32").asnumpy().ravel()[:64].tolist(),
                             "dw": net[2].weight.grad().asnumpy().ravel()[:64].tolist(),
                             "dw0": net[0].weight.grad().asnumpy().ravel()[:64].tolist()}))
""")


def _trained(filters, whole):
    """Its outputs, gradients and the oneDNN convolutions of the last layer (filters, pass, impl)
    that ran in bfloat16, from ``DNNL_VERBOSE``, training under ``init`` in a process of its own."""
    lines, values = verbose_run(_TRAIN, [filters, whole])
    impls = set()
    for line in lines:
        # the net's 16x16 maps: the speed probe, where it runs in this process (its figures not yet
        # in the cache), times convolutions of 64 channels too, at 56x56 and 28x28
        found = re.match(r"dnnl_verbose,exec,cpu,convolution,([^,]+),(\w+),src_bf16:.*_ic64oc(\d+)_ih16", line)
        if found:
            impls.add((int(found.group(3)), found.group(2), found.group(1)))
    return values, impls


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("filters", [20, 48])
def test_init_trains_them_on_the_blocked_kernel_to_the_same_values(filters):
    """On this CPU, under ``init``: without whole blocks oneDNN runs the GEMM for 20 filters, and
    with AMX the data gradient of 48 off AMX (if a later oneDNN blocks these, this fails and the
    pass can go); with them, its blocked kernels (AMX's in all three passes, where it runs
    AMX), and the outputs and gradients are as before to bfloat16's precision."""
    amx = runtime.amx_active()
    plain, plain_impls = _trained(filters, False)
    whole, whole_impls = _trained(filters, True)
    if filters == 48 and not amx:  # a whole block of 16 already: nothing to do
        assert whole_impls == plain_impls and whole == plain
        assert not any("gemm" in i for *_, i in whole_impls), whole_impls
        return
    assert {f for f, *_ in plain_impls} == {filters}
    if filters == 20:
        assert all("gemm" in i for *_, i in plain_impls), plain_impls
    else:
        assert {p for _, p, i in plain_impls if "amx" not in i} == {"backward_data"}, plain_impls
    assert {f for f, *_ in whole_impls} == {filters + (-filters % 32)}, whole_impls
    assert not any("gemm" in i for *_, i in whole_impls), whole_impls
    assert not amx or all("amx" in i for *_, i in whole_impls), whole_impls
    for k in plain:
        np.testing.assert_allclose(whole[k], plain[k], rtol=0.02, atol=0.02 * np.abs(plain[k]).max(), err_msg=k)
