"""Where a converted block is bound: slow ops of same-shape bfloat16 values run as their twins.

The plan keeps ``_npi_add``, ``broadcast_add`` and numpy's relu in float32 (their bfloat16 loops
are slow); at the shapes a converter's result is bound with, outside autograd, those whose inputs
have one shape and come from bfloat16 ops run as ``elemwise_add`` or ``Activation`` in bfloat16
(:mod:`gluon_amp_core.same_shape`), in what runs only: the plan, what ``export`` writes, is never
changed. MXNet does not bind a block again for a call at other shapes, so such a call asks
:func:`outgrown` first: where a twin's inputs no longer have one shape, the block is bound again
(at those shapes) before the call.

Not for a graph that trains: in numpy mode, d2l's residual net trained 4x slower with them (its
bfloat16 gradients reached the batch norms in a plain layout, and oneDNN's reference kernel
ran them), so ``init``'s blocks and a converted block bound under ``autograd.record`` keep the plan.
"""
from __future__ import annotations

import json
import weakref
from typing import Dict, FrozenSet, Mapping, Optional, Set, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.decide import Decision, Reason, users_casts
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import Change, retype
from gluon_amp_core.same_shape import follows_safely, heads_as_before, one_shape_still, renamed, twins_to_run
from gluon_amp_core.walk import Note

from . import mxnet_internals as mxi, plan_notes
from .tuning.casts import with_fewer_casts
from .type_inference import infer_dtypes, infer_shapes

Shapes = Mapping[str, Tuple[int, ...]]


class _Bound:
    """A block's run graph with twins: the graph, the twins' names, the call shapes known to fit."""

    def __init__(self, graph: dict, names: FrozenSet[str], shapes: Shapes) -> None:
        self.graph, self.names = graph, names
        self.fits: Set[Tuple] = {_key(shapes)}


_BOUND: "weakref.WeakKeyDictionary[HybridBlock, _Bound]" = weakref.WeakKeyDictionary()


def _key(shapes: Shapes) -> Tuple:
    return tuple(sorted(shapes.items()))


def with_twins(block: HybridBlock, plan: Symbol, known: Mapping[str, str], shapes: Shapes,
               policy: Optional[Policy]) -> Symbol:
    """``plan`` as ``block`` runs it at ``shapes`` (its inputs typed ``known``): each slow op the
    table has a twin for, fed values of one shape from ops in the target dtype, running as that
    twin in the target dtype, and the casts that no longer convert anything gone. A twin
    in the target passes it on to the ops that follow (a residual stream's next add may then
    have a twin too: found again until none is). ``plan`` itself where there is none, where an
    op that must not (float32, a slow loop) would then read the target dtype, or where MXNet
    does not type the result. Remembers the block's twins for :func:`outgrown`."""
    _BOUND.pop(block, None)
    plan_notes.record(block, "same_shape_twins", {})
    table = policy.table if policy is not None and policy.enabled else None
    if table is None or not table.same_shape_twins or not shapes:
        return plan
    graph = mxi.symbol_graph(plan)
    if not any(table.canonical(n["op"]) in table.same_shape_twins for n in graph["nodes"]):
        return plan
    entry_shapes = infer_shapes(plan, shapes)
    keep = users_casts(graph)
    first = typed = infer_dtypes(plan, known, partial=True) or {}
    op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
    low = Change(Decision(table.target_dtype, Reason.WIDEST))
    run, twins = plan, {}
    while True:
        nodes = graph["nodes"]

        def name(e: Tuple[int, int], nodes: list = nodes) -> Tuple[str, int]:
            return nodes[e[0]]["name"], e[1]

        found = twins_to_run(graph, table, lambda e: entry_shapes.get(name(e)), lambda e: typed.get(name(e)), keep)
        if not found:
            break
        twins.update(found)
        graph = retype(renamed(graph, found), {n: low for n in found}, typed, op_inputs, keep=keep)
        run = mx.sym.load_json(json.dumps(graph))
        typed = infer_dtypes(run, known, partial=True)
        if not typed:
            return plan
    if not twins or not follows_safely(graph, table, lambda n, i: first.get((n, i)), lambda n, i: typed.get((n, i)),
                                       twins):
        return plan
    run = mx.sym.load_json(json.dumps(heads_as_before(graph, lambda n, i: first.get((n, i)),
                                                      lambda n, i: typed.get((n, i)))))
    run, _ = with_fewer_casts(run, known, table, keep=keep)
    if not infer_dtypes(run, known, partial=True):
        return plan
    _BOUND[block] = _Bound(mxi.symbol_graph(run), frozenset(twins), shapes)
    plan_notes.record(block, "same_shape_twins", {
        n: Note(Reason.SLOW_KERNEL.value, f"runs as {op} in {table.target_dtype} at the bound shapes "
                                          f"({', '.join(f'{k}: {v}' for k, v in sorted(shapes.items()))})")
        for n, (op, _) in twins.items()})
    return mxi.like_frontend(plan, run)


def outgrown(block: HybridBlock, shapes: Shapes) -> bool:
    """True when ``block`` runs twins that a call at ``shapes`` (its inputs') would feed two
    values of different shapes: its CachedOp must be built again at them. Asked per call only
    of blocks bound with twins; each fitting set of shapes is inferred once."""
    bound = _BOUND.get(block)
    if bound is None or _key(shapes) in bound.fits:
        return False
    sym = mx.sym.load_json(json.dumps(bound.graph))
    entry_shapes = infer_shapes(sym, shapes)
    nodes = bound.graph["nodes"]
    if one_shape_still(bound.graph, bound.names, lambda e: entry_shapes.get((nodes[e[0]]["name"], e[1]))):
        bound.fits.add(_key(shapes))
        return False
    return True


def twins_of(block: HybridBlock) -> FrozenSet[str]:
    """The names of the nodes ``block``'s run graph runs as their twins (none: empty)."""
    bound = _BOUND.get(block)
    return bound.names if bound is not None else frozenset()


def call_shapes(block: HybridBlock, args: tuple) -> Dict[str, Tuple[int, ...]]:
    """The shapes of a call's inputs, by the block's graph's input names."""
    return mxi.call_shapes(args, block._cached_graph[0]) if block._cached_graph else {}
