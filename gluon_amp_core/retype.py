"""Run some op nodes of an already-cast graph in float32. Pure: no MXNet.

A hybridized block's graph under ``init`` is traced before any shape is known, so a
decision that depends on input shapes (``decide(..., input_shapes=...)``) can only be
applied once the first call gives them: :func:`feed_float32` rewires the graph then.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Mapping, Sequence, Tuple

from .dtypes import LOW_PRECISION_DTYPES
from .walk import REASON_ATTR


def feed_float32(graph: dict, nodes: Mapping[str, Collection[str]],
                 op_inputs: Mapping[str, Sequence[str]], reason: str) -> dict:
    """``graph`` (MXNet's JSON form) with the named op nodes fed float32 inputs.

    Parameters
    ----------
    graph : dict
        ``json.loads(sym.tojson(remove_amp_cast=False))`` of a graph whose casts are in place.
    nodes : mapping
        Op node name -> the declared input names it keeps as they are (normalisation
        parameters).
    op_inputs : mapping
        Op name -> declared input names.
    reason : str
        Recorded on each rewired node (``REASON_ATTR``), as the converter records its own.

    Each other input is read from before its ``amp_cast`` to a low-precision dtype, when it
    has one (no rounding on the way), and cast to float32 (``amp_cast`` leaves float32
    tensors and non-float inputs as they are). The op's output dtype follows its inputs;
    the graph's consumers were traced without dtypes, so they accept it. The casts left
    without a consumer are dropped.
    """
    old = graph["nodes"]
    out: List[dict] = []
    index: Dict[int, int] = {}
    casts: Dict[Tuple[int, int], int] = {}
    for i, node in enumerate(old):
        inputs = [[index[e[0]], e[1], 0] for e in node["inputs"]]
        if node["op"] != "null" and node["name"] in nodes:
            keep, declared = nodes[node["name"]], op_inputs.get(node["op"], ())
            for k, e in enumerate(node["inputs"]):
                if k < len(declared) and declared[k] in keep:
                    continue
                src = old[e[0]]
                if src["op"] == "amp_cast" and src.get("attrs", {}).get("dtype") in LOW_PRECISION_DTYPES:
                    e = src["inputs"][0]
                key = (index[e[0]], e[1])
                if key not in casts:
                    out.append({"op": "amp_cast", "name": f"{node['name']}_amp_cast_float32_{k}",
                                "attrs": {"dtype": "float32"}, "inputs": [[key[0], key[1], 0]]})
                    casts[key] = len(out) - 1
                inputs[k] = [casts[key], 0, 0]
            node = {**node, "attrs": {**node.get("attrs", {}), REASON_ATTR: reason}}
        out.append({**node, "inputs": inputs})
        index[i] = len(out) - 1
    heads = [[index[h[0]], h[1], 0] for h in graph["heads"]]
    return _reachable(graph, out, heads)


def _reachable(graph: dict, nodes: List[dict], heads: List[list]) -> dict:
    """The graph of ``nodes`` keeping only what the heads read (and every variable)."""
    used = {h[0] for h in heads}
    for j in range(len(nodes) - 1, -1, -1):
        if j in used:
            used.update(e[0] for e in nodes[j]["inputs"])
    keep = [j for j, n in enumerate(nodes) if j in used or n["op"] == "null"]
    new_index = {j: k for k, j in enumerate(keep)}
    kept = [{**nodes[j], "inputs": [[new_index[e[0]], e[1], 0] for e in nodes[j]["inputs"]]} for j in keep]
    result = {k: v for k, v in graph.items() if k not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    result["nodes"] = kept
    result["arg_nodes"] = [k for k, n in enumerate(kept) if n["op"] == "null"]
    result["heads"] = [[new_index[h[0]], h[1], 0] for h in heads]
    return result
