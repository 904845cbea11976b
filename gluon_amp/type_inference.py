"""MXNet's type and shape inference, asked for what gluon_amp needs: every output's dtype
and shape in a graph, and one op's type rule for given input dtypes (what the graph pass
plugs in)."""
from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

import mxnet as mx
from mxnet.base import MXNetError
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import DTYPE_CODE, dtype_name
from .mxnet_internals import internal_entries, quiet_stderr, symbol_graph, to_mx_dtype

def infer_dtypes(sym: Symbol, input_types: Mapping[str, Any],
                 partial: bool = False) -> Optional[Dict[Tuple[str, int], Optional[str]]]:
    """``{(node name, output index): dtype name}`` for every node of ``sym``.

    ``input_types`` maps input names to dtypes (names or NumPy/MXNet dtypes); names that are
    not inputs of ``sym`` are ignored. Returns ``None`` when the graph does not type-check,
    or with ``partial=True`` leaves untyped outputs as ``None``; where partial inference
    stops at an op whose type rule refuses an unknown input (``Embedding`` of an untyped
    index), ``None`` too.
    """
    args = set(sym.list_inputs())
    names = {k: dtype_name(v) for k, v in input_types.items() if k in args}
    if "bfloat16" in names.values():
        sym, given = _declared(sym, names), {}
    else:
        given = {k: to_mx_dtype(v) for k, v in names.items()}
    internals = sym.get_internals()
    if partial:
        try:
            _, out_types, _ = internals.infer_type_partial(**given)
        except MXNetError:
            return None
    else:
        _, out_types, _ = internals.infer_type(**given)
    if out_types is None:
        return None
    return {key: dtype_name(t) if t is not None else None
            for key, t in zip(internal_entries(sym), out_types)}


def infer_shapes(sym: Symbol, input_shapes: Mapping[str, Tuple[int, ...]]
                 ) -> Dict[Tuple[str, int], Optional[Tuple[int, ...]]]:
    """``{(node name, output index): shape}`` for every node of ``sym`` given the shapes of
    some inputs; ``None`` where MXNet cannot tell (or rejects the shapes)."""
    args = set(sym.list_inputs())
    internals = sym.get_internals()
    try:
        _, out_shapes, _ = internals.infer_shape_partial(**{k: v for k, v in input_shapes.items() if k in args})
    except MXNetError:
        return {}
    if out_shapes is None:
        return {}
    # partial inference marks an unknown dimension with 0 (or leaves the shape empty)
    return {key: (tuple(s) if s and all(d > 0 for d in s) else None)
            for key, s in zip(internal_entries(sym), out_shapes)}


def entry_keys(internals: Symbol) -> List[Tuple[str, int]]:
    """``(node name, output index)`` for each output of ``internals`` (a graph's
    ``get_internals()``), in order: the entries MXNet lists them as.

    An output's name is its node's name and the op's own name for that output (RNN's
    ``rnn0_state``, BatchNorm's ``bn_mean``, SliceChannel's ``sp_output1``), so the
    entries are read from the graph itself rather than from the names.
    """
    graph = symbol_graph(internals)
    nodes = graph["nodes"]
    return [(nodes[h[0]]["name"], h[1]) for h in graph["heads"]]


def _declared(sym: Symbol, names: Mapping[str, str]) -> Symbol:
    """``sym`` with these input dtypes declared as ``__dtype__`` attributes: MXNet 1.9.1's
    ``infer_type(name=dtype)`` silently drops bfloat16 (its NumPy type is ``void``)."""
    graph = symbol_graph(sym)
    for node in graph["nodes"]:
        if node["op"] == "null" and node["name"] in names:
            node["attrs"] = {**node.get("attrs", {}), "__dtype__": str(DTYPE_CODE[names[node["name"]]])}
    return mx.sym.load_json(json.dumps(graph))


def op_types(op: str, attrs: Mapping[str, str], in_dtypes: Tuple[Optional[str], ...]
             ) -> Optional[Tuple[Tuple[Optional[str], ...], Tuple[Optional[str], ...]]]:
    """MXNet's own type rule for one op: the dtype each input must have and the output
    dtypes, given ``in_dtypes`` (``None``: free). ``None`` when MXNet rejects the inputs.

    The graph pass's ``op_types`` argument. Cached per (op, attributes, input dtypes).
    """
    return _op_types(op, tuple(sorted(attrs.items())), in_dtypes)


@functools.lru_cache(maxsize=8192)
def _op_types(op: str, attrs: Tuple[Tuple[str, str], ...], in_dtypes: Tuple[Optional[str], ...]
              ) -> Optional[Tuple[Tuple[Optional[str], ...], Tuple[Optional[str], ...]]]:
    # Input dtypes are declared as ``__dtype__`` attributes (see _declared).
    n = len(in_dtypes)
    nodes = [{"op": "null", "name": f"in{k}", "inputs": [],
              **({"attrs": {"__dtype__": str(DTYPE_CODE[t])}} if t in DTYPE_CODE else {})}
             for k, t in enumerate(in_dtypes)]
    nodes.append({"op": op, "name": "node", "attrs": dict(attrs), "inputs": [[k, 0, 0] for k in range(n)]})
    graph = {"nodes": nodes, "arg_nodes": list(range(n)), "heads": [[n, 0, 0]],
             "attrs": {"mxnet_version": ["int", 10901]}}
    try:  # attributes MXNet rejects fail in load_json, dtypes in infer_type: both "unknown"
        internals = mx.sym.load_json(json.dumps(graph)).get_internals()
        with quiet_stderr():  # a rule probed with free inputs may log (np.linalg.norm: "Integer input to norm")
            _, out_types, _ = internals.infer_type_partial()
    except MXNetError:
        return None
    if out_types is None:
        return None
    # the variables come first (one output each), then the op's outputs
    typed = [dtype_name(t) if t is not None else None for t in out_types]
    return tuple(typed[:n]), tuple(typed[n:])
