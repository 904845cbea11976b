"""Dtypes of every output of a Symbol graph, keyed the way the JSON graph names nodes."""
from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional, Tuple

from mxnet.symbol import Symbol

from .dtypes import dtype_name, to_mx_dtype

_MULTI = re.compile(r"^(.*)_output(\d+)$")


def infer_dtypes(sym: Symbol, input_types: Mapping[str, Any],
                 partial: bool = False) -> Optional[Dict[Tuple[str, int], Optional[str]]]:
    """``{(node name, output index): dtype name}`` for every node of ``sym``.

    ``input_types`` maps input names to dtypes (names or NumPy/MXNet dtypes); names that are
    not inputs of ``sym`` are ignored. Returns ``None`` when the graph does not type-check,
    or with ``partial=True`` leaves untyped outputs as ``None``.
    """
    internals = sym.get_internals()
    args = set(internals.list_inputs())
    given = {k: to_mx_dtype(dtype_name(v)) for k, v in input_types.items() if k in args}
    infer = internals.infer_type_partial if partial else internals.infer_type
    _, out_types, _ = infer(**given)
    if out_types is None:
        return None
    out: Dict[Tuple[str, int], Optional[str]] = {}
    for name, t in zip(internals.list_outputs(), out_types):
        m = _MULTI.match(name)
        if m:
            key = (m.group(1), int(m.group(2)))
        elif name.endswith("_output"):
            key = (name[: -len("_output")], 0)
        else:  # a variable
            key = (name, 0)
        out[key] = dtype_name(t) if t is not None else None
    return out
