"""A value read only for its shape gets no gradient pass. Pure: no MXNet.

GluonCV's SSD makes each feature map's anchors with ``slice_like(anchors, feature * 0)``: the
feature's values are never used, only its shape. MXNet's gradient pass still runs that
path backward (``_backward_slice_like`` writes zeros of the feature's shape, then
``_backward_mul_scalar`` and the cast's backward), and adds its zeros, a plain array, to the
feature's real gradients. A gradient sum (``add_n``) with one plain input leaves oneDNN's sum
for MXNet's own loop, whose output is plain too: in bfloat16 that loop converts each input to
float32 and back, and the plain gradient then runs every block of the stage before it
(SSD-512 at batch 8: 22 such conversions of 8x1024x32x32 values a step).

:func:`stop_shape_only_gradients` puts a ``BlockGrad`` where a value enters such a path: its
gradient there is MXNet's zero node, which the gradient sum leaves out, and nothing of the
path runs backward. Values are unchanged, and so is every gradient (a sum less a zero).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Set, Tuple

from .retype import _Rebuilt

#: Ops and the inputs of theirs whose values they never read, only the shape.
SHAPE_ONLY_INPUTS: Mapping[str, Tuple[int, ...]] = {
    "slice_like": (1,), "reshape_like": (1,), "broadcast_like": (1,),
    "zeros_like": (0,), "ones_like": (0,), "shape_array": (0,), "size_array": (0,),
}
#: Suffix of the ``BlockGrad`` put where a value enters a path read only for its shape.
STOP_SUFFIX = "_amp_shape_only"


def shape_only_nodes(graph: dict) -> Set[int]:
    """The op nodes of ``graph`` (MXNet's JSON form) whose outputs reach the graph's outputs
    only through inputs that :data:`SHAPE_ONLY_INPUTS` names (an output of the graph never is)."""
    nodes = graph["nodes"]
    heads = {h[0] for h in graph["heads"]}
    readers: Dict[int, List[Tuple[int, int]]] = {}
    for j, node in enumerate(nodes):
        for pos, e in enumerate(node.get("inputs", [])):
            readers.setdefault(e[0], []).append((j, pos))
    only: Set[int] = set()
    for i in range(len(nodes) - 1, -1, -1):  # readers come after what they read
        if nodes[i]["op"] == "null" or i in heads or i not in readers:
            continue
        if all(j in only or pos in SHAPE_ONLY_INPUTS.get(nodes[j]["op"], ()) for j, pos in readers[i]):
            only.add(i)
    return only


def stop_shape_only_gradients(graph: dict) -> Tuple[dict, int]:
    """``graph`` with a ``BlockGrad`` on each edge from an op node whose value is used to a
    path that reads it only for its shape (:func:`shape_only_nodes`, or the shape-only input
    itself), one per value; and how many values got one. ``graph`` itself (and 0) where none
    does. Graph inputs are left: MXNet computes no gradient for one nobody asks about."""
    nodes = graph["nodes"]
    only = shape_only_nodes(graph)

    def enters(node: dict, pos: int, src: int) -> bool:
        return (src not in only and nodes[src]["op"] != "null"
                and (pos in SHAPE_ONLY_INPUTS.get(node["op"], ()) or id(node) in only_ids))

    only_ids = {id(nodes[i]) for i in only}
    g = _Rebuilt(graph)
    stops: Dict[Tuple[int, int], int] = {}
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        for pos, e in enumerate(node.get("inputs", [])):
            if enters(node, pos, e[0]):
                key = (e[0], e[1])
                if key not in stops:
                    stops[key] = g.add({"op": "BlockGrad", "name": f"{nodes[e[0]]['name']}{STOP_SUFFIX}{e[1] or ''}",
                                        "attrs": {}, "inputs": [inputs[pos]]})
                inputs[pos] = [stops[key], 0, 0]
        g.keep(i, node, inputs)
    return (g.result(), len(stops)) if stops else (graph, 0)
