"""The capability model: what each kind of host can execute and what AMP picks there."""
import pytest

from gluon_amp_core.capability import Bf16, Capability, classify, cpu_isa, effective_isa, resolve_target

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
SKYLAKE = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
ZEN3 = frozenset({"avx2", "avx", "sse4_1"})


@pytest.mark.parametrize("flags, granted, cap, isa, bf16", [
    (AMX, True, None, "AVX512_CORE_AMX", Bf16.NATIVE),
    (AMX, False, None, "AVX512_CORE_BF16", Bf16.NATIVE),        # AMX permission refused
    (ZEN4, False, None, "AVX512_CORE_BF16", Bf16.NATIVE),
    (SKYLAKE, False, None, "AVX512_CORE", Bf16.EMULATED),
    (ZEN4, False, "AVX512_CORE", "AVX512_CORE", Bf16.EMULATED),  # user cap below bf16
    (AMX, True, "AVX2", "AVX2", Bf16.NONE),                      # user cap below AVX-512
    (ZEN3, False, None, "AVX2", Bf16.NONE),
])
def test_classify_by_flags_and_cap(flags, granted, cap, isa, bf16):
    probe = None if bf16 is not Bf16.NONE else "could not create a primitive descriptor iterator"
    got = classify(flags, granted, cap, probe_error=probe)
    assert (got.isa, got.bf16) == (isa, bf16)


def test_failed_probe_wins_over_flags_and_names_the_cause():
    got = classify(ZEN3, False, None, probe_error="could not create a primitive descriptor iterator")
    assert got.bf16 is Bf16.NONE and "avx512f" in got.why and "AVX512-BF16" in got.why
    capped = classify(AMX, True, "avx2", probe_error="boom")
    assert "DNNL_MAX_CPU_ISA=AVX2" in capped.why and "unset" in capped.why
    # flags promise bf16, but the kernel did not run: trust the probe
    assert classify(ZEN4, False, None, probe_error="boom").bf16 is Bf16.NONE


def test_probe_that_runs_without_avx512_flags_counts_as_emulated():
    assert classify(frozenset(), False, None).bf16 is Bf16.EMULATED


def test_isa_helpers():
    assert cpu_isa(AMX, amx_granted=False) == "AVX512_CORE_BF16"
    assert effective_isa("AVX512_CORE_AMX", "bogus") == "AVX512_CORE_AMX"
    assert effective_isa("AVX2", "ALL") == "AVX2"


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
