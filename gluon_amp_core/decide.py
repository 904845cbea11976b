"""The dtype decision: one pure function shared by ``init`` and the graph converter."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import FrozenSet, Mapping, Optional, Sequence, Tuple

from .dtypes import FLOAT_DTYPES, widest
from .shape_limits import keeps_fp32
from .table import OpClass, OpTable
from .verdicts import Verdict

_EMPTY: frozenset = frozenset()


class Reason(str, enum.Enum):
    """Why an op runs in the dtype it does."""

    LOW_PRECISION = "low_precision"
    FP32 = "fp32"
    CONDITIONAL_FP32 = "conditional_fp32"
    CONDITIONAL_NEUTRAL = "conditional_neutral"
    NARROW_INPUT = "narrow_input"  # a low-precision op kept float32 at its input's shape (a kernel's limits)
    WIDEST = "widest"
    NEUTRAL = "neutral"
    EXCLUDED = "excluded"
    MEASURED = "measured"    # the tuner timed both dtypes here (gluon_amp_core.tuning.problem)
    CAST = "cast"            # amp_cast / amp_multicast: a cast node itself
    KEPT = "kept"            # a fused or quantized op: the dtypes it has in the FP32 graph
    NO_KERNEL = "no_kernel"  # float32: MXNet has no kernel for the target dtype (a conformance verdict)
    WRONG_KERNEL = "wrong_kernel"  # float32: MXNet's kernel in the target dtype is beyond its bound
    UNIFORM_INPUTS = "uniform_inputs"  # the widest input type: MXNet refuses mixed float inputs here
    SLOW_KERNEL = "slow_kernel"  # float32: MXNet's kernel in the target dtype is slower (kernel_speed, its input limit)

    def __str__(self) -> str:
        return self.value


#: The cast ops AMP inserts (and users may write): they decide nothing themselves.
CAST_OPS = frozenset({"amp_cast", "amp_multicast"})

#: The names gluon_amp gives the cast nodes it puts in a graph: the symbolic wrappers'
#: (``amp_plan_cast<N>``, ``amp_plan_multicast<N>``, numbered as MXNet numbers auto names and
#: prefixed by the block's scope), the converter's (``fc1_amp_cast_bfloat16``), the retyping's,
#: the fewer-casts pass's, execution's and emulation's. A cast node named otherwise
#: (``amp_cast3``, MXNet's auto name, or the user's own) is the user's: every pass keeps it,
#: with the dtype it asks for. (A name given twice in a graph, by a block entered twice in one
#: trace, gets ``_<index>`` appended: gluon_amp.tuning.casts.)
PLAN_CAST_NAME = re.compile(r"(?:amp_plan_(?:multi)?cast\d+(?:_\d+_*)?"
                            r"|_amp_(?:cast|retyped|moved)_(?:b?float(?:16|32))(?:_\d+)?"
                            r"|_amp_output\d+|_amp_widened|_amp_emulated.*)$")
#: The name hints of the wrappers' casts (MXNet appends its count)
PLAN_CAST_HINTS = {"amp_cast": "amp_plan_cast", "amp_multicast": "amp_plan_multicast"}


def users_casts(graph: dict) -> FrozenSet[str]:
    """Names of the ``amp_cast``/``amp_multicast`` nodes of ``graph`` (MXNet's JSON form) that
    are the user's, not gluon_amp's (:data:`PLAN_CAST_NAME`)."""
    return frozenset(n["name"] for n in graph["nodes"]
                     if n["op"] in CAST_OPS and not PLAN_CAST_NAME.search(n["name"]))


def users_cast_readers(graph: dict) -> FrozenSet[str]:
    """Names of the op nodes that read a user's cast (:func:`users_casts`): their dtype is the
    one the user cast to, not a choice of gluon_amp's (the tuner leaves them as they are)."""
    users = users_casts(graph)
    nodes = graph["nodes"]
    return frozenset(n["name"] for n in nodes
                     if n["op"] != "null" and any(nodes[e[0]]["name"] in users for e in n["inputs"]))


@dataclass(frozen=True)
class MeasuredChoice:
    """The dtype the tuner (:mod:`gluon_amp_core.tuning.problem`) gives one op node, and the figures
    behind it (ms): data for :func:`decide`'s ``measured``.

    ``low_ms``/``fp32_ms`` are the op's own times; ``cast_ms`` is what the casts around it
    cost in the chosen dtype minus in the other one (its neighbours as chosen).
    """

    dtype: str
    low_ms: float
    fp32_ms: float
    cast_ms: float
    target: str
    #: the whole graph's time (ms) without and with the change this choice belongs to
    graph_ms: Optional[Tuple[float, float]] = None

    def describe(self) -> str:
        """e.g. ``float32: measured 2.0x slower in bfloat16 (409.00 vs 205.00 ms)``."""
        low, fp32, t = self.low_ms, self.fp32_ms, self.target
        if self.dtype == "float32" and not fp32 > 0:  # no figures: the whole graph runs float32 by rule
            return "float32: the whole graph runs float32 until measured against it"
        if self.dtype == "float32":
            if low >= fp32:
                text = f"float32: measured {low / fp32:.1f}x slower in {t} ({low:.2f} vs {fp32:.2f} ms)"
            else:
                text = (f"float32: faster alone in {t} ({low:.2f} vs {fp32:.2f} ms), not with the casts it "
                        f"would need (+{-self.cast_ms:.2f} ms)")
        else:
            text = f"{t}: measured faster with its casts ({low:.2f} vs {fp32:.2f} ms, casts {self.cast_ms:+.2f} ms)"
        if self.graph_ms is not None:
            before, after = self.graph_ms
            text += f"; whole graph {before:.0f} -> {after:.0f} ms with this change"
        return text


@dataclass(frozen=True)
class Decision:
    """What to do with one op call.

    Attributes
    ----------
    dtype : str or None
        Float inputs are cast to this dtype. ``None`` leaves them as they are (neutral),
        or, for ``reason == 'widest'`` with unknown input dtypes, asks the caller to cast
        to the widest at run time (``amp_multicast``).
    reason : Reason
    keep_fp32 : frozenset of str
        Input names that are never cast (normalisation parameters and running stats).
    """

    dtype: Optional[str]
    reason: Reason
    keep_fp32: frozenset = _EMPTY


def decide(
    op: str,
    attrs: Mapping[str, object],
    input_dtypes: Sequence[Optional[str]],
    table: OpTable,
    excluded: bool = False,
    measured: Optional[str] = None,
    input_shapes: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> Decision:
    """Decide the compute dtype of one op.

    Parameters
    ----------
    op : str
        Registered op name or alias.
    attrs : mapping
        The op's attributes; only the conditional rule's attribute is read (as ``str``).
    input_dtypes : sequence of str or None
        Dtypes of the tensor inputs, ``None`` where unknown (symbol construction).
    table : OpTable
    excluded : bool
        The caller excluded this node by name: it runs in float32.
    measured : str, optional
        The dtype the tuner chose for this node from measured times (its speed table is
        data for this rule: :mod:`gluon_amp_core.tuning.problem`). It overrides the op's class,
        except where float32 is required (an fp32 op, or a conditional rule that applies).
    input_shapes : sequence of tuple or None, optional
        Shapes of the tensor inputs where known (a run, or a graph with its input shapes).
        A low-precision op with a rule in ``table.narrow_fp32`` runs in float32 where one
        applies to its data input (:mod:`gluon_amp_core.shape_limits`: a kernel's limits).
    """
    name = table.canonical(op)
    if name in CAST_OPS:
        return Decision(None, Reason.CAST)
    if excluded:
        return Decision("float32", Reason.EXCLUDED, table.keep_fp32_inputs.get(name, _EMPTY))
    op_class = table.classes.get(name, OpClass.NEUTRAL)
    keep = table.keep_fp32_inputs.get(name, _EMPTY)
    if op_class is OpClass.LOW_PRECISION:  # a kernel's limits first: they are about correctness
        rules = table.narrow_fp32.get(name)
        if rules and input_shapes and keeps_fp32(rules, input_shapes[0], attrs):
            return Decision("float32", Reason.NARROW_INPUT, keep)
    if measured is not None and op_class is not OpClass.FP32 and not _rule_applies(table, name, attrs):
        return Decision(measured, Reason.MEASURED, keep)
    if op_class is OpClass.LOW_PRECISION:
        return Decision(table.target_dtype, Reason.LOW_PRECISION, keep)
    if op_class is OpClass.FP32:
        return Decision("float32", _VERDICT_REASONS.get(table.verdicts.get(name), Reason.FP32), keep)
    if op_class is OpClass.CONDITIONAL_FP32:
        if _rule_applies(table, name, attrs):
            rule = table.conditions[name]
            verdict = table.verdicts.get(f"{name}:{rule.attr}={attrs.get(rule.attr)}")
            return Decision("float32", _VERDICT_REASONS.get(verdict, Reason.CONDITIONAL_FP32), keep)
        return Decision(None, Reason.CONDITIONAL_NEUTRAL, keep)
    if op_class is OpClass.WIDEST:
        floats = [d for d in input_dtypes if d is None or d in FLOAT_DTYPES]
        verdict = table.verdicts.get(name)
        reason = Reason.WIDEST if verdict is Verdict.SLOW else _VERDICT_REASONS.get(verdict, Reason.WIDEST)
        if not floats or any(d is None for d in floats):
            return Decision(None, reason, keep)
        dtype = widest(floats)
        if dtype == table.target_dtype and slow_in_target(table, name, len(input_dtypes)):
            return Decision("float32", Reason.SLOW_KERNEL, keep)
        return Decision(dtype, reason, keep)
    return Decision(None, Reason.NEUTRAL, keep)


def slow_in_target(table: OpTable, name: str, n_inputs: int) -> bool:
    """Whether widest op ``name`` (canonical), called with ``n_inputs`` tensor inputs, is slower
    in the target dtype than in float32 with its casts: a ``slow`` kernel verdict, or more
    inputs than its kernel there takes (``table.fp32_above_inputs``)."""
    limit = table.fp32_above_inputs.get(name)
    return table.verdicts.get(name) is Verdict.SLOW or (limit is not None and n_inputs > limit)


_VERDICT_REASONS = {Verdict.NO_KERNEL: Reason.NO_KERNEL, Verdict.WRONG: Reason.WRONG_KERNEL,
                    Verdict.NEEDS_UNIFORM_INPUTS: Reason.UNIFORM_INPUTS, Verdict.SLOW: Reason.SLOW_KERNEL}


def _rule_applies(table: OpTable, name: str, attrs: Mapping[str, object]) -> bool:
    """True when a conditional-fp32 op's attribute takes one of its float32 values."""
    rule = table.conditions.get(name)
    if rule is None or table.classes.get(name) is not OpClass.CONDITIONAL_FP32:
        return False
    value = attrs.get(rule.attr)
    return value is not None and str(value) in rule.values
