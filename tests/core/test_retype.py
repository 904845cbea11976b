"""retype: a traced graph's nodes rewired for new decisions (shape rules, the tuner)."""
from gluon_amp_core.decide import Decision, MeasuredChoice, Reason
from gluon_amp_core.retype import Change, retype
from gluon_amp_core.table import default_table
from gluon_amp_core.walk import MEASURED_WHY_ATTR, REASON_ATTR, measured_attrs

BF16, FP32 = "bfloat16", "float32"
OP_INPUTS = {"Convolution": ("data", "weight", "bias"),
             "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var")}
NARROW = {REASON_ATTR: "narrow_input"}


def _traced():
    """x -> amp_cast(bf16) -> conv(w cast to bf16) -> relu -> head, as init traces it."""
    nodes = [
        {"op": "null", "name": "x", "inputs": []},
        {"op": "amp_cast", "name": "x_cast", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "amp_cast", "name": "w_cast", "attrs": {"dtype": BF16}, "inputs": [[2, 0, 0]]},
        {"op": "Convolution", "name": "conv", "attrs": {"stride": "(2, 2)"}, "inputs": [[1, 0, 0], [3, 0, 0]]},
        {"op": "relu", "name": "relu", "inputs": [[4, 0, 0]]},
    ]
    return {"nodes": nodes, "arg_nodes": [0, 2], "heads": [[5, 0, 0]], "attrs": {"mxnet_version": ["int", 10901]}}


def _by_name(graph):
    nodes = graph["nodes"]
    return {n["name"]: (n, [nodes[e[0]]["name"] for e in n["inputs"]]) for n in nodes}


def test_float32_with_unknown_dtypes_reads_before_the_low_casts_casts_and_drops_them():
    change = Change(Decision(FP32, Reason.NARROW_INPUT), NARROW)
    graph = retype(_traced(), {"conv": change}, {}, OP_INPUTS)
    nodes = _by_name(graph)
    conv, conv_in = nodes["conv"]
    assert conv["attrs"][REASON_ATTR] == "narrow_input" and conv["attrs"]["stride"] == "(2, 2)"
    assert [nodes[c][1] for c in conv_in] == [["x"], ["w"]]
    assert all(nodes[c][0]["attrs"]["dtype"] == FP32 for c in conv_in)  # unknown dtypes: cast
    assert "x_cast" not in nodes and "w_cast" not in nodes  # nothing reads them any more
    assert nodes["relu"][1] == ["conv"]
    assert [graph["nodes"][i]["name"] for i in graph["arg_nodes"]] == ["x", "w"]
    assert graph["nodes"][graph["heads"][0][0]]["name"] == "relu"
    assert all(e[0] < j for j, n in enumerate(graph["nodes"]) for e in n["inputs"])  # topological


def test_kept_inputs_and_other_nodes_are_left_alone():
    graph = _traced()
    graph["nodes"][4] = {**graph["nodes"][4], "op": "BatchNorm"}
    change = Change(Decision(FP32, Reason.NARROW_INPUT, frozenset({"gamma"})), NARROW)
    out = _by_name(retype(graph, {"conv": change}, {}, OP_INPUTS))
    assert [out[c][0]["attrs"]["dtype"] for c in out["conv"][1]] == [FP32, BF16]
    untouched = retype(_traced(), {"other": change}, {}, OP_INPUTS)
    assert untouched["nodes"] == _traced()["nodes"]


def test_measured_choices_with_known_dtypes_bypass_or_add_casts_as_needed():
    from test_tune import _chain
    nodes, heads, dt, _ = _chain()
    choices = {"conv": MeasuredChoice(FP32, 409.0, 205.0, 0.0, BF16), "bn": MeasuredChoice(BF16, 1.0, 9.0, 0.5, BF16)}
    table = default_table(BF16)
    changes = {n: Change(Decision(c.dtype, Reason.MEASURED, table.keep_fp32_inputs.get(op, frozenset())),
                         measured_attrs(c)) for (n, c), op in zip(choices.items(), ("Convolution", "BatchNorm"))}
    g = retype({"nodes": nodes, "heads": heads, "arg_nodes": [], "attrs": {}}, changes, dt, OP_INPUTS)
    by = {n["name"]: n for n in g["nodes"]}
    name = [n["name"] for n in g["nodes"]]
    assert [name[e[0]] for e in by["conv"]["inputs"]] == ["data", "w"]  # the wrappers' casts are bypassed ...
    assert "data_c" not in by and "w_c" not in by                         # ... and dropped, unread
    src = name[by["bn"]["inputs"][0][0]]
    assert by[src]["op"] == "amp_cast" and by[src]["attrs"]["dtype"] == BF16  # bn held low: a new cast
    assert [name[e[0]] for e in by["bn"]["inputs"][1:]] == ["g", "b", "m", "v"]  # statistics untouched
    assert by["conv"]["attrs"][REASON_ATTR] == "measured" and "2.0x slower" in by["conv"]["attrs"][MEASURED_WHY_ATTR]
    assert name[g["heads"][0][0]] == "out" and g["arg_nodes"] == [j for j, n in enumerate(g["nodes"]) if n["op"] == "null"]
    assert retype({"nodes": nodes, "heads": heads, "attrs": {}}, {}, dt, OP_INPUTS)["nodes"] == nodes
