"""retype: a traced graph's nodes rewired for new decisions (shape rules, the tuner)."""
import pytest

from gluon_amp_core.decide import Decision, MeasuredChoice, Reason
from gluon_amp_core.retype import Change, cast_each_input, drop_identity_casts, retype, unique_op_names
from gluon_amp_core.table import default_table
from gluon_amp_core.walk import measured_note

BF16, FP32 = "bfloat16", "float32"
OP_INPUTS = {"Convolution": ("data", "weight", "bias"),
             "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var")}


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
    change = Change(Decision(FP32, Reason.NARROW_INPUT))
    graph = retype(_traced(), {"conv": change}, {}, OP_INPUTS)
    nodes = _by_name(graph)
    conv, conv_in = nodes["conv"]
    assert conv["attrs"] == {"stride": "(2, 2)"}  # the reason is the caller's to keep, beside the graph
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
    change = Change(Decision(FP32, Reason.NARROW_INPUT, frozenset({"gamma"})))
    out = _by_name(retype(graph, {"conv": change}, {}, OP_INPUTS))
    assert [out[c][0]["attrs"]["dtype"] for c in out["conv"][1]] == [FP32, BF16]
    untouched = retype(_traced(), {"other": change}, {}, OP_INPUTS)
    assert untouched["nodes"] == _traced()["nodes"]


def test_measured_choices_with_known_dtypes_bypass_or_add_casts_as_needed():
    from test_tuning_problem import _chain
    nodes, heads, dt, _ = _chain()
    choices = {"conv": MeasuredChoice(FP32, 409.0, 205.0, 0.0, BF16), "bn": MeasuredChoice(BF16, 1.0, 9.0, 0.5, BF16)}
    table = default_table(BF16)
    changes = {n: Change(Decision(c.dtype, Reason.MEASURED, table.keep_fp32_inputs.get(op, frozenset())))
               for (n, c), op in zip(choices.items(), ("Convolution", "BatchNorm"))}
    g = retype({"nodes": nodes, "heads": heads, "arg_nodes": [], "attrs": {}}, changes, dt, OP_INPUTS)
    by = {n["name"]: n for n in g["nodes"]}
    name = [n["name"] for n in g["nodes"]]
    assert [name[e[0]] for e in by["conv"]["inputs"]] == ["data", "w"]  # the wrappers' casts are bypassed ...
    assert "data_c" not in by and "w_c" not in by                         # ... and dropped, unread
    src = name[by["bn"]["inputs"][0][0]]
    assert by[src]["op"] == "amp_cast" and by[src]["attrs"]["dtype"] == BF16  # bn held low: a new cast
    assert [name[e[0]] for e in by["bn"]["inputs"][1:]] == ["g", "b", "m", "v"]  # statistics untouched
    note = measured_note(choices["conv"])
    assert note.reason == "measured" and "2.0x slower" in note.detail
    assert not any(k.startswith("__amp_") for n in g["nodes"] for k in n.get("attrs", {}))
    assert name[g["heads"][0][0]] == "out"
    assert g["arg_nodes"] == [j for j, n in enumerate(g["nodes"]) if n["op"] == "null"]
    assert retype({"nodes": nodes, "heads": heads, "attrs": {}}, {}, dt, OP_INPUTS)["nodes"] == nodes


def _ids_graph():
    """ids (int64) and x (float32) -> each cast to bf16 -> Embedding; a multicast of
    (lengths, x, y) -> where; a multicast of (lengths, x) -> broadcast_add; as init traces them."""
    nodes = [
        {"op": "null", "name": "ids", "inputs": []},
        {"op": "amp_cast", "name": "ids_cast", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "amp_cast", "name": "w_cast", "attrs": {"dtype": BF16}, "inputs": [[2, 0, 0]]},
        {"op": "Embedding", "name": "emb", "inputs": [[1, 0, 0], [3, 0, 0]]},
        {"op": "null", "name": "lengths", "inputs": []},
        {"op": "amp_multicast", "name": "mc", "attrs": {"num_outputs": "3"},
         "inputs": [[5, 0, 0], [4, 0, 0], [2, 0, 0]]},
        {"op": "where", "name": "where", "inputs": [[6, 0, 0], [6, 1, 0], [6, 2, 0]]},
        {"op": "amp_multicast", "name": "mc2", "attrs": {"num_outputs": "2"}, "inputs": [[5, 0, 0], [7, 0, 0]]},
        {"op": "broadcast_add", "name": "add", "inputs": [[8, 0, 0], [8, 1, 0]]},
    ]
    return {"nodes": nodes, "arg_nodes": [0, 2, 5], "heads": [[9, 0, 0]], "attrs": {}}


def test_casts_of_integers_and_float64_are_dropped_and_multicasts_keep_their_floats():
    dtypes = {("ids", 0): "int64", ("ids_cast", 0): "int64", ("w", 0): FP32, ("w_cast", 0): BF16,
              ("emb", 0): BF16, ("lengths", 0): "int32", ("mc", 0): "int32", ("mc", 1): FP32, ("mc", 2): FP32,
              ("where", 0): FP32, ("mc2", 0): "int32", ("mc2", 1): FP32, ("add", 0): FP32}
    graph, dropped = drop_identity_casts(_ids_graph(), dtypes)
    nodes = _by_name(graph)
    assert dropped == 3
    assert "ids_cast" not in nodes and nodes["emb"][1] == ["ids", "w_cast"]
    mc, mc_in = nodes["mc"]
    assert mc_in == ["emb", "w"] and mc["attrs"]["num_outputs"] == "2"
    where = graph["nodes"][[n["name"] for n in graph["nodes"]].index("where")]
    assert [(graph["nodes"][e[0]]["name"], e[1]) for e in where["inputs"]] == [("lengths", 0), ("mc", 0), ("mc", 1)]
    assert "mc2" not in nodes and nodes["add"][1] == ["lengths", "where"]  # one float left: no multicast
    assert all(e[0] < j for j, n in enumerate(graph["nodes"]) for e in n["inputs"])
    float64 = {**dtypes, ("ids", 0): "float64", ("ids_cast", 0): "float64"}
    assert drop_identity_casts(_ids_graph(), float64)[1] == 3  # amp_cast passes float64 too


@pytest.mark.parametrize("low", [BF16, "float16", FP32])
def test_a_multicast_with_a_float64_input_goes_and_low_inputs_come_in_float32(low):
    """Numpy mode promotes float32 with float64 to float64: the multicast to float64 (which
    oneDNN's arrays refuse) goes, low inputs are cast to float32, the op promotes as in FP32."""
    nodes = [
        {"op": "null", "name": "x", "inputs": []},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "FullyConnected", "name": "fc", "inputs": [[0, 0, 0], [1, 0, 0]]},
        {"op": "null", "name": "v", "inputs": []},
        {"op": "amp_multicast", "name": "mc", "attrs": {"num_outputs": "3"},
         "inputs": [[2, 0, 0], [3, 0, 0], [0, 0, 0]]},
        {"op": "_npi_multiply", "name": "mul", "inputs": [[4, 0, 0], [4, 1, 0]]},
        {"op": "_npi_add", "name": "add", "inputs": [[5, 0, 0], [4, 2, 0]]},
    ]
    graph = {"nodes": nodes, "arg_nodes": [0, 1, 3], "heads": [[6, 0, 0]], "attrs": {}}
    dtypes = {("x", 0): FP32, ("w", 0): FP32, ("fc", 0): low, ("v", 0): "float64", ("mc", 0): "float64",
              ("mc", 1): "float64", ("mc", 2): "float64", ("mul", 0): "float64", ("add", 0): "float64"}
    out, dropped = drop_identity_casts(graph, dtypes)
    by = _by_name(out)
    assert "mc" not in by and dropped == 3
    if low == FP32:
        assert by["mul"][1] == ["fc", "v"] and by["add"][1] == ["mul", "x"]
    else:
        cast, cast_in = by["mc_0_float32"]
        assert cast["op"] == "amp_cast" and cast["attrs"]["dtype"] == FP32 and cast_in == ["fc"]
        assert by["mul"][1] == ["mc_0_float32", "v"] and by["add"][1] == ["mul", "x"]
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])


def test_a_graph_of_float_entries_is_left_as_it_is():
    dtypes = {(n["name"], 0): FP32 for n in _traced()["nodes"]}
    graph = _traced()
    assert drop_identity_casts(graph, dtypes) == (graph, 0)


@pytest.mark.parametrize("narrow", [False, True])
def test_a_multicast_with_a_float16_input_becomes_one_cast_per_input_as_a_cpu_runs_it(narrow):
    """A CPU's amp_multicast runs in oneDNN, which has no float16: a float16 mask meeting
    float32 scores in ``where`` gets each input cast to what the multicast gives them."""
    nodes = [
        {"op": "null", "name": "mask", "inputs": []},
        {"op": "null", "name": "s", "inputs": []},
        {"op": "null", "name": "y", "inputs": []},
        {"op": "amp_multicast", "name": "mc", "attrs": {"num_outputs": "3", "cast_narrow": str(narrow)},
         "inputs": [[0, 0, 0], [1, 0, 0], [2, 0, 0]]},
        {"op": "where", "name": "where", "inputs": [[3, 0, 0], [3, 1, 0], [3, 2, 0]]},
    ]
    graph = {"nodes": nodes, "arg_nodes": [0, 1, 2], "heads": [[4, 0, 0]], "attrs": {}}
    dtypes = {("mask", 0): "float16", ("s", 0): FP32, ("y", 0): BF16}
    out, split = cast_each_input(graph, dtypes, "float16")
    by = _by_name(out)
    assert split == 1 and "mc" not in by
    want = "float16" if narrow else FP32
    reads = by["where"][1]
    for name, source, dtype in zip(reads, ("mask", "s", "y"), ("float16", FP32, BF16)):
        if dtype == want:
            assert name == source  # already the dtype: read as it is
        else:
            cast, cast_in = by[name]
            assert cast["op"] == "amp_cast" and cast["attrs"]["dtype"] == want and cast_in == [source]
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])
    # without a float16 input, or with only low inputs (no wider one decides), nothing changes
    assert cast_each_input(graph, {**dtypes, ("mask", 0): FP32}, "float16") == (graph, 0)
    assert cast_each_input(graph, {**dtypes, ("s", 0): BF16}, "float16") == (graph, 0)


@pytest.mark.parametrize("only", [None, ("relu",)], ids=["every op", "relu only"])
@pytest.mark.parametrize("seed", range(20))
def test_unique_op_names_renames_only_later_ops_of_a_repeated_name_and_keeps_the_graph(seed, only):
    """Generated graphs whose op names repeat (a block called twice in one trace), some
    already ending as a renamed one would: every name unique after (of the ops asked for:
    the casts a cell repeats), the first of each name and every variable kept, the same ops
    and edges."""
    import random
    rng = random.Random(seed)
    pool = ["relu0_fwd", "dense0_fwd", "relu0_fwd_3", "drop0_fwd"]
    nodes = [{"op": "null", "name": "x", "inputs": []}]
    for i in range(1, rng.randint(3, 12)):
        if rng.random() < 0.2:
            nodes.append({"op": "null", "name": f"w{i}", "inputs": []})
        else:
            nodes.append({"op": rng.choice(["relu", "FullyConnected", "Dropout"]), "name": rng.choice(pool),
                          "inputs": [[rng.randrange(i), 0, 0]]})
    graph = {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
             "heads": [[len(nodes) - 1, 0, 0]], "attrs": {}}
    before = [dict(n) for n in nodes]
    out, renamed = unique_op_names(graph, only)
    names = [n["name"] for i, n in enumerate(out["nodes"]) if only is None or before[i]["op"] in only]
    assert len(set(names)) == len(names)
    assert [n["name"] for n in nodes] == [n["name"] for n in before]  # the caller's graph as it was
    firsts = {}
    for i, n in enumerate(before):
        firsts.setdefault(n["name"], i)
    asked = [only is None or n["op"] in only for n in before]
    assert renamed == sum(1 for i, n in enumerate(before) if firsts[n["name"]] != i and asked[i])
    for i, (old, new) in enumerate(zip(before, out["nodes"])):
        assert (new["op"], new["inputs"]) == (old["op"], old["inputs"])
        if firsts[old["name"]] == i or old["op"] == "null" or not asked[i]:
            assert new["name"] == old["name"]
        else:
            assert new["name"].startswith(old["name"] + "_")
    assert out["heads"] == graph["heads"] and out["arg_nodes"] == graph["arg_nodes"]
