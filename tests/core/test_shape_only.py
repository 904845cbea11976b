"""shape_only: a value read only for its shape gets no gradient pass."""
import random

import pytest

from gluon_amp_core.shape_only import SHAPE_ONLY_INPUTS, STOP_SUFFIX, shape_only_nodes, stop_shape_only_gradients
from graph_json import graph as _graph, var as _var


def _op(op, name, *inputs):
    return {"op": op, "name": name, "attrs": {}, "inputs": [[i, 0, 0] for i in inputs]}


def _anchors():
    """SSD's feature map: relu -> conv (a prediction), and relu -> cast -> * 0 -> slice_like(anchors, .)."""
    nodes = [_var("x"), _op("Activation", "relu", 0), _var("w"), _op("Convolution", "pred", 1, 2),
             {"op": "amp_cast", "name": "cast", "attrs": {"dtype": "float32"}, "inputs": [[1, 0, 0]]},
             {"op": "_mul_scalar", "name": "zero", "attrs": {"scalar": "0"}, "inputs": [[4, 0, 0]]},
             _var("anchors"), _op("slice_like", "anchors_like", 6, 5)]
    return _graph(nodes, [3, 7])


def _by_name(graph):
    nodes = graph["nodes"]
    return {n["name"]: (n, [(nodes[e[0]]["name"], e[1]) for e in n["inputs"]]) for n in nodes}


def test_ssds_anchor_path_stops_where_the_feature_enters_it():
    graph = _anchors()
    assert shape_only_nodes(graph) == {4, 5}
    out, stopped = stop_shape_only_gradients(graph)
    assert stopped == 1
    nodes = _by_name(out)
    stop, stop_in = nodes["relu" + STOP_SUFFIX]
    assert stop["op"] == "BlockGrad" and stop_in == [("relu", 0)]
    assert nodes["cast"][1] == [("relu" + STOP_SUFFIX, 0)]
    assert nodes["pred"][1] == [("relu", 0), ("w", 0)]  # the value's own readers read it as before
    assert nodes["anchors_like"][1] == [("anchors", 0), ("zero", 0)]
    assert [out["nodes"][h[0]]["name"] for h in out["heads"]] == ["pred", "anchors_like"]
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])


def test_a_path_that_is_an_output_too_stops_at_the_shape_only_input_alone():
    graph = _anchors()
    graph["heads"].append([5, 0, 0])  # the zeros are an output: their own gradient runs back
    out, stopped = stop_shape_only_gradients(graph)
    nodes = _by_name(out)
    assert stopped == 1 and nodes["cast"][1] == [("relu", 0)]
    assert nodes["anchors_like"][1] == [("anchors", 0), ("zero" + STOP_SUFFIX, 0)]


@pytest.mark.parametrize("case", ["the value is read too", "a graph input", "no such op"])
def test_what_is_left_as_it_is(case):
    graph = _anchors()
    nodes = graph["nodes"]
    if case == "the value is read too":
        nodes[7]["op"] = "broadcast_add"  # reads both inputs' values
    elif case == "a graph input":
        nodes[4]["inputs"] = [[0, 0, 0]]
        nodes[3]["inputs"] = [[0, 0, 0], [2, 0, 0]]
    elif case == "no such op":
        nodes[7]["op"] = "elemwise_add"
    out, stopped = stop_shape_only_gradients(graph)
    assert out is graph and stopped == 0


_OPS = ["Activation", "elemwise_add", "_mul_scalar", "amp_cast", "Convolution", *SHAPE_ONLY_INPUTS]


def _random_graph(rng):
    """A random DAG of 2-input and 1-input ops over 2 inputs; its outputs: every node no one reads."""
    nodes = [_var("a"), _var("b")]
    for k in range(rng.randint(3, 14)):
        op = rng.choice(_OPS)
        arity = 1 if op in ("Activation", "_mul_scalar", "amp_cast", "zeros_like", "ones_like", "shape_array",
                            "size_array") else 2
        nodes.append(_op(op, f"n{k}", *[rng.randrange(len(nodes)) for _ in range(arity)]))
    read = {e[0] for n in nodes for e in n["inputs"]}
    return _graph(nodes, [i for i in range(2, len(nodes)) if i not in read])


def _values_used(graph):
    """Brute force: the nodes whose values reach an output through some input that is not shape-only."""
    nodes, used = graph["nodes"], {h[0] for h in graph["heads"]}
    changed = True
    while changed:
        changed = False
        for j, n in enumerate(nodes):
            if j not in used:
                continue
            for pos, e in enumerate(n["inputs"]):
                if pos not in SHAPE_ONLY_INPUTS.get(n["op"], ()) and e[0] not in used:
                    used.add(e[0])
                    changed = True
    return used


@pytest.mark.parametrize("seed", range(200))
def test_generated_graphs(seed):
    graph = _random_graph(random.Random(seed))
    nodes = graph["nodes"]
    used = _values_used(graph)
    assert shape_only_nodes(graph) == {i for i, n in enumerate(nodes) if n["op"] != "null" and i not in used}
    out, stopped = stop_shape_only_gradients(graph)
    # every edge from a used op node into a shape-only reading now passes a BlockGrad, and no other
    expected = {(e[0], e[1]) for j, n in enumerate(nodes) for pos, e in enumerate(n["inputs"])
                if e[0] in used and nodes[e[0]]["op"] != "null"
                and (j not in used or pos in SHAPE_ONLY_INPUTS.get(n["op"], ()))}
    assert stopped == len(expected)
    if not expected:
        assert out is graph
        return
    onodes = out["nodes"]
    stops = [n for n in onodes if n["op"] == "BlockGrad"]
    assert sorted(onodes[s["inputs"][0][0]]["name"] for s in stops) == sorted(nodes[i]["name"] for i, _ in expected)
    assert sum(n["op"] != "null" for n in onodes) == sum(n["op"] != "null" for n in nodes) + len(stops)
    assert [onodes[h[0]]["name"] for h in out["heads"]] == [nodes[h[0]]["name"] for h in graph["heads"]]
