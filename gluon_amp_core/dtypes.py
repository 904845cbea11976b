"""Dtype names and parsing. Pure: no MXNet, no NumPy (dtype objects are read by duck typing)."""
from __future__ import annotations

from typing import Any, Iterable, Optional

LOW_PRECISION_DTYPES = ("float16", "bfloat16")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

#: MXNet's integer dtype codes, as stored in a graph's ``__dtype__`` attribute.
DTYPE_CODE = {"float32": 0, "float64": 1, "float16": 2, "uint8": 3, "int32": 4, "int8": 5,
              "int64": 6, "bool": 7, "int16": 8, "uint16": 9, "uint32": 10, "uint64": 11,
              "bfloat16": 12}
CODE_DTYPE = {v: k for k, v in DTYPE_CODE.items()}


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype: a string, a NumPy dtype or scalar type, or MXNet's
    bfloat16 (a structured NumPy dtype with the single field ``bfloat16``)."""
    if isinstance(dtype, str):
        return _ALIASES.get(dtype, dtype)
    if getattr(dtype, "names", None) == ("bfloat16",):
        return "bfloat16"
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"not a dtype: {dtype!r}")
    return _ALIASES.get(name, name)


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


#: float16's smallest normal value: below it a float16 number keeps fewer bits, below 2**-24 none
#: (MXNet's float16 kernels take ``rescale_grad`` as such a value)
FLOAT16_SMALLEST_NORMAL = 2.0 ** -14
