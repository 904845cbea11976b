"""The capability model: what each kind of host can execute and what AMP picks there."""
import pytest

from gluon_amp_core.capability import Bf16, cap_in_force, classify, cpu_isa, effective_isa

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
SKYLAKE = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
ZEN3 = frozenset({"avx2", "avx", "sse4_1"})


@pytest.mark.parametrize("flags, granted, cap, isa, bf16", [
    (AMX, True, "AVX512_CORE_AMX", "AVX512_CORE_AMX", Bf16.NATIVE),  # what enable_amx sets
    (AMX, True, None, "AVX512_CORE_BF16", Bf16.NATIVE),         # oneDNN 2.4's default leaves AMX out
    (AMX, True, "ALL", "AVX512_CORE_BF16", Bf16.NATIVE),        # so does ALL
    (AMX, True, "avx512_core_amx", "AVX512_CORE_BF16", Bf16.NATIVE),  # names are case-sensitive
    (AMX, False, "AVX512_CORE_AMX", "AVX512_CORE_BF16", Bf16.NATIVE),  # AMX permission refused
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
    capped = classify(AMX, True, "AVX2", probe_error="boom")
    assert "DNNL_MAX_CPU_ISA=AVX2" in capped.why and "unset" in capped.why
    # flags promise bf16, but the kernel did not run: trust the probe
    assert classify(ZEN4, False, None, probe_error="boom").bf16 is Bf16.NONE


def test_probe_that_runs_without_avx512_flags_counts_as_emulated():
    assert classify(frozenset(), False, None).bf16 is Bf16.EMULATED


def test_isa_helpers():
    assert cpu_isa(AMX, amx_granted=False) == "AVX512_CORE_BF16"
    assert effective_isa("AVX512_CORE_AMX", "AVX512_CORE_AMX") == "AVX512_CORE_AMX"
    assert effective_isa("AVX512_CORE_AMX", "bogus") == "AVX512_CORE_BF16"
    assert effective_isa("AVX2", "ALL") == "AVX2"


# Measured on an AMX host (Intel Xeon, amx_bf16 avx512_bf16, MXNet 1.9.1's oneDNN 2.4.4, AMX granted):
# the kernel DNNL_VERBOSE names for a bfloat16 convolution under each DNNL_MAX_CPU_ISA value.
ONEDNN_244_AMX_HOST = {None: "avx512_core_bf16", "": "avx512_core_bf16", "ALL": "avx512_core_bf16",
                       "all": "avx512_core_bf16", "avx512_core_amx": "avx512_core_bf16",
                       "AVX512_CORE_AMX": "avx512_core_amx", "AVX512_CORE_BF16": "avx512_core_bf16",
                       "avx2": "avx512_core_bf16", "Avx2": "avx512_core_bf16", " AVX2": "avx512_core_bf16"}


@pytest.mark.parametrize("value, ran", sorted(ONEDNN_244_AMX_HOST.items(), key=str))
def test_the_cap_is_read_as_onednn_244_reads_it(value, ran):
    isa = effective_isa(cpu_isa(AMX, amx_granted=True), value)
    assert isa.lower() == ran, (value, cap_in_force(value))


@pytest.mark.parametrize("value", [None, "", "ALL", "avx512_core_amx", "AVX512_CORE_BF16"])
def test_a_granted_amx_host_kept_off_amx_by_the_cap_says_how_to_get_it(value):
    got = classify(AMX, True, value)
    assert got.isa == "AVX512_CORE_BF16" and repr(value) in got.amx_hint and "unset it" in got.amx_hint


SAPPHIRE_VM = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16"})  # AMX hidden by the hypervisor


def test_amx_hint_names_hidden_or_refused_amx_and_nothing_elsewhere():
    hidden = classify(SAPPHIRE_VM, False, None)
    assert hidden.bf16 is Bf16.NATIVE and "5.16" in hidden.amx_hint and "virtual machine" in hidden.amx_hint
    refused = classify(AMX, False, None)
    assert "5.16" in refused.amx_hint and "did not grant" in refused.amx_hint
    assert classify(AMX, True, "AVX512_CORE_AMX").amx_hint is None
    assert classify(ZEN4, False, None).amx_hint is None


def test_oneDNN_started_before_gluon_amp_is_told_apart_from_a_cap_the_user_set():
    # oneDNN read no cap at an operator MXNet ran first: the fix is the import order, not the variable
    first = classify(AMX, True, None, onednn_first=True)
    assert first.isa == "AVX512_CORE_BF16" and first.bf16 is Bf16.NATIVE
    assert "before gluon_amp was imported" in first.amx_hint and "unset it" not in first.amx_hint
    assert "unset it" in classify(AMX, True, None).amx_hint
    for flags, granted in ((ZEN4, False), (SAPPHIRE_VM, False)):  # no AMX to lose: the flag changes nothing
        assert classify(flags, granted, None, onednn_first=True) == classify(flags, granted, None)
