"""A dynamic loss scale for graph loss heads, in the graph that is run. Pure: JSON dicts only.

A loss head (``SoftmaxOutput``, ``MakeLoss``...) starts its backward from its own
``grad_scale``, so a scale that changes every few steps cannot be put there without
building the executor again. Instead, the graph that is bound (never the user's) feeds each
head's data input ``x`` through an exact identity whose gradient is multiplied by ``s``, a
float32 argument of shape ``(1,)`` set before each backward::

    y = BlockGrad(x) + (x - BlockGrad(x)) * s

Forward, ``x - x`` is exactly 0 for every finite ``x``, so ``y == x`` bit for bit (a
non-finite ``x`` stays non-finite). Backward, only the second term passes a gradient: ``g * s``.
A head input that is not float32 is multiplied in float32 and cast back.

Where the input's rank is known, ``s`` is broadcast to the input's shape in the forward pass
(``broadcast_like`` of ``s`` reshaped to that rank) and multiplied elementwise: MXNet 1.9.1 runs
the backward of ``broadcast_mul`` on a CPU as a generic reduction, even for the operand of the
output's shape (20 ms on a 128 x 10,000 softmax head; elementwise, 4 ms). The backward then
multiplies by the ``s`` the forward pass read, so ``s`` must hold the step's scale before it.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: MXNet's type flag of float32 in a variable's ``__dtype__`` attribute.
_FLOAT32_FLAG = "0"


def loss_heads(graph: Dict[str, Any], head_ops: Sequence[str]) -> List[int]:
    """Indices of the nodes among ``graph``'s outputs whose op is in ``head_ops``."""
    nodes = graph["nodes"]
    return sorted({h[0] for h in graph["heads"] if nodes[h[0]]["op"] in head_ops})


def scale_loss_heads(graph: Dict[str, Any], head_ops: Sequence[str], scale_name: str,
                     input_dtype: Optional[Callable[[int, int], Optional[str]]] = None,
                     input_rank: Optional[Callable[[int, int], Optional[int]]] = None
                     ) -> Tuple[Dict[str, Any], List[str]]:
    """A copy of ``graph`` (MXNet symbol JSON, parsed) whose loss heads' data inputs pass
    through the scaled identity, and the names of the heads it reached.

    ``scale_name`` names the new float32 ``(1,)`` argument. ``input_dtype(node, output)``
    gives the dtype of a node's output where known (``None``: float32); ``input_rank(node,
    output)`` its number of axes where known (``None``: the scale is multiplied by
    ``broadcast_mul``, which reads it in the backward pass). A graph without a loss head is
    returned unchanged (a copy), with no new argument.
    """
    nodes = graph["nodes"]
    names = {n["name"] for n in nodes}
    if scale_name in names:
        raise ValueError(f"the graph already has a node named {scale_name!r}")
    heads = set(loss_heads(graph, head_ops))
    if not heads:
        return copy.deepcopy(graph), []
    out: List[Dict[str, Any]] = [{"op": "null", "name": scale_name,
                                  "attrs": {"__shape__": "(1,)", "__dtype__": _FLOAT32_FLAG}, "inputs": []}]
    new_index: Dict[int, int] = {}

    def add(op: str, name: str, inputs: List[List[int]], attrs: Optional[Dict[str, str]] = None) -> List[int]:
        node: Dict[str, Any] = {"op": op, "name": _fresh(name, names), "inputs": inputs}
        if attrs:
            node["attrs"] = attrs
        out.append(node)
        return [len(out) - 1, 0, 0]

    def entry(e: Sequence[int]) -> List[int]:
        return [new_index[e[0]], e[1], e[2] if len(e) > 2 else 0]

    reached = []
    for i, node in enumerate(nodes):
        node = copy.deepcopy(node)
        node["inputs"] = [entry(e) for e in node["inputs"]]
        if i in heads and node["inputs"]:
            x = node["inputs"][0]
            old = nodes[i]["inputs"][0]
            dtype = (input_dtype(old[0], old[1]) if input_dtype else None) or "float32"
            base = node["name"] + "_amp_scale"
            blocked = add("BlockGrad", base + "_block", [x])
            zero = add("elemwise_sub", base + "_zero", [x, blocked])
            if dtype != "float32":
                zero = add("amp_cast", base + "_to32", [zero], {"dtype": "float32"})
            rank = input_rank(old[0], old[1]) if input_rank else None
            if rank:
                shaped = add("Reshape", base + "_rank", [[0, 0, 0]], {"shape": str((1,) * rank)})
                full = add("broadcast_like", base + "_like", [shaped, zero])
                scaled = add("elemwise_mul", base + "_mul", [zero, full])
            else:
                scaled = add("broadcast_mul", base + "_mul", [zero, [0, 0, 0]])
            if dtype != "float32":
                scaled = add("amp_cast", base + "_back", [scaled], {"dtype": dtype})
            node["inputs"][0] = add("elemwise_add", base, [blocked, scaled])
            reached.append(node["name"])
        out.append(node)
        new_index[i] = len(out) - 1
    result = {k: copy.deepcopy(v) for k, v in graph.items() if k not in ("nodes", "arg_nodes", "node_row_ptr",
                                                                          "heads")}
    result["nodes"] = out
    result["arg_nodes"] = [i for i, n in enumerate(out) if n["op"] == "null"]
    result["heads"] = [entry(h) for h in graph["heads"]]
    return result, reached


def _fresh(name: str, taken: set) -> str:
    """``name``, or ``name_1``, ``name_2``... where taken; the result is taken from now on."""
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    taken.add(candidate)
    return candidate
