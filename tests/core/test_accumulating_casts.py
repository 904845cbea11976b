"""accumulating_casts: a variable whose gradient accumulates is cast through an identity."""
import random

import pytest

from gluon_amp_core.accumulating_casts import IDENTITY_SUFFIX, cast_accumulating_inputs
from graph_json import graph as _graph, var as _var

BF16, FP16, FP32 = "bfloat16", "float16", "float32"


def _dtypes(graph, var_dtype=FP32):
    """Variables ``var_dtype``, an amp_cast its dtype, a multicast (narrow) its narrowest
    input's dtype, other ops their first input's."""
    out, nodes = {}, graph["nodes"]
    for n in nodes:
        ins = [out[(nodes[e[0]]["name"], e[1])] for e in n["inputs"]]
        if n["op"] == "null":
            t = var_dtype
        elif n["op"] == "amp_cast":
            t = n["attrs"]["dtype"]
        elif n["op"] == "amp_multicast":
            t = BF16 if BF16 in ins else FP16 if FP16 in ins else FP32
            for k in range(len(ins)):
                out[(n["name"], k)] = t
            continue
        else:
            t = ins[0]
        out[(n["name"], 0)] = t
    return out


def _random_graph(rng):
    """Variables cast by amp_casts (to bfloat16 or float16) and multicasts, read by dense ops."""
    nodes = [_var("x"), {"op": "amp_cast", "name": "x_cast", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]}]
    h, names = 1, []
    for layer in range(rng.randint(1, 5)):
        w = len(nodes)
        nodes.append(_var(f"w{layer}"))
        names.append(f"w{layer}")
        kind = rng.choice(["cast", "cast", "float16 cast", "multicast", "twice"])
        if kind == "multicast":
            nodes.append({"op": "amp_multicast", "name": f"m{layer}", "inputs": [[h, 0, 0], [w, 0, 0]],
                          "attrs": {"num_outputs": "2", "cast_narrow": "True"}})
            nodes.append({"op": "FullyConnected", "name": f"fc{layer}", "attrs": {},
                          "inputs": [[len(nodes) - 1, 0, 0], [len(nodes) - 1, 1, 0]]})
        else:
            dtype = FP16 if kind == "float16 cast" else BF16
            nodes.append({"op": "amp_cast", "name": f"w{layer}_cast", "attrs": {"dtype": dtype}, "inputs": [[w, 0, 0]]})
            ins = [[h, 0, 0], [len(nodes) - 1, 0, 0]]
            if kind == "twice":  # a second cast of the same variable (a shared weight)
                nodes.append({"op": "amp_cast", "name": f"w{layer}_cast2", "attrs": {"dtype": BF16},
                              "inputs": [[w, 0, 0]]})
                ins.append([len(nodes) - 1, 0, 0])
            nodes.append({"op": "FullyConnected", "name": f"fc{layer}", "attrs": {}, "inputs": ins})
        h = len(nodes) - 1
    return _graph(nodes, [h]), names


def _source(graph, e):
    n = graph["nodes"][e[0]]
    return n["name"], n["op"]


@pytest.mark.parametrize("seed", range(30))
def test_each_low_cast_of_an_accumulating_variable_reads_it_through_one_identity(seed):
    rng = random.Random(seed)
    graph, names = _random_graph(rng)
    accumulating = None if seed % 5 == 0 else set(rng.sample(names, rng.randint(0, len(names))))
    dtypes = _dtypes(graph)
    out, changed = cast_accumulating_inputs(graph, dtypes, BF16, accumulating)
    chosen = {"x", *names} if accumulating is None else accumulating  # None: every variable

    before = {n["name"]: n for n in graph["nodes"]}
    after = {n["name"]: n for n in out["nodes"]}
    identities = {k for k, n in after.items() if k.endswith(IDENTITY_SUFFIX)}
    want = 0
    for name, node in before.items():
        new = after[name]
        assert new["op"] == node["op"] and new.get("attrs") == node.get("attrs")  # every node kept as it was
        low = node["op"] in ("amp_cast", "amp_multicast") and dtypes[(name, 0)] == BF16
        for e_old, e_new in zip(node["inputs"], new["inputs"]):
            var, op = _source(graph, e_old)
            got, got_op = _source(out, e_new)
            if low and op == "null" and var in chosen:
                want += 1
                assert (got, got_op) == (var + IDENTITY_SUFFIX, "_copy")
                assert _source(out, after[got]["inputs"][0]) == (var, "null")
            else:
                assert (got, got_op) == (var, op)
    assert changed == want
    assert identities == {v + IDENTITY_SUFFIX for v in chosen if any(
        _source(out, e)[0] == v + IDENTITY_SUFFIX for n in out["nodes"] for e in n["inputs"])}
    if not changed:
        assert out is graph
    assert all(e[0] < j for j, n in enumerate(out["nodes"]) for e in n["inputs"])  # topological


def test_casts_of_float16_of_an_operator_output_and_of_other_dtypes_stay_as_they_are():
    nodes = [_var("w"), {"op": "amp_cast", "name": "w16", "attrs": {"dtype": FP16}, "inputs": [[0, 0, 0]]},
             {"op": "relu", "name": "r", "attrs": {}, "inputs": [[0, 0, 0]]},
             {"op": "amp_cast", "name": "r_cast", "attrs": {"dtype": BF16}, "inputs": [[2, 0, 0]]},
             {"op": "elemwise_add", "name": "add", "attrs": {}, "inputs": [[1, 0, 0], [3, 0, 0]]}]
    graph = _graph(nodes, [4])
    assert cast_accumulating_inputs(graph, _dtypes(graph), BF16, None) == (graph, 0)
    # a variable that is bfloat16 already (a user's cast network) has no float32 gradient to drop
    one = _graph([_var("w"), {"op": "amp_cast", "name": "c", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]}], [1])
    assert cast_accumulating_inputs(one, _dtypes(one, BF16), BF16, None) == (one, 0)
    assert cast_accumulating_inputs(one, _dtypes(one), BF16, set()) == (one, 0)
    out, n = cast_accumulating_inputs(one, _dtypes(one), BF16, {"w"})
    assert n == 1 and [x["op"] for x in out["nodes"]] == ["null", "_copy", "amp_cast"]
