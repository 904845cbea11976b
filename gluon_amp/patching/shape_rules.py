"""The table's input-shape rules (``OpTable.narrow_fp32``) applied to hybridized blocks' graphs.

Under ``init`` a block's graph is traced with symbols, before any shape is known, so its
low-precision ops are cast to the target then. A call gives the input shapes: the decision
is asked again with them, and the ops it now keeps in float32 are fed float32
(:func:`gluon_amp_core.retype.retype`). A block called later with other shapes is
checked again; if they keep more ops in float32, its graph is rebuilt with those too.
"""
from __future__ import annotations

import json
import weakref
from typing import Mapping, Set, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.decide import Decision, Reason, users_casts
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import Change, retype
from gluon_amp_core.walk import Note, walk

from .. import mxnet_internals as mxi, plan_notes
from ..type_inference import infer_shapes

Shapes = Mapping[str, Tuple[int, ...]]

#: input shapes remembered per block as checked
_CHECKED_SHAPES = 256


class ShapeRules:
    """The shape rules of one policy, and per block the ops they keep in float32 so far."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        table = policy.table
        self.active = table is not None and bool(table.narrow_fp32)
        self._kept: "weakref.WeakKeyDictionary[HybridBlock, frozenset]" = weakref.WeakKeyDictionary()
        #: blocks whose graph holds an op with a rule: the only ones other shapes can change
        self._watched: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()
        #: per block, input shapes found to keep nothing more in float32: ``_kept`` only grows,
        #: so they never will (a graph's shapes and decisions cost a ResNet-50 call's time again)
        self._checked: "weakref.WeakKeyDictionary[HybridBlock, Set[frozenset]]" = weakref.WeakKeyDictionary()

    def watches(self, block: HybridBlock) -> bool:
        """True when other input shapes could keep more of ``block``'s ops in float32."""
        return block in self._watched

    def apply(self, block: HybridBlock, out: Symbol, shapes: Shapes) -> Symbol:
        """``out`` (``block``'s freshly traced graph) with every op the rules keep in float32
        at ``shapes``, or at shapes of earlier calls of ``block``, fed float32.

        ``out`` itself when no op of the graph has a rule (the block is then not watched:
        other shapes cannot change it), or none applies.
        """
        if not self.active:
            return out
        graph = mxi.symbol_graph(out)
        table = self.policy.table
        plan_notes.record(block, "shape_rules", {})
        if not any(table.canonical(n["op"]) in table.narrow_fp32 for n in graph["nodes"]):
            return out
        self._watched.add(block)
        kept = self._kept.get(block, frozenset()) | self._narrow(graph, out, shapes).keys()
        self._remember(block, shapes)
        if not kept:
            return out
        self._kept[block] = frozenset(kept)
        changes = {n["name"]: Change(Decision("float32", Reason.NARROW_INPUT,
                                              table.keep_fp32_inputs.get(table.canonical(n["op"]), frozenset())))
                   for n in graph["nodes"] if n["name"] in kept and n["op"] != "null"}
        op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
        plan_notes.record(block, "shape_rules", {n: Note(Reason.NARROW_INPUT.value) for n in changes})
        return mx.sym.load_json(json.dumps(retype(graph, changes, {}, op_inputs, keep=users_casts(graph))))

    def keeps_more(self, block: HybridBlock, out: Symbol, shapes: Shapes) -> bool:
        """True when ``shapes`` keep an op of ``block``'s graph ``out`` in float32 that its
        graph does not run so yet (it must then be rebuilt)."""
        if not self.active:
            return False
        if frozenset(shapes.items()) in self._checked.get(block, ()):
            return False
        graph = mxi.symbol_graph(out)
        if not self._narrow(graph, out, shapes).keys() <= self._kept.get(block, frozenset()):
            return True  # its rebuild keeps them (``apply`` at these shapes)
        self._remember(block, shapes)
        return False

    def _remember(self, block: HybridBlock, shapes: Shapes) -> None:
        """``shapes`` keep nothing in float32 that ``block``'s graph does not: now or later."""
        checked = self._checked.setdefault(block, set())
        if len(checked) >= _CHECKED_SHAPES:  # shapes that never repeat: bounded, not remembered
            checked.clear()
        checked.add(frozenset(shapes.items()))

    def _narrow(self, graph: dict, out: Symbol, shapes: Shapes) -> dict:
        """Op node name -> its decision, for the nodes the rules keep in float32 at ``shapes``."""
        nodes = graph["nodes"]
        known = infer_shapes(out, shapes)
        decisions = walk(nodes, self.policy.table, lambda e: None, self.policy.excluded,
                         shape_of=lambda e: known.get((nodes[e[0]]["name"], e[1])))
        return {nd.name: nd.decision for nd in decisions if nd.reason is Reason.NARROW_INPUT}
