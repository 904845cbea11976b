"""Fewer casts in a plan: MXNet's side of :mod:`gluon_amp_core.fewer_casts`.

The pass is pure; here MXNet types the graph before it and checks it after: a result whose
inferred dtypes differ from the pass's anywhere (or that does not type-check) is not used.
"""
from __future__ import annotations

import json
from typing import Collection, Mapping, Optional, Tuple

import mxnet as mx
from mxnet.symbol import Symbol

from gluon_amp_core.decide import CAST_OPS
from gluon_amp_core.fewer_casts import fewer_casts, names_given_twice
from gluon_amp_core.graph_pass import PassResult
from gluon_amp_core.retype import unique_op_names
from gluon_amp_core.table import OpTable

from ..mxnet_internals import symbol_graph
from ..type_inference import infer_dtypes


def with_fewer_casts(sym: Symbol, known: Mapping[str, str], table: OpTable,
                     dtypes: Optional[Mapping[Tuple[str, int], Optional[str]]] = None,
                     keep: Collection[str] = ()) -> Tuple[Symbol, int]:
    """``sym`` with casts moved across neutral ops where that removes some, and how many went
    (``sym`` itself and 0 where none could go or MXNet disagrees with the result).
    ``known``: the input dtypes MXNet types it from; ``dtypes``: its typing, where known;
    ``keep``: the names of the user's casts, which stay."""
    # the op wrappers name casts per name scope (an unrolled cell repeats them); typed by name
    graph, renamed = unique_op_names(symbol_graph(sym), CAST_OPS)
    if renamed:  # the renamed casts typed again
        dtypes = infer_dtypes(mx.sym.load_json(json.dumps(graph)), known, partial=True) or {}
    typed = dict(dtypes) if dtypes is not None else (infer_dtypes(sym, known, partial=True) or {})
    new_graph, new_types, removed = fewer_casts(graph, typed, table, keep)
    if not removed:
        return sym, 0
    new = mx.sym.load_json(json.dumps(new_graph))
    if not _agrees(new, new_graph, new_types, known, partial=True):
        return sym, 0
    return new, removed


def _agrees(sym: Symbol, graph: dict, dtypes: Mapping[Tuple[str, int], Optional[str]], known: Mapping[str, str],
            partial: bool) -> bool:
    """True when MXNet types ``sym`` as the pass says (names given twice are not compared)."""
    inferred = infer_dtypes(sym, known, partial=partial)
    if inferred is None:
        return False
    twice = names_given_twice(graph["nodes"])
    return all(inferred.get(k) == t for k, t in dtypes.items() if t is not None and k in inferred and k[0] not in twice)


def pass_result_with_fewer_casts(result: PassResult, table: OpTable, known: Mapping[str, str],
                                 keep: Collection[str] = ()) -> Optional[Symbol]:
    """A converter's result with fewer casts, updated in place (graph, dtypes, casts
    inserted), and its symbol; None (``result`` as it was) where none could go or MXNet
    disagrees. ``keep``: the names of the user's casts, which stay."""
    new_graph, new_types, removed = fewer_casts(result.graph, result.dtypes, table, keep)
    if not removed:
        return None
    new = mx.sym.load_json(json.dumps(new_graph))
    if not _agrees(new, new_graph, new_types, known, partial=False):
        return None
    result.graph, result.dtypes = new_graph, new_types
    result.casts_inserted = max(0, result.casts_inserted - removed)
    return new
