"""padded_inputs: an image read as a map of one channel more, so its first convolution trains low."""
import random

import pytest

from gluon_amp_core.padded_inputs import PADDED_SUFFIX, pad_image_inputs, paddable
from gluon_amp_core.shape_limits import OddChannelsRule
from graph_json import graph as _graph, var as _var

BF16, FP32 = "bfloat16", "float32"
RULE = OddChannelsRule(16)


def _kept(shape, attrs):
    return RULE.applies(shape, attrs)


def _stem(channels=3, bias=False, conv_dtype=FP32, weight_readers=1, data_readers=1, **attrs):
    """data -> conv(w[, b]) -> bn -> conv2(w2 cast), as the plan keeps an image's first layer."""
    conv_attrs = {"kernel": "(7, 7)", "num_filter": "64", "stride": "(2, 2)", **attrs}
    nodes = [_var("data"), _var("w")]
    conv_in = [[0, 0, 0], [1, 0, 0]]
    if bias:
        nodes.append(_var("b"))
        conv_in.append([2, 0, 0])
    nodes.append({"op": "Convolution", "name": "conv0", "attrs": conv_attrs, "inputs": conv_in})
    c = len(nodes) - 1
    nodes += [{"op": "BatchNorm", "name": "bn0", "attrs": {}, "inputs": [[c, 0, 0]]}]
    heads = [len(nodes) - 1]
    if weight_readers > 1:
        nodes.append({"op": "sum", "name": "wsum", "attrs": {}, "inputs": [[1, 0, 0]]})
        heads.append(len(nodes) - 1)
    if data_readers > 1:
        nodes.append({"op": "mean", "name": "dmean", "attrs": {}, "inputs": [[0, 0, 0]]})
        heads.append(len(nodes) - 1)
    graph = _graph(nodes, heads)
    dtypes = {(n["name"], 0): FP32 for n in nodes}
    dtypes[("conv0", 0)] = conv_dtype
    shapes = {("data", 0): (2, channels, 32, 32), ("w", 0): (64, channels, 7, 7), ("b", 0): (64,)}
    return graph, dtypes, shapes


def _cases(n=250, seed=9):
    rng = random.Random(seed)
    for _ in range(n):
        yield dict(channels=rng.randint(1, 20), bias=rng.random() < 0.3,
                   conv_dtype=rng.choice([FP32, FP32, BF16]), weight_readers=rng.choice([1, 1, 2]),
                   data_readers=rng.choice([1, 1, 1, 2]), num_group=rng.choice([None, None, "1", "3"]),
                   layout=rng.choice([None, None, "NCHW", "NHWC"]))


@pytest.mark.parametrize("case", list(_cases()), ids=str)
def test_which_inputs_it_pads(case):
    case = dict(case)
    attrs = {k: case.pop(k) for k in ("num_group", "layout")}
    attrs = {k: v for k, v in attrs.items() if v is not None}
    graph, dtypes, shapes = _stem(**case, **attrs)
    expected = (RULE.applies(shapes[("data", 0)], graph["nodes"][2 + case["bias"]]["attrs"])
                and case["conv_dtype"] == FP32 and case["weight_readers"] == 1 and case["data_readers"] == 1
                and attrs.get("layout", "NCHW") == "NCHW")
    assert paddable(graph, dtypes, shapes, {"data"}, _kept) == ({0: [2 + case["bias"]]} if expected else {})
    assert paddable(graph, dtypes, shapes, {"other"}, _kept) == {}  # only the block's data inputs


@pytest.mark.parametrize("channels", [1, 3, 15])
@pytest.mark.parametrize("bias", [False, True])
def test_the_weight_gets_a_zero_input_channel_in_the_low_dtype(channels, bias):
    graph, dtypes, shapes = _stem(channels, bias)
    out, pads = pad_image_inputs(graph, dtypes, shapes, {"data"}, _kept, BF16)
    assert pads == {"data": channels + 1}
    nodes = {n["name"]: n for n in out["nodes"]}
    by_index = out["nodes"]
    conv = nodes["conv0"]
    assert by_index[conv["inputs"][0][0]]["name"] == "data"  # a graph input: MXNet computes no data gradient
    cat = by_index[conv["inputs"][1][0]]
    assert cat["op"] == "Concat" and cat["attrs"]["dim"] == "1" and cat["name"] == "conv0_weight" + PADDED_SUFFIX
    cast, zeros = (by_index[e[0]] for e in cat["inputs"])
    assert cast["op"] == "amp_cast" and cast["attrs"]["dtype"] == BF16 and by_index[cast["inputs"][0][0]]["name"] == "w"
    assert zeros["op"] == "_zeros" and zeros["attrs"] == {"shape": str((64, 1, 7, 7)), "dtype": BF16}
    if bias:
        bcast = by_index[conv["inputs"][2][0]]
        assert bcast["op"] == "amp_cast" and by_index[bcast["inputs"][0][0]]["name"] == "b"
    assert conv["attrs"] == graph["nodes"][2 + bias]["attrs"]
    assert [by_index[h[0]]["name"] for h in out["heads"]] == ["bn0"]


def test_nothing_to_pad_leaves_the_graph():
    graph, dtypes, shapes = _stem(4)
    assert pad_image_inputs(graph, dtypes, shapes, {"data"}, _kept, BF16) == (graph, {})
