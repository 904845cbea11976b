"""Never slower, per graph: the whole plan against float32, and the rule without a measurement."""
import random

import pytest

from gluon_amp_core.tuning.verdict import (UNMEASURED_MAX_CASTS_PER_LOW_OP, Verdict, activation_casts, cast_nodes,
                                           casts_per_low_op, describe_unmeasured, low_op_nodes,
                                           unmeasured_runs_fp32)


def test_the_plan_is_kept_only_where_it_measured_faster_than_float32():
    rng = random.Random(0)
    for _ in range(500):
        amp, fp32 = rng.choice([rng.uniform(0.1, 100), 5.0]), rng.choice([rng.uniform(0.1, 100), 5.0])
        v = Verdict(amp, fp32)
        assert v.runs_fp32 == (not amp < fp32)
        text = v.describe("bfloat16")
        assert text.startswith("runs float32" if v.runs_fp32 else "keeps bfloat16")
        assert f"{fp32 / amp:.2f}x" in text and f"{amp:.1f} ms vs {fp32:.1f} ms" in text


@pytest.mark.parametrize("casts, low_ops", [(0, 0), (0, 5), (5, 5), (6, 5), (1083, 388), (109, 208)])
def test_the_rule_without_a_measurement_runs_float32_above_the_cast_limit(casts, low_ops):
    ratio = casts_per_low_op(casts, low_ops)
    assert unmeasured_runs_fp32(casts, low_ops) == (ratio is not None and ratio > UNMEASURED_MAX_CASTS_PER_LOW_OP)
    text = describe_unmeasured(casts, low_ops, "bfloat16", "no whole-graph timing yet")
    assert ("runs float32 until measured" in text) == unmeasured_runs_fp32(casts, low_ops)
    assert "no whole-graph timing yet" in text


def test_the_rule_separates_the_recorded_graphs():
    """Activation casts per low op of bfloat16 training graphs traced under init at aeec3b5:
    SSD-512 and ResNet-50 (faster than float32 on Zen 4) keep the plan; the DeepAR-like LSTM runs float32."""
    assert not unmeasured_runs_fp32(109, 208)  # SSD-512
    assert not unmeasured_runs_fp32(69, 174)   # ResNet-50
    assert unmeasured_runs_fp32(1083, 388)     # DeepAR-like


def test_counts_of_a_random_graph():
    rng = random.Random(1)
    for _ in range(50):
        nodes, dtypes, want_low, want_act, want_casts = [], {}, [], 0, 0
        for i in range(rng.randint(1, 30)):
            kind = rng.choice(["null", "amp_cast", "amp_multicast", "op"]) if i else "null"
            name = f"n{i}"
            inputs = [[rng.randrange(i), 0, 0] for _ in range(rng.randint(1, 2))] if kind != "null" else []
            nodes.append({"op": {"op": "FullyConnected"}.get(kind, kind), "name": name, "inputs": inputs})
            dt = rng.choice(["float32", "bfloat16"])
            dtypes[(name, 0)] = dt
            if kind == "op" and dt == "bfloat16":
                want_low.append(name)
            if kind in ("amp_cast", "amp_multicast"):
                want_casts += 1
                want_act += any(nodes[e[0]]["op"] != "null" for e in inputs)
        assert low_op_nodes(nodes, dtypes, "bfloat16") == want_low
        assert cast_nodes(nodes) == want_casts and activation_casts(nodes) == want_act
