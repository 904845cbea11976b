"""Op conformance verdicts: what MXNet's kernels do in a low dtype, as data. Pure.

A :class:`Fact` says how one op behaved in one low dtype on one host (the conformance harness,
``python -m gluon_amp.conformance``, measures them; facts this machine cannot produce are
recorded with the host that did). :func:`plan_verdicts` folds the facts that hold for a target
into one verdict per op; :func:`gluon_amp_core.table.build_table` puts them in the op table, so
:func:`gluon_amp_core.decide.decide` (and so patching, the converters, emulation and the report)
runs an op without a working kernel in float32, and gives an op that needs uniform inputs
one float dtype.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, Iterable, Mapping, Optional, Tuple


class Verdict(str, enum.Enum):
    """One op's conformance in one low dtype."""

    OK = "ok"                        # runs, forward and backward, within the dtype's bound of FP32
    NO_KERNEL = "no_kernel"          # MXNet refuses the dtype (no kernel, or type inference fails)
    WRONG = "wrong"                  # runs, but beyond the dtype's bound of FP32
    NEEDS_UNIFORM_INPUTS = "needs_uniform_inputs"  # runs in the dtype, but not with mixed float inputs

    def __str__(self) -> str:
        return self.value


#: How far a low-precision result may be from FP32's: the relative max error
#: ``max|low - ref| / max|ref|``, where ``ref`` is FP32 run on the same inputs rounded to the
#: dtype (so what rounding the inputs costs is not counted; an ill-conditioned op is not
#: "wrong"). Rounding the output costs 2**-9 (bfloat16) or 2**-12 (float16); the bound allows
#: 16 times that for a kernel's own arithmetic (a short accumulation in the dtype). A kernel that
#: accumulates a long reduction in the dtype is beyond it (AdaptiveAvgPooling2D: 31% on 16x16).
BOUNDS: Mapping[str, float] = MappingProxyType({"bfloat16": 2.0 ** -5, "float16": 2.0 ** -8})

#: Facts about a whole device kind. ``any``: type inference, the same on every device.
DEVICE_ANY = "any"
DEVICE_CPU = "cpu"

#: The devices whose facts a plan for each target dtype follows. bfloat16 runs on CPUs (MXNet
#: 1.9 has no GPU bfloat16 kernels); float16 runs on GPUs, whose kernels nobody here has run:
#: a float16 plan follows only facts that hold on every device.
PLAN_DEVICES: Mapping[str, Tuple[str, ...]] = MappingProxyType(
    {"bfloat16": (DEVICE_ANY, DEVICE_CPU), "float16": (DEVICE_ANY,)})

SEVERITY: Mapping[Verdict, int] = MappingProxyType(
    {Verdict.OK: 0, Verdict.NEEDS_UNIFORM_INPUTS: 1, Verdict.WRONG: 2, Verdict.NO_KERNEL: 3})


@dataclass(frozen=True)
class Host:
    """A machine that produced facts, and how."""

    key: str
    cpu: str
    flags: str
    mxnet: str
    command: str


@dataclass(frozen=True)
class Fact:
    """One op in one low dtype on one host.

    Attributes
    ----------
    op : str
        The registered op name.
    dtype : {'float16', 'bfloat16'}
    verdict : Verdict
    device : {'any', 'cpu'}
        ``any`` for what type inference decides (every device agrees), ``cpu`` for a CPU kernel.
    host : str
        Key of the :class:`Host` that produced it.
    error : float or None
        The largest relative error against FP32 measured, where the op ran.
    note : str
        What MXNet said, or what was run.
    """

    op: str
    dtype: str
    verdict: Verdict
    device: str
    host: str
    error: Optional[float] = None
    note: str = ""


def fact_from_row(row: Tuple) -> Fact:
    """A fact from the data files' tuple ``(op, dtype, verdict, device, host, error, note)``."""
    op, dtype, verdict, device, host, error, note = row
    return Fact(op, dtype, Verdict(verdict), device, host, error, note)


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most restrictive verdict (no kernel, wrong, needs uniform inputs, ok)."""
    return max(verdicts, key=SEVERITY.__getitem__, default=Verdict.OK)


def plan_verdicts(facts: Iterable[Fact], target_dtype: str) -> Mapping[str, Verdict]:
    """Op -> the verdict a plan for ``target_dtype`` follows: the worst of the facts for that
    dtype on the devices it runs on (:data:`PLAN_DEVICES`); ops whose verdict is ``ok`` left out.

    The worst, because a kernel right on one host and wrong on another is wrong somewhere a
    plan may run.
    """
    devices = PLAN_DEVICES.get(target_dtype, ())
    found: Dict[str, Verdict] = {}
    for f in facts:
        if f.dtype == target_dtype and f.device in devices:
            found[f.op] = worst((found.get(f.op, Verdict.OK), f.verdict))
    return MappingProxyType({op: v for op, v in sorted(found.items()) if v is not Verdict.OK})


@dataclass(frozen=True)
class Observation:
    """What the harness saw of one op in one low dtype (the MXNet layer runs it; this is data).

    Attributes
    ----------
    refused : str or None
        MXNet's message when it refused the op with every float input in the dtype.
    refused_by_types : bool
        The refusal came from type inference (the same on every device), not a kernel.
    error : float or None
        The largest relative error of the op's outputs and input gradients against FP32 on
        the same rounded inputs (:data:`BOUNDS`), when it ran.
    mixed_refused : str or None
        MXNet's message for a mix of the dtype and float32 inputs it refused, when
        MXNet's type inference cannot give the other inputs the first one's dtype either
        (so no cast to the first input's dtype helps: the inputs must be made uniform).
    """

    refused: Optional[str] = None
    refused_by_types: bool = False
    error: Optional[float] = None
    mixed_refused: Optional[str] = None


def judge(seen: Observation, dtype: str) -> Tuple[Verdict, str]:
    """The verdict for one observation and the device kind it holds on (``any``/``cpu``)."""
    if seen.refused is not None:
        return Verdict.NO_KERNEL, DEVICE_ANY if seen.refused_by_types else DEVICE_CPU
    if seen.error is not None and not seen.error <= BOUNDS[dtype]:  # NaN is beyond any bound
        return Verdict.WRONG, DEVICE_CPU
    if seen.mixed_refused is not None:
        return Verdict.NEEDS_UNIFORM_INPUTS, DEVICE_ANY
    return Verdict.OK, DEVICE_CPU
