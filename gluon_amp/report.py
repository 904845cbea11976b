"""Precision report: every op of a graph with its dtype and why."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from .convert.graph import REASON_ATTR
from .decide import decide
from .graph_types import infer_dtypes
from .patching import current_table, make_table
from .table import OpTable


@dataclass(frozen=True)
class OpRow:
    name: str
    op: str
    dtype: str
    reason: str


@dataclass
class Report:
    """Rows per op node, plus totals. ``str(report)`` is a readable table."""

    target_dtype: str
    rows: List[OpRow]
    casts: int
    totals_by_dtype: Dict[str, int] = field(default_factory=dict)
    totals_by_reason: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"target_dtype": self.target_dtype, "casts": self.casts,
                "totals_by_dtype": self.totals_by_dtype, "totals_by_reason": self.totals_by_reason,
                "ops": [r.__dict__ for r in self.rows]}

    def __str__(self) -> str:
        w = max([len(r.name) for r in self.rows] + [4])
        lines = [f"{'node':<{w}}  {'op':<22} {'dtype':<9} reason", "-" * (w + 45)]
        lines += [f"{r.name:<{w}}  {r.op:<22} {r.dtype:<9} {r.reason}" for r in self.rows]
        lines += ["", f"ops by dtype:  {dict(sorted(self.totals_by_dtype.items()))}",
                  f"ops by reason: {dict(sorted(self.totals_by_reason.items()))}",
                  f"casts: {self.casts}  (target dtype {self.target_dtype})"]
        return "\n".join(lines)


def _graph_of(obj: Any) -> Symbol:
    if isinstance(obj, Symbol):
        return obj
    if isinstance(obj, HybridBlock):
        cached = getattr(obj, "_cached_graph", ())
        if not cached:
            raise RuntimeError("the block has no cached graph: hybridize() it and run one forward pass "
                               "before gluon_amp.report(block).")
        return cached[1]
    raise TypeError(f"report expects a Symbol or a hybridized HybridBlock, got {type(obj).__name__}")


def report(symbol_or_block: Any, target_dtype: Optional[str] = None, **input_types: Any) -> Report:
    """List every op of a graph with its dtype and the reason for it.

    Works on training graphs built under :func:`gluon_amp.init` and on converted
    inference graphs. Data inputs default to float32; pass ``name=dtype`` to change one.
    Reasons come from the op table (``low_precision``, ``fp32``, ``conditional_fp32``,
    ``widest``, ``neutral``...) or ``excluded`` for nodes the converter forced to float32.
    """
    sym = _graph_of(symbol_or_block)
    table: OpTable = current_table() or make_table(target_dtype)
    if target_dtype is not None and table.target_dtype != target_dtype:
        table = make_table(target_dtype)
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    nodes = graph["nodes"]
    attrs = sym.attr_dict()
    known = {n: "float32" for n in sym.list_inputs() if "__dtype__" not in attrs.get(n, {})}
    by_name = infer_dtypes(sym, {**known, **input_types})
    if by_name is None:
        raise ValueError("could not infer the graph's dtypes; pass the dtype of every data input, "
                         f"e.g. report(sym, data='float32'); inputs: {sym.list_inputs()[:8]}")

    def out_type(i: int, k: int) -> Optional[str]:
        return by_name.get((nodes[i]["name"], k))

    rows, casts = [], 0
    for i, node in enumerate(nodes):
        op = node["op"]
        if op == "null":
            continue
        if op in ("amp_cast", "amp_multicast"):
            casts += 1
            continue
        in_types = [out_type(e[0], e[1]) for e in node["inputs"]]
        node_attrs = node.get("attrs", {})
        if node_attrs.get(REASON_ATTR) == "excluded":
            reason = "excluded"
        else:
            d = decide(op, node_attrs, in_types, table)
            reason = d.reason
            rule = table.conditions.get(table.canonical(op))
            if rule is not None:
                reason += f" ({rule.attr}={node_attrs.get(rule.attr, 'default')})"
        rows.append(OpRow(node["name"], op, out_type(i, 0) or "?", reason))
    return Report(table.target_dtype, rows, casts,
                  dict(Counter(r.dtype for r in rows)), dict(Counter(r.reason.split(" ")[0] for r in rows)))
