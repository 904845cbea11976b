"""A symbol's graph as JSON, serialised by MXNet once per chain of passes (MXNet 1.9.1).

``Symbol.tojson`` writes the whole graph in C++ at every call: 40-120 ms on a graph of
5,000 nodes. The passes a block's graph goes through before it first runs each read the
graph they are given, often the same symbol, and ask MXNet's type inference, which reads
``get_internals()`` of it again. Within :func:`shared_reads` each symbol is serialised once.
"""
from __future__ import annotations

import contextlib
import functools
import json
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mxnet as mx
from mxnet.base import MXNetError
from mxnet.symbol import Symbol

__all__ = ["shared_reads", "symbol_json", "symbol_graph", "internal_entries"]


class _Reads(threading.local):
    memo: Optional[Dict[int, Tuple[Symbol, str]]] = None


_reads = _Reads()


@contextlib.contextmanager
def shared_reads() -> Iterator[None]:
    """Within this block, on this thread, :func:`symbol_json` serialises each symbol once.

    Only for code that changes no symbol in place (``Symbol._set_attr``, ``_compose``) while
    it runs: gluon_amp's passes build each changed graph anew (``load_json``). A nested
    block shares the outer one's reads; the memo ends with the outer block. As a decorator
    (``@shared_reads()``), each call of the function runs inside one.
    """
    if _reads.memo is not None:
        yield
        return
    _reads.memo = {}
    try:
        yield
    finally:
        _reads.memo = None


def symbol_json(sym: Symbol) -> str:
    """``sym``'s graph as MXNet writes it, cast nodes included.

    1.9.1: ``tojson()`` leaves ``amp_cast``/``amp_multicast`` out unless
    ``remove_amp_cast=False``; a rename of that argument breaks every pass here.
    """
    memo = _reads.memo
    if memo is None:
        return sym.tojson(remove_amp_cast=False)
    hit = memo.get(id(sym))
    if hit is not None and hit[0] is sym:
        return hit[1]
    text = sym.tojson(remove_amp_cast=False)
    memo[id(sym)] = (sym, text)  # the memo holds the symbol: its id is not reused meanwhile
    return text


def symbol_graph(sym: Symbol) -> Dict[str, Any]:
    """``sym``'s graph, parsed anew for the caller (who may change it)."""
    return json.loads(symbol_json(sym))


def internal_entries(sym: Symbol) -> List[Tuple[str, int]]:
    """``(node name, output index)`` of each output of ``sym.get_internals()``, in its order,
    read from ``sym``'s own graph.

    1.9.1: ``get_internals()`` lists the visible outputs of each node (``FNumVisibleOutputs``:
    Dropout's mask and LayerNorm's mean are hidden, BatchNorm's mean and variance shown only with
    ``output_mean_var``), nodes in the order the graph's JSON lists them; the JSON's
    ``node_row_ptr`` counts every output. Checked against the internals' own graph in
    ``tests/mxnet_layer/runtime/test_graph_reads.py``.
    """
    graph = symbol_graph(sym)
    nodes, rows = graph["nodes"], graph["node_row_ptr"]
    keys: List[Tuple[str, int]] = []
    for i, node in enumerate(nodes):
        count = rows[i + 1] - rows[i]
        if count > 1:
            try:
                if "subgraphs" in node:  # a control-flow op: its outputs follow from its subgraphs
                    raise MXNetError(node["op"])
                count = _visible_outputs(node["op"], tuple(sorted(node.get("attrs", {}).items())),
                                         len(node["inputs"]))
            except MXNetError:  # the node alone cannot be built: the internals' own graph
                internals = json.loads(sym.get_internals().tojson(remove_amp_cast=False))
                return [(internals["nodes"][j]["name"], k) for j, k, _ in internals["heads"]]
        keys.extend((node["name"], k) for k in range(count))
    return keys


@functools.lru_cache(maxsize=4096)
def _visible_outputs(op: str, attrs: Tuple[Tuple[str, str], ...], n_inputs: int) -> int:
    """How many outputs ``get_internals()`` lists for one node of ``op`` with ``attrs``: asked of
    MXNet, on a graph of that node alone."""
    nodes = [{"op": "null", "name": f"in{k}", "inputs": []} for k in range(n_inputs)]
    nodes.append({"op": op, "name": "node", "attrs": dict(attrs), "inputs": [[k, 0, 0] for k in range(n_inputs)]})
    graph = {"nodes": nodes, "arg_nodes": list(range(n_inputs)), "heads": [[n_inputs, 0, 0]],
             "attrs": {"mxnet_version": ["int", 10901]}}
    return len(mx.sym.load_json(json.dumps(graph)).get_internals().list_outputs()) - n_inputs
