"""The probe's figures and the step-speedup estimate they give."""
import pytest

from gluon_amp_core.speed.probe import (MIN_SPEEDUP, PROBE, OpTiming, SpeedVerdict, contended, step_speedup,
                                        timings_from_records, timings_to_records)


def test_the_estimate_is_the_ratio_of_total_times_so_the_largest_items_weigh_most():
    assert step_speedup([OpTiming("block", "basic_block", 30.0, 15.0), OpTiming("fc", "dense", 1.0, 2.0)]) \
        == pytest.approx(31.0 / 17.0)


def test_the_verdict_turns_on_from_the_threshold():
    at = SpeedVerdict("bfloat16", (OpTiming("b", "basic_block", MIN_SPEEDUP, 1.0),), "measured")
    below = SpeedVerdict("bfloat16", (OpTiming("b", "basic_block", 1.0, 1.0),), "measured")
    assert at.faster and not below.faster
    assert "measured now" in below.describe() and "1.00x" in below.describe()
    assert below.to_dict()["items"][0]["ratio"] == 1.0


def test_no_timings_are_refused():
    with pytest.raises(ValueError, match="cannot estimate"):
        step_speedup([])


def test_records_round_trip_and_malformed_ones_are_refused():
    ts = (OpTiming("c", "Convolution", 2.0, 1.0),)
    assert timings_from_records(timings_to_records(ts)) == ts
    for bad in ([], "x", [{"label": "c"}], [{"label": "c", "kind": "Convolution", "fp32_ms": -1, "low_ms": 1}],
                [{"label": "c", "kind": "Convolution", "fp32_ms": "nan", "low_ms": 1}]):
        with pytest.raises(ValueError):
            timings_from_records(bad)


def test_the_probe_times_blocks_and_a_dense_layer():
    assert [kind for _, kind, _ in PROBE] == ["basic_block", "bottleneck_block", "dense"]


def test_other_work_counts_only_beyond_the_cpus_the_probe_leaves_free():
    assert contended(0.02, 1.0, 2, 2) is None  # a quiet 2-CPU machine
    why = contended(1.0, 1.0, 2, 2)  # one busy process beside a 2-thread probe on 2 CPUs
    assert why is not None and "1.0 of the machine's 2 CPUs" in why and "2 threads" in why
    assert contended(6.0, 1.0, 16, 2) is None  # a big machine: other jobs on CPUs the probe does not use
    assert contended(14.5, 1.0, 16, 2) is not None
    assert contended(0.5, 0.0, 2, 2) is None  # nothing timed
