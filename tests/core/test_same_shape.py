"""Slow adds run as their same-shape twin (gluon_amp_core.same_shape), on generated graphs."""
import random

import pytest

from gluon_amp_core.same_shape import follows_safely, one_shape_still, renamed, twins_to_run
from gluon_amp_core.table import default_table
from gluon_amp_core.verdicts import Verdict

TABLE = default_table("bfloat16")
SLOW_ADDS = sorted(op for op, (twin, _) in TABLE.same_shape_twins.items() if twin == "elemwise_add")
SLOW_RELUS = sorted(op for op, (twin, _) in TABLE.same_shape_twins.items() if twin == "Activation")


def _graph(rng):
    """A chain of two-input ops over data inputs of random shapes and dtypes, some read through
    casts: (graph, entry shapes, entry dtypes, the expected twins)."""
    nodes, shapes, dtypes, expected = [], {}, {}, {}

    def var(shape, dtype):
        nodes.append({"op": "null", "name": f"v{len(nodes)}", "inputs": []})
        shapes[(len(nodes) - 1, 0)], dtypes[(len(nodes) - 1, 0)] = shape, dtype
        return len(nodes) - 1

    def cast(k, dtype):
        nodes.append({"op": "amp_cast", "name": f"c{len(nodes)}", "attrs": {"dtype": dtype}, "inputs": [[k, 0, 0]]})
        shapes[(len(nodes) - 1, 0)], dtypes[(len(nodes) - 1, 0)] = shapes[(k, 0)], dtype
        return len(nodes) - 1

    for _ in range(rng.randint(1, 12)):
        shape_a = rng.choice([(2, 8), (4, 3, 5), None])
        shape_b = shape_a if rng.random() < 0.6 else rng.choice([(1, 8), (4, 1, 5), (2, 8), None])
        dtype_a, dtype_b = (rng.choice(["bfloat16", "bfloat16", "float32", None]) for _ in range(2))
        a, b = var(shape_a, dtype_a), var(shape_b, dtype_b)
        through = rng.random() < 0.7  # the plan reads bfloat16 values through float32 casts
        ins = [cast(a, "float32"), cast(b, "float32")] if through else [a, b]
        op = rng.choice(SLOW_ADDS + SLOW_RELUS + ["elemwise_add", "broadcast_mul"])
        if op in SLOW_RELUS:  # one input: any shape
            ins, shape_b, dtype_b = ins[:1], shape_a, dtype_a
        nodes.append({"op": op, "name": f"n{len(nodes)}", "inputs": [[k, 0, 0] for k in ins]})
        out = (len(nodes) - 1, 0)
        shapes[out] = shape_a if shape_a == shape_b else None
        dtypes[out] = "float32" if through else dtype_a
        if op in SLOW_RELUS and dtype_a == "bfloat16" or \
                op in SLOW_ADDS and shape_a is not None and shape_a == shape_b and dtype_a == dtype_b == "bfloat16":
            expected[nodes[-1]["name"]] = TABLE.same_shape_twins[op]
    return {"nodes": nodes, "heads": [[len(nodes) - 1, 0, 0]]}, shapes, dtypes, expected


@pytest.mark.parametrize("seed", range(200))
def test_twins_are_the_slow_adds_of_one_shape_from_bfloat16_values(seed):
    graph, shapes, dtypes, expected = _graph(random.Random(seed))
    found = twins_to_run(graph, TABLE, shapes.get, dtypes.get)
    assert found == expected
    run = renamed(graph, found)
    assert [(n["op"], n.get("attrs")) for n in run["nodes"]] == \
        [(found[n["name"]][0], dict(found[n["name"]][1])) if n["name"] in found else (n["op"], n.get("attrs"))
         for n in graph["nodes"]]
    assert one_shape_still(run, found, shapes.get)


def test_the_table_pairs_slow_adds_with_a_fast_twin_by_its_kernel_timings():
    relu = ("Activation", (("act_type", "relu"),))
    assert dict(TABLE.same_shape_twins) == {"_npi_add": ("elemwise_add", ()), "broadcast_add": ("elemwise_add", ()),
                                            "_npx_relu": relu, "relu": relu}
    for op, (twin, _) in TABLE.same_shape_twins.items():
        assert TABLE.verdicts.get(op) is Verdict.SLOW and TABLE.verdicts.get(twin) is not Verdict.SLOW
    assert default_table("float16").same_shape_twins == {}


def test_a_users_cast_is_not_seen_through():
    graph, shapes, dtypes, _ = _graph(random.Random(3))
    for n in graph["nodes"]:
        if n["op"] in SLOW_ADDS:
            n["inputs"] = [[0, 0, 0], [0, 0, 0]]
    shapes[(0, 0)], dtypes[(0, 0)] = (2, 8), "bfloat16"
    assert twins_to_run(graph, TABLE, shapes.get, dtypes.get)
    graph["nodes"][0] = {"op": "amp_cast", "name": "mine", "attrs": {"dtype": "float32"},
                         "inputs": [[0, 0, 0]]}
    dtypes[(0, 0)] = "float32"
    assert not twins_to_run(graph, TABLE, shapes.get, dtypes.get, keep={"mine"})


@pytest.mark.parametrize("shape_b, still", [((2, 8), True), ((1, 8), False), (None, False)])
def test_one_shape_still_at_a_calls_new_shapes(shape_b, still):
    graph = {"nodes": [{"op": "null", "name": "a", "inputs": []}, {"op": "null", "name": "b", "inputs": []},
                       {"op": "elemwise_add", "name": "t", "inputs": [[0, 0, 0], [1, 0, 0]]}], "heads": [[2, 0, 0]]}
    shapes = {(0, 0): (2, 8), (1, 0): shape_b}
    assert one_shape_still(graph, {"t"}, shapes.get) is still


@pytest.mark.parametrize("reader, attrs, safe", [
    ("Activation", {"act_type": "relu"}, True), ("Activation", {"act_type": "softrelu"}, False),
    ("Pooling", {}, True), ("Convolution", {}, True), ("softmax", {}, False), ("_npi_multiply", {}, False),
])
def test_what_reads_a_twins_value_must_run_on_what_it_is_given(reader, attrs, safe):
    graph = {"nodes": [{"op": "null", "name": "a", "inputs": []},
                       {"op": "elemwise_add", "name": "t", "inputs": [[0, 0, 0], [0, 0, 0]]},
                       {"op": reader, "name": "r", "attrs": attrs, "inputs": [[1, 0, 0]] * 2}],
             "heads": [[2, 0, 0]]}
    before = {"a": "bfloat16", "t": "float32", "r": "float32"}
    after = {"a": "bfloat16", "t": "bfloat16", "r": "bfloat16"}
    assert follows_safely(graph, TABLE, lambda n, i: before[n], lambda n, i: after[n], {"t"}) is safe
