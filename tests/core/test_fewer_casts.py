"""Fewer casts (gluon_amp_core/fewer_casts.py): no value cast back and forth between neighbours."""
import random

import pytest

from gluon_amp_core.fewer_casts import MOVES_DATA, fewer_casts, names_given_twice
from gluon_amp_core.table import OpClass, default_table

BF16, FP32 = "bfloat16", "float32"
TABLE = default_table(BF16)
CASTS = ("amp_cast", "amp_multicast")


def _types(nodes, data=FP32):
    """A small type inference: variables are ``data``; a cast gives its dtype (a multicast
    the widest of its inputs); every other op gives its first input's dtype (MXNet's rule for
    the ops used here), SliceChannel as many outputs as ``num_outputs``."""
    out = {}
    for n in nodes:
        ins = [out[(nodes[e[0]]["name"], e[1])] for e in n["inputs"]]
        if n["op"] == "null":
            got = [data]
        elif n["op"] == "amp_cast":
            got = [n["attrs"]["dtype"]]
        elif n["op"] == "amp_multicast":
            got = [FP32 if FP32 in ins else BF16] * len(ins)
        else:
            got = [ins[0]] * int(n.get("attrs", {}).get("num_outputs", 1))
        out.update({(n["name"], k): t for k, t in enumerate(got)})
    return out


def _lstm_gates():
    """FullyConnected (bfloat16) -> SliceChannel into 4 gates -> each cast to float32 -> sigmoid."""
    nodes = [{"op": "null", "name": "x", "inputs": []},
             {"op": "amp_cast", "name": "xc", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
             {"op": "FullyConnected", "name": "fc", "inputs": [[1, 0, 0]]},
             {"op": "SliceChannel", "name": "gates", "attrs": {"num_outputs": "4"}, "inputs": [[2, 0, 0]]}]
    for k in range(4):
        nodes.append({"op": "amp_cast", "name": f"g{k}c", "attrs": {"dtype": FP32}, "inputs": [[3, k, 0]]})
        nodes.append({"op": "sigmoid", "name": f"s{k}", "inputs": [[len(nodes) - 1, 0, 0]]})
    heads = [[5 + 2 * k, 0, 0] for k in range(4)]
    return {"nodes": nodes, "heads": heads}


def _reads(graph, types):
    """What every non-cast op node reads: its name -> the dtypes of its inputs."""
    nodes = graph["nodes"]
    return {n["name"]: [types[(nodes[e[0]]["name"], e[1])] for e in n["inputs"]]
            for n in nodes if n["op"] not in CASTS and n["op"] != "null"}


def test_a_split_value_is_cast_once_before_the_split_not_once_per_piece():
    graph = _lstm_gates()
    types = _types(graph["nodes"])
    new, new_types, removed = fewer_casts(graph, types, TABLE)
    assert removed == 3 and sum(n["op"] in CASTS for n in new["nodes"]) == 2  # x's, then fc's output
    assert new_types == _types(new["nodes"])  # what the pass says is what inference gives
    assert new_types[("gates", 0)] == FP32 and all(_reads(new, new_types)[f"s{k}"] == [FP32] for k in range(4))
    assert _reads(new, new_types)["fc"] == [BF16]


def test_casts_that_change_nothing_go_and_casts_of_one_value_are_shared():
    nodes = [{"op": "null", "name": "w", "inputs": []},
             {"op": "amp_cast", "name": "w1", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
             {"op": "amp_cast", "name": "w2", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},  # the same cast
             {"op": "FullyConnected", "name": "a", "inputs": [[1, 0, 0]]},
             {"op": "FullyConnected", "name": "b", "inputs": [[2, 0, 0]]},
             {"op": "amp_multicast", "name": "m", "attrs": {"num_outputs": "2"}, "inputs": [[3, 0, 0], [4, 0, 0]]},
             {"op": "elemwise_add", "name": "add", "inputs": [[5, 0, 0], [5, 1, 0]]},
             {"op": "amp_cast", "name": "same", "attrs": {"dtype": BF16}, "inputs": [[6, 0, 0]]},
             {"op": "relu", "name": "r", "inputs": [[7, 0, 0]]}]
    graph = {"nodes": nodes, "heads": [[8, 0, 0]]}
    types = _types(nodes)
    new, new_types, removed = fewer_casts(graph, types, TABLE)
    assert removed == 3 and [n["name"] for n in new["nodes"] if n["op"] in CASTS] == ["w1"]
    assert _reads(new, new_types) == _reads(graph, types) and new_types == _types(new["nodes"])


def test_a_graph_without_such_casts_is_returned_as_it_is():
    nodes = [{"op": "null", "name": "x", "inputs": []},
             {"op": "amp_cast", "name": "xc", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
             {"op": "FullyConnected", "name": "fc", "inputs": [[1, 0, 0]]}]
    graph = {"nodes": nodes, "heads": [[2, 0, 0]]}
    assert fewer_casts(graph, _types(nodes), TABLE)[0] is graph


def _random_graph(rng):
    """Random typed plans: variables, bfloat16 and float32 ops, neutral ops between them
    (data movement and arithmetic), each input cast where its op's dtype differs."""
    nodes = [{"op": "null", "name": "v0", "inputs": []}]
    types = {("v0", 0): FP32}
    values = [(0, 0)]
    ops = {"FullyConnected": BF16, "Convolution": BF16, "sigmoid": FP32, "softmax": FP32,
           "SliceChannel": None, "Reshape": None, "relu": None, "Flatten": None}
    for i in range(rng.randint(2, 25)):
        op = rng.choice(sorted(ops))
        src = rng.choice(values)
        have = types[(nodes[src[0]]["name"], src[1])]
        want = ops[op] or have
        if want != have:
            nodes.append({"op": "amp_cast", "name": f"c{i}", "attrs": {"dtype": want}, "inputs": [[src[0], src[1], 0]]})
            types[(f"c{i}", 0)] = want
            src = (len(nodes) - 1, 0)
        outs = rng.randint(1, 4) if op == "SliceChannel" else 1
        attrs = {"num_outputs": str(outs)} if op == "SliceChannel" else {}
        nodes.append({"op": op, "name": f"n{i}", "attrs": attrs, "inputs": [[src[0], src[1], 0]]})
        types.update({(f"n{i}", k): want for k in range(outs)})
        values += [(len(nodes) - 1, k) for k in range(outs)]
    read = {e[0] for n in nodes for e in n["inputs"]}
    heads = [[j, 0, 0] for j, n in enumerate(nodes) if j not in read and n["op"] != "null"]
    return {"nodes": nodes, "heads": heads}, types


def test_random_plans_keep_every_decided_op_and_head_in_its_dtype_with_no_more_casts():
    rng = random.Random(0)
    moved = 0
    for _ in range(400):
        graph, types = _random_graph(rng)
        assert types == _types(graph["nodes"])
        new, new_types, removed = fewer_casts(graph, types, TABLE)
        assert new_types == _types(new["nodes"])
        before, after = _reads(graph, types), _reads(new, new_types)
        assert set(after) == set(before)
        for n in graph["nodes"]:
            if n["op"] in CASTS or n["op"] == "null":
                continue
            neutral = TABLE.classes.get(TABLE.canonical(n["op"])) is OpClass.NEUTRAL
            if not neutral:
                assert after[n["name"]] == before[n["name"]], n["name"]
            elif after[n["name"]] != before[n["name"]]:
                moved += 1  # toward float32, or toward a low dtype only where it moves data
                assert after[n["name"]] == [FP32] or n["op"] in MOVES_DATA
        head = [types[(graph["nodes"][h[0]]["name"], h[1])] for h in graph["heads"]]
        assert head == [new_types[(new["nodes"][h[0]]["name"], h[1])] for h in new["heads"]]
        count = sum(n["op"] in CASTS for n in graph["nodes"]) - sum(n["op"] in CASTS for n in new["nodes"])
        assert count == removed >= 0
    assert moved > 0


def _unrolled(steps):
    """An ``NTC`` input split into ``steps`` time steps, each cast to bfloat16 for a product
    whose output is split into two gates, each gate cast to float32 for ``sigmoid`` (an
    unrolled LSTM's shape): every step gives the pass a move (its gate split toward float32),
    and the input's split one more (toward bfloat16)."""
    nodes = [{"op": "null", "name": "x", "inputs": []},
             {"op": "SliceChannel", "name": "steps", "attrs": {"num_outputs": str(steps)}, "inputs": [[0, 0, 0]]}]
    heads = []
    for t in range(steps):
        nodes.append({"op": "amp_cast", "name": f"in{t}", "attrs": {"dtype": BF16}, "inputs": [[1, t, 0]]})
        nodes.append({"op": "FullyConnected", "name": f"fc{t}", "inputs": [[len(nodes) - 1, 0, 0]]})
        nodes.append({"op": "SliceChannel", "name": f"g{t}", "attrs": {"num_outputs": "2"},
                      "inputs": [[len(nodes) - 1, 0, 0]]})
        split = len(nodes) - 1
        for k in range(2):
            nodes.append({"op": "amp_cast", "name": f"g{t}c{k}", "attrs": {"dtype": FP32}, "inputs": [[split, k, 0]]})
            nodes.append({"op": "sigmoid", "name": f"s{t}_{k}", "inputs": [[len(nodes) - 1, 0, 0]]})
            heads.append([len(nodes) - 1, 0, 0])
    return {"nodes": nodes, "heads": heads}


@pytest.mark.parametrize("steps", [12, 48, 192])
def test_the_pass_looks_at_each_node_a_bounded_number_of_times_not_once_per_move(monkeypatch, steps):
    """After a move the search resumes where the move changed something: an unrolled graph of
    n pieces needs O(n) looks, where starting over after each of its n moves needed O(n^2)
    (GluonTS DeepState's graph: 5.4 s of its first call)."""
    from gluon_amp_core import fewer_casts as module
    looked = []
    real = module._move

    def counted(i, *args, **kwargs):
        looked.append(i)
        return real(i, *args, **kwargs)

    monkeypatch.setattr(module, "_move", counted)
    graph = _unrolled(steps)
    types = _types(graph["nodes"])
    new, new_types, removed = fewer_casts(graph, types, TABLE)
    assert new_types == _types(new["nodes"])
    assert removed == 2 * steps - 1  # x cast once before its split; each product's output once
    reads = _reads(new, new_types)
    assert all(reads[f"fc{t}"] == [BF16] and reads[f"g{t}"] == [FP32] for t in range(steps))
    assert len(looked) <= 4 * len(graph["nodes"]), (len(looked), len(graph["nodes"]))


def test_names_given_twice_are_the_names_of_more_than_one_node():
    rng = random.Random(3)
    for _ in range(50):
        names = [f"n{rng.randint(0, 30)}" for _ in range(rng.randint(0, 40))]
        nodes = [{"name": n} for n in names]
        assert names_given_twice(nodes) == {n for n in names if names.count(n) > 1}
