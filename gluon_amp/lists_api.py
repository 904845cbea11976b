"""The peer-compatible ``list_*_ops`` functions, read from the op table."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from gluon_amp_core.lists.loss_outputs import LOSS_OUTPUT_FUNCTIONS
from gluon_amp_core.table import OpClass, default_table


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


def list_loss_output_functions(target_dtype: Any = "float16") -> List[str]:
    """Loss-output ops (``SoftmaxOutput`` and the ``*RegressionOutput`` ops).

    Their backward ignores the gradient ``scale_loss`` scales and starts from their
    ``grad_scale`` attribute instead. The list is the same for both target dtypes.
    """
    _name(target_dtype)
    return list(LOSS_OUTPUT_FUNCTIONS)


def list_lp16_use_fp32_params(target_dtype: Any = "float16") -> Dict[str, List[str]]:
    """``{op: [input name or '', ...]}``: inputs kept in float32 whatever the op's dtype.

    One entry per declared input of the op, in order: the input's name when it stays
    float32 (normalisation parameters, running statistics), ``''`` when it follows the
    op's dtype. Both tables keep these inputs in float32, so both dtypes return the mapping.
    """
    from . import mxnet_internals as mxi  # reads MXNet's op registry; the rest of this module is pure
    infos = mxi.op_infos()
    keep = default_table(_name(target_dtype)).keep_fp32_inputs
    return {op: [n if n in names else "" for n in infos[op].inputs]
            for op, names in sorted(keep.items()) if op in infos}


def _name(target_dtype: Any) -> str:
    from gluon_amp_core.dtypes import parse_target_dtype
    return parse_target_dtype(target_dtype)
