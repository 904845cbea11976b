"""The peer-compatible ``list_*_ops`` functions, read from the op table."""
from __future__ import annotations

from typing import Any, List, Tuple

from .table import OpClass, default_table


def list_lp16_ops(target_dtype: Any = "float16") -> List[str]:
    """Ops run in the low-precision ``target_dtype``."""
    return list(default_table(_name(target_dtype)).names(OpClass.LOW_PRECISION))


def list_fp32_ops(target_dtype: Any = "float16") -> List[str]:
    """Ops run in float32."""
    return list(default_table(_name(target_dtype)).names(OpClass.FP32))


def list_lp16_fp32_ops(target_dtype: Any = "float16") -> List[str]:
    """Neutral ops: they run in whatever dtype they are given."""
    return list(default_table(_name(target_dtype)).names(OpClass.NEUTRAL))


def list_conditional_fp32_ops(target_dtype: Any = "float16") -> List[Tuple[str, str, List[str]]]:
    """``(op, attribute, [values])``: float32 when the attribute takes one of the values."""
    t = default_table(_name(target_dtype))
    return [(n, t.conditions[n].attr, sorted(t.conditions[n].values))
            for n in t.names(OpClass.CONDITIONAL_FP32)]


def list_widest_type_cast(target_dtype: Any = "float16") -> List[str]:
    """Ops run in the widest float type among their inputs."""
    return list(default_table(_name(target_dtype)).names(OpClass.WIDEST))


def _name(target_dtype: Any) -> str:
    from .dtypes import parse_target_dtype
    return parse_target_dtype(target_dtype)
