"""The conversion pass on hand-written JSON graphs: no MXNet involved."""
from gluon_amp.convert.graph import REASON_ATTR, convert_graph, strip_casts
from gluon_amp.table import build_table

TABLE = build_table("bfloat16")
OP_INPUTS = {"FullyConnected": ("data", "weight", "bias"), "softmax": ("data",),
             "elemwise_add": ("lhs", "rhs"), "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var")}


def var(name):
    return {"op": "null", "name": name, "inputs": []}


def node(op, name, *inputs, **attrs):
    return {"op": op, "name": name, "attrs": {k: str(v) for k, v in attrs.items()},
            "inputs": [[i, 0, 0] for i in inputs]}


def graph(nodes, heads):
    return {"nodes": nodes, "arg_nodes": [], "heads": [[h, 0, 0] for h in heads], "attrs": {}}


def run(g, **kw):
    original = {(i, 0): "float32" for i in range(len(g["nodes"]))}
    return convert_graph(g, TABLE, ["x"], original, OP_INPUTS, **kw)


def two_fc():
    # x -> fc1(w) -> softmax ; x -> fc2(w) ; fc2 + softmax
    return graph([var("x"), var("w"), node("FullyConnected", "fc1", 0, 1, num_hidden=4, no_bias=True),
                  node("softmax", "sm", 2), node("FullyConnected", "fc2", 0, 1, num_hidden=4, no_bias=True),
                  node("elemwise_add", "add", 4, 3)], [5])


def test_one_cast_per_tensor_and_dtype():
    r = run(two_fc())
    casts = [n for n in r.graph["nodes"] if n["op"] == "amp_cast"]
    # x and w once each for both FCs, fc1's output to fp32 for softmax, fc2's for the add
    assert sorted(c["attrs"]["dtype"] for c in casts) == ["bfloat16", "bfloat16", "float32", "float32"]
    assert r.casts_inserted == 4
    assert r.reasons == {"fc1": "low_precision", "sm": "fp32", "fc2": "low_precision", "add": "widest"}
    assert r.dtypes[("add", 0)] == "float32" and r.dtypes[("fc1", 0)] == "bfloat16"


def test_excluded_node_is_float32_and_marked():
    r = run(two_fc(), excluded=["fc2"])
    fc2 = next(n for n in r.graph["nodes"] if n["name"] == "fc2")
    assert fc2["attrs"][REASON_ATTR] == "excluded" and r.dtypes[("fc2", 0)] == "float32"


def test_cast_optional_params_folds_weight_casts():
    r = run(two_fc(), cast_optional_params=True)
    w = next(n for n in r.graph["nodes"] if n["name"] == "w")
    assert w["attrs"]["__dtype__"] == "12" and r.param_dtypes["w"] == "bfloat16"
    assert r.casts_inserted == 3  # x, fc1->fp32, fc2->fp32
    assert all(n["name"] != "w_amp_cast_bfloat16" for n in r.graph["nodes"])


def test_low_precision_outputs_come_back_float32():
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True)], [2])
    r = run(g)
    head = r.graph["nodes"][r.graph["heads"][0][0]]
    assert head["op"] == "amp_cast" and head["attrs"]["dtype"] == "float32"
    plain = run(g, float32_outputs=False)
    assert plain.graph["nodes"][plain.graph["heads"][0][0]]["name"] == "fc"


def test_batchnorm_parameters_are_never_cast():
    g = graph([var("x"), var("w"), node("FullyConnected", "fc", 0, 1, num_hidden=4, no_bias=True),
               var("g"), var("b"), var("m"), var("v"), node("BatchNorm", "bn", 2, 3, 4, 5, 6)], [7])
    r = run(g)
    assert r.dtypes[("bn", 0)] == "bfloat16"  # neutral: runs in what it is given
    bn = next(n for n in r.graph["nodes"] if n["name"] == "bn")
    assert [r.graph["nodes"][i[0]]["name"] for i in bn["inputs"][1:]] == ["g", "b", "m", "v"]


def test_strip_casts_restores_the_fp32_graph():
    r = run(two_fc())
    stripped = strip_casts(r.graph)
    assert [n["op"] for n in stripped["nodes"]] == [n["op"] for n in two_fc()["nodes"]]
    assert stripped["heads"] == [[5, 0, 0]]
