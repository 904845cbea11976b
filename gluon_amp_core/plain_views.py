"""A reshape of a 5-d low-precision value reads a plain copy of it. Pure: no MXNet.

MXNet 1.9.1 cannot use a reshaped view of a oneDNN bfloat16 array of 5 dimensions held in a
blocked layout (the output of a ``Convolution``, ``Pooling`` or batch norm over a 3-d map): in a
bound graph, a ``Reshape``, ``Flatten``, ``expand_dims``, ``reshape_like`` or numpy mode's
``reshape`` of it (to any other shape), then an op that must reorder it (``amp_cast`` to
float32, ``Concat``, ``elemwise_add``, ``softmax``; a 2-d convolution, pooling or batch norm
after a second reshape), fails with "could not create a primitive descriptor for a reorder
primitive" (or "... for a sum primitive"). GluonCV's C3D (a segment consensus: reshape, then a float32 ``mean``)
and its non-local I3D networks (reshapes before ``batch_dot`` and ``softmax``) meet it under
``init`` (hybridized) and converted. Imperative calls, 4-d and 3-d values, and values that an
op without a oneDNN kernel copied first (``slice_axis``, ``transpose``, ``clip``) all run.

:func:`plain_before_views` has each such view read ``slice_axis`` of the whole value (a copy
in the plain layout, as MXNet gives any op without a oneDNN kernel): the same values and
dtypes, one copy of the value per reshaped value.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]

#: Ops that give their input's values in another shape (MXNet's names in a graph's JSON).
VIEW_OPS = frozenset({"Reshape", "Flatten", "expand_dims", "reshape_like", "_np_reshape", "_npx_reshape"})
#: Suffix of the plain copy a view reads.
PLAIN_SUFFIX = "_amp_plain"
#: The least rank of a value whose reshaped view MXNet cannot use.
MIN_RANK = 5


def plain_before_views(graph: dict, dtypes: Mapping[Key, Optional[str]],
                       shapes: Mapping[Key, Optional[Tuple[int, ...]]], low: str) -> Tuple[dict, int]:
    """``graph`` (MXNet's JSON form) with each :data:`VIEW_OPS` node that reads a ``low`` value of
    at least :data:`MIN_RANK` dimensions (or of unknown shape) from an op reading it through a
    ``slice_axis`` of the whole value (module docstring), one per value; and how many views do.
    A view that gives the value its own shape again is left as it is. ``dtypes``/``shapes``:
    entries' dtypes and shapes by (node name, output index), as MXNet infers them. ``graph``
    itself (and 0) where none is."""
    nodes = graph["nodes"]

    def needs_copy(node: dict) -> bool:
        if node["op"] not in VIEW_OPS or not node["inputs"]:
            return False
        src = node["inputs"][0]
        if nodes[src[0]]["op"] == "null":  # a graph input: MXNet gives it in the plain layout
            return False
        key = (nodes[src[0]]["name"], src[1])
        shape = shapes.get(key)
        if dtypes.get(key) != low or (shape is not None and len(shape) < MIN_RANK):
            return False
        return shape is None or shapes.get((node["name"], 0)) != shape

    g = _Rebuilt(graph)
    made: Dict[Tuple[int, int], int] = {}  # source entry -> its plain copy
    copied = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        if needs_copy(node):
            src = node["inputs"][0]
            if (src[0], src[1]) not in made:
                made[(src[0], src[1])] = g.add({"op": "slice_axis", "name": f"{nodes[src[0]]['name']}{PLAIN_SUFFIX}",
                                                "attrs": {"axis": "0", "begin": "0", "end": "None"},
                                                "inputs": [inputs[0]]})
            inputs[0] = [made[(src[0], src[1])], 0, 0]
            copied += 1
        g.keep(i, node, inputs)
    return (g.result(), copied) if copied else (graph, 0)
