"""The loss-curve verdict (benchmarks/loss_match.py): like with like, skipped steps named."""
import math
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from loss_match import CurveMatch, Step, match_curves  # noqa: E402

# FP32's loss after n updates, on the same batch every step (ssd_synthetic's and the notebook's
# set-up): it falls by 10% per update, so an update behind is far beyond 2%.
CURVE = [10.0 * 0.9 ** n for n in range(8)]


def _fp32(n=8):
    return [Step(CURVE[i], True, None) for i in range(n)]


def _skipping(skips=2, noise=0.004, n=8):
    """A mode whose scaler backs off from 65536 on its first ``skips`` steps (as emulated
    float16 did on SSD-512), whose numerics are within ``noise`` of FP32's."""
    steps, scale = [], 65536.0
    for i in range(n):
        updated = i >= skips
        scale = scale if updated else scale / 2
        done = max(0, i - skips)  # updates applied before step i
        steps.append(Step(CURVE[done] * (1 + noise * (-1) ** i), updated, scale))
    return steps


def _by_index(mode, reference):
    """The old verdict: step i against step i."""
    return max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(mode, reference))


def test_a_planted_skip_is_named_with_its_scale_and_does_not_fail_the_curves():
    mode, ref = _skipping(), _fp32()
    assert _by_index(mode, ref) > 0.02  # what the old comparison called "NOT within"
    m = match_curves(mode, ref)
    assert m.skipped == ((0, 32768.0), (1, 16384.0)) and m.reference_skipped == ()
    assert m.within and m.max_rel_diff == pytest.approx(0.004)
    assert m.first_rel_diff == pytest.approx(0.004)  # step 0: both at the initial weights
    # each update count once, the mode's first step that had it: step 2 is at 0 updates again
    assert [(p.updates, p.step, p.reference_step) for p in m.pairs] == [(n, 0 if n == 0 else n + 2, n)
                                                                        for n in range(6)]
    text = m.describe("emulated-float16")
    assert "skipped step 0 (overflow; scale -> 32768), 1 (overflow; scale -> 16384)" in text
    assert "first step (equal weights): rel. diff 0.0040" in text
    assert "within 2%" in text and "NOT within" not in text


@pytest.mark.parametrize("where", ["first step", "after equal updates"])
def test_numerics_off_fail_with_or_without_skips(where):
    mode = _skipping()
    bad = 0 if where == "first step" else 5
    mode[bad] = Step(mode[bad].loss * 1.05, mode[bad].updated, mode[bad].scale)
    m = match_curves(mode, _fp32())
    assert not m.within and m.max_rel_diff == pytest.approx(0.05, rel=0.1)
    assert "NOT within 2%: the numerics differ" in m.describe("emulated-float16")


def test_a_non_finite_loss_fails():
    mode = _skipping(skips=0)
    mode[3] = Step(math.nan, True, 65536.0)
    assert not match_curves(mode, _fp32()).within


def test_new_batches_are_compared_step_by_step_until_a_mode_skips():
    """convergence.py's set-up: after a skip, an equal update count meets another batch."""
    ref = _fp32()
    mode = [Step(s.loss * 1.001, True, 65536.0) for s in ref]
    mode[3] = Step(mode[3].loss, False, 32768.0)
    m = match_curves(mode, ref, same_batch=False)
    assert [p.step for p in m.pairs] == [0, 1, 2, 3] and m.within and m.skipped == ((3, 32768.0),)
    assert "while neither mode had skipped a step" in m.describe("bfloat16")


def test_the_horizon_limits_the_compared_update_counts():
    m = match_curves(_skipping(), _fp32(), max_updates=3)
    assert [p.updates for p in m.pairs] == [0, 1, 2]


def test_a_reference_skip_is_named_too_and_nothing_compared_says_so():
    ref = _fp32()
    ref[1] = Step(ref[1].loss, False, 32768.0)
    assert match_curves(_fp32(), ref).reference_skipped == ((1, 32768.0),)
    empty = match_curves([], _fp32())
    assert not empty.within and "no step to compare" in empty.describe("x")


def test_steps_round_trip_through_json_dicts():
    s = Step(1.5, False, 4096.0)
    assert Step.from_dict(s.to_dict()) == s and Step.from_dict({"loss": 2}) == Step(2.0, True, None)
    m = match_curves(_skipping(), _fp32())
    d = m.to_dict()
    assert d["within"] and d["skipped"] == [{"step": 0, "scale": 32768.0}, {"step": 1, "scale": 16384.0}]
    assert CurveMatch.from_dict(d) == m


@pytest.mark.parametrize("kwargs, message", [({"tolerance": -0.1}, "tolerance must be >= 0, got -0.1"),
                                             ({"max_updates": 0}, "max_updates must be >= 1 or None, got 0")])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        match_curves(_fp32(), _fp32(), **kwargs)
