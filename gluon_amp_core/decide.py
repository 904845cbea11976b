"""The dtype decision: one pure function shared by ``init`` and the graph converter."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .dtypes import FLOAT_DTYPES, widest
from .table import OpClass, OpTable

_EMPTY: frozenset = frozenset()


class Reason(str, enum.Enum):
    """Why an op runs in the dtype it does."""

    LOW_PRECISION = "low_precision"
    FP32 = "fp32"
    CONDITIONAL_FP32 = "conditional_fp32"
    CONDITIONAL_NEUTRAL = "conditional_neutral"
    WIDEST = "widest"
    NEUTRAL = "neutral"
    EXCLUDED = "excluded"
    CAST = "cast"            # amp_cast / amp_multicast: a cast node itself
    KEPT = "kept"            # a fused or quantized op: the dtypes it has in the FP32 graph

    def __str__(self) -> str:
        return self.value


#: The cast ops AMP inserts (and users may write): they decide nothing themselves.
CAST_OPS = frozenset({"amp_cast", "amp_multicast"})


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
    """
    name = table.canonical(op)
    if name in CAST_OPS:
        return Decision(None, Reason.CAST)
    if excluded:
        return Decision("float32", Reason.EXCLUDED, table.keep_fp32_inputs.get(name, _EMPTY))
    op_class = table.classes.get(name, OpClass.NEUTRAL)
    keep = table.keep_fp32_inputs.get(name, _EMPTY)
    if op_class is OpClass.LOW_PRECISION:
        return Decision(table.target_dtype, Reason.LOW_PRECISION, keep)
    if op_class is OpClass.FP32:
        return Decision("float32", Reason.FP32, keep)
    if op_class is OpClass.CONDITIONAL_FP32:
        rule = table.conditions[name]
        value = attrs.get(rule.attr)
        if value is not None and str(value) in rule.values:
            return Decision("float32", Reason.CONDITIONAL_FP32, keep)
        return Decision(None, Reason.CONDITIONAL_NEUTRAL, keep)
    if op_class is OpClass.WIDEST:
        floats = [d for d in input_dtypes if d is None or d in FLOAT_DTYPES]
        if not floats or any(d is None for d in floats):
            return Decision(None, Reason.WIDEST, keep)
        return Decision(widest(floats), Reason.WIDEST, keep)
    return Decision(None, Reason.NEUTRAL, keep)
