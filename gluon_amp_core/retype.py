"""Apply the tuner's choices to a graph AMP has already typed (a training graph traced under
``init``). Pure.

The converter applies choices while it types an FP32 graph (``convert_graph(measured=)``);
a training graph arrives typed, with the casts the op wrappers put in. Here each chosen
node gets the inputs :func:`~gluon_amp_core.decide.decide` asks for under its choice: read
straight from where each value comes from (seen through the wrappers' casts) when that
already has the dtype, else through a new ``amp_cast`` shared by the nodes that need it.
Everything else keeps its casts; casts nobody reads any more are dropped.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .decide import CAST_OPS, MeasuredChoice, decide
from .dtypes import FLOAT_DTYPES
from .table import OpTable
from .walk import measured_attrs

Key = Tuple[str, int]
Entry = Tuple[int, int]


def retype(graph: dict, choices: Mapping[str, MeasuredChoice], dtypes: Mapping[Key, Optional[str]],
           table: OpTable, op_inputs: Mapping[str, Sequence[str]]) -> dict:
    """``graph`` (MXNet's JSON form, typed as ``dtypes``) with ``choices`` applied.

    The caller checks the result with the framework's type inference: a node whose dtype
    a cast does not fix follows its inputs, and this pass marks such values as unknown
    rather than model every op's type rule.
    """
    nodes = graph["nodes"]
    name_of = [n["name"] for n in nodes]
    now: Dict[Entry, Optional[str]] = {}  # the dtype each old entry has after the change (None: unknown)

    def plan(e: Entry) -> Optional[str]:
        return dtypes.get((name_of[e[0]], e[1]))

    def source(e: Entry) -> Entry:
        while nodes[e[0]]["op"] in CAST_OPS:
            node = nodes[e[0]]
            e = tuple(node["inputs"][0 if node["op"] == "amp_cast" else e[1]][:2])
        return e

    out_nodes: List[dict] = []
    new_index: Dict[int, int] = {}
    casts: Dict[Tuple[Entry, str], int] = {}

    def cast(e: Entry, dtype: str) -> List[int]:
        if (e, dtype) not in casts:
            base = name_of[e[0]] + (f"_{e[1]}" if e[1] else "")
            out_nodes.append({"op": "amp_cast", "name": f"{base}_amp_tuned_{dtype}", "attrs": {"dtype": dtype},
                              "inputs": [[new_index[e[0]], e[1], 0]]})
            casts[(e, dtype)] = len(out_nodes) - 1
        return [casts[(e, dtype)], 0, 0]

    for i, node in enumerate(nodes):
        name, op = node["name"], node["op"]
        inputs = [tuple(e[:2]) for e in node["inputs"]]
        new = {**node, "inputs": [[new_index[e[0]], e[1], 0] for e in inputs]}
        n_out = _n_outputs(dtypes, name)
        if name in choices and op != "null":
            choice = choices[name]
            in_types = [plan(e) for e in inputs]
            d = decide(op, node.get("attrs", {}), in_types, table, measured=choice.dtype)
            names = op_inputs.get(op, ())
            wired = []
            for k, e in enumerate(inputs):
                src = source(e)
                if (k < len(names) and names[k] in d.keep_fp32) or plan(src) not in FLOAT_DTYPES or d.dtype is None:
                    wired.append(new["inputs"][k])
                elif now.get(src, plan(src)) == d.dtype:
                    wired.append([new_index[src[0]], src[1], 0])
                else:
                    wired.append(cast(src, d.dtype))
            new["inputs"] = wired
            new["attrs"] = {**node.get("attrs", {}), **measured_attrs(choice)}
            for k in range(n_out):
                if dtypes.get((name, k)) == table.target_dtype:  # its low outputs; statistics stay
                    now[(i, k)] = choice.dtype
        elif op == "amp_cast":
            pass  # fixes its dtype
        elif op != "null" and any(now.get(e, plan(e)) != plan(e) for e in inputs):
            for k in range(max(n_out, 1)):
                if plan((i, k)) in FLOAT_DTYPES:
                    now[(i, k)] = None  # follows inputs that moved: MXNet will tell
        out_nodes.append(new)
        new_index[i] = len(out_nodes) - 1
    heads = [[new_index[h[0]], h[1], 0] for h in graph["heads"]]
    return _prune(graph, out_nodes, heads)


def _n_outputs(dtypes: Mapping[Key, Optional[str]], name: str) -> int:
    k = 0
    while (name, k) in dtypes:
        k += 1
    return k


def _prune(graph: dict, nodes: List[dict], heads: List[list]) -> dict:
    """Drop op nodes no head reaches (the casts the change left unread); keep variables."""
    alive: Set[int] = set()
    stack = [h[0] for h in heads]
    while stack:
        j = stack.pop()
        if j in alive:
            continue
        alive.add(j)
        stack.extend(e[0] for e in nodes[j]["inputs"])
    keep = [j for j, n in enumerate(nodes) if j in alive or n["op"] == "null"]
    remap = {j: k for k, j in enumerate(keep)}
    out_nodes = [{**nodes[j], "inputs": [[remap[e[0]], e[1], 0] for e in nodes[j]["inputs"]]} for j in keep]
    out = {k: v for k, v in graph.items() if k not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    out["nodes"] = out_nodes
    out["arg_nodes"] = [j for j, n in enumerate(out_nodes) if n["op"] == "null"]
    out["heads"] = [[remap[h[0]], h[1], 0] for h in heads]
    return out
