"""What gluon_amp knows of a hybridized block's plan beyond its graph, kept beside the graph.

A plan is a plain MXNet graph: its nodes carry no attribute of gluon_amp's (MXNet hands every
node attribute to a Python custom op's constructor, and ``export``, ``tojson`` and the
converters read the graph as it is). What the precision report needs besides the graph is
kept through these functions, per block and keyed by node name, by whoever made it, in the
block's record in :mod:`gluon_amp.state` (:func:`gluon_amp.state.block_record`: one home for
process state, one ``reset``):

- the reasons of decisions taken once shapes were known (the shape rules, the tuner), with
  the tuner's figures (:class:`gluon_amp_core.walk.Note`), one set per source, replaced
  each time that source rebuilds the block's graph;
- for a block that runs its plan emulated, the dtypes real AMP gives its nodes.

Converted results keep theirs in their ``amp_result`` (:class:`gluon_amp_core.graph_pass.PassResult`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

import mxnet as mx

from gluon_amp_core.decide import users_casts
from gluon_amp_core.graph_pass import without_amp_casts
from gluon_amp_core.walk import Note

from . import state


def record(block: object, source: str, notes: Mapping[str, Note]) -> None:
    """Keep ``notes`` (node name -> note) as what ``source`` says of ``block``'s current graph,
    replacing what it said before (nothing, when ``notes`` is empty)."""
    by_source = state.block_record(block).notes
    if notes:
        by_source[source] = dict(notes)
    else:
        by_source.pop(source, None)


def notes(block: object) -> Dict[str, Note]:
    """Node name -> note, for ``block``'s current graph (later sources win)."""
    out: Dict[str, Note] = {}
    kept = state.process.blocks.get(block)
    for by_node in (kept.notes if kept is not None else {}).values():
        out.update(by_node)
    return out


def _keep(block: object, field: str, value: Any) -> None:
    """Set ``field`` of ``block``'s record; ``None`` clears it without creating a record."""
    if value is not None:
        setattr(state.block_record(block), field, value)
    elif (kept := state.process.blocks.get(block)) is not None:
        setattr(kept, field, None)


def record_emulated(block: object, real_dtypes: Optional[Mapping[str, str]]) -> None:
    """``block`` runs its plan emulated, and ``real_dtypes`` (node name -> dtype) are the
    plan's; ``None``: it runs its graph as it is."""
    _keep(block, "real_dtypes", None if real_dtypes is None else dict(real_dtypes))


def emulated_dtypes(block: object) -> Optional[Dict[str, str]]:
    """The plan's dtypes by node name where ``block`` runs its plan emulated, else ``None``."""
    kept = state.process.blocks.get(block)
    return kept.real_dtypes if kept is not None else None


def record_traced(block: object, traced: Any, given: Any) -> None:
    """``block``'s graph ``traced`` under ``init`` became ``given`` (the graph the block keeps):
    a converter reads the block's FP32 graph from it (the symbolic wrappers' casts in it)."""
    state.block_record(block).traced = (traced, given)


def traced_graph(block: object, kept: Any) -> Optional[Any]:
    """The graph traced under ``init`` that ``block``'s graph ``kept`` was made from, or
    ``None`` when ``kept`` is not one the block hooks made (traced without AMP, or given)."""
    kept_by = state.process.blocks.get(block)
    traced = kept_by.traced if kept_by is not None else None
    return traced[0] if traced is not None and traced[1] is kept else None


def fp32_graph(block: object, kept: Any) -> Any:
    """``block``'s FP32 graph, given the graph ``kept`` it keeps: ``kept`` itself, or where it
    was made under ``init`` (:func:`traced_graph`), the traced graph without the plan's casts
    (any policy's; the user's own casts stay), as a legacy Symbol."""
    traced = traced_graph(block, kept)
    if traced is None:
        return kept
    graph = json.loads(traced.tojson(remove_amp_cast=False))
    return mx.sym.load_json(json.dumps(without_amp_casts(graph, keep=users_casts(graph))))


def record_fed(block: object, dtypes: Mapping[str, str]) -> None:
    """``block``'s executor was built for inputs of ``dtypes`` (graph input name -> dtype): data
    an O2 boundary or GPU-style code feeds low, parameters as stored."""
    state.block_record(block).fed = dict(dtypes)


def fed_dtypes(block: object) -> Dict[str, str]:
    """The input dtypes ``block``'s executor was last built for (:func:`record_fed`), else ``{}``."""
    kept = state.process.blocks.get(block)
    return dict(kept.fed or {}) if kept is not None else {}


def record_plan_heads(block: object, heads: Optional[Sequence[Optional[str]]]) -> None:
    """The dtypes of ``block``'s plan outputs before measured choices retyped its graph
    (the tuner), where they did; ``None``: the graph is the plan as decided without timings."""
    _keep(block, "plan_heads", None if heads is None else list(heads))


def plan_heads(block: object) -> Optional[List[Optional[str]]]:
    """What :func:`record_plan_heads` kept for ``block``, else ``None``."""
    kept = state.process.blocks.get(block)
    return kept.plan_heads if kept is not None else None
