"""The pure core's half of issue 41 item 4: no cast that converts nothing, and nothing between
a parameter and an input MXNet's kernels read directly (``DIRECT_INPUTS``), in the hooks'
rewrite (``drop_identity_casts``) and the emulation rewrite (``emulate_graph``)."""
import itertools

import pytest

from gluon_amp_core.emulate import DIRECT_INPUTS, DIRECT_SUFFIX, emulate_graph
from gluon_amp_core.retype import drop_identity_casts

FP32, F16, BF16 = "float32", "float16", "bfloat16"
OPS = ["Deconvolution", "Convolution", "FullyConnected", "BatchNorm", "Embedding", "LayerNorm"]


def _traced(op, cast_dtype, n_params=2):
    """x -> op(x, params...), every input read through the cast init's wrappers put there."""
    nodes = [{"op": "null", "name": "x", "inputs": []},
             {"op": "amp_cast", "name": "x_cast", "attrs": {"dtype": cast_dtype}, "inputs": [[0, 0, 0]]}]
    op_inputs = [[1, 0, 0]]
    for k in range(n_params):
        nodes.append({"op": "null", "name": f"p{k}", "inputs": []})
        nodes.append({"op": "amp_cast", "name": f"p{k}_cast", "attrs": {"dtype": cast_dtype},
                      "inputs": [[len(nodes) - 1, 0, 0]]})
        op_inputs.append([len(nodes) - 1, 0, 0])
    nodes.append({"op": op, "name": "op", "attrs": {"no_bias": "False"}, "inputs": op_inputs})
    return {"nodes": nodes, "arg_nodes": [0, 2, 4], "heads": [[len(nodes) - 1, 0, 0]], "attrs": {}}


def _inputs(graph, name):
    nodes = graph["nodes"]
    node = next(n for n in nodes if n["name"] == name)
    return [nodes[e[0]]["name"] for e in node["inputs"]]


@pytest.mark.parametrize("op,dtype", list(itertools.product(OPS, [FP32, F16, BF16])))
def test_an_op_fed_the_dtype_its_inputs_have_reads_them_directly(op, dtype):
    """Casts to the dtype a value has (a float32 op's parameters, a low op's low data) go."""
    graph = _traced(op, dtype)
    dtypes = {(n["name"], 0): dtype for n in graph["nodes"]}
    out, dropped = drop_identity_casts(graph, dtypes)
    assert dropped == 3
    assert _inputs(out, "op") == ["x", "p0", "p1"]
    assert not any(n["op"] == "amp_cast" for n in out["nodes"])


def test_casts_that_convert_and_a_cast_that_is_an_output_stay():
    graph = _traced("Deconvolution", BF16)
    dtypes = {(n["name"], 0): FP32 for n in graph["nodes"]}
    dtypes.update({("x_cast", 0): BF16, ("p0_cast", 0): BF16, ("p1_cast", 0): BF16, ("op", 0): BF16})
    assert drop_identity_casts(graph, dtypes) == (graph, 0)
    head = {"nodes": [{"op": "null", "name": "x", "inputs": []},
                      {"op": "amp_cast", "name": "c", "attrs": {"dtype": FP32}, "inputs": [[0, 0, 0]]}],
            "arg_nodes": [0], "heads": [[1, 0, 0]], "attrs": {}}
    assert drop_identity_casts(head, {("x", 0): FP32, ("c", 0): FP32}) == (head, 0)


def test_a_multicast_of_one_dtype_goes():
    nodes = [{"op": "null", "name": "a", "inputs": []}, {"op": "null", "name": "b", "inputs": []},
             {"op": "amp_multicast", "name": "mc", "attrs": {"num_outputs": "2"}, "inputs": [[0, 0, 0], [1, 0, 0]]},
             {"op": "elemwise_add", "name": "add", "inputs": [[2, 0, 0], [2, 1, 0]]}]
    graph = {"nodes": nodes, "arg_nodes": [0, 1], "heads": [[3, 0, 0]], "attrs": {}}
    dtypes = {("a", 0): FP32, ("b", 0): FP32, ("mc", 0): FP32, ("mc", 1): FP32, ("add", 0): FP32}
    out, dropped = drop_identity_casts(graph, dtypes)
    assert dropped == 2 and _inputs(out, "add") == ["a", "b"]
    mixed = {**dtypes, ("b", 0): BF16}
    assert drop_identity_casts(graph, mixed)[1] == 0


def _typed(graph, op_dtype, param_dtype):
    """The dtypes real AMP gives ``_traced``'s graph: data and parameters float32, cast to
    ``param_dtype`` (the parameters) and ``op_dtype`` (the data), the op in ``op_dtype``."""
    d = {("x", 0): FP32, ("p0", 0): FP32, ("p1", 0): FP32, ("x_cast", 0): op_dtype,
         ("p0_cast", 0): param_dtype, ("p1_cast", 0): param_dtype, ("op", 0): op_dtype}
    return d


@pytest.mark.parametrize("kernel", [None, "_gluon_amp_round"])
@pytest.mark.parametrize("op,low", list(itertools.product(OPS, [F16, BF16])))
def test_emulation_reads_a_direct_parameter_itself_and_its_gradient_is_the_ops_alone(op, low, kernel):
    """A low op of DIRECT_INPUTS: op(x, w) + op(x, BlockGrad(round(BlockGrad(w)) - BlockGrad(w)))."""
    graph = _traced(op, low)
    out = emulate_graph(graph, _typed(graph, low, low), kernel=kernel).graph
    nodes = out["nodes"]
    by_name = {n["name"]: n for n in nodes}
    live = {h[0] for h in out["heads"]}  # what MXNet runs: the nodes the outputs reach
    for j in range(len(nodes) - 1, -1, -1):
        if j in live:
            live.update(e[0] for e in nodes[j]["inputs"])
    readers = {}  # variable -> the ops that read it
    for n in (nodes[j] for j in sorted(live)):
        for e in n["inputs"]:
            readers.setdefault(nodes[e[0]]["name"], []).append(n)
    if op not in DIRECT_INPUTS:
        assert not any(n["name"].startswith("op" + DIRECT_SUFFIX) for n in nodes)
        return
    k = DIRECT_INPUTS[op] - 1  # p0 is input 1
    param = f"p{k}"
    main = by_name["op" + DIRECT_SUFFIX]
    assert nodes[main["inputs"][DIRECT_INPUTS[op]][0]]["name"] == param  # the variable itself
    # every other reader of the parameter passes no gradient back to it
    assert all(r["op"] == "BlockGrad" or r is main for r in readers[param])
    correction = by_name["op" + DIRECT_SUFFIX + "_correction"]
    assert correction["attrs"]["no_bias"] == "True" and len(correction["inputs"]) == 2
    assert nodes[correction["inputs"][1][0]]["op"] == "BlockGrad"
    assert by_name["op"]["op"] == "elemwise_add"  # the op's name holds its value


@pytest.mark.parametrize("op", OPS)
def test_emulation_of_a_float32_op_reads_its_parameters_through_no_node(op):
    graph = _traced(op, FP32)
    dtypes = {(n["name"], 0): FP32 for n in graph["nodes"]}
    out = emulate_graph(graph, dtypes).graph
    assert _inputs(out, "op") == ["x", "p0", "p1"]
