"""Kernel speed facts (gluon_amp_core.kernel_speed): the rule, generated timings, and the op
table applying the recorded ones (an op timed slow in bfloat16 runs float32, reason slow_kernel)."""
import random

import pytest

from gluon_amp_core.decide import decide
from gluon_amp_core.kernel_speed import SLOW_FACTOR, Timing, slow_verdicts, timing_from_row
from gluon_amp_core.lists import kernel_speed as data
from gluon_amp_core.table import OpClass, apply_verdicts, build_table, default_table, default_verdicts, split_key
from gluon_amp_core.verdicts import Verdict


def _t(key, host, ratio, dtype="bfloat16"):
    return Timing(key, dtype, host, "64x64x64", 1.0, ratio)


def test_the_slow_line_is_the_factor():
    assert not _t("a", "h", SLOW_FACTOR).slow
    assert _t("a", "h", SLOW_FACTOR * 1.01).slow
    assert _t("a", "h", 0.1).ratio == pytest.approx(0.1)
    assert Timing("a", "bfloat16", "h", "", 0.0, 1.0).slow  # a float32 side too fast to time


def test_a_row_needs_six_fields():
    assert timing_from_row(("a", "bfloat16", "h", "c", 1, 2)) == Timing("a", "bfloat16", "h", "c", 1.0, 2.0)
    with pytest.raises(ValueError, match="6 fields"):
        timing_from_row(("a", "bfloat16", "h", "c", 1.0))


@pytest.mark.parametrize("seed", range(200))
def test_generated_timings_give_slow_where_every_host_found_a_slow_case(seed):
    rng = random.Random(seed)
    hosts, keys = ["h1", "h2", "h3"][:rng.randint(1, 3)], [f"op{i}" for i in range(rng.randint(1, 6))]
    timings = [_t(k, h, rng.choice([0.3, 1.0, 1.6, 9.0]), dtype=rng.choice(["bfloat16", "bfloat16", "float16"]))
               for _ in range(rng.randint(0, 25)) for k in [rng.choice(keys)] for h in [rng.choice(hosts)]]
    got = slow_verdicts(timings, "bfloat16")
    for key in keys:
        mine = [t for t in timings if t.key == key and t.dtype == "bfloat16"]
        per_host = {h: any(t.slow for t in mine if t.host == h) for h in {t.host for t in mine}}
        expected = bool(per_host) and all(per_host.values())
        assert (got.get(key) is Verdict.SLOW) == expected, (key, mine)
    assert set(got.values()) <= {Verdict.SLOW}


def test_slow_makes_an_op_widest_or_one_attribute_value_float32():
    """Slow in the target dtype only: a neutral op becomes widest (decide then runs it float32
    where the widest input is the target); one attribute value runs float32."""
    classes = {"w": OpClass.WIDEST, "n": OpClass.NEUTRAL, "c": OpClass.CONDITIONAL_FP32, "u": OpClass.WIDEST}
    from gluon_amp_core.table import ConditionalRule
    conditions = {"c": ConditionalRule("act_type", frozenset({"softrelu"}))}
    applied = apply_verdicts(classes, conditions, {"w": Verdict.SLOW, "n:act_type=relu": Verdict.SLOW,
                                                   "c:act_type=sigmoid": Verdict.SLOW, "u": Verdict.SLOW}, {"u"})
    assert classes["w"] is OpClass.WIDEST and classes["u"] is OpClass.WIDEST  # the user's list wins
    assert classes["n"] is OpClass.CONDITIONAL_FP32 and conditions["n"].values == {"relu"}
    plain = {"n": OpClass.NEUTRAL, "f": OpClass.FP32}
    assert set(apply_verdicts(plain, {}, {"n": Verdict.SLOW, "f": Verdict.SLOW}, ())) == {"n"}
    assert plain == {"n": OpClass.WIDEST, "f": OpClass.FP32}
    assert conditions["c"].values == {"softrelu", "sigmoid"}
    assert set(applied) == {"w", "n:act_type=relu", "c:act_type=sigmoid"}


def test_every_recorded_slow_kernel_runs_float32_in_a_bfloat16_plan():
    """From the data: each key every timing host found slow is float32 in the table, and the
    decision names the reason; a key found fast keeps its class."""
    timings = [timing_from_row(r) for r in data.TIMINGS]
    slow = slow_verdicts(timings, "bfloat16")
    assert slow, "no bfloat16 kernel recorded slow: lists/kernel_speed_measured*.py is empty"
    table = default_table("bfloat16")
    verdicts = default_verdicts("bfloat16")
    for key in slow:
        op, cond = split_key(key)
        assert verdicts[key] in (Verdict.SLOW, Verdict.WRONG, Verdict.NO_KERNEL), key
        attrs = {cond[0]: cond[1]} if cond else {}
        d = decide(op, attrs, ["bfloat16"] * 3, table)
        assert d.dtype == "float32", (key, d)
        if verdicts[key] is Verdict.SLOW and cond is None:
            assert d.reason.value == "slow_kernel", (key, d)
    fast = {t.key for t in timings if t.dtype == "bfloat16"} - set(slow)
    assert fast, "no bfloat16 kernel recorded as fast as float32: the timings cannot tell the two apart"
    for key in fast:
        assert default_verdicts("bfloat16").get(key) is not Verdict.SLOW, key


def test_cpu_timings_leave_float16_plans_alone():
    """The recorded timings are of bfloat16 kernels; a float16 plan (GPUs) follows none."""
    assert Verdict.SLOW not in set(default_verdicts("float16").values())
    assert build_table("float16").classes["broadcast_add"] is OpClass.WIDEST
