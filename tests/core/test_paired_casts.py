"""paired_casts: a parameter's low-precision cast moved onto its op's data input."""
import random

import pytest

from gluon_amp_core.paired_casts import PAIRED_SUFFIX, pair_param_casts
from graph_json import graph as _graph, var as _var

BF16, FP16, FP32 = "bfloat16", "float16", "float32"


def _cast(name, src, dtype=BF16):
    return {"op": "amp_cast", "name": name, "attrs": {"dtype": dtype}, "inputs": [[src, 0, 0]]}


def _op(op, name, *inputs):
    return {"op": op, "name": name, "attrs": {}, "inputs": [[i, 0, 0] for i in inputs]}


def _dtypes(graph):
    """Every entry's dtype as MXNet types such a graph: variables float32, casts their dtype,
    ops their data input's."""
    out, nodes = {}, graph["nodes"]
    for n in nodes:
        if n["op"] == "null":
            t = FP32
        elif n["op"] == "amp_cast":
            t = n["attrs"]["dtype"]
        else:
            t = out[(nodes[n["inputs"][0][0]]["name"], n["inputs"][0][1])]
        out[(n["name"], 0)] = t
    return out


def _conv_block():
    """x -> cast -> conv1(w1, b1 cast) -> relu -> conv2(w2 cast) -> relu, the relu read by both."""
    nodes = [_var("x"), _cast("x_cast", 0), _var("w1"), _cast("w1_cast", 2), _var("b1"), _cast("b1_cast", 4),
             _op("Convolution", "conv1", 1, 3, 5), _op("relu", "relu1", 6),
             _var("w2"), _cast("w2_cast", 8), _op("Convolution", "conv2", 7, 9), _op("relu", "relu2", 10),
             _op("elemwise_add", "add", 11, 7)]
    return _graph(nodes, [12])


def _by_name(graph):
    nodes = graph["nodes"]
    return {n["name"]: (n, [(nodes[e[0]]["name"], e[1]) for e in n["inputs"]]) for n in nodes}


def test_an_ops_data_and_its_parameter_casts_become_one_multicast():
    graph = _conv_block()
    out, paired = pair_param_casts(graph, _dtypes(graph), BF16)
    assert paired == 2
    nodes = _by_name(out)
    m1, m1_in = nodes["conv1" + PAIRED_SUFFIX]
    assert m1["op"] == "amp_multicast" and m1["attrs"] == {"num_outputs": "3", "cast_narrow": "True"}
    assert m1_in == [("x_cast", 0), ("w1", 0), ("b1", 0)]
    assert nodes["conv1"][1] == [("conv1" + PAIRED_SUFFIX, k) for k in range(3)]
    # relu1 is read by conv2 and by add: conv2 is paired all the same (amp_multicast is an identity)
    assert nodes["conv2" + PAIRED_SUFFIX][1] == [("relu1", 0), ("w2", 0)]
    assert nodes["add"][1] == [("relu2", 0), ("relu1", 0)]
    assert not {"w1_cast", "b1_cast", "w2_cast"} & set(nodes)
    assert "x_cast" in nodes
    assert [out["nodes"][i]["name"] for i in out["arg_nodes"]] == ["x", "w1", "b1", "w2"]
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])  # topological


@pytest.mark.parametrize("case", ["data is a graph input", "data is float32", "cast read twice",
                                  "cast to another dtype", "cast of an op's output", "data is a head",
                                  "cast is a head", "parameter is float16"])
def test_what_is_not_paired(case):
    nodes = [_var("x"), _cast("x_cast", 0), _var("w"), _cast("w_cast", 2), _op("Convolution", "conv", 1, 3)]
    heads = [4]
    if case == "data is a graph input":
        nodes[4] = _op("Convolution", "conv", 0, 3)
    elif case == "data is float32":
        nodes[1] = _op("relu", "x_relu", 0)
    elif case == "cast read twice":
        nodes.append(_op("elemwise_add", "add", 4, 3))
        heads = [5]
    elif case == "cast to another dtype":
        nodes[3] = _cast("w_cast", 2, FP16)
    elif case == "cast of an op's output":
        nodes[3] = _cast("w_cast", 1)
    elif case == "data is a head":
        heads = [4, 1]
    elif case == "cast is a head":
        heads = [4, 3]
    graph = _graph(nodes, heads)
    dtypes = _dtypes(graph)
    if case == "parameter is float16":
        dtypes[("w", 0)] = FP16
    out, paired = pair_param_casts(graph, dtypes, BF16)
    assert (out, paired) == (graph, 0)


def _value(graph, entry, dtypes):
    """What an entry holds, followed through casts: (its source, the dtype it holds).
    ``dtypes``: the original graph's, for its variables and ops (whose names stay)."""
    nodes = graph["nodes"]
    node, k = nodes[entry[0]], entry[1]
    if node["op"] == "amp_cast":
        return _value(graph, node["inputs"][0], dtypes)[0], node["attrs"]["dtype"]
    if node["op"] == "amp_multicast":  # the narrowest of its inputs' dtypes, or the widest
        held = [_value(graph, e, dtypes)[1] for e in node["inputs"]]
        pick = min if node["attrs"].get("cast_narrow") == "True" else max
        return _value(graph, node["inputs"][k], dtypes)[0], pick(held, key=[BF16, FP16, FP32].index)
    return (node["name"], k), dtypes[(node["name"], k)]


def _random_graph(rng):
    """A random chain of ops, some reading several earlier values, with cast parameters."""
    nodes, values = [_var("x"), _cast("x_cast", 0, rng.choice([BF16, FP32]))], [1]
    for i in range(rng.randint(1, 8)):
        data = rng.choice(values)
        inputs = [data]
        for p in range(rng.randint(0, 2)):
            nodes.append(_var(f"p{i}_{p}"))
            if rng.random() < 0.8:
                nodes.append(_cast(f"p{i}_{p}_cast", len(nodes) - 1, rng.choice([BF16, BF16, FP16])))
            inputs.append(len(nodes) - 1)
        if rng.random() < 0.3:
            inputs.append(rng.choice(values))
        nodes.append(_op(rng.choice(["Convolution", "FullyConnected", "elemwise_add"]), f"op{i}", *inputs))
        values.append(len(nodes) - 1)
    read = {e[0] for n in nodes for e in n["inputs"]}
    sinks = [v for v in values[1:] if v not in read]
    return _graph(nodes, sorted(set(sinks + rng.sample(values[1:], min(2, len(values) - 1)))))


@pytest.mark.parametrize("seed", range(40))
def test_every_op_reads_the_same_values_in_the_same_dtypes(seed):
    """Generated graphs: after pairing, each op's inputs hold what they held (source and dtype),
    the graph's outputs are the same ops, and nothing else changed but casts."""
    graph = _random_graph(random.Random(seed))
    dtypes = _dtypes(graph)
    out, paired = pair_param_casts(graph, dtypes, BF16)
    before = {n["name"]: [_value(graph, e, dtypes) for e in n["inputs"]] for n in graph["nodes"]
              if n["op"] not in ("null", "amp_cast")}
    after = {n["name"]: [_value(out, e, dtypes) for e in n["inputs"]] for n in out["nodes"]
             if n["op"] not in ("null", "amp_cast", "amp_multicast")}
    assert after == before
    assert [out["nodes"][h[0]]["name"] for h in out["heads"]] == [graph["nodes"][h[0]]["name"] for h in graph["heads"]]
    assert paired == sum(1 for n in out["nodes"] if n["name"].endswith(PAIRED_SUFFIX))
    for n in out["nodes"]:
        if n["op"] == "amp_multicast":  # its data input is already in the dtype it casts to
            data = _value(out, n["inputs"][0], dtypes)
            assert data[1] == BF16 and all(_value(out, e, dtypes)[1] == FP32 for e in n["inputs"][1:])
