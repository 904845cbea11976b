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


def test_multiply_adds_of_gemms_and_convolutions_come_from_their_shapes():
    from gluon_amp_core.tuning.verdict import op_macs
    assert op_macs("FullyConnected", {}, [(8, 128, 768), (768, 768), (768,)], (8, 128, 768)) == 8 * 128 * 768 * 768
    assert op_macs("Convolution", {}, [(2, 16, 8, 8), (32, 16, 3, 3)], (2, 32, 8, 8)) == 2 * 32 * 64 * 16 * 9
    assert op_macs("batch_dot", {"transpose_b": "True"}, [(96, 128, 64), (96, 128, 64)], None) == 96 * 128 * 64 * 128
    assert op_macs("batch_dot", {}, [(96, 128, 128), (96, 128, 64)], None) == 96 * 128 * 128 * 64
    assert op_macs("Activation", {}, [(4, 5)], (4, 5)) == 20  # one per input element


@pytest.mark.parametrize("intensity, casts, runs_fp32", [(2000.0, 30, False), (30.0, 1, True), (None, 30, True),
                                                         (None, 10, False), (float("inf"), 30, False)])
def test_the_graphs_own_figures_decide_where_its_shapes_are_known(intensity, casts, runs_fp32):
    """Multiply-adds per cast element, where known, replace the casts per op (20 low ops here)."""
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_MACS_PER_CAST_ELEMENT
    assert unmeasured_runs_fp32(casts, 20, 10 ** 7, intensity) == runs_fp32
    text = describe_unmeasured(casts, 20, "bfloat16", "no whole-graph timing yet", 10 ** 7, intensity)
    assert text.startswith("runs float32" if runs_fp32 else "runs the plan")
    if intensity is not None and runs_fp32:
        assert f"at least {UNMEASURED_MIN_MACS_PER_CAST_ELEMENT:g} multiply-adds per cast element" in text
    assert unmeasured_runs_fp32(casts, 20, 20 * 100, intensity)  # tiny ops: float32 whatever the figures


def test_where_the_probe_measured_the_dtype_slower_no_unmeasured_plan_runs_low():
    """Whatever the graph's own figures say, a plan of a dtype this machine's probe measured
    slower than float32 (an explicit target_dtype there) runs float32 until measured; a graph
    with nothing low has nothing to decide."""
    rng = random.Random(2)
    probe = "bfloat16 measured 0.66x the speed of float32 on this CPU (...)"
    for _ in range(300):
        casts, low_ops = rng.randint(0, 400), rng.choice([0, rng.randint(1, 400)])
        elements = rng.choice([None, rng.randint(1, 10 ** 8)])
        intensity = rng.choice([None, float("inf"), rng.uniform(1, 10 ** 4)])
        without = unmeasured_runs_fp32(casts, low_ops, elements, intensity)
        assert unmeasured_runs_fp32(casts, low_ops, elements, intensity, probe_slower=True) == (low_ops > 0)
        assert unmeasured_runs_fp32(casts, low_ops, elements, intensity, probe_slower=False) == without
        text = describe_unmeasured(casts, low_ops, "bfloat16", "no whole-graph timing yet", elements, intensity,
                                   probe_slower=probe)
        if low_ops:
            assert text.startswith("runs float32 until measured (no whole-graph timing yet)") and probe in text
        else:
            assert text == describe_unmeasured(casts, low_ops, "bfloat16", "no whole-graph timing yet", elements,
                                               intensity)
