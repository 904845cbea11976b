"""A parameter's low-precision cast paired with its op's data input, for training. Pure: no MXNet.

A plan casts each float32 weight to the low dtype with one ``amp_cast`` that the op alone
reads. In the backward pass that cast's node turns the weight's low-precision gradient into
the float32 one. MXNet orders the backward pass from the graph inputs' gradients, parameters
last, and that node is reached only from its parameter's gradient: it runs after the whole
backward chain, so every op's low-precision weight gradient waits in a buffer of its own until
the end: a bfloat16 copy of all the weights at once.

:func:`pair_param_casts` casts the op's data input and its parameters together instead, in one
``amp_multicast(data, weight, ..., cast_narrow=True)``: the data is in the low dtype already, so
it passes in place, and the weights are cast to it. Its backward node gives the data's gradient
too, so the backward chain passes through it: it runs as the chain reaches the op, and the
weight gradient's buffer is freed there. Values and dtypes are those of the plan, bit for bit.
The emulated copy does the same with its roundings (:func:`gluon_amp_core.emulate._pair_weight_roundings`).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]

#: Suffix of the multicast that casts an op's data and parameters together.
PAIRED_SUFFIX = "_amp_paired"


def pair_param_casts(graph: dict, dtypes: Mapping[Key, Optional[str]], low_dtype: str) -> Tuple[dict, int]:
    """``graph`` with the casts of parameters that one op alone reads paired with that op's
    data input (module docstring), and how many ops were paired.

    An op is paired where its input 0 is the output of an op node (not a graph input) held in
    ``low_dtype``, not an output of the graph, and some of its other inputs are ``amp_cast``
    nodes to that dtype of a float32 variable, read by this op alone. Other ops may read the
    data too: MXNet's ``amp_multicast`` declares its outputs identities of its inputs
    (``FInplaceIdentity``), so its planner shares the data's buffer all the same.

    ``dtypes``: the dtype of every entry, by (node name, output index), as MXNet infers them;
    ``low_dtype``: the low dtype whose casts are paired. ``graph`` itself (and 0) where nothing
    is paired."""
    nodes = graph["nodes"]
    readers: Dict[Tuple[int, int], int] = {}
    for node in nodes:
        for e in node.get("inputs", []):
            readers[(e[0], e[1])] = readers.get((e[0], e[1]), 0) + 1
    heads = {(h[0], h[1]) for h in graph["heads"]}

    def dtype(e: list) -> Optional[str]:
        return dtypes.get((nodes[e[0]]["name"], e[1]))

    def param_cast(e: list, low: str) -> bool:
        cast = nodes[e[0]]
        if (cast["op"] != "amp_cast" or cast.get("attrs", {}).get("dtype") != low
                or readers.get((e[0], e[1])) != 1 or (e[0], e[1]) in heads):
            return False
        src = cast["inputs"][0]
        return nodes[src[0]]["op"] == "null" and dtype(src) == "float32"

    g = _Rebuilt(graph)
    paired = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        casts: List[int] = []
        data = node["inputs"][0] if len(inputs) > 1 else None
        low = dtype(data) if data is not None else None
        if low == low_dtype and nodes[data[0]]["op"] != "null" and (data[0], data[1]) not in heads:
            casts = [k for k, e in enumerate(node["inputs"]) if k and param_cast(e, low)]
        if not casts:
            g.keep(i, node, inputs)
            continue
        sources = [g.entry(nodes[node["inputs"][k][0]]["inputs"][0]) for k in casts]
        m = g.add({"op": "amp_multicast", "name": f"{node['name']}{PAIRED_SUFFIX}",
                   "attrs": {"num_outputs": str(1 + len(casts)), "cast_narrow": "True"},
                   "inputs": [inputs[0], *sources]})
        inputs[0] = [m, 0, 0]
        for n, k in enumerate(casts, start=1):
            inputs[k] = [m, n, 0]
        g.keep(i, node, inputs)
        paired += 1
    return (g.result(), paired) if paired else (graph, 0)
