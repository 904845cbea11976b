"""CPU feature detection and the AMX fast path for bfloat16 on oneDNN.

oneDNN only uses AMX tiles when (a) Linux has granted the process permission to use the
XTILEDATA state, which it does on request through ``arch_prctl``, and (b) the CPU ISA it
is allowed to use includes AMX. Asking for (b) without (a) kills the process with
SIGILL, so we ask the kernel first and only then widen the ISA, before the first oneDNN
primitive is created (it reads ``DNNL_MAX_CPU_ISA`` once).
"""
from __future__ import annotations

import ctypes
import os
import platform
import warnings
from typing import Any, Dict, FrozenSet

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AMX_ISA = "AVX512_CORE_AMX"

_state: Dict[str, Any] = {"amx_permission": None, "isa_set_by": None, "error": None}


def cpu_flags() -> FrozenSet[str]:
    """Flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _request_amx_permission() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        _state["error"] = f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed: errno {ctypes.get_errno()}"
    return rc == 0


def enable_amx() -> bool:
    """Let oneDNN use AMX when the CPU has it and the kernel grants it. Idempotent.

    Never raises: on any other CPU or OS, or if the user already chose
    ``DNNL_MAX_CPU_ISA``, it leaves things as they are and returns False.
    Set ``GLUON_AMP_DISABLE_AMX=1`` to skip it.
    """
    if _state["amx_permission"] is not None:
        return bool(_state["amx_permission"])
    ok = False
    try:
        if (os.environ.get("GLUON_AMP_DISABLE_AMX") != "1" and platform.system() == "Linux"
                and platform.machine() in ("x86_64", "AMD64")
                and {"amx_bf16", "amx_tile"} <= cpu_flags()):
            ok = _request_amx_permission()
            if ok and "DNNL_MAX_CPU_ISA" not in os.environ:
                os.environ["DNNL_MAX_CPU_ISA"] = _AMX_ISA
                _state["isa_set_by"] = "gluon_amp"
            elif "DNNL_MAX_CPU_ISA" in os.environ:
                _state["isa_set_by"] = _state["isa_set_by"] or "user"
    except Exception as exc:  # pragma: no cover - depends on the platform
        _state["error"] = repr(exc)
        ok = False
    _state["amx_permission"] = ok
    return ok


def has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_target(target_dtype: str) -> None:
    """Warn when bfloat16 is chosen on a CPU without native bfloat16 instructions."""
    if target_dtype == "bfloat16" and cpu_flags() and not has_fast_bf16():
        warnings.warn(
            "This CPU has neither avx512_bf16 nor amx_bf16: bfloat16 ops are emulated and "
            "will be slower than float32. Use gluon_amp only for numerics checks here.",
            RuntimeWarning, stacklevel=3)


def runtime_info() -> Dict[str, Any]:
    """What gluon_amp found and chose on this machine."""
    import mxnet as mx
    flags = cpu_flags()
    features = mx.runtime.Features()
    gpus = mx.context.num_gpus()
    if _state["amx_permission"]:
        isa = "avx512_core_amx"
    elif "avx512_bf16" in flags:
        isa = "avx512_core_bf16"
    else:
        isa = "no native bfloat16"
    return {
        "mxnet": mx.__version__,
        "onednn": features.is_enabled("MKLDNN"),
        "gpus": gpus,
        "default_target_dtype": "float16" if gpus > 0 else "bfloat16",
        "cpu_avx512_bf16": "avx512_bf16" in flags,
        "cpu_amx_bf16": "amx_bf16" in flags,
        "amx_permission": bool(_state["amx_permission"]),
        "DNNL_MAX_CPU_ISA": os.environ.get("DNNL_MAX_CPU_ISA"),
        "isa_set_by": _state["isa_set_by"],
        "bf16_isa": isa,
        "error": _state["error"],
    }
