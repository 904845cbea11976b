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
    #: runs right, but slower than float32 with the casts around it (timed: :mod:`gluon_amp_core.kernel_speed`)
    SLOW = "slow"
    #: beyond the bound of FP32, but MXNet's FP32 itself disagrees with float64 or with itself run
    #: again: what MXNet's float32 does, not the dtype's fault (a plan keeps the op's class)
    FP32_WRONG = "fp32_wrong"

    def __str__(self) -> str:
        return self.value


#: How far a low-precision result may be from FP32's: the relative max error
#: ``max|low - ref| / max|ref|``, where ``ref`` is FP32 run on the same inputs rounded to the
#: dtype (so what rounding the inputs costs is not counted; an ill-conditioned op is not
#: "wrong"). Rounding the output costs 2**-9 (bfloat16) or 2**-12 (float16); the bound allows
#: 16 times that for a kernel's own arithmetic (a short accumulation in the dtype). A kernel that
#: accumulates a long reduction in the dtype is beyond it (AdaptiveAvgPooling2D: 31% on 16x16).
BOUNDS: Mapping[str, float] = MappingProxyType({"bfloat16": 2.0 ** -5, "float16": 2.0 ** -8})

#: How far MXNet's FP32 reference may be from its float64 run, or from itself run again, before
#: the reference is not trusted to judge a low dtype: well inside both :data:`BOUNDS` (FP32 against
#: float64 on these small inputs is ~1e-7), so a reference this far off is itself wrong.
REFERENCE_BOUND = 2.0 ** -10

#: The rules the harness judges by, recorded in each generated facts module (``RULES``; a module
#: without one was judged by rules 1). 1: the backward in predict mode only, against FP32 unchecked.
#: 2: the FP32 reference checked (float64, a second run) before a dtype is blamed; the forward in
#: both modes and the train-mode backward decide, the predict-mode backward is recorded.
RULES = 2

#: The autograd modes a backward runs in. ``train`` (``autograd.record()``'s default) is what
#: training uses and decides the verdict; ``predict`` (``record(train_mode=False)``) is recorded.
MODES = ("train", "predict")

#: Facts about a whole device kind. ``any``: type inference, the same on every device.
DEVICE_ANY = "any"
DEVICE_CPU = "cpu"

#: The verdicts the conformance harness gives (``slow`` is a timing's: :mod:`gluon_amp_core.kernel_speed`)
CONFORMANCE_VERDICTS = tuple(v for v in Verdict if v is not Verdict.SLOW)

#: The devices whose facts a plan for each target dtype follows. bfloat16 runs on CPUs (MXNet
#: 1.9 has no GPU bfloat16 kernels); float16 runs on GPUs, whose kernels nobody here has run:
#: a float16 plan follows only facts that hold on every device.
PLAN_DEVICES: Mapping[str, Tuple[str, ...]] = MappingProxyType(
    {"bfloat16": (DEVICE_ANY, DEVICE_CPU), "float16": (DEVICE_ANY,)})

SEVERITY: Mapping[Verdict, int] = MappingProxyType(
    {Verdict.OK: 0, Verdict.FP32_WRONG: 1, Verdict.NEEDS_UNIFORM_INPUTS: 2, Verdict.SLOW: 3, Verdict.WRONG: 4,
     Verdict.NO_KERNEL: 5})

#: Verdicts that change nothing in a plan: float32 would be no better (``fp32_wrong``)
NO_RULE = frozenset({Verdict.OK, Verdict.FP32_WRONG})


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
        The largest relative error against FP32 measured, where the op ran (the parts that
        decide the verdict: forward in both modes, backward in train mode).
    note : str
        What MXNet said, or what was run.
    backward : tuple of (mode, Verdict, error)
        The backward's verdict and error in each autograd mode (:data:`MODES`), where measured.
    """

    op: str
    dtype: str
    verdict: Verdict
    device: str
    host: str
    error: Optional[float] = None
    note: str = ""
    backward: Tuple[Tuple[str, Verdict, Optional[float]], ...] = ()


def fact_from_row(row: Tuple) -> Fact:
    """A fact from the data files' tuple ``(op, dtype, verdict, device, host, error, note)``,
    optionally followed by the backward per mode, ``((mode, verdict, error), ...)``."""
    if len(row) not in (7, 8):
        raise ValueError(f"a fact row has 7 or 8 fields (op, dtype, verdict, device, host, error, note"
                         f"[, backward]), got {len(row)}: {row!r}")
    op, dtype, verdict, device, host, error, note = row[:7]
    backward = tuple((m, Verdict(v), e) for m, v, e in (row[7] if len(row) == 8 else ()))
    return Fact(op, dtype, Verdict(verdict), device, host, error, note, backward)


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most restrictive verdict (no kernel, wrong, slow, needs uniform inputs, fp32 wrong, ok)."""
    return max(verdicts, key=SEVERITY.__getitem__, default=Verdict.OK)


def plan_verdicts(facts: Iterable[Fact], target_dtype: str) -> Mapping[str, Verdict]:
    """Op -> the verdict a plan for ``target_dtype`` follows: the worst of the facts for that
    dtype on the devices it runs on (:data:`PLAN_DEVICES`); ops whose verdict changes nothing
    (``ok``, ``fp32_wrong``: :data:`NO_RULE`) left out.

    The worst, because a kernel right on one host and wrong on another is wrong somewhere a
    plan may run.
    """
    found = _worst_per_op(facts, target_dtype, PLAN_DEVICES.get(target_dtype, ()))
    return MappingProxyType({op: v for op, v in found.items() if v not in NO_RULE})


def _worst_per_op(facts: Iterable[Fact], dtype: str, devices: Iterable[str]) -> Dict[str, Verdict]:
    """Op -> the worst of its facts for ``dtype`` on ``devices``, by op name."""
    kinds = frozenset(devices)
    found: Dict[str, Verdict] = {}
    for f in facts:
        if f.dtype == dtype and f.device in kinds:
            found[f.op] = worst((found.get(f.op, Verdict.OK), f.verdict))
    return dict(sorted(found.items()))


def device_verdicts(facts: Iterable[Fact], dtype: str, device: str) -> Mapping[str, Verdict]:
    """Op key -> the worst verdict of its facts for ``dtype`` on ``device`` (that device's facts
    and those that hold on every device), every verdict kept: an op absent here was never run
    in ``dtype`` there. What a graph computing in a dtype that is not the plan's target (a
    script's own float16 mask on a bfloat16 CPU) can run, op by op."""
    return MappingProxyType(_worst_per_op(facts, dtype, (DEVICE_ANY, device)))


@dataclass(frozen=True)
class Part:
    """One compared part of one run of an op in a low dtype: its outputs (``forward``) or its
    input gradients (``backward``), in one autograd mode, on one path (API and execution).

    Attributes
    ----------
    path : str
        How it ran (``'legacy/imperative'``, ...).
    name : {'forward', 'backward'}
    mode : {'train', 'predict'}
        ``autograd.record(train_mode=...)`` (:data:`MODES`).
    error : float
        The relative error against FP32 on the same rounded inputs.
    reference_error : float or None
        How far that FP32 reference is from MXNet's float64 run of the op, or from itself run
        again (the larger); None where it was not checked. A part beyond the bound needs it
        (:func:`part_verdict`).
    """

    path: str
    name: str
    mode: str
    error: float
    reference_error: Optional[float] = None

    @property
    def decisive(self) -> bool:
        """Whether this part decides the verdict: every forward, and the train-mode backward
        (what training runs); the predict-mode backward is recorded only."""
        return not (self.name == "backward" and self.mode == "predict")


def part_verdict(part: Part, dtype: str) -> Verdict:
    """``ok`` within the bound; beyond it ``wrong``, or ``fp32_wrong`` where the FP32 reference
    itself is off (:data:`REFERENCE_BOUND`): the low dtype is not blamed for MXNet's float32.

    Raises
    ------
    ValueError
        A part beyond the bound whose reference was not checked: judging it would blame the
        dtype for what may be float32's error.
    """
    if part.error <= BOUNDS[dtype]:  # NaN is beyond any bound
        return Verdict.OK
    if part.reference_error is None:
        raise ValueError(
            f"{part.path} {part.mode}-mode {part.name}: error {part.error:.3g} is beyond the {dtype} bound "
            f"{BOUNDS[dtype]:.3g}, but its float32 reference was not checked (reference_error=None); "
            "check it against float64 or against itself run again before judging the dtype wrong")
    if part.reference_error <= REFERENCE_BOUND:
        return Verdict.WRONG
    return Verdict.FP32_WRONG


def backward_by_mode(parts: Iterable[Part], dtype: str) -> Tuple[Tuple[str, Verdict, Optional[float]], ...]:
    """``((mode, verdict, error), ...)``: the backward's worst verdict and largest error per mode."""
    out: Dict[str, Tuple[Verdict, float]] = {}
    for p in parts:
        if p.name != "backward":
            continue
        v, e = out.get(p.mode, (Verdict.OK, 0.0))
        out[p.mode] = (worst((v, part_verdict(p, dtype))), _max_error(e, p.error))
    return tuple((m, *out[m]) for m in MODES if m in out)


def _max_error(a: float, b: float) -> float:
    return b if b != b or b > a else a  # NaN wins


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
    parts : tuple of Part
        Each compared part, per path and autograd mode, with its reference's check. ``error``
        (a reference known to be right) and ``parts`` may be given together; the worst counts.
    """

    refused: Optional[str] = None
    refused_by_types: bool = False
    error: Optional[float] = None
    mixed_refused: Optional[str] = None
    parts: Tuple[Part, ...] = ()


def judge(seen: Observation, dtype: str) -> Tuple[Verdict, str]:
    """The verdict for one observation and the device kind it holds on (``any``/``cpu``).

    Parts decide as :attr:`Part.decisive` says: the predict-mode backward does not. A part beyond
    the bound whose FP32 reference is itself off gives ``fp32_wrong``, ranked below every verdict
    that changes a plan, so a real defect elsewhere still shows.
    """
    if seen.refused is not None:
        return Verdict.NO_KERNEL, DEVICE_ANY if seen.refused_by_types else DEVICE_CPU
    if seen.error is not None and not seen.error <= BOUNDS[dtype]:  # NaN is beyond any bound
        return Verdict.WRONG, DEVICE_CPU
    found = worst(part_verdict(p, dtype) for p in seen.parts if p.decisive)
    if found is Verdict.WRONG:
        return Verdict.WRONG, DEVICE_CPU
    if seen.mixed_refused is not None:
        return Verdict.NEEDS_UNIFORM_INPUTS, DEVICE_ANY
    return found, DEVICE_CPU


def decisive_error(seen: Observation) -> Optional[float]:
    """The largest error of the parts that decide the verdict (and ``error``), or None."""
    errors = [p.error for p in seen.parts if p.decisive] + ([seen.error] if seen.error is not None else [])
    out: Optional[float] = None
    for e in errors:
        out = e if out is None else _max_error(out, e)
    return out
