"""Dtype names and parsing. Pure: needs NumPy only, not MXNet."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

#: MXNet 1.x spells bfloat16 as this structured NumPy dtype.
BFLOAT16 = np.dtype([("bfloat16", np.uint16)])

LOW_PRECISION_DTYPES = ("float16", "bfloat16")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name of a NumPy/MXNet dtype, e.g. ``'bfloat16'``."""
    if isinstance(dtype, str):
        return _ALIASES.get(dtype, dtype)
    if dtype is BFLOAT16 or (isinstance(dtype, np.dtype) and dtype == BFLOAT16):
        return "bfloat16"
    return np.dtype(dtype).name


def parse_target_dtype(value: Any) -> str:
    """Parse a low-precision target dtype.

    Accepts ``'float16'``, ``'bfloat16'``, their short names, ``numpy.float16`` and
    MXNet's bfloat16 dtype. Raises ``ValueError`` naming the choices otherwise.
    """
    try:
        name = dtype_name(value)
    except TypeError:
        name = None
    if name not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"target_dtype={value!r} is not supported; choose one of "
            f"{', '.join(repr(d) for d in LOW_PRECISION_DTYPES)} (or None to pick "
            "float16 on GPU and bfloat16 on CPU)."
        )
    return name


def to_mx_dtype(name: str) -> Any:
    """The object MXNet accepts as ``dtype=`` for a canonical dtype name."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def widest(dtypes: Iterable[Optional[str]]) -> Optional[str]:
    """Widest float dtype among ``dtypes``; ``None`` if none is a known float.

    float16 and bfloat16 together widen to float32: neither holds the other.
    """
    best: Optional[str] = None
    for d in dtypes:
        if d not in _RANK:
            continue
        if best is None or _RANK[d] > _RANK[best]:
            best = d
        elif _RANK[d] == _RANK[best] and d != best:
            best = "float32"
    return best
