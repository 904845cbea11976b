"""Casts moved ahead of the reshapes that read a 5-d low-precision value. Pure: no MXNet.

MXNet 1.9.1 cannot convert the dtype of a reshaped view of a oneDNN 5-d bfloat16 array: in a
bound graph, a ``Convolution`` or ``Pooling`` over a 3-d map (its output in a blocked 5-d
layout), then a ``Reshape``, ``Flatten``, ``expand_dims`` or ``reshape_like`` that changes its
rank (numpy mode's ``reshape`` too), then an ``amp_cast`` or ``amp_multicast`` to float32,
fails with "could not create a primitive descriptor for a reorder primitive". GluonCV's C3D
(a segment consensus: reshape, then a float32 ``mean``) and its non-local I3D networks
(reshapes before ``batch_dot`` and ``softmax``) meet it under ``init`` (hybridized) and
converted. Imperative calls, 4-d (2-d map) and 3-d values, and the same cast ahead of the
reshape all run.

:func:`casts_before_views` gives each such cast the value before the reshape, and reshapes
the cast value instead: the same values and dtypes, one more reshape (a view) where the old
one still has other readers.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]

#: Ops that give their input's values in another shape (MXNet's names in a graph's JSON).
VIEW_OPS = frozenset({"Reshape", "Flatten", "expand_dims", "reshape_like", "_np_reshape", "_npx_reshape"})
#: Suffixes of the cast taken ahead of a reshape, and of the reshape of its value.
CAST_SUFFIX, VIEW_SUFFIX = "_amp_cast_ahead", "_amp_of_cast"
#: The least rank of a value whose reshaped view MXNet cannot cast.
MIN_RANK = 5


def casts_before_views(graph: dict, dtypes: Mapping[Key, Optional[str]],
                       shapes: Mapping[Key, Optional[Tuple[int, ...]]], low: str) -> Tuple[dict, int]:
    """``graph`` (MXNet's JSON form) with every ``amp_cast``/``amp_multicast`` input that casts a
    :data:`VIEW_OPS` node's output away from ``low``, where that node reads a ``low`` value of
    at least :data:`MIN_RANK` dimensions (or of unknown shape), read instead from the same view
    op applied to that value cast first (module docstring); and how many inputs moved.
    ``dtypes``/``shapes``: entries' dtypes and shapes by (node name, output index), as MXNet
    infers them. ``graph`` itself (and 0) where none is."""
    nodes = graph["nodes"]

    def behind(e: list) -> Optional[list]:
        """The entry a view op at ``e`` reads, where it is such a value."""
        view = nodes[e[0]]
        if view["op"] not in VIEW_OPS or not view["inputs"]:
            return None
        src = view["inputs"][0]
        key = (nodes[src[0]]["name"], src[1])
        shape = shapes.get(key)
        return src if dtypes.get(key) == low and (shape is None or len(shape) >= MIN_RANK) else None

    g = _Rebuilt(graph)
    made: Dict[Tuple[int, str], int] = {}  # (view node, dtype) -> the new view of the cast value
    moved = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        if node["op"] in ("amp_cast", "amp_multicast"):
            for k, e in enumerate(node["inputs"]):
                out_key = (node["name"], 0 if node["op"] == "amp_cast" else k)
                dtype = node.get("attrs", {}).get("dtype") if node["op"] == "amp_cast" else dtypes.get(out_key)
                src = behind(e)
                if src is None or dtype is None or dtype == low:
                    continue
                if (e[0], dtype) not in made:
                    view = nodes[e[0]]
                    cast = g.add({"op": "amp_cast", "name": f"{view['name']}{CAST_SUFFIX}_{dtype}",
                                  "attrs": {"dtype": dtype}, "inputs": [g.entry(src)]})
                    rest: List[List[int]] = [g.entry(x) for x in view["inputs"][1:]]
                    made[(e[0], dtype)] = g.add({**view, "name": f"{view['name']}{VIEW_SUFFIX}_{dtype}",
                                                 "inputs": [[cast, 0, 0]] + rest})
                inputs[k] = [made[(e[0], dtype)], 0, 0]
                moved += 1
        g.keep(i, node, inputs)
    return (g.result(), moved) if moved else (graph, 0)
