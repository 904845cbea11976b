"""The emulation rewrite on hand-written graphs (pure: no MXNet needed)."""
from gluon_amp_core.emulate import REAL_DTYPE_ATTR, ROUND_SUFFIX, emulate_graph, preserves_values, rounding_node


def _graph(nodes, heads):
    return {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
            "heads": heads, "attrs": {"mxnet_version": ["int", 10901]}}


def _var(name, **attrs):
    return {"op": "null", "name": name, "inputs": [], **({"attrs": attrs} if attrs else {})}


def _op(op, name, inputs, **attrs):
    return {"op": op, "name": name, "attrs": attrs, "inputs": [[i, k, 0] for i, k in inputs]}


def _by_name(graph):
    return {n["name"]: n for n in graph["nodes"]}


def test_cast_down_becomes_a_rounding_and_low_outputs_are_rounded():
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "c", [(0, 0)], dtype="float16"),
                _op("amp_cast", "cw", [(1, 0)], dtype="float16"),
                _op("FullyConnected", "fc", [(2, 0), (3, 0)], num_hidden="2", no_bias="True"),
                _op("amp_cast", "out", [(4, 0)], dtype="float32")], [[5, 0, 0]])
    types = {("data", 0): "float32", ("w", 0): "float32", ("c", 0): "float16", ("cw", 0): "float16",
             ("fc", 0): "float16", ("out", 0): "float32"}
    emu = emulate_graph(g, types)
    nodes = _by_name(emu.graph)
    # the plan's cast down stays, followed by the way back up; consumers read the float32 copy
    assert nodes["c" + ROUND_SUFFIX]["inputs"][0][0] == list(nodes).index("c")
    assert nodes["c" + ROUND_SUFFIX]["attrs"]["dtype"] == "float32"
    fc_inputs = {emu.graph["nodes"][e[0]]["name"] for e in nodes["fc"]["inputs"]}
    assert fc_inputs == {"c" + ROUND_SUFFIX, "cw" + ROUND_SUFFIX}
    # fc's float16 output is rounded: down to float16, back up to float32
    down = nodes[f"fc{ROUND_SUFFIX}_float16"]
    assert down["attrs"]["dtype"] == "float16" and emu.graph["nodes"][down["inputs"][0][0]]["name"] == "fc"
    assert nodes["fc"]["attrs"][REAL_DTYPE_ATTR] == "float16"
    assert emu.entries[("fc", 0)] == (rounding_node("fc"), 0)
    assert emu.rounds == 3


def test_low_precision_variables_are_stored_float32_and_rounded():
    g = _graph([_var("data"), _var("w", __dtype__="12"),
                _op("FullyConnected", "fc", [(0, 0), (1, 0)], num_hidden="2", no_bias="True")], [[2, 0, 0]])
    types = {("data", 0): "bfloat16", ("w", 0): "bfloat16", ("fc", 0): "bfloat16"}
    nodes = _by_name(emulate_graph(g, types).graph)
    assert nodes["w"]["attrs"]["__dtype__"] == "0" and nodes["w"]["attrs"][REAL_DTYPE_ATTR] == "bfloat16"
    assert rounding_node("w") in nodes and rounding_node("data") in nodes


def test_multicast_rounds_only_the_outputs_that_narrow():
    g = _graph([_var("a"), _var("b"), _op("amp_multicast", "m", [(0, 0), (1, 0)], num_outputs="2", cast_narrow="True"),
                _op("elemwise_add", "add", [(2, 0), (2, 1)])], [[3, 0, 0]])
    types = {("a", 0): "float16", ("b", 0): "float32", ("m", 0): "float16", ("m", 1): "float16",
             ("add", 0): "float16"}
    emu = emulate_graph(g, types)
    nodes = _by_name(emu.graph)
    assert "m" not in nodes  # resolved statically
    add_in = [emu.graph["nodes"][e[0]]["name"] for e in nodes["add"]["inputs"]]
    # a was float16 already (its value is the rounded variable), b narrows: rounded
    assert add_in == [rounding_node("a"), rounding_node("m_1")]


def test_value_preserving_ops_are_not_rounded_again_and_ops_that_make_low_data_run_float32():
    g = _graph([_var("data"), _op("amp_cast", "c", [(0, 0)], dtype="float16"),
                _op("Reshape", "r", [(1, 0)], shape="(-1,)"), _op("Pooling", "p", [(1, 0)], pool_type="avg"),
                _op("_zeros", "z", [], dtype="float16", shape="(2,)")], [[2, 0, 0], [3, 0, 0], [4, 0, 0]])
    types = {("data", 0): "float32", ("c", 0): "float16", ("r", 0): "float16", ("p", 0): "float16",
             ("z", 0): "float16"}
    nodes = _by_name(emulate_graph(g, types).graph)
    assert rounding_node("r") not in nodes and rounding_node("p") in nodes
    assert nodes["z"]["attrs"]["dtype"] == "float32" and rounding_node("z") in nodes


def test_preserves_values_reads_the_conditional_attribute():
    assert preserves_values("Activation", {"act_type": "relu"})
    assert not preserves_values("Activation", {"act_type": "tanh"})
    assert preserves_values("Pooling", {}) and not preserves_values("Pooling", {"pool_type": "avg"})
    assert not preserves_values("Convolution", {})


def _bf16_graph():
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "cw", [(1, 0)], dtype="bfloat16"),
                _op("Convolution", "conv", [(0, 0), (2, 0)], kernel="(1, 1)", num_filter="2", no_bias="True")],
               [[3, 0, 0]])
    types = {("data", 0): "bfloat16", ("w", 0): "float32", ("cw", 0): "bfloat16", ("conv", 0): "bfloat16"}
    return g, types


def test_bf16_rounding_reads_op_outputs_through_a_copy_and_parameters_in_place():
    g, types = _bf16_graph()
    nodes = _by_name(emulate_graph(g, types, ndims={("conv", 0): 4, ("cw", 0): 4, ("data", 0): 4}).graph)
    first = {base: nodes[f"{base}{ROUND_SUFFIX}_bf16_0"] for base in ("conv", "cw", "data")}
    assert first["conv"]["op"] == "transpose" and first["conv"]["attrs"]["axes"] == "(0, 1, 2, 3)"
    assert first["cw"]["op"] == "Reshape" and first["data"]["op"] == "Reshape"  # parameters, data
    unknown = _by_name(emulate_graph(g, types).graph)  # no shapes: the in-place reshape
    assert unknown[f"conv{ROUND_SUFFIX}_bf16_0"]["op"] == "Reshape"


def test_bf16_rounding_is_differentiated_only_through_its_last_node():
    """Forward x + BlockGrad(change): backward keeps nothing of the chain."""
    g, types = _bf16_graph()
    emu = emulate_graph(g, types)
    nodes = emu.graph["nodes"]
    last = _by_name(emu.graph)[rounding_node("conv")]
    assert last["op"] == "elemwise_add"
    x, change = (nodes[e[0]] for e in last["inputs"])
    assert x["name"] == "conv" and change["op"] == "BlockGrad"
    chain = [n for n in nodes if n["name"].startswith(f"conv{ROUND_SUFFIX}_bf16_")]
    assert len(chain) == 7 and all(n["op"] != "null" for n in chain)


def test_a_cast_to_the_dtype_its_input_has_already_is_no_rounding():
    for dtype in ("float16", "bfloat16"):
        g = _graph([_var("data"), _op("Activation", "act", [(0, 0)], act_type="sigmoid"),
                    _op("amp_cast", "c", [(1, 0)], dtype=dtype)], [[2, 0, 0]])
        types = {("data", 0): dtype, ("act", 0): dtype, ("c", 0): dtype}
        emu = emulate_graph(g, types)
        nodes = _by_name(emu.graph)
        assert rounding_node("act") in nodes and rounding_node("c") not in nodes  # act's output is rounded once
        assert nodes["c"]["attrs"]["dtype"] == "float32"  # the cast stays, an identity
        assert emu.entries[("c", 0)] == ("c", 0)
