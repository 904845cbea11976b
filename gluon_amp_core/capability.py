"""What low precision a machine can execute, and which target dtype to use. Pure: no MXNet.

MXNet 1.9's oneDNN 2.4 runs bfloat16 only from AVX-512 up: natively with AVX512-BF16 or
AMX, emulated (slower than float32) with plain AVX-512, not at all below. ``DNNL_MAX_CPU_ISA``
caps the ISA oneDNN may use, so a user's cap removes bfloat16 as surely as the hardware.
The MXNet layer adds what flags cannot tell: a probe that executes a tiny bf16 op.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import FrozenSet, Optional


#: oneDNN 2.4 ISA names (``DNNL_MAX_CPU_ISA``), lowest first.
_ISA_ORDER = ("SSE41", "AVX", "AVX2", "AVX512_MIC", "AVX512_MIC_4OPS", "AVX512_CORE",
              "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL")
_RANK = {name: i for i, name in enumerate(_ISA_ORDER)}
_FIRST_AVX512 = _RANK["AVX512_CORE"]
_FIRST_BF16 = _RANK["AVX512_CORE_BF16"]

_FAST_HW = ("a CPU with AVX512-BF16 (Intel Cooper Lake or newer, AMD Zen 4 or newer) or AMX "
            "(Intel Sapphire Rapids or newer), or a GPU with float16")


class Bf16(enum.Enum):
    """How this process can run bfloat16 on the CPU."""

    NATIVE = "native"        # AVX512-BF16 or AMX instructions
    EMULATED = "emulated"    # AVX-512 without bf16 instructions: runs, slower than float32
    NONE = "none"            # no bf16 kernels at all (below AVX-512, or capped there)


@dataclass(frozen=True)
class Capability:
    """What this machine can execute.

    Attributes
    ----------
    gpus : int
        GPUs MXNet sees (float16 runs there).
    bf16 : Bf16
    isa : str
        The highest oneDNN ISA in effect (CPU flags, capped by ``DNNL_MAX_CPU_ISA``).
    why : str
        Why ``bf16`` is what it is, naming the CPU feature or setting.
    amx_hint : str or None
        Set where the CPU has AMX this process cannot use: what would enable it.
    """

    gpus: int
    bf16: Bf16
    isa: str
    why: str
    amx_hint: Optional[str] = None


def cpu_isa(flags: FrozenSet[str], amx_granted: bool) -> str:
    """The highest oneDNN ISA these ``/proc/cpuinfo`` flags support."""
    if amx_granted and {"amx_bf16", "amx_tile"} <= flags:
        return "AVX512_CORE_AMX"
    if "avx512_bf16" in flags:
        return "AVX512_CORE_BF16"
    if "avx512f" in flags:
        return "AVX512_CORE_VNNI" if "avx512_vnni" in flags else "AVX512_CORE"
    for name in ("avx2", "avx", "sse4_1"):
        if name in flags:
            return {"avx2": "AVX2", "avx": "AVX", "sse4_1": "SSE41"}[name]
    return "SSE41"


#: What oneDNN 2.4 runs where ``DNNL_MAX_CPU_ISA`` names no ISA: everything but AMX, its opt-in.
_DEFAULT_MAX = "AVX512_CORE_BF16"
_AMX = "AVX512_CORE_AMX"


def cap_in_force(cap: Optional[str]) -> str:
    """The ISA cap oneDNN 2.4 applies for a ``DNNL_MAX_CPU_ISA`` value.

    It matches the value exactly, case included (measured with MXNet 1.9.1's oneDNN 2.4.4 on an
    AMX host: ``avx2``, ``Avx2`` and `` AVX2`` cap nothing). Any other value, none, an empty one
    and ``ALL`` give its default, every ISA but AMX: AMX runs only where the value is exactly
    ``AVX512_CORE_AMX``.
    """
    return cap if cap in _RANK and cap != "ALL" else _DEFAULT_MAX


def effective_isa(cpu: str, cap: Optional[str]) -> str:
    """``cpu`` limited by the cap oneDNN 2.4 applies for a ``DNNL_MAX_CPU_ISA`` value."""
    return min(cpu, cap_in_force(cap), key=_RANK.__getitem__)


def classify(flags: FrozenSet[str], amx_granted: bool, isa_cap: Optional[str], gpus: int = 0,
             probe_error: Optional[str] = None, onednn_first: bool = False) -> Capability:
    """Build a :class:`Capability` from CPU flags, the ISA cap and the probe's outcome.

    ``probe_error`` is the message of a failed bf16 probe (``None``: it ran). A failed
    probe means no bf16 whatever the flags say; a passing one on a CPU whose flags show
    no AVX-512 (another architecture) counts as emulated: it runs, speed unknown.
    ``onednn_first``: oneDNN read its ISA cap before gluon_amp could set it (``isa_cap`` is
    then what it read), which only the hint tells apart.
    """
    cpu = cpu_isa(flags, amx_granted)
    isa = effective_isa(cpu, isa_cap)
    capped = isa != cpu
    rank = _RANK[isa]
    if probe_error is not None:
        return Capability(gpus, Bf16.NONE, isa, _why_none(cpu, isa, capped, probe_error))
    if rank >= _FIRST_BF16:
        return Capability(gpus, Bf16.NATIVE, isa, f"oneDNN runs bfloat16 natively ({isa.lower()})",
                          amx_hint(flags, amx_granted, isa_cap, onednn_first))
    if rank >= _FIRST_AVX512:
        cause = (f"DNNL_MAX_CPU_ISA={isa_cap} caps oneDNN below AVX512_CORE_BF16" if capped else
                 "this CPU has AVX-512 but neither avx512_bf16 nor amx_bf16")
        return Capability(gpus, Bf16.EMULATED, isa, f"{cause}: bfloat16 runs emulated, slower than float32")
    return Capability(gpus, Bf16.EMULATED, isa, "a bf16 probe ran although the CPU flags show no "
                      "AVX-512 (not x86?): bfloat16 executes, its speed is unknown")


def _why_none(cpu: str, isa: str, capped: bool, probe_error: str) -> str:
    if capped and _RANK[isa] < _FIRST_AVX512 <= _RANK[cpu]:
        cause = (f"DNNL_MAX_CPU_ISA={isa} caps oneDNN below AVX-512, where MXNet 1.9's oneDNN has "
                 "no bfloat16 kernels; unset DNNL_MAX_CPU_ISA to use them")
    elif _RANK[cpu] < _FIRST_AVX512:
        cause = (f"this CPU lacks avx512f (best ISA {cpu.lower()}), and MXNet 1.9's oneDNN has no "
                 f"bfloat16 kernels below AVX-512; {_FAST_HW} would enable mixed precision")
    else:
        cause = "a bfloat16 convolution could not run on this machine"
    return f"{cause} (probe: {probe_error})"


def amx_hint(flags: FrozenSet[str], amx_granted: bool, isa_cap: Optional[str],
             onednn_first: bool = False) -> Optional[str]:
    """What would enable AMX, where this CPU has it but this process cannot use it.

    ``isa_cap`` is ``DNNL_MAX_CPU_ISA`` as oneDNN reads it (``enable_amx`` sets it to
    ``AVX512_CORE_AMX`` where the user left it unset or empty). ``onednn_first``: oneDNN read
    it at an operator MXNet ran before gluon_amp was imported, so it never saw that value.

    ``avx512_fp16`` first shipped with AMX (Intel Sapphire Rapids), so a CPU showing it
    without ``amx_tile``/``amx_bf16`` has AMX that is hidden: by a hypervisor's CPU model, or
    by a kernel older than 5.16 (which cannot switch the tile state on). Flags present but
    permission refused means the kernel said no.
    """
    if {"amx_bf16", "amx_tile"} <= flags and not amx_granted:
        return ("this CPU has AMX, but the kernel did not grant it to this process "
                "(arch_prctl(ARCH_REQ_XCOMP_PERM) needs Linux 5.16 or newer, and GLUON_AMP_DISABLE_AMX "
                "must be unset); with AMX, bfloat16 runs several times faster")
    if {"amx_bf16", "amx_tile"} <= flags and onednn_first and cap_in_force(isa_cap) != _AMX:
        return ("this CPU has AMX, but MXNet ran an operator before gluon_amp was imported, and MXNet's "
                "oneDNN 2.4 chose its kernels then, without AMX (it takes AMX only if asked before its "
                "first operator), for the rest of this process; import gluon_amp before MXNet runs "
                "anything (or start the program with python -m gluon_amp.run), with which bfloat16 "
                "runs several times faster")
    if {"amx_bf16", "amx_tile"} <= flags and cap_in_force(isa_cap) != _AMX:
        return (f"this CPU has AMX, but DNNL_MAX_CPU_ISA={isa_cap!r} keeps MXNet's oneDNN 2.4 off it "
                f"(it uses AMX only where the value is exactly {_AMX!r}, case included; any other "
                "value, 'ALL' too, means every ISA but AMX); unset it and gluon_amp enables AMX, "
                "with which bfloat16 runs several times faster")
    if "avx512_fp16" in flags and not flags & {"amx_bf16", "amx_tile"}:
        return ("this CPU (AVX512-FP16: Intel Sapphire Rapids or newer) has AMX, which is not exposed "
                "to this process (no amx_bf16 flag in /proc/cpuinfo); with AMX, bfloat16 runs several "
                "times faster. AMX needs Linux 5.16 or newer and, in a virtual machine, a CPU model "
                "that passes AMX through (e.g. KVM/QEMU '-cpu host', or an AMX-enabled instance type)")
    return None
