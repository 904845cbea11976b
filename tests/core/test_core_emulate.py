"""The emulation rewrite on hand-written graphs (pure: no MXNet needed)."""
import math
import random
import struct

import pytest

from gluon_amp_core.emulate import (BF16_ROUNDING, PAIR_SUFFIX, ROUND_SUFFIX, emulate_graph, lift_input_roundings,
                                    preserves_values, round_bits, rounding_node)

KERNEL = "_gluon_amp_round"
PAIR = KERNEL + PAIR_SUFFIX


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
    assert emu.real_dtypes["fc"] == "float16" and "__amp_dtype__" not in nodes["fc"].get("attrs", {})
    assert emu.entries[("fc", 0)] == (rounding_node("fc"), 0)
    assert emu.rounds == 3


def test_low_precision_variables_are_stored_float32_and_rounded():
    g = _graph([_var("data"), _var("w", __dtype__="12"),
                _op("FullyConnected", "fc", [(0, 0), (1, 0)], num_hidden="2", no_bias="True")], [[2, 0, 0]])
    types = {("data", 0): "bfloat16", ("w", 0): "bfloat16", ("fc", 0): "bfloat16"}
    emu = emulate_graph(g, types)
    nodes = _by_name(emu.graph)
    assert nodes["w"]["attrs"] == {"__dtype__": "0"} and emu.real_dtypes["w"] == "bfloat16"
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


def test_bf16_rounding_reads_op_outputs_through_a_copy_and_parameters_as_they_are():
    g, types = _bf16_graph()
    emu = emulate_graph(g, types, ndims={("conv", 0): 4, ("cw", 0): 4, ("data", 0): 4}).graph
    nodes = _by_name(emu)
    first = nodes[f"conv{ROUND_SUFFIX}_bf16_0"]
    assert first["op"] == "transpose" and first["attrs"]["axes"] == "(0, 1, 2, 3)"
    for base in ("cw", "data"):  # a cast of a parameter, and a variable: no copy, read directly
        assert f"{base}{ROUND_SUFFIX}_bf16_0" not in nodes
        assert emu["nodes"][nodes[f"{base}{ROUND_SUFFIX}_bf16_1"]["inputs"][0][0]]["name"] == base
    unknown = _by_name(emulate_graph(g, types).graph)  # no shapes: the in-place reshape
    assert unknown[f"conv{ROUND_SUFFIX}_bf16_0"]["op"] == "Reshape"


def test_bf16_rounding_is_differentiated_only_through_ops_that_keep_nothing():
    """The value's path to the result: its plain copy, a difference with a BlockGrad'd change,
    two scalings. The rest of the chain is behind the BlockGrad: backward keeps none of it."""
    g, types = _bf16_graph()
    emu = emulate_graph(g, types)
    nodes = emu.graph["nodes"]
    node = _by_name(emu.graph)[rounding_node("conv")]
    path = []
    while node["name"] != "conv":
        path.append(node["op"])
        if node["op"] == "elemwise_sub":
            assert nodes[node["inputs"][1][0]]["op"] == "BlockGrad"
        node = nodes[node["inputs"][0][0]]
    assert path == ["_mul_scalar", "_mul_scalar", "elemwise_sub", "Reshape"]
    chain = [n for n in nodes if n["name"].startswith(f"conv{ROUND_SUFFIX}_bf16_")]
    assert len(chain) == len(BF16_ROUNDING) - 1 and all(n["op"] != "null" for n in chain)
    cw_chain = [n for n in nodes if n["name"].startswith(f"cw{ROUND_SUFFIX}_bf16_")]
    assert len(cw_chain) == len(BF16_ROUNDING) - 2  # a parameter's value is read as it is


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


def _fc_graph(weight_dtype):
    """data -> cast -> FullyConnected (its weight cast to ``weight_dtype``) -> cast again -> out."""
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "c", [(0, 0)], dtype=weight_dtype),
                _op("amp_cast", "cw", [(1, 0)], dtype=weight_dtype),
                _op("FullyConnected", "fc", [(2, 0), (3, 0)], num_hidden="2", no_bias="True"),
                _op("amp_cast", "again", [(4, 0)], dtype=weight_dtype),
                _op("amp_cast", "out", [(5, 0)], dtype="float32")], [[6, 0, 0]])
    types = {("data", 0): "float32", ("w", 0): "float32", ("c", 0): weight_dtype, ("cw", 0): weight_dtype,
             ("fc", 0): weight_dtype, ("again", 0): weight_dtype, ("out", 0): "float32"}
    return g, types


def _topological(graph):
    return all(e[0] < j for j, n in enumerate(graph["nodes"]) for e in n["inputs"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_with_the_kernel_each_rounding_is_one_node_and_is_the_plan_casts_value(dtype):
    emu = emulate_graph(*_fc_graph(dtype), kernel=KERNEL)
    nodes = _by_name(emu.graph)
    names = [n["name"] for n in emu.graph["nodes"]]
    kernels = [n for n in emu.graph["nodes"] if n["op"] in (KERNEL, PAIR)]
    assert {n["name"] for n in kernels} == {rounding_node(b) for b in ("c", "cw", "fc")}
    assert all(n["attrs"] == {"dtype": dtype} for n in kernels) and emu.rounds == 3
    # the op reads the parameter's rounding itself: no cast node stands between the op's
    # gradient and the parameter's (MXNet held a gradient buffer per parameter for one)
    fc_inputs = [(names[e[0]], e[1]) for e in nodes["fc"]["inputs"]]
    weight = 1 if dtype == "float16" else 0  # float16: the pair's second output (the next test)
    assert fc_inputs[1] == (rounding_node("cw"), weight)
    assert names[nodes[rounding_node("cw")]["inputs"][-1][0]] == "w" and "cw" not in nodes and "c" not in nodes
    assert emu.entries[("cw", 0)] == (rounding_node("cw"), weight) and emu.entries[("c", 0)] == (rounding_node("c"), 0)
    assert emu.entries[("fc", 0)] == (rounding_node("fc"), 0)
    # a cast of a value the plan holds in the dtype already is an identity, as without the kernel
    assert names[nodes["again"]["inputs"][0][0]] == rounding_node("fc") and rounding_node("again") not in nodes
    assert not [n for n in emu.graph["nodes"] if n["name"].startswith(rounding_node("fc") + "_")]
    assert _topological(emu.graph)


def test_a_float16_parameters_rounding_rides_on_the_data_input_of_the_op_that_reads_it():
    """The pair (data, w) -> (data, w rounded) sits between the data's rounding and the op: its
    backward, which rounds the weight's gradient, is on the data gradient's way back, so MXNet
    runs it as the backward pass reaches the op (alone, at the end of the backward pass)."""
    emu = emulate_graph(*_fc_graph("float16"), kernel=KERNEL)
    nodes = _by_name(emu.graph)
    names = [n["name"] for n in emu.graph["nodes"]]
    pair = nodes[rounding_node("cw")]
    assert pair["op"] == PAIR and pair["attrs"] == {"dtype": "float16"}
    assert [(names[e[0]], e[1]) for e in pair["inputs"]] == [(rounding_node("c"), 0), ("w", 0)]
    assert [(names[e[0]], e[1]) for e in nodes["fc"]["inputs"]] == [(rounding_node("cw"), 0), (rounding_node("cw"), 1)]
    assert names.index(rounding_node("c")) < names.index(rounding_node("cw")) == names.index("fc") - 1
    assert [n["op"] for n in emu.graph["nodes"]].count(KERNEL) == 2  # the data's and the output's


def _shared_weight():
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "c", [(0, 0)], dtype="float16"),
                _op("amp_cast", "cw", [(1, 0)], dtype="float16"),
                _op("FullyConnected", "fc1", [(2, 0), (3, 0)], num_hidden="4", no_bias="True"),
                _op("FullyConnected", "fc2", [(4, 0), (3, 0)], num_hidden="4", no_bias="True")], [[5, 0, 0]])
    return g, {("data", 0): "float32", ("w", 0): "float32", ("c", 0): "float16", ("cw", 0): "float16",
               ("fc1", 0): "float16", ("fc2", 0): "float16"}


def _data_is_a_graph_input():
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "cw", [(1, 0)], dtype="float16"),
                _op("FullyConnected", "fc", [(0, 0), (2, 0)], num_hidden="4", no_bias="True")], [[3, 0, 0]])
    return g, {("data", 0): "float32", ("w", 0): "float32", ("cw", 0): "float16", ("fc", 0): "float16"}


def _ids_as_data():
    g = _graph([_var("ids"), _var("w"), _op("Cast", "i", [(0, 0)], dtype="int32"),
                _op("amp_cast", "cw", [(1, 0)], dtype="float16"),
                _op("Embedding", "emb", [(2, 0), (3, 0)], input_dim="8", output_dim="4")], [[4, 0, 0]])
    return g, {("ids", 0): "float32", ("w", 0): "float32", ("i", 0): "int32", ("cw", 0): "float16",
               ("emb", 0): "float16"}


def _rounding_is_an_output():
    g, types = _fc_graph("float16")
    g["heads"].append([3, 0, 0])  # the rounded weight is also an output of the graph
    return g, types


@pytest.mark.parametrize("case", [_shared_weight, _data_is_a_graph_input, _ids_as_data, _rounding_is_an_output],
                         ids=lambda c: c.__name__.strip("_"))
def test_a_parameters_rounding_stays_alone_where_no_one_op_reads_it_beside_a_float32_value(case):
    """Read by two ops (shared weights), beside a graph input (kept out of the planner's place),
    beside int32 ids, or an output of the graph itself: the rounding stays one node."""
    emu = emulate_graph(*case(), kernel=KERNEL)
    ops = [n["op"] for n in emu.graph["nodes"]]
    assert PAIR not in ops and _by_name(emu.graph)[rounding_node("cw")]["op"] == KERNEL
    assert _topological(emu.graph)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_with_the_kernel_stored_low_parameters_and_multicasts_are_rounded_by_it(dtype):
    g = _graph([_var("a"), _var("b", __dtype__="2"), _op("amp_multicast", "m", [(0, 0), (1, 0)], num_outputs="2"),
                _op("elemwise_add", "add", [(2, 0), (2, 1)])], [[3, 0, 0]])
    types = {("a", 0): "float32", ("b", 0): dtype, ("m", 0): dtype, ("m", 1): dtype, ("add", 0): dtype}
    emu = emulate_graph(g, types, kernel=KERNEL)
    ops = {n["name"]: n["op"] for n in emu.graph["nodes"]}
    assert ops[rounding_node("m_0")] == ops[rounding_node("add")] == KERNEL
    assert ops[rounding_node("b")] == (PAIR if dtype == "float16" else KERNEL)  # add reads it beside m_0
    assert rounding_node("m_1") not in ops  # b holds the dtype's values already


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits(value):
    return struct.unpack("<I", struct.pack("<f", value))[0]


@pytest.mark.parametrize("value, want", [
    (65504.0, 65504.0), (65519.99, 65504.0), (65520.0, math.inf), (-1e6, -math.inf),
    (1.0 + 2.0 ** -11, 1.0), (1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -9),        # ties to even
    (2.0 ** -24, 2.0 ** -24), (2.0 ** -25, 0.0), (3 * 2.0 ** -25, 2.0 ** -23),  # subnormals, ties
    (2.0 ** -14 - 2.0 ** -26, 2.0 ** -14), (-0.0, -0.0), (-2.0 ** -26, -0.0), (math.inf, math.inf)])
def test_round_bits_float16_follows_ieee(value, want):
    got = _f32(round_bits(_bits(value), "float16"))
    assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


@pytest.mark.parametrize("bits, want", [
    (0x3F808000, 0x3F800000), (0x3F818000, 0x3F820000), (0x3F808001, 0x3F810000),  # ties to even, above
    (0x7F7FFFFF, 0x7F800000), (0x7F7F7FFF, 0x7F7F0000), (0xFF7F8000, 0xFF800000),  # overflow to -+inf
    (0x00008000, 0x00000000), (0x00018000, 0x00020000), (0x00007FFF, 0x00000000),  # subnormals kept
    (0x80000000, 0x80000000), (0x7F800000, 0x7F800000), (0xFF800000, 0xFF800000)])
def test_round_bits_bfloat16_follows_ieee(bits, want):
    assert round_bits(bits, "bfloat16") == want


def _rne_to_bits(value, significant, min_exp, max_finite):
    """Round a finite float to ``significant`` bits, quantum at least 2**min_exp, to nearest
    even, with exact integer arithmetic: an implementation independent of round_bits's."""
    if value == 0 or math.isinf(value):
        return value
    m, e = math.frexp(abs(value))  # value = m 2**e, 0.5 <= m < 1
    quantum = max(e - significant, min_exp)
    q, r = divmod(abs(value), 2.0 ** quantum)
    q = int(q) + (1 if r > 2.0 ** (quantum - 1) or (r == 2.0 ** (quantum - 1) and int(q) % 2) else 0)
    out = q * 2.0 ** quantum
    out = math.inf if out > max_finite else out
    return math.copysign(out, value)


@pytest.mark.parametrize("dtype, significant, min_exp, max_finite", [
    ("float16", 11, -24, 65504.0), ("bfloat16", 8, -133, (2 - 2.0 ** -7) * 2.0 ** 127)])
def test_round_bits_agrees_with_an_independent_rounding_on_random_values(dtype, significant, min_exp, max_finite):
    rng = random.Random(11)
    for _ in range(20_000):
        bits = rng.getrandbits(32)
        value = _f32(bits)
        got = _f32(round_bits(bits, dtype))
        if math.isnan(value):
            assert math.isnan(got)
            continue
        want = _rne_to_bits(value, significant, min_exp, max_finite)
        assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), hex(bits)


def test_round_bits_names_a_bad_dtype():
    with pytest.raises(ValueError, match="'float16' or 'bfloat16', got 'float64'"):
        round_bits(0, "float64")


def test_emulation_adds_no_attribute_of_gluon_amps_and_keeps_real_dtypes_beside_the_graph():
    """MXNet hands every node attribute to a Python custom op's constructor: the emulated graph's
    nodes carry their own attributes only; the plan's dtypes are in the result, by node name."""
    g = _graph([_var("data"), _op("amp_cast", "c", [(0, 0)], dtype="bfloat16"),
                _op("Custom", "twice", [(1, 0)], op_type="twice"),
                _op("amp_cast", "out", [(2, 0)], dtype="float32")], [[3, 0, 0]])
    types = {("data", 0): "float32", ("c", 0): "bfloat16", ("twice", 0): "bfloat16", ("out", 0): "float32"}
    for kernel in (None, "_gluon_amp_round"):
        emu = emulate_graph(g, types, kernel=kernel)
        assert _by_name(emu.graph)["twice"]["attrs"] == {"op_type": "twice"}
        assert not any(k.startswith("__amp_") for n in emu.graph["nodes"] for k in n.get("attrs", {}))
        assert emu.real_dtypes == {"data": "float32", "c": "bfloat16", "twice": "bfloat16", "out": "float32"}
def _fed_graph():
    """data (no ``__dtype__``: typed from what the caller feeds) -> cast -> fc -> (fc, softmax)."""
    g = _graph([_var("data"), _var("w"), _op("amp_cast", "c", [(0, 0)], dtype="float16"),
                _op("amp_cast", "cw", [(1, 0)], dtype="float16"),
                _op("FullyConnected", "fc", [(2, 0), (3, 0)], num_hidden="2", no_bias="True"),
                _op("amp_cast", "up", [(4, 0)], dtype="float32"), _op("softmax", "sm", [(5, 0)])],
               [[4, 0, 0], [6, 0, 0]])
    return g


@pytest.mark.parametrize("kernel", [None, KERNEL])
@pytest.mark.parametrize("fed", ["float16", "bfloat16"])
def test_low_precision_data_is_cast_to_float32_and_low_outputs_come_back_in_its_dtype(kernel, fed):
    types = {("data", 0): fed, ("w", 0): "float32", ("c", 0): "float16", ("cw", 0): "float16",
             ("fc", 0): "float16", ("up", 0): "float32", ("sm", 0): "float32"}
    emu = emulate_graph(_fed_graph(), types, kernel=kernel, fed={"data": fed, "w": "float32"}).graph
    nodes, names = _by_name(emu), [n["name"] for n in emu["nodes"]]
    # the caller's array is read in its dtype, then cast to float32, exactly (no rounding)
    assert "__dtype__" not in nodes["data"].get("attrs", {})
    up = nodes[rounding_node("data")]
    assert up["op"] == "amp_cast" and up["attrs"]["dtype"] == "float32" and up["inputs"][0][0] == names.index("data")
    assert not any(n["op"] == KERNEL and emu["nodes"][n["inputs"][0][0]]["name"] == "data" for n in emu["nodes"])
    # fc (float16 in real AMP) is given back in the caller's dtype; the softmax stays float32
    fc_head, sm_head = (emu["nodes"][h[0]] for h in emu["heads"])
    assert fc_head["op"] == "amp_cast" and fc_head["attrs"]["dtype"] == fed
    assert emu["nodes"][fc_head["inputs"][0][0]]["name"] == rounding_node("fc")
    assert sm_head["name"] == "sm"


def test_a_graph_fed_float32_gives_float32_outputs():
    types = {("data", 0): "float32", ("w", 0): "float32", ("c", 0): "float16", ("cw", 0): "float16",
             ("fc", 0): "float16", ("up", 0): "float32", ("sm", 0): "float32"}
    for fed in (None, {"data": "float32", "w": "float32"}):
        emu = emulate_graph(_fed_graph(), types, fed=fed).graph
        assert [emu["nodes"][h[0]]["name"] for h in emu["heads"]] == [rounding_node("fc"), "sm"]


def test_a_parameter_stored_low_and_fed_low_keeps_its_dtype():
    """A parameter the executor holds in bfloat16 (``__dtype__`` says so) is read as it is and
    cast to float32; one the graph declares low but that is fed float32 is stored float32 and
    rounded (a converter's emulated copies)."""
    g = _graph([_var("data"), _var("w", __dtype__="12"),
                _op("FullyConnected", "fc", [(0, 0), (1, 0)], num_hidden="2", no_bias="True")], [[2, 0, 0]])
    types = {("data", 0): "bfloat16", ("w", 0): "bfloat16", ("fc", 0): "bfloat16"}
    held = _by_name(emulate_graph(g, types, fed={"data": "bfloat16", "w": "bfloat16"}).graph)
    assert held["w"]["attrs"]["__dtype__"] == "12"
    assert held[rounding_node("w")]["op"] == "amp_cast" and held[rounding_node("w")]["attrs"]["dtype"] == "float32"
    stored = _by_name(emulate_graph(g, types, fed={"w": "float32"}).graph)
    assert stored["w"]["attrs"]["__dtype__"] == "0"
    assert stored[rounding_node("data")]["op"] == BF16_ROUNDING[-1][0]  # not fed low: rounded


@pytest.mark.parametrize("kernel", [None, KERNEL])
@pytest.mark.parametrize("source", ["int32", "float64"])
def test_a_cast_of_a_non_float32_value_to_a_low_dtype_rounds_float32(kernel, source):
    """Sockeye casts its int32 ``finished`` mask to float16: the rounding must read float32 (the
    kernel rejects other dtypes), so the value is cast to float32 before it is rounded."""
    g = _graph([_var("mask"), _op("Cast", "c", [(0, 0)], dtype="float16")], [[1, 0, 0]])
    types = {("mask", 0): source, ("c", 0): "float16"}
    emu = emulate_graph(g, types, kernel=kernel).graph
    nodes = emu["nodes"]
    for n in nodes:
        if n["op"] == KERNEL:
            src = nodes[n["inputs"][0][0]]
            assert src["op"] == "Cast" and src["attrs"]["dtype"] == "float32", n
    head = nodes[emu["heads"][0][0]]
    assert head["op"] in (KERNEL, "amp_cast", "Cast") and any(n["op"] in (KERNEL, "amp_cast") for n in nodes)


def _random_plan(rng):
    """A random plan: a chain of ops on a float32 input, each reading the one before (through a
    cast to the layer's dtype or not), some a parameter (cast to a random dtype, some shared with
    a later op), some an output of the graph."""
    nodes, types, heads = [_var("data")], {("data", 0): "float32"}, []
    x, params = (0, 0), []
    for k in range(rng.randint(1, 6)):
        dtype = rng.choice(["float16", "bfloat16", "float32"])
        if dtype != "float32" and rng.random() < 0.7:
            nodes.append(_op("amp_cast", f"x{k}", [x], dtype=dtype))
            types[(f"x{k}", 0)] = dtype
            x = (len(nodes) - 1, 0)
        op_inputs = [x]
        if rng.random() < 0.8:
            if params and rng.random() < 0.3:
                op_inputs.append(rng.choice(params))  # shared with an earlier op
            else:
                nodes.append(_var(f"w{k}"))
                types[(f"w{k}", 0)] = "float32"
                low = rng.choice(["float16", "bfloat16"])
                nodes.append(_op("amp_cast", f"cw{k}", [(len(nodes) - 1, 0)], dtype=low))
                types[(f"cw{k}", 0)] = nodes[-1]["attrs"]["dtype"]
                op_inputs.append((len(nodes) - 1, 0))
                params.append(op_inputs[-1])
        name = f"op{k}"
        nodes.append(_op("FullyConnected" if len(op_inputs) == 2 else "tanh", name, op_inputs, num_hidden="3"))
        types[(name, 0)] = dtype
        x = (len(nodes) - 1, 0)
        if rng.random() < 0.2:
            heads.append([*x, 0])
    if params and rng.random() < 0.2:
        heads.append([*params[-1], 0])
    heads.append([*x, 0])
    return _graph(nodes, heads), types


def _value(graph, entry, memo):
    """What ``entry`` of an emulated graph computes, as a nested tuple: the pair's first output
    is its data, its second the rounding of its weight, as a kernel rounding."""
    key = (entry[0], entry[1])
    if key not in memo:
        node = graph["nodes"][entry[0]]
        inputs = node.get("inputs", [])
        if node["op"] == PAIR:
            memo[key] = (_value(graph, inputs[0], memo) if entry[1] == 0 else
                         (KERNEL, node["attrs"]["dtype"], _value(graph, inputs[1], memo)))
        elif node["op"] == KERNEL:
            memo[key] = (KERNEL, node["attrs"]["dtype"], _value(graph, inputs[0], memo))
        else:
            memo[key] = (node["op"], node["name"], entry[1], tuple(_value(graph, e, memo) for e in inputs))
    return memo[key]


def test_pairing_changes_where_roundings_run_never_what_the_graph_computes(monkeypatch):
    """300 random plans: with and without the pairs, every output and every real entry holds the
    same computation; the pairs' graph is in order; each pair's op reads its two outputs."""
    import gluon_amp_core.emulate as emulate
    rng = random.Random(20261125)
    paired = 0
    for _ in range(300):
        g, types = _random_plan(rng)
        with_pairs = emulate_graph(g, types, kernel=KERNEL)
        with monkeypatch.context() as m:
            m.setattr(emulate, "_pair_weight_roundings", lambda rw, heads, dtypes: (lambda j, k: (j, k)))
            alone = emulate_graph(g, types, kernel=KERNEL)
        a, b = with_pairs.graph, alone.graph
        assert _topological(a)
        memo_a, memo_b = {}, {}
        assert [_value(a, h, memo_a) for h in a["heads"]] == [_value(b, h, memo_b) for h in b["heads"]]
        index_a = {n["name"]: j for j, n in enumerate(a["nodes"])}
        index_b = {n["name"]: j for j, n in enumerate(b["nodes"])}
        for key in with_pairs.entries:
            (na, ka), (nb, kb) = with_pairs.entries[key], alone.entries[key]
            assert _value(a, (index_a[na], ka), memo_a) == _value(b, (index_b[nb], kb), memo_b), key
        for j, node in enumerate(a["nodes"]):
            if node["op"] == PAIR:
                paired += 1
                readers = [(c, e) for c, n in enumerate(a["nodes"]) for e in n["inputs"] if e[0] == j]
                assert [e[1] for _, e in readers] == [0, 1] and len({c for c, _ in readers}) == 1
                assert node["attrs"]["dtype"] == "float16"
    assert paired > 50  # the plans hold pairs to check


def _fed_rounded(graph, lifted):
    """``graph`` with each variable named in ``lifted`` (name -> dtype) read through its kernel
    rounding: what the caller's rounding feeds the graph, written as a graph."""
    out, index = [], {}
    for j, node in enumerate(graph["nodes"]):
        out.append({**node, "inputs": [[index[e[0]], e[1], 0] for e in node.get("inputs", [])]})
        index[j] = len(out) - 1
        if node["op"] == "null" and node["name"] in lifted:
            out.append(_op(KERNEL, node["name"] + "_fed", [(index[j], 0)], dtype=lifted[node["name"]]))
            index[j] = len(out) - 1
    return {**graph, "nodes": out, "heads": [[index[h[0]], h[1], 0] for h in graph["heads"]]}


def test_an_input_the_caller_rounds_computes_what_the_graph_rounding_it_did():
    """300 random plans, emulated with the kernel: where ``data`` is only rounded, the lifted
    graph reads it as it is, and fed its rounding computes every output as before; no pair reads
    a graph input; the graph stays in order; elsewhere nothing changes."""
    rng = random.Random(20261128)
    lifted_count = 0
    for _ in range(300):
        g, types = _random_plan(rng)
        emu = emulate_graph(g, types, kernel=KERNEL).graph
        lifted, dtypes = lift_input_roundings(emu, {"data"}, KERNEL)
        nodes = emu["nodes"]
        data = next(j for j, n in enumerate(nodes) if n["name"] == "data")
        readers = [nodes[c] for c, n in enumerate(nodes) for e in n["inputs"] if e[0] == data]
        only_rounded = bool(readers) and all(r["op"] == KERNEL for r in readers) and \
            len({r["attrs"]["dtype"] for r in readers}) == 1 and data not in {h[0] for h in emu["heads"]}
        if not only_rounded:
            assert lifted is emu and dtypes == {}
            continue
        lifted_count += 1
        assert dtypes == {"data": readers[0]["attrs"]["dtype"]}
        assert _topological(lifted) and len(lifted["heads"]) == len(emu["heads"])
        now = lifted["nodes"]
        assert not [n for n in now if n["op"] == PAIR and now[n["inputs"][0][0]]["op"] == "null"]
        data_now = next(j for j, n in enumerate(lifted["nodes"]) if n["name"] == "data")
        assert not [n for n in lifted["nodes"] if n["op"] == KERNEL and n["inputs"][0][0] == data_now]
        fed = _fed_rounded(lifted, dtypes)
        assert [_value(fed, h, {}) for h in fed["heads"]] == [_value(emu, h, {}) for h in emu["heads"]]
    assert lifted_count > 50


@pytest.mark.parametrize("case", ["read_float32_too", "an_output", "two_dtypes", "a_parameter"])
def test_an_input_read_otherwise_stays_rounded_in_the_graph(case):
    nodes = [_var("data"), _op(KERNEL, "r16", [(0, 0)], dtype="float16"), _op("tanh", "t", [(1, 0)])]
    heads = [[2, 0, 0]]
    names = {"data"}
    if case == "read_float32_too":
        nodes.append(_op("relu", "f32", [(0, 0)]))
        heads.append([3, 0, 0])
    elif case == "an_output":
        heads.append([0, 0, 0])
    elif case == "two_dtypes":
        nodes.append(_op(KERNEL, "rb", [(0, 0)], dtype="bfloat16"))
        heads.append([3, 0, 0])
    else:
        names = {"other"}  # a parameter: not one of the block's data inputs
    g = _graph(nodes, heads)
    assert lift_input_roundings(g, names, KERNEL) == (g, {})


def test_a_lifted_inputs_paired_weight_rounding_is_single_again():
    """data -> rounding -> pair(data, w) -> fc: lifted, fc reads data itself and w's rounding."""
    emu = emulate_graph(*_fc_graph("float16"), kernel=KERNEL).graph
    lifted, dtypes = lift_input_roundings(emu, ["data"], KERNEL)
    assert dtypes == {"data": "float16"}
    nodes = _by_name(lifted)
    names = [n["name"] for n in lifted["nodes"]]
    assert [(names[e[0]], e[1]) for e in nodes["fc"]["inputs"]] == [("data", 0), (rounding_node("cw"), 0)]
    assert nodes[rounding_node("cw")]["op"] == KERNEL and nodes[rounding_node("cw")]["attrs"] == {"dtype": "float16"}
    assert [(names[e[0]], e[1]) for e in nodes[rounding_node("cw")]["inputs"]] == [("w", 0)]
    assert rounding_node("c") not in nodes and [n["op"] for n in lifted["nodes"]].count(PAIR) == 0
    assert lifted["arg_nodes"] == [j for j, n in enumerate(lifted["nodes"]) if n["op"] == "null"]
