"""The op table: which precision class each operator belongs to, per target dtype.

The data lives in ``gluon_amp_core.lists.<dtype>``; this module builds an immutable
``OpTable`` from it, applies user overrides and rejects overlaps and unknown names.
Pure: it needs no MXNet (the registry is passed in as ``known_ops``/``aliases``).
"""
from __future__ import annotations

import difflib
import enum
import functools
import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from .dtypes import LOW_PRECISION_DTYPES
from .shape_limits import NarrowRule, OddChannelsRule, OutputPixelsRule, ShapeRule
from .kernel_speed import Timing, slow_verdicts, timing_from_row
from .verdicts import Fact, Verdict, device_verdicts, fact_from_row, plan_verdicts, worst


class OpListError(ValueError, AssertionError):
    """A mistake in an op list (an unknown op, an op in two lists). A ``ValueError``, and an
    ``AssertionError`` too, for code written against the peer (MXNet's own AMP module), which asserted."""


class OpListTypeError(TypeError, AssertionError):
    """An op list of the wrong type. A ``TypeError``, and an ``AssertionError`` as above."""


class OpClass(enum.Enum):
    """Precision class of an operator."""

    LOW_PRECISION = "low_precision"
    FP32 = "fp32"
    CONDITIONAL_FP32 = "conditional_fp32"
    WIDEST = "widest"
    NEUTRAL = "neutral"


@dataclass(frozen=True)
class ConditionalRule:
    """Run the op in float32 when ``attrs[attr]`` is one of ``values``; else neutral."""

    attr: str
    values: frozenset


ConditionalSpec = Tuple[str, str, Sequence[str]]

_BATCHNORM_OPS = ("BatchNorm", "_contrib_BatchNormWithReLU")


@dataclass(frozen=True)
class OpTable:
    """Immutable classification of every operator for one target dtype."""

    target_dtype: str
    classes: Mapping[str, OpClass]
    conditions: Mapping[str, ConditionalRule] = field(default_factory=dict)
    keep_fp32_inputs: Mapping[str, frozenset] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    #: low-precision op -> the input-shape rules that keep it in float32 (its kernel's limits,
    #: :mod:`gluon_amp_core.shape_limits`)
    narrow_fp32: Mapping[str, Tuple[ShapeRule, ...]] = field(default_factory=dict)
    #: widest op -> the most inputs its kernel in the target dtype takes; with more it runs in
    #: float32 where it would run in the target (a kernel's limit, as ``narrow_fp32``)
    fp32_above_inputs: Mapping[str, int] = field(default_factory=dict)
    #: op whose kernel is slow -> the op and attributes computing the same on inputs of one shape
    #: (:mod:`gluon_amp_core.same_shape`)
    same_shape_twins: Mapping[str, Tuple[str, Tuple[Tuple[str, str], ...]]] = field(default_factory=dict)
    #: op -> the conformance verdict that set its class (:mod:`gluon_amp_core.verdicts`): no kernel
    #: or wrong in the target dtype -> float32; needs uniform inputs -> the widest input type
    verdicts: Mapping[str, Verdict] = field(default_factory=dict)

    def canonical(self, op: str) -> str:
        """Resolve an alias (``'concat'``) to the registered op name (``'Concat'``)."""
        return self.aliases.get(op, op)

    def class_of(self, op: str) -> OpClass:
        """Class of ``op`` (aliases resolved). Raises :class:`OpListError` for unknown names."""
        name = self.canonical(op)
        try:
            return self.classes[name]
        except KeyError:
            raise OpListError(_unknown_message(op, self.known_names(), "op table")) from None

    def names(self, op_class: OpClass) -> Tuple[str, ...]:
        """Sorted canonical names in one class."""
        return tuple(sorted(n for n, c in self.classes.items() if c is op_class))

    def known_names(self) -> frozenset:
        return frozenset(self.classes) | frozenset(self.aliases)


def _unknown_message(name: str, valid: Iterable[str], where: str) -> str:
    near = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return (f"{name!r} is not an operator known to the {where}.{hint} "
            "See gluon_amp.list_lp16_ops() and friends, or docs/op_reference.md, for valid names.")


def _load_lists(target_dtype: str):
    return importlib.import_module(f"{__package__}.lists.{target_dtype}")


@functools.lru_cache(maxsize=None)
def _recorded_facts() -> Tuple[Fact, ...]:
    """The facts of ``lists/verdicts.py``, read once."""
    return tuple(fact_from_row(r) for r in importlib.import_module(f"{__package__}.lists.verdicts").FACTS)


@functools.lru_cache(maxsize=None)
def _recorded_timings() -> Tuple[Timing, ...]:
    """The kernel timings of ``lists/kernel_speed.py``, read once."""
    return tuple(timing_from_row(r) for r in importlib.import_module(f"{__package__}.lists.kernel_speed").TIMINGS)


@functools.lru_cache(maxsize=None)
def default_verdicts(target_dtype: str) -> Mapping[str, Verdict]:
    """The verdicts a ``target_dtype`` plan follows: from the recorded conformance facts
    (``lists/verdicts.py``), and ``slow`` from the recorded kernel timings
    (``lists/kernel_speed.py``); the worst where both name an op."""
    merged = dict(slow_verdicts(_recorded_timings(), target_dtype))
    for key, verdict in plan_verdicts(_recorded_facts(), target_dtype).items():
        merged[key] = worst((merged.get(key, verdict), verdict))
    return MappingProxyType(dict(sorted(merged.items())))


@functools.lru_cache(maxsize=None)
def kernel_verdicts(dtype: str, device: str) -> Mapping[str, Verdict]:
    """Every op's verdict in ``dtype`` on ``device`` from the recorded facts (see
    :func:`gluon_amp_core.verdicts.device_verdicts`)."""
    return device_verdicts(_recorded_facts(), dtype, device)


def split_key(key: str) -> Tuple[str, Optional[Tuple[str, str]]]:
    """A verdict's key: ``'op'``, or ``'op:attr=value'`` for one value of a conditional attribute."""
    op, _, cond = key.partition(":")
    if not cond:
        return op, None
    attr, _, value = cond.partition("=")
    return op, (attr, value)


def apply_verdicts(classes: Dict[str, OpClass], conditions: Dict[str, ConditionalRule],
                   verdicts: Mapping[str, Verdict], user_named: Iterable[str]) -> Dict[str, Verdict]:
    """Move the ops the verdicts rule out of their class (in place); returns those applied.

    An op with no kernel, or a wrong one, runs in float32 (a widest or neutral op fed a low
    input gets it cast up); an op that needs uniform inputs takes the widest one, unless its class
    already casts every input to one dtype. A slow one (``slow``: its kernel in the target dtype
    timed slower than float32 with its casts, :mod:`gluon_amp_core.kernel_speed`) runs in
    float32 where it would run in the target dtype, and as before in any other dtype (a
    script's own float16 mask stays float16): a neutral one becomes widest, which
    :func:`gluon_amp_core.decide.decide` turns to float32 where the widest is the target. A
    verdict for one value of an attribute (``'Activation:act_type=softsign'``) adds that value
    to the op's conditional float32 rule.
    An op the user put in a list keeps the user's class.
    """
    applied: Dict[str, Verdict] = {}
    named = set(user_named)
    for key, verdict in verdicts.items():
        name, cond = split_key(key)
        have = classes.get(name, OpClass.NEUTRAL)
        if name in named:
            continue
        if verdict is Verdict.SLOW and cond is None:
            if have is OpClass.NEUTRAL:  # decided per call: float32 where it would run in the target dtype
                classes[name] = OpClass.WIDEST
            if have in (OpClass.NEUTRAL, OpClass.WIDEST):
                applied[key] = verdict
        elif verdict in (Verdict.NO_KERNEL, Verdict.WRONG, Verdict.SLOW):
            if cond is not None:
                rule = conditions.get(name)
                if have is OpClass.CONDITIONAL_FP32 and rule is not None and rule.attr == cond[0]:
                    if cond[1] not in rule.values:
                        conditions[name] = ConditionalRule(rule.attr, rule.values | {cond[1]})
                        applied[key] = verdict
                elif have is OpClass.NEUTRAL:
                    classes[name] = OpClass.CONDITIONAL_FP32
                    conditions[name] = ConditionalRule(cond[0], frozenset({cond[1]}))
                    applied[key] = verdict
            elif have is not OpClass.FP32:
                classes[name] = OpClass.FP32
                conditions.pop(name, None)
                applied[key] = verdict
        elif verdict is Verdict.NEEDS_UNIFORM_INPUTS and cond is None and have is OpClass.NEUTRAL:
            classes[name] = OpClass.WIDEST
            applied[key] = verdict
    return applied


def check_name_list(arg: str, value: object, kind: str = "op names") -> Tuple[str, ...]:
    """``value`` as a tuple of names (``kind``: op names, node names, ...);
    :class:`OpListTypeError` (a ``TypeError``) naming ``arg`` otherwise. The one check of
    every list-of-names argument."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise OpListTypeError(f"{arg} must be a list of {kind}, got {type(value).__name__}: {value!r}")
    for v in value:
        if not isinstance(v, str):
            raise OpListTypeError(f"{arg} must contain {kind} (str); got {v!r} of type {type(v).__name__}")
    return tuple(value)


def check_conditional(value: object) -> Tuple[ConditionalSpec, ...]:
    """``value`` as a tuple of ``(op, attr, (values...))``; :class:`OpListTypeError` otherwise."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise OpListTypeError("conditional_fp32_ops must be a list of (op_name, attr_name, [values]) "
                        f"tuples, got {value!r}")
    out = []
    for item in value:
        ok = (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str)
              and isinstance(item[1], str) and isinstance(item[2], (list, tuple))
              and all(isinstance(v, str) for v in item[2]))
        if not ok:
            raise OpListTypeError("each conditional_fp32_ops entry must be (op_name, attr_name, "
                            f"[str values]), e.g. ('Activation', 'act_type', ['softrelu']); got {item!r}")
        out.append((item[0], item[1], tuple(item[2])))
    return tuple(out)


_ARG_NAMES = {OpClass.LOW_PRECISION: "target_precision_ops", OpClass.FP32: "fp32_ops",
              OpClass.WIDEST: "widest_type_ops", OpClass.CONDITIONAL_FP32: "conditional_fp32_ops"}


def _default_classes(target_dtype: str, data: Any) -> Dict[str, OpClass]:
    classes: Dict[str, OpClass] = {}
    lists = (
        (OpClass.LOW_PRECISION, data.LOW_PRECISION),
        (OpClass.FP32, data.FP32),
        (OpClass.CONDITIONAL_FP32, [c[0] for c in data.CONDITIONAL_FP32]),
        (OpClass.WIDEST, data.WIDEST),
        (OpClass.NEUTRAL, data.NEUTRAL),
    )
    for op_class, names in lists:
        for name in names:
            if name in classes:
                raise ValueError(f"op table for {target_dtype} lists {name!r} as both "
                                 f"{classes[name].value} and {op_class.value}; fix the lists/{target_dtype}.py data")
            classes[name] = op_class
    return classes


def list_classes(target_dtype: str) -> Dict[str, OpClass]:
    """Op -> class as ``lists/<target_dtype>.py`` gives it, before any verdict or override."""
    return _default_classes(target_dtype, _load_lists(target_dtype))


def _valid_names(target_dtype: str, classes: Mapping[str, OpClass], known_ops: Optional[Iterable[str]],
                 aliases: Mapping[str, str]) -> set:
    if known_ops is None:
        return set(classes) | set(aliases)
    known = set(known_ops)
    stale = sorted(n for n in classes if n not in known)
    if stale:
        raise ValueError(f"op table for {target_dtype} names ops this MXNet does not register: "
                         f"{stale[:10]}{' ...' if len(stale) > 10 else ''}")
    return known | set(aliases)


def _resolve_overrides(overrides: Mapping[OpClass, Sequence[str]], valid: set,
                       aliases: Mapping[str, str]) -> Dict[str, OpClass]:
    """Canonical op name -> the class an override puts it in; rejects unknown and doubled names."""
    seen: Dict[str, OpClass] = {}
    for op_class, names in overrides.items():
        for raw in names:
            if raw not in valid:
                raise OpListError(_unknown_message(raw, valid, f"op table ({_ARG_NAMES[op_class]})"))
            name = aliases.get(raw, raw)
            if name in seen and seen[name] is not op_class:
                raise OpListError(f"op {raw!r} is in both {_ARG_NAMES[seen[name]]} and "
                                  f"{_ARG_NAMES[op_class]}; an op can be in one list only: "
                                  "remove it from one of them.")
            seen[name] = op_class
    return seen


def _overrides(target_precision_ops: Optional[Sequence[str]],
               conditional_fp32_ops: Optional[Sequence[ConditionalSpec]],
               fp32_ops: Optional[Sequence[str]],
               widest_type_ops: Optional[Sequence[str]]) -> Dict[OpClass, Sequence[str]]:
    """The override lists given, by the class they put their ops in."""
    overrides: Dict[OpClass, Sequence[str]] = {}
    for op_class, names in ((OpClass.LOW_PRECISION, target_precision_ops), (OpClass.FP32, fp32_ops),
                            (OpClass.WIDEST, widest_type_ops)):
        if names is not None:
            overrides[op_class] = names
    if conditional_fp32_ops is not None:
        overrides[OpClass.CONDITIONAL_FP32] = [c[0] for c in conditional_fp32_ops]
    return overrides


def check_op_lists(
    *,
    target_precision_ops: Optional[Sequence[str]] = None,
    conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
    fp32_ops: Optional[Sequence[str]] = None,
    widest_type_ops: Optional[Sequence[str]] = None,
    known_ops: Optional[Iterable[str]] = None,
    aliases: Optional[Mapping[str, str]] = None,
) -> None:
    """The checks :func:`build_table` makes of the override lists (unknown and doubled names),
    where no table is built (AMP off): a misspelt op is an error on every machine, not only
    where low precision runs. Without ``known_ops``, names are checked against both tables."""
    aliases = dict(aliases or {})
    if known_ops is None:
        valid = set(aliases).union(*(_default_classes(d, _load_lists(d)) for d in LOW_PRECISION_DTYPES))
    else:
        valid = set(known_ops) | set(aliases)
    _resolve_overrides(_overrides(target_precision_ops, conditional_fp32_ops, fp32_ops, widest_type_ops),
                       valid, aliases)


def build_table(
    target_dtype: str,
    *,
    target_precision_ops: Optional[Sequence[str]] = None,
    conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
    fp32_ops: Optional[Sequence[str]] = None,
    widest_type_ops: Optional[Sequence[str]] = None,
    keep_batchnorm_fp32: Optional[bool] = None,
    known_ops: Optional[Iterable[str]] = None,
    aliases: Optional[Mapping[str, str]] = None,
) -> OpTable:
    """Build and validate the op table for ``target_dtype`` from checked override lists.

    Each override list *replaces* the default list of its class: ops named there move
    into that class, and default members that are not named become neutral. An op named
    in two override lists, or a name that is not a registered op, raises :class:`OpListError`
    (a ``ValueError`` and an ``AssertionError``). A widest-type op may be named in
    ``fp32_ops``, which the peer refuses: it then runs in float32.
    ``known_ops``/``aliases`` are the registry (all names, and alias -> canonical); when
    given, every table entry and every override must be in it. ``keep_batchnorm_fp32``:
    True runs batch norm in float32, False in the target dtype, None as the table says.
    """
    if target_dtype not in LOW_PRECISION_DTYPES:  # resolved by the caller; only checked here
        raise ValueError(f"build_table needs target_dtype 'float16' or 'bfloat16', got {target_dtype!r}; "
                         "parse user input with gluon_amp_core.dtypes.parse_target_dtype first")
    data = _load_lists(target_dtype)
    aliases = dict(aliases or {})
    classes = _default_classes(target_dtype, data)
    conditions = {n: ConditionalRule(a, frozenset(v)) for n, a, v in data.CONDITIONAL_FP32}
    valid = _valid_names(target_dtype, classes, known_ops, aliases)
    overrides = _overrides(target_precision_ops, conditional_fp32_ops, fp32_ops, widest_type_ops)
    seen = _resolve_overrides(overrides, valid, aliases)
    for name, c in list(classes.items()):
        if c in overrides and name not in seen:
            classes[name] = OpClass.NEUTRAL
            conditions.pop(name, None)
    for name, op_class in seen.items():
        classes[name] = op_class
        if op_class is not OpClass.CONDITIONAL_FP32:
            conditions.pop(name, None)
    for n, a, v in conditional_fp32_ops or ():
        conditions[aliases.get(n, n)] = ConditionalRule(a, frozenset(v))
    if keep_batchnorm_fp32 is not None:
        for bn in _BATCHNORM_OPS:
            if bn in classes:
                classes[bn] = OpClass.FP32 if keep_batchnorm_fp32 else OpClass.LOW_PRECISION
    verdicts = default_verdicts(target_dtype)
    if known_ops is not None:
        stale = sorted(n for n in verdicts if split_key(n)[0] not in valid)
        if stale:
            raise ValueError(f"conformance verdicts name ops this MXNet does not register: {stale[:10]}; "
                             "fix gluon_amp_core/lists/verdicts.py or run python -m gluon_amp.conformance --write")
    applied = apply_verdicts(classes, conditions, verdicts, seen)
    narrow: Dict[str, Tuple[ShapeRule, ...]] = {}
    for n, a in data.FP32_WHEN_NARROWER:
        narrow[n] = narrow.get(n, ()) + (NarrowRule(a),)
    for n, kernel, stride, channel_multiple, plain, pixels in data.FP32_AT_OUTPUT_PIXELS:
        narrow[n] = narrow.get(n, ()) + (OutputPixelsRule(frozenset(pixels), kernel, stride, channel_multiple,
                                                          plain),)
    for n, below, ranks in data.FP32_WITH_ODD_CHANNELS_BELOW:
        narrow[n] = narrow.get(n, ()) + (OddChannelsRule(below, tuple(ranks)),)
    twins = {op: (twin, tuple(attrs)) for op, twin, attrs in data.SAME_SHAPE_TWINS}
    above = dict(data.FP32_WITH_MORE_INPUTS_THAN)
    unknown = sorted((set(narrow) | set(twins) | {t for t, _ in twins.values()} | set(above)) - set(classes))
    if unknown:
        raise ValueError(f"op table for {target_dtype} has input-shape rules or twins for ops it does not "
                         f"list: {unknown}; fix the lists/{target_dtype}.py data")
    return OpTable(target_dtype=target_dtype, classes=MappingProxyType(classes),
                   conditions=MappingProxyType(conditions),
                   keep_fp32_inputs=MappingProxyType({n: frozenset(v) for n, v in data.KEEP_FP32_INPUTS.items()}),
                   aliases=MappingProxyType(aliases), narrow_fp32=MappingProxyType(narrow),
                   fp32_above_inputs=MappingProxyType(above),
                   same_shape_twins=MappingProxyType(twins), verdicts=MappingProxyType(applied))


@functools.lru_cache(maxsize=None)
def default_table(target_dtype: str) -> OpTable:
    """The unmodified table for ``target_dtype`` (no registry check, no aliases)."""
    return build_table(target_dtype)
