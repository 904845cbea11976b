"""Fewer casts in a plan: MXNet's side of :mod:`gluon_amp_core.fewer_casts`.

The pass is pure; here MXNet types the graph before it and checks it after: a result whose
inferred dtypes differ from the pass's anywhere (or that does not type-check) is not used.
"""
from __future__ import annotations

import json
from typing import Mapping, Optional, Tuple

import mxnet as mx
from mxnet.symbol import Symbol

from gluon_amp_core.fewer_casts import fewer_casts
from gluon_amp_core.graph_pass import PassResult
from gluon_amp_core.table import OpTable

from ..type_inference import infer_dtypes


def with_fewer_casts(sym: Symbol, known: Mapping[str, str], table: OpTable,
                     dtypes: Optional[Mapping[Tuple[str, int], Optional[str]]] = None) -> Tuple[Symbol, int]:
    """``sym`` with casts moved across neutral ops where that removes some, and how many went
    (``sym`` itself and 0 where none could go or MXNet disagrees with the result).
    ``known``: the input dtypes MXNet types it from; ``dtypes``: its typing, where known."""
    typed = dict(dtypes) if dtypes is not None else (infer_dtypes(sym, known, partial=True) or {})
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    new_graph, new_types, removed = fewer_casts(graph, typed, table)
    if not removed:
        return sym, 0
    new = mx.sym.load_json(json.dumps(new_graph))
    inferred = infer_dtypes(new, known, partial=True)
    if inferred is None or any(inferred.get(k) != t for k, t in new_types.items() if t is not None and k in inferred):
        return sym, 0
    return new, removed


def pass_result_with_fewer_casts(result: PassResult, table: OpTable, known: Mapping[str, str]) -> Optional[Symbol]:
    """A converter's result with fewer casts, updated in place (graph, dtypes, casts
    inserted), and its symbol; None (``result`` as it was) where none could go or MXNet
    disagrees."""
    new_graph, new_types, removed = fewer_casts(result.graph, result.dtypes, table)
    if not removed:
        return None
    new = mx.sym.load_json(json.dumps(new_graph))
    inferred = infer_dtypes(new, known)
    if inferred is None or any(inferred.get(k) != t for k, t in new_types.items() if t is not None and k in inferred):
        return None
    result.graph, result.dtypes = new_graph, new_types
    result.casts_inserted = max(0, result.casts_inserted - removed)
    return new
