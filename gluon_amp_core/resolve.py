"""Which target dtype AMP uses here: capability plus measured speed give a resolution. Pure.

``target_dtype=None`` turns a low dtype on only where it executes natively and, on a CPU,
where the speed probe measured it faster (:class:`~gluon_amp_core.speed.probe.SpeedVerdict`);
otherwise AMP stays in float32 with one message saying why and how to force the dtype. An
explicit dtype is obeyed, with a message when it cannot run or was measured slower.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .capability import _FAST_HW, Bf16, Capability
from .dtypes import LOW_PRECISION_DTYPES, parse_target_dtype
from .speed.probe import MIN_SPEEDUP, SpeedVerdict

#: What to do about a target this machine cannot execute, for numerics.
EMULATE_HINT = ("Pass emulate=True to run the same plan emulated in float32 on this CPU "
                "(the target's rounding, for numerics; not faster).")


@dataclass(frozen=True)
class Resolution:
    """The dtype AMP will use, and what to tell the user about it.

    ``dtype`` is ``'float32'`` when no useful low precision exists (AMP stays off).
    ``executable`` is False when the dtype cannot run on this machine (graph work only).
    ``speed`` is the probe's verdict the choice rests on, where one was measured.
    """

    dtype: str
    warning: Optional[str]
    executable: bool = True
    speed: Optional[SpeedVerdict] = None


def _force(dtype: str) -> str:
    return (f"To use it anyway, pass target_dtype={dtype!r} (benchmarks and CLIs: --target-dtype {dtype}); "
            "set GLUON_AMP_SPEED_PROBE=0 to choose by CPU flags alone.")


def resolve_target(requested: object, cap: Capability, speed: Optional[SpeedVerdict] = None) -> Resolution:
    """Choose the target dtype for ``requested`` (``None``: pick for this machine).

    Parameters
    ----------
    requested : str, dtype or None
    cap : Capability
    speed : SpeedVerdict, optional
        The probe's figures for bfloat16 on this CPU (on a busy machine, its CPU time:
        ``speed.busy``); ``None`` where none were measured (a GPU, no native bfloat16, or
        the probe turned off): the flags decide alone.

    ``None`` never picks a dtype this machine cannot execute, nor bfloat16 where it is
    emulated or measured slower than float32: then AMP stays in float32. Raises
    ``ValueError`` for a dtype that is not ``float16``/``bfloat16``.
    """
    hint = f" Note: {cap.amx_hint}." if cap.amx_hint else ""
    if requested is None:
        if cap.gpus > 0:
            return Resolution("float16", None)
        if cap.bf16 is Bf16.NATIVE:
            if speed is not None and not speed.faster:
                return Resolution("float32", f"gluon_amp: mixed precision is off, training and inference stay "
                                             f"in float32: {speed.describe()}; AMP turns it on from "
                                             f"{MIN_SPEEDUP:.2f}x.{hint} {_force('bfloat16')}", speed=speed)
            return Resolution("bfloat16", None, speed=speed)
        return Resolution("float32", f"gluon_amp: mixed precision is off, training and inference "
                                     f"stay in float32: {cap.why}.")
    dtype = requested if requested in LOW_PRECISION_DTYPES else parse_target_dtype(requested)  # parsed once
    if dtype == "float16" and cap.gpus == 0:
        return Resolution(dtype, "gluon_amp: target_dtype='float16' without a GPU: MXNet's CPU build "
                                 "has no float16 convolution or GEMM. Graph building, type inference "
                                 f"and conversion work; running float16 ops needs a GPU. {EMULATE_HINT}", False)
    if dtype == "bfloat16" and cap.bf16 is Bf16.NONE:
        return Resolution(dtype, f"gluon_amp: target_dtype='bfloat16' cannot execute here: {cap.why}. "
                                 "Graph building, type inference and conversion still work; running "
                                 f"a bfloat16 convolution or dense layer cannot. {EMULATE_HINT}", False)
    if dtype == "bfloat16" and cap.bf16 is Bf16.EMULATED:
        return Resolution(dtype, f"gluon_amp: target_dtype='bfloat16': {cap.why}. Use it for numerics "
                                 f"checks; {_FAST_HW} runs it fast.")
    if dtype == "bfloat16" and speed is not None and not speed.faster:
        return Resolution(dtype, f"gluon_amp: target_dtype='bfloat16' as asked, though {speed.describe()}."
                                 f"{hint} With tune=True (the default) a graph runs float32 until it is "
                                 "measured faster as a whole (tune=False runs the plan as it is).",
                          speed=speed)
    return Resolution(dtype, None, speed=speed)
