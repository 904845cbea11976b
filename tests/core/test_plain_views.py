"""plain_views: a reshape of a 5-d bfloat16 value reads a plain copy of it (``slice_axis`` of the whole)."""
import copy
import random

import pytest

from gluon_amp_core.plain_views import MIN_RANK, PLAIN_SUFFIX, VIEW_OPS, plain_before_views
from graph_json import graph as _graph, var as _var

BF16, FP32 = "bfloat16", "float32"


def _node(op, name, *inputs, attrs=None):
    return {"op": op, "name": name, "attrs": attrs or {}, "inputs": [list(e) + [0] * (3 - len(e)) for e in inputs]}


def _case(rng):
    """x -> producer (an op or the input itself; bfloat16 or float32; rank 3-6 or unknown) -> one or
    two view ops (to another shape, or to its own) -> readers. Returns the graph, its dtypes and
    shapes, and the names of the views that must read a copy."""
    from_input = rng.random() < 0.2
    low = rng.random() < 0.7
    rank = rng.choice([3, 4, 5, 6, None])
    dtype = BF16 if low else FP32
    shape = None if rank is None else (2, 8) + (3,) * (rank - 2)
    nodes = [_var("x"), _var("like")]
    if from_input:
        src = 0
    else:
        nodes.append(_node("Convolution", "conv", (0, 0), attrs={"num_filter": "8"}))
        src = 2
    src_name = nodes[src]["name"]
    dtypes = {(src_name, 0): dtype, ("like", 0): FP32}
    shapes = {(src_name, 0): shape}
    want, heads = set(), []
    for k in range(rng.randint(1, 2)):
        op = rng.choice(sorted(VIEW_OPS))
        same = rng.random() < 0.2
        inputs = [(src, 0)] + ([(1, 0)] if op == "reshape_like" else [])
        nodes.append(_node(op, f"view{k}", *inputs, attrs={"shape": "(2, -1)"}))
        dtypes[(f"view{k}", 0)] = dtype
        shapes[(f"view{k}", 0)] = shape if same else (None if shape is None else (2, 8 * 3 ** (rank - 2)))
        reader = rng.choice([("amp_cast", {"dtype": FP32}), ("softmax", {}), ("Activation", {"act_type": "relu"})])
        nodes.append(_node(reader[0], f"reader{k}", (len(nodes) - 1, 0), attrs=reader[1]))
        heads.append(len(nodes) - 1)
        if not from_input and low and (rank is None or rank >= MIN_RANK) and (rank is None or not same):
            want.add(f"view{k}")
    if rng.random() < 0.5:
        nodes.append(_node("Activation", "other", (src, 0), attrs={"act_type": "relu"}))
        heads.append(len(nodes) - 1)
    return _graph(nodes, heads), dtypes, shapes, want


def _values(graph):
    """Each output's value as a tree of ops, the plain copies seen through."""
    nodes = graph["nodes"]

    def value(e):
        node = nodes[e[0]]
        if node["name"].endswith(PLAIN_SUFFIX):
            return value(node["inputs"][0])
        if node["op"] == "null":
            return node["name"]
        return (node["op"], tuple(sorted(node["attrs"].items())), tuple(value(i) for i in node["inputs"]))

    return [value(h) for h in graph["heads"]]


@pytest.mark.parametrize("seed", range(40))
def test_a_reshape_of_a_5d_bfloat16_value_reads_a_plain_copy(seed):
    rng = random.Random(seed)
    for _ in range(10):
        graph, dtypes, shapes, want = _case(rng)
        before = copy.deepcopy(graph)
        out, copied = plain_before_views(graph, dtypes, shapes, BF16)
        assert graph == before  # the caller's graph is not changed
        assert copied == len(want), (graph, shapes)
        if not want:
            assert out is graph
            continue
        assert _values(out) == _values(graph)  # the same values reach every output
        nodes = out["nodes"]
        names = [n["name"] for n in nodes]
        copies = [n for n in nodes if n["name"].endswith(PLAIN_SUFFIX)]
        assert len(copies) == 1  # one copy of the value, whatever the views
        (plain,) = copies
        assert plain["op"] == "slice_axis" and plain["attrs"] == {"axis": "0", "begin": "0", "end": "None"}
        assert nodes[plain["inputs"][0][0]]["name"] == "conv"
        for n in nodes:
            if n["op"] in VIEW_OPS:
                reads = nodes[n["inputs"][0][0]]["name"]
                assert (reads == plain["name"]) is (n["name"] in want), n
        # the other reader of the value reads it as before
        assert all(nodes[n["inputs"][0][0]]["name"] == "conv" for n in nodes if n["name"] == "other")
        assert names.index(plain["name"]) < min(names.index(v) for v in want)


def test_a_float16_or_float32_value_or_a_4d_one_keeps_its_graph():
    nodes = [_var("x"), _node("Convolution", "conv", (0, 0)), _node("Reshape", "view", (1, 0))]
    graph = _graph(nodes, [2])
    for dtype, shape in [(FP32, (1, 2, 2, 2, 2)), ("float16", (1, 2, 2, 2, 2)), (BF16, (1, 2, 2, 2))]:
        out, copied = plain_before_views(graph, {("conv", 0): dtype}, {("conv", 0): shape, ("view", 0): (1, 16)}, BF16)
        assert (out, copied) == (graph, 0), (dtype, shape)
    out, copied = plain_before_views(graph, {("conv", 0): BF16}, {("conv", 0): (1, 2, 2, 2, 2), ("view", 0): (1, 16)},
                                     BF16)
    assert copied == 1
