"""make_policy, init's edge: each argument is parsed once on the way to a Policy."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Dict, Iterator

import pytest

import gluon_amp as amp
from gluon_amp_core import dtypes
from gluon_amp_core.tuning import schedule as tune_schedule


@contextmanager
def counting(*functions: Callable) -> Iterator[Dict[str, int]]:
    """Count every call of ``functions`` (by code object, so a reference imported under another
    name counts too) while inside."""
    codes = {f.__code__: f.__name__ for f in functions}
    counts = {name: 0 for name in codes.values()}
    previous = sys.getprofile()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


@pytest.mark.parametrize("spelling", ["bfloat16", "bf16", "float16"])
@pytest.mark.parametrize("emulate", [False, True])
def test_init_parses_target_dtype_once(spelling: str, emulate: bool) -> None:
    with counting(dtypes.parse_target_dtype, tune_schedule.parse_budget) as counts:
        policy = amp.init(target_dtype=spelling, emulate=emulate, tune=False, tune_budget="5%")
    try:
        assert policy.target_dtype == dtypes.parse_target_dtype(spelling)
        assert counts == {"parse_target_dtype": 1, "parse_budget": 1}
    finally:
        amp.disable()


def test_a_bad_target_dtype_is_named_once_at_the_edge() -> None:
    with counting(dtypes.parse_target_dtype) as counts, pytest.raises(ValueError, match="'int8'.*'float16'"):
        amp.make_policy("int8")
    assert counts == {"parse_target_dtype": 1}
