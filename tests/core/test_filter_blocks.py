"""filter_blocks: a low-precision convolution run on whole blocks of 16 filters, 32 on AMX."""
import random

import pytest

from gluon_amp_core.filter_blocks import AMX_BLOCK, BLOCK, PADDED_SUFFIX, filters_to_pad, whole_filter_blocks
from graph_json import graph as _graph, var as _var

BF16, FP32 = "bfloat16", "float32"


def _conv(name, filters, *inputs, kernel="(3, 3)", **attrs):
    attrs = {"kernel": kernel, "num_filter": str(filters), **{k: str(v) for k, v in attrs.items()}}
    return {"op": "Convolution", "name": name, "attrs": attrs, "inputs": [[i, 0, 0] for i in inputs]}


def _cast(name, src):
    return {"op": "amp_cast", "name": name, "attrs": {"dtype": BF16}, "inputs": [[src, 0, 0]]}


def _predictor(filters, bias=True, channels=8):
    """x -> relu -> conv(w cast[, b cast]) -> transpose, and relu read by a second conv too."""
    nodes = [_var("x"), {"op": "relu", "name": "relu", "attrs": {}, "inputs": [[0, 0, 0]]},
             _var("w"), _cast("w_cast", 2)]
    if bias:
        nodes += [_var("b"), _cast("b_cast", 4), _conv("pred", filters, 1, 3, 5)]
    else:
        nodes += [_conv("pred", filters, 1, 3, no_bias=True)]
    p = len(nodes) - 1
    nodes += [{"op": "transpose", "name": "tr", "attrs": {"axes": "(0, 2, 3, 1)"}, "inputs": [[p, 0, 0]]},
              _var("w2"), _cast("w2_cast", p + 2), _conv("other", 16, 1, p + 3, no_bias=True)]
    graph = _graph(nodes, [p + 1, p + 4])
    dtypes = {(n["name"], 0): (FP32 if n["op"] == "null" else BF16) for n in nodes}
    shapes = {("w", 0): (filters, channels, 3, 3), ("w_cast", 0): (filters, channels, 3, 3),
              ("w2", 0): (16, channels, 1, 1), ("w2_cast", 0): (16, channels, 1, 1)}
    return graph, dtypes, shapes


def _by_name(graph):
    nodes = graph["nodes"]
    return {n["name"]: (n, [(nodes[e[0]]["name"], e[1]) for e in n["inputs"]]) for n in nodes}


def _cases(n=300, seed=5):
    rng = random.Random(seed)
    for _ in range(n):
        yield (rng.choice([1, 2, 3, 15, 16, 17, 24, 32, 324, 486]) if rng.random() < 0.3 else rng.randint(1, 600),
               rng.choice(["(3,)", "(3, 3)", "(1, 1)", "(3, 3, 3)"]), rng.choice([None, "1", "2"]),
               rng.choice([None, "NCHW", "NHWC"]), rng.choice([BF16, BF16, FP32]))


@pytest.mark.parametrize("block", [BLOCK, AMX_BLOCK])
@pytest.mark.parametrize("filters,kernel,groups,layout,dtype", list(_cases()))
def test_how_many_filters_it_adds(filters, kernel, groups, layout, dtype, block):
    attrs = {} if groups is None else {"num_group": groups}
    if layout is not None:
        attrs["layout"] = layout
    node = _conv("c", filters, kernel=kernel, **attrs)
    rank = {"(3,)": 1, "(3, 3)": 2, "(1, 1)": 2, "(3, 3, 3)": 3}[kernel]
    applies = dtype == BF16 and rank == 2 and groups in (None, "1") and layout in (None, "NCHW")
    expected = (-filters) % block if applies else 0
    assert filters_to_pad(node, {("c", 0): dtype}, BF16, block) == expected
    assert expected == 0 or (filters + expected) % block == 0 < expected < block
    if block == BLOCK:
        assert filters_to_pad(node, {("c", 0): dtype}, BF16) == expected  # the default: without AMX


@pytest.mark.parametrize("block", [BLOCK, AMX_BLOCK])
@pytest.mark.parametrize("filters", [1, 15, 17, 24, 324, 486])
@pytest.mark.parametrize("bias", [True, False])
def test_the_convolution_runs_whole_blocks_and_its_readers_read_its_first_filters(filters, bias, block):
    graph, dtypes, shapes = _predictor(filters, bias)
    out, padded = whole_filter_blocks(graph, dtypes, shapes, BF16, block)
    extra = -filters % block
    assert padded == (["pred"] if block == BLOCK else ["pred", "other"])  # AMX pads the other's 16 too
    nodes = _by_name(out)
    conv, conv_in = nodes["pred" + PADDED_SUFFIX]
    assert conv["op"] == "Convolution" and conv["attrs"]["num_filter"] == str(filters + extra)
    assert conv_in[0] == ("relu", 0)
    wcat, wcat_in = nodes[conv_in[1][0]]
    assert wcat["op"] == "Concat" and wcat["attrs"]["dim"] == "0" and wcat_in[0] == ("w_cast", 0)
    zeros = nodes[wcat_in[1][0]][0]
    assert zeros["op"] == "_zeros" and zeros["attrs"] == {"shape": str((extra, 8, 3, 3)), "dtype": BF16}
    if bias:
        bcat, bcat_in = nodes[conv_in[2][0]]
        assert bcat_in[0] == ("b_cast", 0) and nodes[bcat_in[1][0]][0]["attrs"]["shape"] == str((extra,))
    else:
        assert len(conv_in) == 2
    sl, sl_in = nodes["pred"]  # the node's own name: every (name, output) key stays as it was
    assert sl["op"] == "slice_axis" and sl["attrs"] == {"axis": "1", "begin": "0", "end": str(filters)}
    assert sl_in == [("pred" + PADDED_SUFFIX, 0)]
    assert nodes["tr"][1] == [("pred", 0)]
    if block == BLOCK:
        assert nodes["other"][0]["attrs"]["num_filter"] == "16" and "other" + PADDED_SUFFIX not in nodes
    else:
        assert nodes["other" + PADDED_SUFFIX][0]["attrs"]["num_filter"] == "32"
        assert nodes["other"][0]["op"] == "slice_axis"
    assert [out["nodes"][h[0]]["name"] for h in out["heads"]] == ["tr", "other"]
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])  # topological


@pytest.mark.parametrize("filters", [16, 48, 80, 336, 496])
def test_amx_blocks_pad_counts_that_are_whole_16_blocks(filters):
    """AMX's data gradient wants 32: 16, 48 or 336 filters get 16 more there, none without AMX."""
    graph, dtypes, shapes = _predictor(filters)
    assert whole_filter_blocks(graph, dtypes, shapes, BF16) == (graph, [])
    out, padded = whole_filter_blocks(graph, dtypes, shapes, BF16, AMX_BLOCK)
    assert padded == ["pred", "other"]
    assert _by_name(out)["pred" + PADDED_SUFFIX][0]["attrs"]["num_filter"] == str(filters + 16)


def test_a_float32_bias_gets_float32_zeros():
    graph, dtypes, shapes = _predictor(20)
    dtypes[("b_cast", 0)] = FP32
    out, _ = whole_filter_blocks(graph, dtypes, shapes, BF16)
    zeros = [n for n in out["nodes"] if n["op"] == "_zeros"]
    assert sorted(z["attrs"]["dtype"] for z in zeros) == [BF16, FP32]


@pytest.mark.parametrize("case", ["whole blocks already", "float32", "weight shape unknown", "grouped"])
def test_what_is_left_as_it_is(case):
    graph, dtypes, shapes = _predictor(32 if case == "whole blocks already" else 20)
    if case == "float32":
        dtypes[("pred", 0)] = FP32
    elif case == "weight shape unknown":
        shapes = {}
    elif case == "grouped":
        graph["nodes"][6]["attrs"]["num_group"] = "2"
    out, padded = whole_filter_blocks(graph, dtypes, shapes, BF16)
    assert out is graph and padded == []
