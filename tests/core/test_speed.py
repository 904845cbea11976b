"""The probe's figures and the step-speedup estimate they give."""
import pytest

from gluon_amp_core.speed import (MIN_SPEEDUP, PROBE_OPS, STEP_SHARE, OpTiming, SpeedVerdict, step_speedup,
                                  timings_from_records, timings_to_records)


def test_the_estimate_weights_each_op_by_its_share_of_a_step():
    conv_twice_as_fast = [OpTiming("c", "Convolution", 10.0, 5.0), OpTiming("b", "BatchNorm", 1.0, 1.0)]
    share = STEP_SHARE["Convolution"] / (STEP_SHARE["Convolution"] + STEP_SHARE["BatchNorm"])
    assert step_speedup(conv_twice_as_fast) == pytest.approx(1 / (share * 0.5 + (1 - share) * 1.0))
    # several shapes of one op count by their summed times
    assert step_speedup([OpTiming("a", "Convolution", 9.0, 3.0), OpTiming("b", "Convolution", 1.0, 7.0)]) == 1.0


def test_the_verdict_turns_on_from_the_threshold():
    at = SpeedVerdict("bfloat16", (OpTiming("c", "Convolution", MIN_SPEEDUP, 1.0),), "measured")
    below = SpeedVerdict("bfloat16", (OpTiming("c", "Convolution", 1.0, 1.0),), "measured")
    assert at.faster and not below.faster
    assert "measured now" in below.describe() and "1.00x" in below.describe()


def test_ops_without_a_share_or_time_are_refused():
    with pytest.raises(ValueError, match="cannot estimate"):
        step_speedup([OpTiming("x", "softmax", 1.0, 1.0)])


def test_records_round_trip_and_malformed_ones_are_refused():
    ts = (OpTiming("c", "Convolution", 2.0, 1.0),)
    assert timings_from_records(timings_to_records(ts)) == ts
    for bad in ([], "x", [{"label": "c"}], [{"label": "c", "op": "Convolution", "fp32_ms": -1, "low_ms": 1}],
                [{"label": "c", "op": "Convolution", "fp32_ms": "nan", "low_ms": 1}]):
        with pytest.raises(ValueError):
            timings_from_records(bad)


def test_every_probe_op_has_a_share():
    assert {op for _, op, _, _ in PROBE_OPS} == set(STEP_SHARE)
