"""The resolution: capability plus measured speed give the target dtype, with why."""
import json
import os

import pytest

from gluon_amp_core.capability import Bf16, Capability, classify
from gluon_amp_core.resolve import resolve_target
from gluon_amp_core.speed.probe import MIN_SPEEDUP, SpeedVerdict, timings_from_records

HOSTS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "probe_hosts.json")))["hosts"]


def _recorded(host):
    """The host's capability (from its flags) and its probe verdict (from its figures)."""
    rec = HOSTS[host]
    cap = classify(frozenset(rec["flags"]), False, None)
    return cap, SpeedVerdict("bfloat16", timings_from_records(rec["items"]), "cached", "/cache/file.json")


def test_the_slow_host_stays_in_float32_and_says_why_how_to_force_and_what_amx_would_do():
    cap, speed = _recorded("intel_xeon_no_amx")
    assert cap.bf16 is Bf16.NATIVE  # the flags alone would turn bfloat16 on
    res = resolve_target(None, cap, speed)
    assert res.dtype == "float32" and res.speed is speed and speed.speedup < 1
    assert f"{speed.speedup:.2f}x" in res.warning and "16.6 ms in bfloat16 vs 12.0 ms in float32" in res.warning
    assert "target_dtype='bfloat16'" in res.warning and "GLUON_AMP_SPEED_PROBE=0" in res.warning
    assert "AMX" in res.warning and "5.16" in res.warning  # avx512_fp16 without amx_bf16
    assert "/cache/file.json" in res.warning  # where the figures come from


def test_the_fast_host_turns_bfloat16_on():
    cap, speed = _recorded("amd_zen4")
    res = resolve_target(None, cap, speed)
    assert res.dtype == "bfloat16" and res.warning is None and speed.speedup >= MIN_SPEEDUP


def test_an_explicit_target_is_obeyed_with_a_warning_only_where_measured_slower():
    slow_cap, slow = _recorded("intel_xeon_no_amx")
    res = resolve_target("bfloat16", slow_cap, slow)
    assert res.dtype == "bfloat16" and res.executable and "as asked" in res.warning and "tune=True" in res.warning
    fast_cap, fast = _recorded("amd_zen4")
    assert resolve_target("bf16", fast_cap, fast).warning is None


def test_without_figures_the_flags_decide():
    cap, _ = _recorded("intel_xeon_no_amx")
    assert resolve_target(None, cap, None).dtype == "bfloat16"


def _cap(bf16, gpus=0):
    return Capability(gpus, bf16, "X", f"reason-{bf16.value}")


@pytest.mark.parametrize("bf16, gpus, want", [
    (Bf16.NATIVE, 0, "bfloat16"),
    (Bf16.EMULATED, 0, "float32"),   # slower than FP32: AMP stays off
    (Bf16.NONE, 0, "float32"),
    (Bf16.NONE, 1, "float16"),
])
def test_none_never_picks_what_cannot_run_or_is_slower(bf16, gpus, want):
    res = resolve_target(None, _cap(bf16, gpus))
    assert res.dtype == want and res.executable
    assert (res.warning is not None) == (want == "float32")
    if res.warning:
        assert f"reason-{bf16.value}" in res.warning and "float32" in res.warning


def test_explicit_targets_are_kept_and_announced():
    res = resolve_target("bf16", _cap(Bf16.NONE))
    assert res.dtype == "bfloat16" and not res.executable
    assert "conversion still work" in res.warning and "reason-none" in res.warning
    res = resolve_target("bfloat16", _cap(Bf16.EMULATED))
    assert res.executable and "reason-emulated" in res.warning
    res = resolve_target("float16", _cap(Bf16.NATIVE))
    assert not res.executable and "GPU" in res.warning
    assert resolve_target("float16", _cap(Bf16.NONE, gpus=1)) == resolve_target("float16", _cap(Bf16.NATIVE, 1))
    assert resolve_target("bfloat16", _cap(Bf16.NATIVE)).warning is None


def test_bad_target_names_the_choices():
    with pytest.raises(ValueError, match="'float16', 'bfloat16'"):
        resolve_target("int8", _cap(Bf16.NATIVE))


def test_figures_from_a_busy_machine_decide_as_measured_in_cpu_time():
    """A busy machine's figures are the process's CPU time, which the load leaves alone: they
    decide as a quiet machine's do (the flags chose bfloat16 there before, on a host where it
    is slower), and the message says how they were taken."""
    from dataclasses import replace
    from gluon_amp_core.speed.probe import busy
    why = busy(5.2, 2)
    assert why and "5.2" in why and busy(1.9, 2) is None
    cap, slow = _recorded("intel_xeon_no_amx")
    res = resolve_target(None, cap, replace(slow, busy=why))
    assert res.dtype == "float32" and res.speed.busy == why
    assert "in CPU time" in res.warning and why in res.warning
    cap, fast = _recorded("amd_zen4")
    res = resolve_target(None, cap, replace(fast, busy=why))
    assert res.dtype == "bfloat16" and res.warning is None and res.speed.busy == why
