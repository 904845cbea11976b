"""The scaled identity in front of a graph's loss heads (gluon_amp_core/loss_heads.py): pure JSON."""
import pytest

from gluon_amp_core.lists.loss_outputs import GRAPH_LOSS_HEADS, LOSS_OUTPUT_FUNCTIONS
from gluon_amp_core.loss_heads import loss_heads, scale_loss_heads


def _graph(head="SoftmaxOutput"):
    return {"nodes": [{"op": "null", "name": "data", "inputs": []},
                      {"op": "null", "name": "w", "inputs": []},
                      {"op": "FullyConnected", "name": "fc", "attrs": {"num_hidden": "3", "no_bias": "True"},
                       "inputs": [[0, 0, 0], [1, 0, 0]]},
                      {"op": "null", "name": "label", "inputs": []},
                      {"op": head, "name": "out", "inputs": [[2, 0, 0], [3, 0, 0]]}],
            "arg_nodes": [0, 1, 3], "node_row_ptr": [0, 1, 2, 3, 4, 5], "heads": [[4, 0, 0]],
            "attrs": {"mxnet_version": ["int", 10901]}}


def test_heads_list_extends_the_peers_loss_outputs():
    assert GRAPH_LOSS_HEADS[:len(LOSS_OUTPUT_FUNCTIONS)] == LOSS_OUTPUT_FUNCTIONS
    assert "MakeLoss" in GRAPH_LOSS_HEADS


def test_head_input_goes_through_the_scaled_identity():
    g = _graph()
    new, reached = scale_loss_heads(g, GRAPH_LOSS_HEADS, "s")
    assert reached == ["out"] and g == _graph()  # the input graph is not changed
    nodes = new["nodes"]
    by_name = {n["name"]: i for i, n in enumerate(nodes)}
    assert nodes[0] == {"op": "null", "name": "s", "attrs": {"__shape__": "(1,)", "__dtype__": "0"}, "inputs": []}
    head = nodes[by_name["out"]]
    add = nodes[head["inputs"][0][0]]
    assert add["op"] == "elemwise_add"
    block, mul = (nodes[e[0]] for e in add["inputs"])
    assert block["op"] == "BlockGrad" and block["inputs"] == [[by_name["fc"], 0, 0]]
    assert mul["op"] == "broadcast_mul" and mul["inputs"][1] == [0, 0, 0]
    zero = nodes[mul["inputs"][0][0]]
    assert zero["op"] == "elemwise_sub" and zero["inputs"] == [[by_name["fc"], 0, 0], [by_name[block["name"]], 0, 0]]
    assert head["inputs"][1] == [by_name["label"], 0, 0]
    assert new["heads"] == [[by_name["out"], 0, 0]]
    assert new["arg_nodes"] == [i for i, n in enumerate(nodes) if n["op"] == "null"]
    for i, n in enumerate(nodes):  # topological: every input comes earlier
        assert all(e[0] < i for e in n["inputs"])


def test_low_precision_input_is_scaled_in_float32():
    new, _ = scale_loss_heads(_graph(), GRAPH_LOSS_HEADS, "s", lambda node, out: "float16")
    casts = [n for n in new["nodes"] if n["op"] == "amp_cast"]
    assert [c["attrs"]["dtype"] for c in casts] == ["float32", "float16"]


def test_graph_without_heads_is_unchanged_and_names_are_checked():
    g = _graph("softmax")
    assert loss_heads(g, GRAPH_LOSS_HEADS) == []
    assert scale_loss_heads(g, GRAPH_LOSS_HEADS, "s") == (g, [])
    with pytest.raises(ValueError, match="'w'"):
        scale_loss_heads(_graph(), GRAPH_LOSS_HEADS, "w")


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_known_rank_multiplies_elementwise_by_the_scale_broadcast_to_the_input(rank):
    """With the input's rank known, ``s`` is reshaped to that rank, broadcast like the input and
    multiplied elementwise (MXNet's broadcast_mul backward is a slow generic reduction on CPUs)."""
    new, reached = scale_loss_heads(_graph(), GRAPH_LOSS_HEADS, "s", None, lambda node, out: rank)
    nodes = new["nodes"]
    by_name = {n["name"]: i for i, n in enumerate(nodes)}
    add = nodes[nodes[by_name["out"]]["inputs"][0][0]]
    mul = nodes[add["inputs"][1][0]]
    assert reached == ["out"] and mul["op"] == "elemwise_mul"
    zero, like = (nodes[e[0]] for e in mul["inputs"])
    assert zero["op"] == "elemwise_sub" and like["op"] == "broadcast_like"
    assert like["inputs"][1] == mul["inputs"][0]
    shaped = nodes[like["inputs"][0][0]]
    assert shaped["op"] == "Reshape" and shaped["inputs"] == [[0, 0, 0]]
    assert tuple(int(d) for d in shaped["attrs"]["shape"].strip("()").split(",") if d.strip()) == (1,) * rank
    for i, n in enumerate(nodes):
        assert all(e[0] < i for e in n["inputs"])
