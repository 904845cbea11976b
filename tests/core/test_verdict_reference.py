"""Verdicts against a reference that is right (issue 46), on planted measurements: a low dtype is
judged "wrong" only where MXNet's FP32 reference agrees with float64 or with itself run again, and
the train-mode backward (what training runs) decides, the predict-mode backward is recorded."""
import math

import pytest

from gluon_amp_core.verdicts import (BOUNDS, REFERENCE_BOUND, Fact, Observation, Part, Verdict, backward_by_mode,
                                     decisive_error, fact_from_row, judge, part_verdict, plan_verdicts)

BF16 = BOUNDS["bfloat16"]


def _pooling_on_zen4():
    """What the harness measured of max pooling in bfloat16 on the Zen 4 (avx512_bf16): right in
    train mode; in predict mode the backward is off by ~1, and so is MXNet's FP32 against float64
    and against a second FP32 run (/work/shared/facts/zen4-native-bf16/maxpool_predict_mode_backward.py)."""
    parts = []
    for path in ("legacy/imperative", "legacy/hybridized", "numpy/imperative", "numpy/hybridized"):
        parts += [Part(path, "forward", "train", 0.0), Part(path, "backward", "train", 0.00255),
                  Part(path, "forward", "predict", 0.0)]
    parts += [Part("legacy/imperative", "backward", "predict", 0.972, 1.0),
              Part("legacy/hybridized", "backward", "predict", 1.0, 1.0),
              Part("numpy/imperative", "backward", "predict", 0.841, 1.0),
              Part("numpy/hybridized", "backward", "predict", 1.0, 0.975)]
    return Observation(parts=tuple(parts))


def test_mxnet_float32_error_in_predict_mode_does_not_make_pooling_wrong():
    seen = _pooling_on_zen4()
    assert judge(seen, "bfloat16") == (Verdict.OK, "cpu")
    assert decisive_error(seen) == pytest.approx(0.00255)
    assert backward_by_mode(seen.parts, "bfloat16") == (
        ("train", Verdict.OK, pytest.approx(0.00255)), ("predict", Verdict.FP32_WRONG, 1.0))


def test_a_part_beyond_the_bound_blames_the_dtype_only_with_a_right_reference():
    assert part_verdict(Part("p", "forward", "train", 0.5, 0.0), "bfloat16") is Verdict.WRONG
    assert part_verdict(Part("p", "forward", "train", 0.5, REFERENCE_BOUND), "bfloat16") is Verdict.WRONG
    assert part_verdict(Part("p", "forward", "train", 0.5, REFERENCE_BOUND * 2), "bfloat16") is Verdict.FP32_WRONG
    assert part_verdict(Part("p", "forward", "train", 0.5, math.inf), "bfloat16") is Verdict.FP32_WRONG
    assert part_verdict(Part("p", "forward", "train", 0.5, math.nan), "bfloat16") is Verdict.FP32_WRONG
    # within the bound: nothing to check
    assert part_verdict(Part("p", "backward", "train", BF16), "bfloat16") is Verdict.OK
    assert part_verdict(Part("p", "backward", "train", math.nan, 0.0), "bfloat16") is Verdict.WRONG
    # the reference is checked as tightly as either dtype's bound needs
    assert REFERENCE_BOUND < min(BOUNDS.values())


def test_a_part_beyond_the_bound_with_an_unchecked_reference_is_refused():
    with pytest.raises(ValueError, match=r"legacy/imperative train-mode backward.*not checked"):
        judge(Observation(parts=(Part("legacy/imperative", "backward", "train", 0.5),)), "bfloat16")


def test_train_mode_backward_decides_and_predict_mode_backward_does_not():
    predict_only = Observation(parts=(Part("a", "backward", "train", 0.001),
                                      Part("a", "backward", "predict", 0.5, 0.0)))
    assert judge(predict_only, "bfloat16")[0] is Verdict.OK
    assert backward_by_mode(predict_only.parts, "bfloat16")[1][:2] == ("predict", Verdict.WRONG)
    train = Observation(parts=(Part("a", "backward", "train", 0.5, 0.0), Part("a", "backward", "predict", 0.001)))
    assert judge(train, "bfloat16") == (Verdict.WRONG, "cpu")
    # an inference forward decides in both modes
    fwd = Observation(parts=(Part("a", "forward", "predict", 0.5, 0.0),))
    assert judge(fwd, "bfloat16")[0] is Verdict.WRONG


def test_fp32_wrong_where_training_runs_shows_but_a_real_defect_beside_it_wins():
    fp32 = Part("legacy/imperative", "backward", "train", 1.0, 0.9)
    assert judge(Observation(parts=(fp32,)), "bfloat16") == (Verdict.FP32_WRONG, "cpu")
    real = Part("numpy/imperative", "forward", "train", 0.2, 0.0)
    assert judge(Observation(parts=(fp32, real)), "bfloat16")[0] is Verdict.WRONG
    assert judge(Observation(parts=(fp32,), mixed_refused="m"), "bfloat16")[0] is Verdict.NEEDS_UNIFORM_INPUTS


def test_fp32_wrong_changes_no_plan():
    facts = [Fact("Pooling", "bfloat16", Verdict.FP32_WRONG, "cpu", "h1", 1.0),
             Fact("Pooling", "bfloat16", Verdict.OK, "cpu", "h2", 0.002),
             Fact("x", "bfloat16", Verdict.FP32_WRONG, "cpu", "h1", 1.0),
             Fact("x", "bfloat16", Verdict.WRONG, "cpu", "h2", 1.0)]
    assert dict(plan_verdicts(facts, "bfloat16")) == {"x": Verdict.WRONG}


def test_a_fact_row_carries_its_backward_per_mode():
    row = ("Pooling", "bfloat16", "ok", "cpu", "h", 0.00255, "n",
           (("train", "ok", 0.00255), ("predict", "fp32_wrong", 1.0)))
    f = fact_from_row(row)
    assert f.verdict is Verdict.OK
    assert f.backward == (("train", Verdict.OK, 0.00255), ("predict", Verdict.FP32_WRONG, 1.0))
    assert fact_from_row(row[:7]).backward == ()
    with pytest.raises(ValueError, match="7 or 8 fields"):
        fact_from_row(row[:6])


def test_the_zen4_facts_stand_beside_the_avx2_hosts():
    from gluon_amp_core.lists import verdicts as data
    keys = [h[0] for h in data.MEASURED_HOSTS]
    assert "amd-epyc-no-bf16" in keys and "amd-epyc-native" in keys  # neither replaced the other
    assert "avx512_bf16" in data.HOSTS["amd-epyc-native"][1] and "native" in data.HOSTS["amd-epyc-native"][1]
    facts = [fact_from_row(r) for r in data.FACTS]
    pooling = {f.host: f for f in facts if f.op == "Pooling" and f.dtype == "bfloat16"}
    zen4 = pooling["amd-epyc-native"]
    assert zen4.verdict is Verdict.OK, zen4
    modes = {m: v for m, v, _ in zen4.backward}
    assert modes == {"train": Verdict.OK, "predict": Verdict.FP32_WRONG}
    assert "Pooling" not in plan_verdicts(facts, "bfloat16")
    # each host's facts were judged by the rules it names
    assert data.RULES_OF["amd-epyc-native"] == 2


def test_the_report_shows_both_hosts_facts():
    from gluon_amp_core import conformance_report
    text = conformance_report.render()
    row = next(line for line in text.splitlines() if line.startswith("| `Pooling` |"))
    bf16_cell = row.split(" | ")[1]
    assert "(amd-epyc-native; predict-mode backward fp32_wrong" in bf16_cell and "xeon-golden" in bf16_cell
    assert "`amd-epyc-no-bf16`" in text and "`amd-epyc-native`" in text
    assert "## Backward per autograd mode" in text
