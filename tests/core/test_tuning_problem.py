"""The tuner: which ops stay low, chosen from measured op and cast times (a minimum cut)."""
import itertools
import random

import pytest

from gluon_amp_core.decide import Reason, decide
from gluon_amp_core.table import default_table
from gluon_amp_core.tuning.problem import FP32, cast_timed, choose, problem
from gluon_amp_core.walk import walk

BF16 = "bfloat16"
TABLE = default_table(BF16)
OP_INPUTS = {"Convolution": ("data", "weight", "bias"),
             "BatchNorm": ("data", "gamma", "beta", "moving_mean", "moving_var"),
             "Activation": ("data",), "softmax": ("data",)}
SHAPE = (2, 8, 4, 4)


def _chain():
    """data -> cast -> conv(w cast) -> BN -> relu -> cast fp32 -> softmax (head), as AMP types it."""
    nodes = [
        {"op": "null", "name": "data", "inputs": []},
        {"op": "amp_cast", "name": "data_c", "attrs": {"dtype": BF16}, "inputs": [[0, 0, 0]]},
        {"op": "null", "name": "w", "inputs": []},
        {"op": "amp_cast", "name": "w_c", "attrs": {"dtype": BF16}, "inputs": [[2, 0, 0]]},
        {"op": "Convolution", "name": "conv", "attrs": {"kernel": "(1, 1)", "num_filter": "8", "no_bias": "True"},
         "inputs": [[1, 0, 0], [3, 0, 0]]},
        {"op": "null", "name": "g", "inputs": []}, {"op": "null", "name": "b", "inputs": []},
        {"op": "null", "name": "m", "inputs": []}, {"op": "null", "name": "v", "inputs": []},
        {"op": "BatchNorm", "name": "bn", "inputs": [[4, 0, 0], [5, 0, 0], [6, 0, 0], [7, 0, 0], [8, 0, 0]]},
        {"op": "Activation", "name": "relu", "attrs": {"act_type": "relu"}, "inputs": [[9, 0, 0]]},
        {"op": "amp_cast", "name": "relu_c", "attrs": {"dtype": FP32}, "inputs": [[10, 0, 0]]},
        {"op": "softmax", "name": "out", "inputs": [[11, 0, 0]]},
    ]
    dt = {("data", 0): FP32, ("data_c", 0): BF16, ("w", 0): FP32, ("w_c", 0): BF16, ("conv", 0): BF16,
          **{(p, 0): FP32 for p in "gbmv"}, ("bn", 0): BF16, ("bn", 1): FP32, ("bn", 2): FP32,
          ("relu", 0): BF16, ("relu_c", 0): FP32, ("out", 0): FP32}
    shapes = {k: ((8,) if k[0] in "gbmv" else (8, 8, 1, 1) if k[0] in ("w", "w_c") else SHAPE) for k in dt}
    return nodes, [[12, 0, 0]], dt, shapes


def _problem(train=True):
    nodes, heads, dt, shapes = _chain()
    return problem(nodes, heads, dt, shapes, TABLE, OP_INPUTS, train)


def test_an_op_whose_low_kernel_fails_at_its_shape_is_never_timed():
    """A 1x1 convolution on a map of 48 pixels with 32 channels: timing it low could take the
    process down (gluon_amp_core.shape_limits), so it is no candidate; its neighbours still are."""
    nodes, heads, dt, shapes = _chain()
    nodes[4] = {**nodes[4], "attrs": {**nodes[4]["attrs"], "num_filter": "32"}}
    at = (2, 32, 8, 6)
    shapes = {k: (at if v == SHAPE else (32, 32, 1, 1) if k[0] in ("w", "w_c") else (32,)) for k, v in shapes.items()}
    prob = problem(nodes, heads, dt, shapes, TABLE, OP_INPUTS, True)
    assert set(prob.candidates) == {"bn", "relu"}
    beside = {k: ((2, 32, 7, 7) if v == at else v) for k, v in shapes.items()}
    assert "conv" in problem(nodes, heads, dt, beside, TABLE, OP_INPUTS, True).candidates
    # the rule is asked of candidates only: the links of the others stay (bn reads conv as a fixed producer)
    assert [pays for pays, _ in prob.fixed["bn"]] == [FP32]
    none = problem(nodes, heads, dt, shapes, TABLE, OP_INPUTS, True, excluded={n["name"] for n in nodes})
    assert not none.candidates and not none.links


def _times(prob, op_ms, cast=0.1):
    """Times for every measurement: ``op_ms[name] = (low, fp32)``, every cast ``cast`` ms."""
    out = {t.key: cast for t in prob.to_time() if t.op == "amp_cast"}
    for name, c in prob.candidates.items():
        out[c.low.key], out[c.fp32.key] = op_ms[name]
    return out


def test_candidates_are_the_ops_the_plan_runs_low_and_casts_are_to_be_timed():
    prob = _problem()
    assert set(prob.candidates) == {"conv", "bn", "relu"}
    assert prob.candidates["bn"].low.dtypes == (BF16, FP32, FP32, FP32, FP32)  # normalisation stats stay fp32
    assert prob.candidates["conv"].fp32.dtypes == (FP32, FP32) and not prob.candidates["conv"].follows
    assert {(u, v) for u, v, _ in prob.links} == {("conv", "bn"), ("bn", "relu")}
    assert cast_timed((8, 8, 1, 1), FP32, BF16, True).key in {t.key for t in prob.to_time()}  # the weight's cast


def test_everything_faster_low_changes_nothing():
    prob = _problem()
    assert choose(prob, _times(prob, {"conv": (1.0, 2.0), "bn": (0.5, 0.6), "relu": (0.1, 0.2)})) == {}


def test_a_slower_convolution_stays_float32_and_its_faster_followers_stay_low_with_casts():
    prob = _problem()
    got = choose(prob, _times(prob, {"conv": (409.0, 205.0), "bn": (1.0, 9.0), "relu": (0.1, 0.2)}, cast=0.5))
    assert got["conv"].dtype == FP32
    assert got["conv"].describe() == "float32: measured 2.0x slower in bfloat16 (409.00 vs 205.00 ms)"
    assert got["bn"].dtype == BF16 and "measured faster" in got["bn"].describe()  # held low: its input moved
    assert "relu" not in got  # its input did not move


def test_casts_can_outweigh_an_ops_own_gain():
    prob = _problem()
    got = choose(prob, _times(prob, {"conv": (409.0, 205.0), "bn": (1.0, 1.5), "relu": (0.1, 0.2)}, cast=2.0))
    assert got["bn"].dtype == FP32 and "not with the casts" in got["bn"].describe()


def test_a_tie_goes_to_float32_and_an_untimed_op_keeps_the_plan():
    prob = _problem()
    times = _times(prob, {"conv": (2.0, 2.0), "bn": (1.0, 2.0), "relu": (0.1, 0.2)}, cast=0.0)
    assert choose(prob, times)["conv"].dtype == FP32
    times[prob.candidates["conv"].low.key] = None  # could not be timed
    assert "conv" not in choose(prob, times)


def _brute_force(prob, times):
    names = list(prob.candidates)
    best = None
    for labels in itertools.product([BF16, FP32], repeat=len(names)):
        lab = dict(zip(names, labels))
        cost = sum(times[(prob.candidates[n].low if lab[n] == BF16 else prob.candidates[n].fp32).key] for n in names)
        cost += sum(times[t.key] for n in names for pays, t in prob.fixed.get(n, ()) if lab[n] == pays)
        for u, v, shape in prob.links:
            if lab[u] != lab[v]:
                cost += times[cast_timed(shape, lab[u], lab[v], True).key]
        best = cost if best is None else min(best, cost)
    return best


def test_the_cut_is_the_cheapest_labelling():
    prob = _problem()
    rng = random.Random(0)
    for _ in range(200):
        times = {t.key: rng.uniform(0, 3) for t in prob.to_time()}
        got = choose(prob, times)
        lab = {n: (got[n].dtype if n in got else BF16) for n in prob.candidates}
        cost = sum(times[(prob.candidates[n].low if lab[n] == BF16 else prob.candidates[n].fp32).key] for n in lab)
        cost += sum(times[t.key] for n in lab for pays, t in prob.fixed.get(n, ()) if lab[n] == pays)
        cost += sum(times[cast_timed(s, lab[u], lab[v], True).key] for u, v, s in prob.links if lab[u] != lab[v])
        assert cost == pytest.approx(_brute_force(prob, times), abs=1e-6)


def test_decide_and_walk_obey_a_measured_choice_except_where_float32_is_required():
    assert decide("Convolution", {}, [BF16], TABLE, measured=FP32).reason is Reason.MEASURED
    assert decide("BatchNorm", {}, [FP32], TABLE, measured=BF16).dtype == BF16
    assert decide("softmax", {}, [BF16], TABLE, measured=BF16).dtype == FP32  # an fp32 op
    assert decide("Activation", {"act_type": "softrelu"}, [BF16], TABLE, measured=BF16).dtype == FP32
    assert decide("Convolution", {}, [BF16], TABLE, excluded=True, measured=BF16).reason is Reason.EXCLUDED
    nodes, _, dt, _ = _chain()
    by = {nd.name: nd.decision for nd in walk(nodes, TABLE, lambda e: dt.get((nodes[e[0]]["name"], e[1])),
                                              measured={nodes[4]["name"]: FP32})}
    assert by["conv"].dtype == FP32 and by["conv"].reason is Reason.MEASURED
    by = {nd.name: nd.decision for nd in walk(nodes, TABLE, lambda e: None, measured={"bn": FP32})}
    assert by["bn"].dtype == FP32
