"""When tuning may spend, and where its decisions carry (gluon_amp_core.tuning.schedule)."""
import math

import pytest

from gluon_amp_core.decide import MeasuredChoice
from gluon_amp_core.tuning.schedule import (DEFAULT_BUDGET, Ledger, ShapeHistory, TuneBudget, could_flip,
                                          parse_budget, still_float32, to_retime)


def test_budget_strings_numbers_and_errors():
    assert parse_budget(None) == DEFAULT_BUDGET == TuneBudget(0.01, 600.0)
    assert parse_budget("5%") == TuneBudget(0.05, 600.0)
    assert parse_budget("5%, 120s") == parse_budget("120,5%") == TuneBudget(0.05, 120.0)
    assert parse_budget("inf") == TuneBudget(None, math.inf) and parse_budget(0) == TuneBudget(None, 0.0)
    assert parse_budget(TuneBudget(0.1, 5.0)) == TuneBudget(0.1, 5.0)
    for bad, match in [("2%,3%", "one share"), ("0%", "above 0%"), ("100%", "below 100%"), ("1,2", "one number"),
                       ("inf%", "cannot read"), ("fast", "cannot read"), (-3, ">= 0 seconds")]:
        with pytest.raises(ValueError, match=match):
            parse_budget(bad)
    with pytest.raises(TypeError, match="tune_budget must be"):
        parse_budget(True)
    with pytest.raises(ValueError, match="share must be in"):
        TuneBudget(1.5, 3.0)


def test_the_allowance_is_a_share_of_the_time_so_far_up_to_the_cap():
    budget = TuneBudget(0.02, 10.0)
    assert budget.allowance(100.0) == pytest.approx(2.0) and budget.allowance(10_000.0) == 10.0
    assert TuneBudget(None, 7.0).allowance(0.0) == 7.0  # seconds alone: all at once
    assert "2% of the training time so far, at most 10 s" in budget.describe()
    ledger = Ledger(budget)
    assert not ledger.allows(0.1, now=5.0)  # not started: nothing allowed yet
    ledger.start(5.0)
    assert ledger.allows(1.0, now=55.0) and not ledger.allows(1.01, now=55.0)
    ledger.charge(1.5, "per-op timing", estimate=1.0)
    assert ledger.spent == 1.5 and ledger.overrun == 0.5 and not ledger.allows(0.0, now=55.0)
    assert ledger.allows(8.5, now=1e6, cap_only=False) and not ledger.allows(8.6, now=1e6)
    assert ledger.allows(8.5, now=0.0, cap_only=True)  # outside a run (the converters): the cap alone
    assert ledger.to_dict(55.0)["spent_on"] == {"per-op timing": 1.5}


def test_a_shape_repeats_only_when_seen_again_and_a_dimension_changing_at_most_calls_is_dynamic():
    h = ShapeHistory()
    a, b = ((2, 3, 8, 8), (2, 5, 4)), ((2, 3, 8, 8), (2, 7, 4))
    assert h.count(h.see(a)) == 1
    assert h.count(h.see(b)) == 1  # another number of boxes: not the same shape (yet)
    assert h.count(h.see(a)) == 2 and h.dynamic == frozenset()
    key = h.see(((2, 3, 8, 8), (2, 6, 4)))  # the box count changed at all 3 changes: dynamic
    assert h.dynamic == {(1, 1)} and key == ((2, 3, 8, 8), (2, -1, 4)) and h.count(key) == 4
    key16 = h.see(((2, 3, 16, 16), (2, 2, 4)))  # the image size changed once in 4 calls: static
    assert h.count(key16) == 1 and (0, 2) not in h.dynamic
    assert h.matches(key16, ((2, 3, 16, 16), (2, 9, 4))) and not h.matches(key16, a)
    assert h.calls == 5 and h.distinct == 4


def test_a_repeated_shape_is_recorded_as_the_general_path_records_it():
    """``see``'s shortcut for a shape equal to the last one (a training loop's usual call) keeps
    every count and key the general path keeps. Generated sequences of repeats, changes and
    dynamic dimensions; the twin is fed lists, which never take the shortcut."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        fast, slow = ShapeHistory(), ShapeHistory()
        shape = ((rng.choice([1, 2, 4]), 3, 8), (rng.choice([2, 5]), 4))
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.25:  # one dimension moves
                i = rng.randrange(len(shape))
                dims = list(shape[i])
                dims[rng.randrange(len(dims))] = rng.choice([1, 2, 3, 5, 8])
                shape = tuple(tuple(dims) if k == i else s for k, s in enumerate(shape))
            elif r < 0.3:  # a call with one input fewer
                shape = shape[:1]
            elif r < 0.35 and len(shape) == 1:
                shape = shape + ((2, 4),)
            key = fast.see(shape)
            assert key == slow.see([list(s) for s in shape])
            assert fast.count(key) == slow.count(key) and fast.dynamic == slow.dynamic
        assert (fast.calls, fast.distinct, fast.last) == (slow.calls, slow.distinct, slow.last)


@pytest.mark.parametrize("share, cap, spent", [(0.01, 600.0, 0.0), (0.05, 20.0, 3.0), (0.5, 2.0, 1.0),
                                               (None, 5.0, 1.0)])
def test_the_time_a_waiting_step_fits_is_the_first_the_ledger_allows_it(share, cap, spent):
    budget = TuneBudget(share, cap)
    ledger = Ledger(budget)
    assert ledger.allowed_at(0.5) == 0.0 and ledger.allowed_at(cap + 1.0) == math.inf  # not started
    ledger.start(100.0)
    ledger.charge(spent, "per-op timing")
    for estimate in (0.0, 0.25, 1.0, 4.0, 50.0):
        at = ledger.allowed_at(estimate)
        if at == math.inf:  # never: the cap, or a fixed allowance it does not fit now
            assert not ledger.allows(estimate, now=1e12)
        elif ledger.allows(estimate, now=100.0):
            assert at <= 100.0 + 1e-9
        else:
            assert ledger.allows(estimate, now=at + 1e-6) and not ledger.allows(estimate, now=at - 1e-3)


def _fp32(low, fp32, cast=0.0):
    return MeasuredChoice("float32", low, fp32, cast, "bfloat16")


def test_a_choice_is_timed_again_only_near_break_even_and_where_the_shape_moved_the_op():
    wide, close = _fp32(409.0, 205.0), _fp32(1.1, 1.0)
    assert not could_flip(wide, 10.0)  # decided by a wide margin, at any size
    assert not could_flip(close, 1.9) and not could_flip(close, 0.6)  # within a factor 2: decided
    assert could_flip(close, 2.9) and could_flip(close, 0.4)
    assert not could_flip(MeasuredChoice("bfloat16", 1.0, 1.1, 0.0, "bfloat16"), 5.0)  # only float32 choices
    assert to_retime({3: wide, 7: close, 9: close}, {3: 4.0, 7: 4.0, 9: 1.5}) == [7]
    assert to_retime({7: close}, {}) == [7]  # an op whose size is unknown could have moved anywhere
    # re-timed: casts scale with the shape; float32 holds while it saves more than they cost
    assert still_float32(_fp32(1.1, 1.0, cast=0.01), 4.0, low_ms=4.6, fp32_ms=4.0)
    assert not still_float32(_fp32(1.1, 1.0, cast=0.01), 4.0, low_ms=3.6, fp32_ms=4.0)
    assert not still_float32(_fp32(1.1, 1.0, cast=0.2), 4.0, low_ms=4.6, fp32_ms=4.0)  # 0.8 ms of casts
