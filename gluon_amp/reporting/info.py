"""``runtime_info()``: what gluon_amp found on this machine, and how AMP runs now."""
from __future__ import annotations

from typing import Any, Dict

from gluon_amp_core.capability import Bf16
from gluon_amp_core.resolve import Resolution

from .. import _numpy_shim, emulation_kernel, runtime
from ..patching import current_policy, tuning_info
from ..speed import probe
from ..tuning import schedule


def runtime_info() -> Dict[str, Any]:
    """What gluon_amp found on this machine and what ``target_dtype=None`` picks, with why."""
    import mxnet as mx
    flags = runtime.cpu_flags()
    cap = runtime.capability()
    default = runtime.resolve(None, warn=False)
    return {
        "mxnet": mx.__version__,
        "onednn": runtime.has_onednn(),
        "gpus": cap.gpus,
        "default_target_dtype": default.dtype,
        "default_why": default.warning,
        "speed": _speed(default),
        "tune": _tune(),
        "amx_hint": cap.amx_hint,
        "bf16": cap.bf16.value,
        "bf16_why": cap.why,
        "onednn_isa": cap.isa.lower(),
        "cpu_avx512f": "avx512f" in flags,
        "cpu_avx512_bf16": "avx512_bf16" in flags,
        "cpu_amx_bf16": "amx_bf16" in flags,
        "amx_permission": bool(runtime._state["amx_permission"]),
        "DNNL_MAX_CPU_ISA": runtime.isa_cap(),
        "isa_set_by": runtime._state["isa_set_by"],
        "bf16_isa": cap.isa.lower() if cap.bf16 is Bf16.NATIVE else f"no native bfloat16 ({cap.bf16.value})",
        "error": runtime._state["error"],
        "mode": amp_mode(),
        "emulation_kernel": _emulation_kernel(),
        "numpy_shim": _numpy_shim.status(),
        "threads": runtime.thread_use().to_dict(),
    }


def _speed(default: Resolution) -> Dict[str, Any]:
    """The probe's figures and the decision they gave, or why no probe ran."""
    if default.speed is not None:
        return {**default.speed.to_dict(), "decision": default.dtype}
    cap = runtime.capability()
    if cap.gpus > 0:
        why = "not run: a GPU (float16) is taken as faster"
    elif cap.bf16 is not Bf16.NATIVE:
        why = f"not run: no native bfloat16 kernels to time ({cap.bf16.value}); the flag rule decides"
    else:
        why = f"not run: {probe.ENV}=0; the flag rule decides"
    return {"source": why, "decision": default.dtype}


def _tune() -> Dict[str, Any]:
    """What tuning spent in this process, against which budget, and where each graph stands."""
    got = tuning_info()
    if got is not None:
        return got
    policy = current_policy()
    why = ("AMP is off" if policy is None else
           "emulate=True" if policy.emulate else "tune=False (or GLUON_AMP_TUNE=0)")
    return {"status": f"not tuning during training: {why}", **schedule.process_ledger().to_dict(schedule.clock())}


def _emulation_kernel() -> Dict[str, Any]:
    """How emulation rounds (``path``: ``'kernel'``, ``'fallback'`` or ``'not used yet'``), and
    why. Under ``emulate=True`` it is decided (and the kernel built, the first time) here."""
    status = emulation_kernel.load() if amp_mode() == "emulated" else emulation_kernel.status()
    return status.to_dict()


def amp_mode() -> str:
    """How AMP runs now: ``'off'``, ``'native'`` (real low-precision kernels), ``'emulated'``
    (``emulate=True``: float32 with the target's rounding) or ``'cannot execute'`` (an
    explicit target this CPU has no kernels for: graphs build, running raises)."""
    policy = current_policy()
    if policy is None:
        return "off"
    if policy.emulate:
        return "emulated"
    return "native" if runtime.executable(policy.target_dtype, "cpu") or runtime.capability().gpus else "cannot execute"
