"""Casts of graph inputs whose gradients accumulate (``grad_req='add'``). Pure: no MXNet.

MXNet 1.9.1's CPU ``amp_cast`` between float32 and bfloat16 runs a oneDNN reorder that drops a
result written with ``req=kAddTo``; ``amp_multicast`` runs the same code. So where the backward
node of such a cast writes a variable's gradient and that gradient accumulates (``grad_req=
'add'``: gradient accumulation, GluonNLP's ``train_transformer.py``), the gradient stays zero and
the parameter never trains. (MXNet's ``Cast`` accumulates, but it rounds to bfloat16 toward
zero, where ``amp_cast`` rounds to nearest even: not the plan's values.)

:func:`cast_accumulating_inputs` has such a cast read the variable through an ``identity``:
the cast's backward then writes the identity's gradient, which nothing accumulates into, and
the identity's backward adds it to the variable's (MXNet's ``_copy`` honours ``kAddTo``). The
cast, its values and dtypes are the plan's; the identity costs one float32 copy of the variable.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Mapping, Optional, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]

#: Suffix of the identity put between an accumulating variable and its cast.
IDENTITY_SUFFIX = "_amp_accumulating"


def cast_accumulating_inputs(graph: dict, dtypes: Mapping[Key, Optional[str]], low_dtype: str,
                             accumulating: Optional[Collection[str]]) -> Tuple[dict, int]:
    """``graph`` with an ``identity`` between each float32 variable named in ``accumulating``
    (``None``: every variable) and the ``amp_cast``/``amp_multicast`` nodes that cast it to
    ``low_dtype`` (module docstring), and how many casts read one.

    ``dtypes``: every entry's dtype, by (node name, output index), as MXNet infers them.
    ``graph`` itself (and 0) where nothing changes."""
    nodes = graph["nodes"]

    def accumulates(e: List[int]) -> bool:
        node = nodes[e[0]]
        return (node["op"] == "null" and dtypes.get((node["name"], e[1])) == "float32"
                and (accumulating is None or node["name"] in accumulating))

    g = _Rebuilt(graph)
    through: Dict[int, int] = {}  # variable -> its identity (one per variable)
    changed = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        op, attrs = node["op"], node.get("attrs", {})
        low = ((op == "amp_cast" and attrs.get("dtype") == low_dtype)
               or (op == "amp_multicast" and dtypes.get((node["name"], 0)) == low_dtype))
        for k, e in enumerate(node.get("inputs", [])):
            if low and accumulates(e):
                if e[0] not in through:
                    through[e[0]] = g.add({"op": "_copy", "name": f"{nodes[e[0]]['name']}{IDENTITY_SUFFIX}",
                                           "inputs": [inputs[k]]})
                inputs[k] = [through[e[0]], 0, 0]
                changed += 1
        g.keep(i, node, inputs)
    return (g.result(), changed) if changed else (graph, 0)
