"""fusion_barriers: batch norms kept out of the fusion of convolutions whose weights the graph casts."""
import itertools
import random

import pytest

from gluon_amp_core.fusion_barriers import BARRIER_SUFFIX, FOLDED_OPS, keep_batchnorms_apart
from graph_json import graph as _graph, var as _var

BF16, FP32 = "bfloat16", "float32"


def _node(op, name, *inputs, attrs=None):
    return {"op": op, "name": name, "attrs": attrs or {}, "inputs": [list(e) + [0] * (3 - len(e)) for e in inputs]}


def _random_graph(rng):
    """A chain of convolutions (weights stored, cast, or cast with a cast bias), each read by
    none, one or two batch norms or other ops; some batch norms read another output."""
    nodes = [_var("x"), _node("amp_cast", "x_cast", (0, 0), attrs={"dtype": BF16})]
    last = 1
    for k in range(rng.randint(1, 6)):
        nodes.append(_var(f"w{k}"))
        w = len(nodes) - 1
        kind = rng.choice(["stored", "cast", "multicast", "bias cast"])
        if kind != "stored":
            op = "amp_multicast" if kind == "multicast" else "amp_cast"
            nodes.append(_node(op, f"w{k}_cast", (w, 0), attrs={"dtype": BF16}))
            w = len(nodes) - 1
        inputs = [(last, 0), (w, 0)]
        if kind == "bias cast":
            nodes += [_var(f"b{k}"), _node("amp_cast", f"b{k}_cast", (len(nodes), 0), attrs={"dtype": BF16})]
            inputs.append((len(nodes) - 1, 0))
        nodes.append(_node(rng.choice(["Convolution", "Convolution", "FullyConnected"]), f"conv{k}", *inputs))
        conv = len(nodes) - 1
        last = conv
        for r in range(rng.choice([0, 1, 1, 2])):
            op = rng.choice(sorted(FOLDED_OPS) + ["Activation", "BatchNorm"])
            src = (conv, 0) if rng.random() < 0.8 else (1, 0)
            nodes.append(_node(op, f"conv{k}_reader{r}", src, *(([(0, 0)] * 4) if op in FOLDED_OPS else [])))
            last = len(nodes) - 1 if r == 0 else last
    read = {e[0] for n in nodes for e in n["inputs"]}
    return _graph(nodes, [i for i, n in enumerate(nodes) if i not in read and n["op"] != "null"])


def _dtypes(graph, unknown=()):
    return {(n["name"], 0): (FP32 if n["op"] == "null" else BF16) for n in graph["nodes"]
            if n["name"] not in unknown}


def _shapes(graph, rng):
    """Each entry a shape of 1 to 3 dimensions; weights and outputs of varied sizes."""
    return {(n["name"], 0): tuple(rng.choice([1, 3, 8, 64]) for _ in range(rng.randint(1, 3)))
            for n in graph["nodes"] if rng.random() < 0.9}


def _size(shapes, name):
    shape = shapes.get((name, 0))
    return None if shape is None else __import__("math").prod(shape)


def _reads(graph):
    """Each node's inputs by name, with the barriers seen through."""
    nodes = graph["nodes"]

    def source(e):
        n = nodes[e[0]]
        return source(n["inputs"][0]) if n["name"].endswith(BARRIER_SUFFIX) else (n["name"], e[1])
    return {n["name"]: [source(e) for e in n["inputs"]] for n in nodes if not n["name"].endswith(BARRIER_SUFFIX)}


@pytest.mark.parametrize("seed", range(60))
def test_exactly_the_batch_norms_of_convolutions_with_computed_weights_are_kept_apart(seed):
    rng = random.Random(seed)
    graph = _random_graph(rng)
    unknown = {"conv1"} if seed % 5 == 0 else set()  # a convolution MXNet could not type is left alone
    shapes = _shapes(graph, rng)
    out, kept = keep_batchnorms_apart(graph, _dtypes(graph, unknown), shapes)
    nodes, new = graph["nodes"], out["nodes"]
    by_name = {n["name"]: n for n in new}
    expected = set()
    for n in nodes:
        src = nodes[n["inputs"][0][0]] if n["inputs"] else None
        if (n["op"] in FOLDED_OPS and src["op"] == "Convolution" and src["name"] not in unknown
                and any(nodes[e[0]]["op"] != "null" for e in src["inputs"][1:])):
            weight, output = _size(shapes, nodes[src["inputs"][1][0]]["name"]), _size(shapes, src["name"])
            if weight is not None and output is not None and weight > output:
                expected.add(src["name"])
    barriers = {n["name"] for n in new if n["name"].endswith(BARRIER_SUFFIX)}
    assert barriers == {c + BARRIER_SUFFIX for c in expected} and kept == len(expected)
    for n in new:
        if n["op"] in FOLDED_OPS:  # a batch norm reads a convolution only where its weights are stored
            src = new[n["inputs"][0][0]]
            assert not (src["op"] == "Convolution" and src["name"] in expected)
        if n["name"] in barriers:
            assert n["op"] == "amp_cast" and n["attrs"] == {"dtype": BF16}
            assert new[n["inputs"][0][0]]["name"] + BARRIER_SUFFIX == n["name"]
    # the same ops read the same values; nothing else changes
    assert _reads(out) == _reads(graph)
    assert [n for n in new if n["name"] not in barriers] == [
        {**n, "inputs": by_name[n["name"]]["inputs"]} for n in nodes]
    if not expected:
        assert out is graph
    again, more = keep_batchnorms_apart(out, _dtypes(out, unknown), shapes)
    assert (again, more) == (out, 0)


@pytest.mark.parametrize("weight, bias, larger", itertools.product(["stored", "cast"], ["none", "stored", "cast"],
                                                                   [True, False]))
def test_one_convolution_and_its_batch_norm(weight, bias, larger):
    nodes = [_var("x"), _var("w")]
    w = 1
    if weight == "cast":
        nodes.append(_node("amp_cast", "w_cast", (1, 0), attrs={"dtype": BF16}))
        w = 2
    inputs = [(0, 0), (w, 0)]
    if bias != "none":
        nodes.append(_var("b"))
        inputs.append((len(nodes) - 1, 0))
        if bias == "cast":
            nodes.append(_node("amp_cast", "b_cast", (len(nodes) - 1, 0), attrs={"dtype": BF16}))
            inputs[-1] = (len(nodes) - 1, 0)
    nodes.append(_node("Convolution", "conv", *inputs))
    nodes.append(_node("BatchNorm", "bn", (len(nodes) - 1, 0)))
    graph = _graph(nodes, [len(nodes) - 1])
    w = nodes[inputs[1][0]]["name"]
    shapes = {(w, 0): (64, 32, 3, 3), ("conv", 0): (1, 64, 4, 4) if larger else (8, 64, 56, 56)}
    _, kept = keep_batchnorms_apart(graph, _dtypes(graph), shapes)
    assert kept == int("cast" in (weight, bias) and larger)
