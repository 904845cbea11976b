from gluon_amp_core.retype import feed_float32
from gluon_amp_core.walk import REASON_ATTR

OP_INPUTS = {"Convolution": ("data", "weight", "bias"), "BatchNorm": ("data", "gamma", "beta")}


def _traced():
    """x -> amp_cast(bf16) -> conv(w cast to bf16) -> relu -> head, as init traces it."""
    nodes = [
        {"op": "null", "name": "x", "inputs": []},
        {"op": "amp_cast", "name": "x_cast", "attrs": {"dtype": "bfloat16"}, "inputs": [[0, 0, 0]]},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "amp_cast", "name": "w_cast", "attrs": {"dtype": "bfloat16"}, "inputs": [[2, 0, 0]]},
        {"op": "Convolution", "name": "conv", "attrs": {"stride": "(2, 2)"}, "inputs": [[1, 0, 0], [3, 0, 0]]},
        {"op": "relu", "name": "relu", "inputs": [[4, 0, 0]]},
    ]
    return {"nodes": nodes, "arg_nodes": [0, 2], "heads": [[5, 0, 0]], "attrs": {"mxnet_version": ["int", 10901]}}


def _by_name(graph):
    nodes = graph["nodes"]
    return {n["name"]: (n, [nodes[e[0]]["name"] for e in n["inputs"]]) for n in nodes}


def test_feed_float32_reads_before_the_low_casts_and_drops_them():
    graph = feed_float32(_traced(), {"conv": frozenset()}, OP_INPUTS, "narrow_input")
    nodes = _by_name(graph)
    conv, conv_in = nodes["conv"]
    assert conv["attrs"][REASON_ATTR] == "narrow_input" and conv["attrs"]["stride"] == "(2, 2)"
    assert [nodes[c][1] for c in conv_in] == [["x"], ["w"]]
    assert all(nodes[c][0]["attrs"]["dtype"] == "float32" for c in conv_in)
    assert "x_cast" not in nodes and "w_cast" not in nodes  # nothing reads them any more
    assert nodes["relu"][1] == ["conv"]
    assert [graph["nodes"][i]["name"] for i in graph["arg_nodes"]] == ["x", "w"]
    assert graph["nodes"][graph["heads"][0][0]]["name"] == "relu"
    # topological: every input comes before its consumer
    assert all(e[0] < j for j, n in enumerate(graph["nodes"]) for e in n["inputs"])


def test_feed_float32_leaves_kept_inputs_and_other_nodes_alone():
    graph = _traced()
    graph["nodes"][4] = {**graph["nodes"][4], "op": "BatchNorm"}
    out = _by_name(feed_float32(graph, {"conv": frozenset({"gamma"})}, OP_INPUTS, "narrow_input"))
    assert [out[c][0]["attrs"]["dtype"] for c in out["conv"][1]] == ["float32", "bfloat16"]
    untouched = feed_float32(_traced(), {"other": frozenset()}, OP_INPUTS, "narrow_input")
    assert untouched["nodes"] == _traced()["nodes"]
