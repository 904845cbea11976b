"""The conversion pass over an MXNet graph in its JSON form. Pure: no MXNet.

Walks the nodes in topological order, keeps the dtype of every output, asks
``decide`` what each op needs and inserts one ``amp_cast`` per (tensor, dtype) pair,
shared by all its consumers. Widest ops get plain casts too: their input dtypes are
known here, so no run-time ``amp_multicast`` is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..decide import decide
from ..dtypes import FLOAT_DTYPES
from ..table import OpTable

#: MXNet's integer dtype codes, as stored in ``__dtype__``.
DTYPE_CODE = {"float32": 0, "float64": 1, "float16": 2, "uint8": 3, "int32": 4, "int8": 5,
              "int64": 6, "bool": 7, "int16": 8, "uint16": 9, "uint32": 10, "uint64": 11,
              "bfloat16": 12}
CODE_DTYPE = {v: k for k, v in DTYPE_CODE.items()}
REASON_ATTR = "__amp_reason__"
_CAST_OPS = ("amp_cast", "amp_multicast")

Entry = Tuple[int, int]  # (node index, output index)


@dataclass
class PassResult:
    """The converted graph and what the pass did."""

    graph: dict
    dtypes: Dict[Tuple[str, int], str]       # predicted dtype of every output, by (node name, index)
    param_dtypes: Dict[str, str]             # parameter name -> stored dtype
    reasons: Dict[str, str] = field(default_factory=dict)  # op node name -> decide() reason
    casts_inserted: int = 0


def strip_casts(graph: dict) -> dict:
    """Remove ``amp_cast``/``amp_multicast`` nodes (e.g. from a graph built under ``init``)."""
    nodes = graph["nodes"]
    redirect: Dict[Entry, Entry] = {}
    keep: List[int] = []
    new_index: Dict[int, int] = {}

    def resolve(e: Entry) -> Entry:
        while e in redirect:
            e = redirect[e]
        return e

    for i, node in enumerate(nodes):
        if node["op"] in _CAST_OPS:
            for k, inp in enumerate(node["inputs"]):
                redirect[(i, k if node["op"] == "amp_multicast" else 0)] = (inp[0], inp[1])
            continue
        new_index[i] = len(keep)
        keep.append(i)

    def remap(e) -> list:
        src, idx = resolve((e[0], e[1]))
        return [new_index[src], idx, 0]

    out_nodes = []
    for i in keep:
        node = dict(nodes[i])
        node["inputs"] = [remap(e) for e in node["inputs"]]
        out_nodes.append(node)
    return _finish(graph, out_nodes, [remap(h) for h in graph["heads"]])


def _finish(graph: dict, nodes: List[dict], heads: List[list]) -> dict:
    out = {k: v for k, v in graph.items() if k not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    out["nodes"] = nodes
    out["arg_nodes"] = [i for i, n in enumerate(nodes) if n["op"] == "null"]
    out["heads"] = heads
    return out


def convert_graph(
    graph: dict,
    table: OpTable,
    input_names: Sequence[str],
    original_dtypes: Mapping[Entry, str],
    op_inputs: Mapping[str, Sequence[str]],
    excluded: Iterable[str] = (),
    cast_optional_params: bool = False,
    float32_outputs: bool = True,
) -> PassResult:
    """Insert casts so every op runs in the dtype ``decide`` gives it.

    Parameters
    ----------
    graph : dict
        ``json.loads(sym.tojson())`` of an FP32 graph without casts.
    table : OpTable
    input_names : sequence of str
        Data inputs (everything else that is a variable is a parameter).
    original_dtypes : mapping
        Output dtypes of the FP32 graph. Outputs that are not float32 there (indices,
        shapes, explicit casts) keep their dtype.
    op_inputs : mapping
        Op name -> declared input names, to honour kept-float32 inputs.
    excluded : names of op nodes forced to float32.
    cast_optional_params : bool
        Store a parameter in the low-precision dtype when every consumer casts it there.
    float32_outputs : bool
        Cast low-precision graph outputs back to float32, so callers get what the FP32
        model returned.
    """
    excluded = set(excluded)
    nodes = graph["nodes"]
    data = set(input_names)
    out_nodes: List[dict] = []
    index: Dict[int, int] = {}
    dtypes: Dict[Entry, str] = {}
    casts: Dict[Tuple[Entry, str], Entry] = {}
    reasons: Dict[str, str] = {}
    cast_count = 0

    def add(node: dict) -> int:
        out_nodes.append(node)
        return len(out_nodes) - 1

    def cast(entry: Entry, dtype: str) -> Entry:
        nonlocal cast_count
        key = (entry, dtype)
        if key not in casts:
            src = out_nodes[entry[0]]
            name = f"{src['name']}_amp_cast_{dtype}" + (f"_{entry[1]}" if entry[1] else "")
            j = add({"op": "amp_cast", "name": name, "attrs": {"dtype": dtype},
                     "inputs": [[entry[0], entry[1], 0]]})
            casts[key] = (j, 0)
            dtypes[(j, 0)] = dtype
            cast_count += 1
        return casts[key]

    for i, node in enumerate(nodes):
        if node["op"] in _CAST_OPS:
            raise ValueError(f"graph already contains {node['op']} node {node['name']!r}; "
                             "strip casts first (strip_casts)")
        if node["op"] == "null":
            j = add(dict(node))
            index[i] = j
            declared = node.get("attrs", {}).get("__dtype__")
            dtypes[(j, 0)] = CODE_DTYPE.get(int(declared), "float32") if declared not in (None, "-1") \
                else original_dtypes.get((i, 0), "float32")
            continue
        op, attrs = node["op"], node.get("attrs", {})
        inputs = [(index[e[0]], e[1]) for e in node["inputs"]]
        in_types = [dtypes.get(e) for e in inputs]
        d = decide(op, attrs, in_types, table, excluded=node["name"] in excluded)
        reasons[node["name"]] = d.reason
        names = op_inputs.get(op, ())
        kept = [k < len(names) and names[k] in d.keep_fp32 for k in range(len(inputs))]
        new_inputs = []
        for e, t, keep in zip(inputs, in_types, kept):
            if d.dtype is not None and t in FLOAT_DTYPES and t != d.dtype and not keep:
                e = cast(e, d.dtype)
            new_inputs.append([e[0], e[1], 0])
        new_node = dict(node)
        new_node["inputs"] = new_inputs
        if d.reason == "excluded":
            new_node["attrs"] = {**attrs, REASON_ATTR: "excluded"}
        j = add(new_node)
        index[i] = j
        float_in = [dtypes[(e[0], e[1])] for e, keep in zip(new_inputs, kept)
                    if dtypes.get((e[0], e[1])) in FLOAT_DTYPES and not keep]
        k = 0
        while (i, k) in original_dtypes:
            orig = original_dtypes[(i, k)]
            if orig != "float32":
                out_t = orig
            elif d.dtype is not None:
                out_t = d.dtype
            elif float_in:
                out_t = float_in[0] if all(t == float_in[0] for t in float_in) else "float32"
            else:
                out_t = "float32"
            dtypes[(j, k)] = out_t
            k += 1

    heads = []
    for h in graph["heads"]:
        e = (index[h[0]], h[1])
        if float32_outputs and dtypes.get(e) in ("float16", "bfloat16"):
            e = cast(e, "float32")
        heads.append([e[0], e[1], 0])
    if cast_optional_params:
        consumers: Dict[int, List[int]] = {}
        for j, n in enumerate(out_nodes):
            for e in n["inputs"]:
                consumers.setdefault(e[0], []).append(j)
        outputs = {h[0] for h in heads}
        for j, n in enumerate(out_nodes):
            if n["op"] == "null" and n["name"] not in data and j not in outputs:
                folded = _foldable_cast(out_nodes, consumers, j)
                if folded is not None:
                    dtypes[(j, 0)] = out_nodes[folded]["attrs"]["dtype"]
    param_dtypes = {n["name"]: dtypes[(j, 0)] for j, n in enumerate(out_nodes)
                    if n["op"] == "null" and n["name"] not in data}
    result_nodes, heads, folded_count = _drop_param_casts(out_nodes, heads, param_dtypes)
    names_left = {n["name"] for n in result_nodes}
    by_name = {(out_nodes[j]["name"], k): t for (j, k), t in dtypes.items()
               if out_nodes[j]["name"] in names_left}
    cast_count -= folded_count
    new_graph = _finish(graph, result_nodes, heads)
    for n in new_graph["nodes"]:
        if n["op"] == "null" and n["name"] in param_dtypes:
            n["attrs"] = {**n.get("attrs", {}), "__dtype__": str(DTYPE_CODE[param_dtypes[n["name"]]])}
    return PassResult(new_graph, by_name, param_dtypes, reasons, cast_count)


def _needs_fp32_param(node: dict, dtype: str) -> bool:
    """oneDNN 2.4 cannot reorder stored bfloat16 weights of grouped convolutions."""
    return (dtype == "bfloat16" and node["op"] == "Convolution"
            and int(node.get("attrs", {}).get("num_group", "1")) > 1)


def _foldable_cast(nodes: List[dict], consumers: Mapping[int, List[int]], param: int) -> Optional[int]:
    """The cast a parameter can be stored as: its only consumer, read by ops that accept it."""
    users = consumers.get(param, [])
    if len(users) != 1 or nodes[users[0]]["op"] != "amp_cast":
        return None
    dtype = nodes[users[0]]["attrs"]["dtype"]
    if any(_needs_fp32_param(nodes[u], dtype) for u in consumers.get(users[0], [])):
        return None
    return users[0]


def _drop_param_casts(nodes: List[dict], heads: List[list], param_dtypes: Dict[str, str]):
    """Remove casts of parameters now stored in the cast's dtype; rewire their consumers."""
    drop = {}
    for j, n in enumerate(nodes):
        if n["op"] == "amp_cast":
            src = nodes[n["inputs"][0][0]]
            if src["op"] == "null" and param_dtypes.get(src["name"]) == n["attrs"]["dtype"]:
                drop[j] = n["inputs"][0][0]
    if not drop:
        return nodes, heads, 0
    keep = [j for j in range(len(nodes)) if j not in drop]
    new_index = {j: k for k, j in enumerate(keep)}

    def remap(e: list) -> list:
        return [new_index[drop[e[0]]], 0, 0] if e[0] in drop else [new_index[e[0]], e[1], 0]

    out = []
    for j in keep:
        n = dict(nodes[j])
        n["inputs"] = [remap(e) for e in n["inputs"]]
        out.append(n)
    return out, [remap(h) for h in heads], len(drop)
