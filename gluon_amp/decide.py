"""The dtype decision: one pure function shared by ``init`` and the graph converter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .dtypes import FLOAT_DTYPES, widest
from .table import OpClass, OpTable

_EMPTY: frozenset = frozenset()


@dataclass(frozen=True)
class Decision:
    """What to do with one op call.

    Attributes
    ----------
    dtype : str or None
        Float inputs are cast to this dtype. ``None`` leaves them as they are (neutral),
        or, for ``reason == 'widest'`` with unknown input dtypes, asks the caller to cast
        to the widest at run time (``amp_multicast``).
    reason : str
        ``'low_precision'``, ``'fp32'``, ``'conditional_fp32'``, ``'conditional_neutral'``,
        ``'widest'``, ``'neutral'`` or ``'excluded'``.
    keep_fp32 : frozenset of str
        Input names that are never cast (normalisation parameters and running stats).
    """

    dtype: Optional[str]
    reason: str
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
    if excluded:
        return Decision("float32", "excluded", table.keep_fp32_inputs.get(table.aliases.get(op, op), _EMPTY))
    name = table.aliases.get(op, op)
    op_class = table.classes.get(name, OpClass.NEUTRAL)
    keep = table.keep_fp32_inputs.get(name, _EMPTY)
    if op_class is OpClass.LOW_PRECISION:
        return Decision(table.target_dtype, "low_precision", keep)
    if op_class is OpClass.FP32:
        return Decision("float32", "fp32", keep)
    if op_class is OpClass.CONDITIONAL_FP32:
        rule = table.conditions[name]
        value = attrs.get(rule.attr)
        if value is not None and str(value) in rule.values:
            return Decision("float32", "conditional_fp32", keep)
        return Decision(None, "conditional_neutral", keep)
    if op_class is OpClass.WIDEST:
        floats = [d for d in input_dtypes if d is None or d in FLOAT_DTYPES]
        if not floats or any(d is None for d in floats):
            return Decision(None, "widest", keep)
        return Decision(widest(floats), "widest", keep)
    return Decision(None, "neutral", keep)
