"""view_casts: a cast away from bfloat16 of a reshaped 5-d bfloat16 value, taken before the reshape."""
import copy
import random

import pytest

from gluon_amp_core.view_casts import CAST_SUFFIX, MIN_RANK, VIEW_OPS, casts_before_views
from graph_json import graph as _graph, var as _var

BF16, FP32, FP16 = "bfloat16", "float32", "float16"


def _node(op, name, *inputs, attrs=None):
    return {"op": op, "name": name, "attrs": attrs or {}, "inputs": [list(e) + [0] * (3 - len(e)) for e in inputs]}


def _case(rng):
    """x -> producer (bf16 or float32, rank 4, 5, 6 or unknown) -> a view op -> a reader; a second
    reader of the view (or none). Returns the graph, its dtypes and shapes, and whether the
    reader's input must move."""
    view_op = rng.choice(sorted(VIEW_OPS))
    low_in = rng.random() < 0.7
    rank = rng.choice([4, 5, 6, None])
    reader = rng.choice(["cast32", "cast16", "castlow", "multicast", "relu"])
    nodes = [_var("x"), _var("y"), _node("Convolution", "conv", (0, 0), attrs={"kernel": "(1, 1, 1)"})]
    view_inputs = [(2, 0)] + ([(1, 0)] if view_op == "reshape_like" else [])
    nodes.append(_node(view_op, "view", *view_inputs, attrs={"shape": "(1, -1)"}))
    made = BF16 if low_in else FP32
    dtypes = {("x", 0): BF16, ("y", 0): FP32, ("conv", 0): made, ("view", 0): made}
    if reader.startswith("cast"):
        to = {"cast32": FP32, "cast16": FP16, "castlow": BF16}[reader]
        nodes.append(_node("amp_cast", "reader", (3, 0), attrs={"dtype": to}))
        dtypes[("reader", 0)] = to
        away = to != BF16
    elif reader == "multicast":
        nodes.append(_node("amp_multicast", "reader", (1, 0), (3, 0), attrs={"num_outputs": "2"}))
        dtypes[("reader", 0)] = dtypes[("reader", 1)] = FP32
        away = True
    else:
        nodes.append(_node("Activation", "reader", (3, 0), attrs={"act_type": "relu"}))
        dtypes[("reader", 0)] = dtypes[("view", 0)]
        away = False
    heads = [4]
    if rng.random() < 0.5:
        nodes.append(_node("Activation", "other", (3, 0), attrs={"act_type": "relu"}))
        heads.append(5)
    shape = None if rank is None else (1, 8) + (2,) * (rank - 2)
    shapes = {("conv", 0): shape, ("x", 0): shape}
    moves = low_in and away and (rank is None or rank >= MIN_RANK)
    return _graph(nodes, heads), dtypes, shapes, moves


def _values(graph):
    """Each head's value as a tree of ops, casts seen through (casts up from bfloat16 are exact, and
    a view moves values without changing them)."""
    nodes = graph["nodes"]

    def value(e):
        node = nodes[e[0]]
        if node["op"] == "amp_cast":
            return value(node["inputs"][0])
        if node["op"] == "amp_multicast":
            return value(node["inputs"][e[1]])
        if node["op"] == "null":
            return node["name"]
        return (node["op"], tuple(sorted(node["attrs"].items())), tuple(value(i) for i in node["inputs"]))

    return [value(h) for h in graph["heads"]]


@pytest.mark.parametrize("seed", range(40))
def test_a_cast_away_from_bfloat16_of_a_reshaped_5d_value_moves_ahead_of_the_reshape(seed):
    rng = random.Random(seed)
    for _ in range(10):
        graph, dtypes, shapes, moves = _case(rng)
        before = copy.deepcopy(graph)
        out, moved = casts_before_views(graph, dtypes, shapes, BF16)
        assert graph == before  # the caller's graph is not changed
        assert moved == int(moves), (graph, shapes)
        if not moves:
            assert out is graph
            continue
        assert _values(out) == _values(graph)  # the same values reach every output
        nodes = out["nodes"]
        reader = next(n for n in nodes if n["name"] == "reader")
        k = 1 if reader["op"] == "amp_multicast" else 0
        view = nodes[reader["inputs"][k][0]]
        cast = nodes[view["inputs"][0][0]]
        # the reader reads a view of a cast of the producer, in the dtype the reader gives
        assert view["op"] in VIEW_OPS and view["name"] != "view"
        assert cast["op"] == "amp_cast" and cast["name"].startswith("view" + CAST_SUFFIX)
        assert nodes[cast["inputs"][0][0]]["name"] == "conv"
        assert cast["attrs"]["dtype"] == dtypes[("reader", k)]
        assert view["inputs"][1:] == [[nodes.index(next(n for n in nodes if n["name"] == "y")), 0, 0]] * (
            view["op"] == "reshape_like")
        # the old view stays for its other reader, and goes where none is left
        assert any(n["name"] == "view" for n in nodes) == any(n["name"] == "other" for n in nodes)
        assert [n["name"] for n in nodes].index(cast["name"]) < [n["name"] for n in nodes].index(view["name"])


def test_two_casts_of_one_view_to_one_dtype_share_the_moved_cast():
    nodes = [_var("x"), _node("Convolution", "conv", (0, 0)), _node("Reshape", "view", (1, 0)),
             _node("amp_cast", "a", (2, 0), attrs={"dtype": FP32}),
             _node("amp_cast", "b", (2, 0), attrs={"dtype": FP32})]
    graph = _graph(nodes, [3, 4])
    out, moved = casts_before_views(graph, {("conv", 0): BF16, ("view", 0): BF16}, {("conv", 0): (1, 2, 2, 2, 2)}, BF16)
    assert moved == 2
    assert sum(n["op"] == "Reshape" for n in out["nodes"]) == 1  # the old one has no reader left
    assert sum(n["op"] == "amp_cast" and n["name"].startswith("view" + CAST_SUFFIX) for n in out["nodes"]) == 1
