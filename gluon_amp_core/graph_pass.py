"""The conversion pass over an MXNet graph in its JSON form. Pure: no MXNet.

It walks the nodes (:func:`gluon_amp_core.walk.walk`), casts each op's float inputs as the
decision says, one ``amp_cast`` per (tensor, dtype) shared by all consumers, and keeps the
dtype of every output. What an op does with dtypes is not modelled here: the caller passes
``op_types``, which answers from the framework's own type inference (the MXNet layer asks
MXNet), so the pass and MXNet agree by construction. Parameters get the dtype the op
requires (a PReLU slope after a float16 convolution becomes float16). Casts already in the
graph (the user's ``amp_cast``/``amp_multicast``, an explicit ``Cast``) are kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from .decide import CAST_OPS, Decision, MeasuredChoice, Reason, users_casts  # noqa: F401  (users_casts: here too)
from .dtypes import CODE_DTYPE, DTYPE_CODE, FLOAT_DTYPES, LOW_PRECISION_DTYPES, widest
from .policy import Policy
from .walk import Entry, NodeDecision, walk

#: ``op_types(op, attrs, input dtypes)`` -> (dtype each input must have, output dtypes), or
#: None when the op cannot be typed with those inputs. ``None`` in the input dtypes means
#: "free" (a parameter whose dtype the op may choose).
OpTypes = Callable[[str, Mapping[str, str], Tuple[Optional[str], ...]],
                   Optional[Tuple[Tuple[Optional[str], ...], Tuple[Optional[str], ...]]]]


@dataclass
class PassResult:
    """The converted graph and what the pass did."""

    graph: dict
    dtypes: Dict[Tuple[str, int], Optional[str]]  # dtype of every output, by (node name, index)
    param_dtypes: Dict[str, str]                  # parameter name -> stored dtype
    policy: Optional[Policy] = None
    decisions: List[NodeDecision] = field(default_factory=list)
    casts_inserted: int = 0
    #: op node name -> the tuner's figures, for the nodes decided by a measured choice
    details: Dict[str, str] = field(default_factory=dict)

    @property
    def reasons(self) -> Dict[str, str]:
        """Op node name -> the reason of its decision (kept here, beside the graph: the
        graph's nodes carry no attribute of gluon_amp's)."""
        return {nd.name: nd.reason.value for nd in self.decisions}


class _Builder:
    """The new node list under construction, with output dtypes and shared casts."""

    def __init__(self) -> None:
        self.nodes: List[dict] = []
        self.dtypes: Dict[Entry, Optional[str]] = {}
        self.casts: Dict[Tuple[Entry, str], Entry] = {}
        #: parameter node -> the low dtypes ops' type rules require of it (not optional casts)
        self.required: Dict[int, set] = {}

    def add(self, node: dict) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def cast_float(self, entry: Entry, dtype: Optional[str]) -> Entry:
        """``entry`` cast to ``dtype`` when both are float dtypes and differ, else as it is."""
        have = self.dtypes.get(entry)
        if dtype in FLOAT_DTYPES and have in FLOAT_DTYPES and have != dtype:
            return self.cast(entry, dtype)
        return entry

    def cast(self, entry: Entry, dtype: str) -> Entry:
        key = (entry, dtype)
        if key not in self.casts:
            src = self.nodes[entry[0]]
            name = f"{src['name']}_amp_cast_{dtype}" + (f"_{entry[1]}" if entry[1] else "")
            j = self.add({"op": "amp_cast", "name": name, "attrs": {"dtype": dtype},
                          "inputs": [[entry[0], entry[1], 0]]})
            self.casts[key] = (j, 0)
            self.dtypes[(j, 0)] = dtype
        return self.casts[key]


#: Ops that only type inside their own graph (oneDNN subgraphs) or carry quantized data.
_KEPT_PREFIXES = ("_sg_", "_contrib_quantize", "_contrib_quantized_", "_contrib_requantize",
                  "_contrib_dequantize")


def is_kept(node: dict) -> bool:
    """A fused or quantized op node: it keeps the dtypes it has in the FP32 graph."""
    return bool(node.get("subgraphs")) or node["op"].startswith(_KEPT_PREFIXES)


#: Declared op input names that only ever hold learned parameters or running statistics.
PARAMETER_SLOTS = frozenset({"weight", "bias", "gamma", "beta", "moving_mean", "moving_var",
                             "running_mean", "running_var", "parameters"})


def parameter_only_inputs(graph: dict, op_inputs: Mapping[str, Sequence[str]]) -> set:
    """Variables that every consumer reads in a parameter slot (``weight``, ``gamma``, ...).

    A symbolic graph's auto-created weights carry no ``__dtype__``; this tells them apart
    from data without guessing from their names.
    """
    slots: Dict[int, set] = {}
    for node in graph["nodes"]:
        names = op_inputs.get(node["op"], ())
        for k, e in enumerate(node["inputs"]):
            slots.setdefault(e[0], set()).add(names[k] if k < len(names) else "")
    heads = {h[0] for h in graph.get("heads", [])}
    return {n["name"] for i, n in enumerate(graph["nodes"])
            if n["op"] == "null" and i not in heads and slots.get(i) and slots[i] <= PARAMETER_SLOTS}


def convert_graph(graph: dict, policy: Policy, input_names: Sequence[str],
                  var_dtypes: Mapping[str, str], op_types: OpTypes,
                  op_inputs: Mapping[str, Sequence[str]], excluded: Collection[str] = (),
                  cast_optional_params: bool = False, float32_outputs: bool = True,
                  fp32_types: Optional[Mapping[Tuple[str, int], Optional[str]]] = None,
                  measured: Mapping[str, MeasuredChoice] = MappingProxyType({}),
                  entry_shapes: Optional[Mapping[Tuple[str, int], Optional[Tuple[int, ...]]]] = None) -> PassResult:
    """Insert casts so every op runs in the dtype the policy gives it.

    Parameters
    ----------
    graph : dict
        ``json.loads(sym.tojson())`` of an FP32 graph.
    policy : Policy
        An enabled policy (its table decides).
    input_names : sequence of str
        Data inputs; every other variable is a parameter.
    var_dtypes : mapping
        Variable name -> dtype in the FP32 graph (declared or inferred); missing: float32.
    op_types : OpTypes
        The framework's type rule per op (see the module docstring).
    op_inputs : mapping
        Op name -> declared input names, to honour the table's kept-float32 inputs.
    excluded : names of op nodes forced to float32.
    cast_optional_params : bool
        Store a parameter in the low-precision dtype when every consumer casts it there
        (the pass's casts, or the graph's own ``amp_cast``/``amp_multicast``). Parameters an
        op's type rule requires in low precision are stored so either way.
    float32_outputs : bool
        Cast low-precision graph outputs back to float32.
    fp32_types : mapping, optional
        ``(node name, output) -> dtype`` of the FP32 graph, needed when it holds fused or
        quantized ops (:func:`is_kept`): they get their inputs in, and give their outputs
        in, exactly these dtypes.
    entry_shapes : mapping, optional
        ``(node name, output) -> shape`` of the FP32 graph at the shapes it will run with, where
        the caller knows them: the table's input-shape rules (a kernel's limits) then type it.
    """
    graph = without_legacy_attrs(graph)
    b, index, data = _Builder(), {}, set(input_names)
    params = set()
    low = _cast_only_params(graph, data, var_dtypes, policy.target_dtype) if cast_optional_params else {}
    for i, node in enumerate(graph["nodes"]):
        if node["op"] == "null":
            index[i] = b.add(dict(node))
            b.dtypes[(index[i], 0)] = low.get(i) or _var_dtype(node, var_dtypes)
            if node["name"] not in data:
                params.add(index[i])
    decisions = []
    chosen = {n: c.dtype for n, c in measured.items()}
    nodes = graph["nodes"]
    shape_of = None if entry_shapes is None else (lambda e: entry_shapes.get((nodes[e[0]]["name"], e[1])))
    for nd in walk(nodes, policy.table, lambda e: b.dtypes.get((index[e[0]], e[1])), excluded,
                   shape_of=shape_of, measured=chosen):
        node = graph["nodes"][nd.index]
        inputs = [(index[e[0]], e[1]) for e in node["inputs"]]
        names = op_inputs.get(node["op"], ())
        if is_kept(node):
            nd = NodeDecision(nd.index, nd.name, nd.op, nd.input_dtypes, Decision(None, Reason.KEPT))
            new_inputs, outs = _keep_node(b, graph["nodes"], node, inputs, fp32_types or {})
        else:
            kept = [k < len(names) and names[k] in nd.decision.keep_fp32 for k in range(len(inputs))]
            new_inputs, outs = _type_node(b, node, nd.decision, inputs, kept, params, op_types)
        index[nd.index] = j = b.add({**node, "inputs": [[e[0], e[1], 0] for e in new_inputs]})
        for k, t in enumerate(outs):
            b.dtypes[(j, k)] = t
        decisions.append(nd)
    heads = [_head(b, (index[h[0]], h[1]), float32_outputs) for h in graph["heads"]]
    result = _finish_pass(graph, b, heads, data, policy, decisions, cast_optional_params)
    result.details = {nd.name: measured[nd.name].describe() for nd in decisions
                      if nd.reason is Reason.MEASURED and nd.name in measured}
    return result


#: Prefix of the node attributes gluon_amp wrote into graphs before plans were plain MXNet
#: graphs (``__amp_reason__``, ``__amp_dtype__``, ``__amp_measured__``): dropped on reading.
LEGACY_ATTR_PREFIX = "__amp_"


def without_legacy_attrs(graph: dict) -> dict:
    """``graph`` with no node attribute of an older gluon_amp's (``graph`` itself when none)."""
    if not any(k.startswith(LEGACY_ATTR_PREFIX) for n in graph["nodes"] for k in n.get("attrs", {})):
        return graph
    nodes = [{**n, "attrs": {k: v for k, v in n["attrs"].items() if not k.startswith(LEGACY_ATTR_PREFIX)}}
             if "attrs" in n else n for n in graph["nodes"]]
    return {**graph, "nodes": nodes}


def _var_dtype(node: dict, var_dtypes: Mapping[str, str]) -> str:
    declared = node.get("attrs", {}).get("__dtype__")
    if declared not in (None, "-1"):
        return CODE_DTYPE.get(int(declared), "float32")
    return var_dtypes.get(node["name"], "float32")


def _cast_only_params(graph: dict, data: Collection[str], var_dtypes: Mapping[str, str],
                      target: str) -> Dict[int, str]:
    """Parameters the graph itself only casts, with the low dtype to store them in.

    For ``cast_optional_params``, as the peer stores them: every consumer is an ``amp_cast``
    to one low dtype or an ``amp_multicast``; a multicast counts when the parameter is also
    cast to that dtype, or when all the multicast's inputs are parameters (it then gets
    ``target``). Decided before typing, so the multicast and everything after it are typed
    with the stored dtypes (and low graph outputs are cast back to float32 as usual).
    The graph's casts stay.
    """
    nodes = graph["nodes"]
    heads = {h[0] for h in graph["heads"]}
    consumers: Dict[int, List[int]] = {}
    for j, n in enumerate(nodes):
        for e in n["inputs"]:
            consumers.setdefault(e[0], []).append(j)

    def is_param(i: int) -> bool:
        n = nodes[i]
        return (n["op"] == "null" and n["name"] not in data and i not in heads
                and _var_dtype(n, var_dtypes) in FLOAT_DTYPES)

    out: Dict[int, str] = {}
    for i in range(len(nodes)):
        users = consumers.get(i, [])
        if not is_param(i) or not users or any(nodes[u]["op"] not in CAST_OPS for u in users):
            continue
        casts = {nodes[u].get("attrs", {}).get("dtype") for u in users if nodes[u]["op"] == "amp_cast"}
        if len(casts) > 1 or not casts <= set(LOW_PRECISION_DTYPES):
            continue
        multicasts = [u for u in users if nodes[u]["op"] == "amp_multicast"]
        if not casts and not all(is_param(e[0]) for u in multicasts for e in nodes[u]["inputs"]):
            continue  # a multicast with data or an op's output: storing low would change its dtype
        dtype = casts.pop() if casts else target
        if not any(_needs_fp32_param(nodes[c], dtype) for u in users for c in consumers.get(u, [])):
            out[i] = dtype
    return out


def _type_node(b: _Builder, node: dict, d: Decision, inputs: List[Entry], kept: List[bool],
               params: Collection[int], op_types: OpTypes) -> Tuple[List[Entry], Tuple[Optional[str], ...]]:
    """Cast ``node``'s inputs as decided, let ``op_types`` type it, and fit its parameters."""
    cast_to = [d.dtype if (d.dtype and not keep) else None for keep in kept]
    typed = _try_types(b, node, inputs, cast_to, params, op_types)
    if typed is None:  # e.g. a neutral op fed float16 and float32: run it in the widest
        wide = widest(b.dtypes.get(e) for e in inputs if e[0] not in params)
        cast_to = [wide if not keep else None for keep in kept]
        typed = _try_types(b, node, inputs, cast_to, params, op_types)
    if typed is None:
        got = [b.dtypes.get(e) for e in inputs]
        raise ValueError(f"node {node['name']!r} (op {node['op']}) cannot be typed with input dtypes "
                         f"{got}; exclude it with excluded_sym_names=[{node['name']!r}] and please report this")
    required, outs = typed
    new_inputs = []
    for e, want, target in zip(inputs, required, cast_to):
        if e[0] in params and target is None and want in LOW_PRECISION_DTYPES and b.dtypes.get(e) != want:
            b.required.setdefault(e[0], set()).add(want)  # the op's type rule, not AMP's decision
        new_inputs.append(b.cast_float(e, want if e[0] in params else target))
    return new_inputs, outs


def _keep_node(b: _Builder, nodes: Sequence[dict], node: dict, inputs: List[Entry],
               fp32_types: Mapping[Tuple[str, int], Optional[str]]) -> Tuple[List[Entry], Tuple[Optional[str], ...]]:
    """A fused or quantized node, typed as in the FP32 graph: float inputs cast back there."""
    new_inputs = [b.cast_float(e, fp32_types.get((nodes[old[0]]["name"], old[1])))
                  for old, e in zip(node["inputs"], inputs)]
    outs, k = [], 0
    while (node["name"], k) in fp32_types:
        outs.append(fp32_types[(node["name"], k)])
        k += 1
    if not outs or None in outs:
        raise ValueError(f"node {node['name']!r} (op {node['op']}) is a fused or quantized op whose "
                         "dtypes MXNet could not infer in the FP32 graph; convert the FP32 graph "
                         "before fusion or quantization")
    return new_inputs, tuple(outs)


def _try_types(b: _Builder, node: dict, inputs: List[Entry], cast_to: List[Optional[str]],
               params: Collection[int], op_types: OpTypes):
    """``op_types`` of the node with its inputs cast; parameters left free for the op to
    type, or, where that leaves anything untyped, fixed at their stored dtype."""
    attrs = {k: v for k, v in node.get("attrs", {}).items() if not k.startswith("__")}
    fixed = [target if (target and b.dtypes.get(e) in FLOAT_DTYPES) else b.dtypes.get(e)
             for e, target in zip(inputs, cast_to)]
    free = tuple(None if (e[0] in params and t in FLOAT_DTYPES) else t for e, t in zip(inputs, fixed))
    typed = op_types(node["op"], attrs, free)
    if typed is not None and None not in typed[1] and all(
            r is not None for e, r, t in zip(inputs, typed[0], free) if t is None and e[0] in params):
        return typed
    stored = tuple(b.dtypes.get(e) if e[0] in params else t for e, t in zip(inputs, fixed))
    return op_types(node["op"], attrs, stored) if stored != free else typed


def _head(b: _Builder, e: Entry, float32_outputs: bool) -> list:
    if float32_outputs and b.dtypes.get(e) in ("float16", "bfloat16"):
        e = b.cast(e, "float32")
    return [e[0], e[1], 0]


def _finish_pass(graph: dict, b: _Builder, heads: List[list], data: Collection[str], policy: Policy,
                 decisions: List[NodeDecision], cast_optional_params: bool) -> PassResult:
    nodes = b.nodes
    _fold_param_casts(b, heads, data, cast_optional_params)
    param_dtypes = {n["name"]: b.dtypes[(j, 0)] for j, n in enumerate(nodes)
                    if n["op"] == "null" and n["name"] not in data}
    ours = {e[0] for e in b.casts.values()}
    result_nodes, heads, folded = _drop_param_casts(nodes, heads, param_dtypes, ours)
    left = {n["name"] for n in result_nodes}
    by_name = {(nodes[j]["name"], k): t for (j, k), t in b.dtypes.items() if nodes[j]["name"] in left}
    new_graph = _finish(graph, result_nodes, heads)
    for n in new_graph["nodes"]:
        if n["op"] == "null" and n["name"] in param_dtypes:
            n["attrs"] = {**n.get("attrs", {}), "__dtype__": str(DTYPE_CODE[param_dtypes[n["name"]]])}
    return PassResult(new_graph, by_name, param_dtypes, policy, decisions, len(b.casts) - folded)


def _finish(graph: dict, nodes: List[dict], heads: List[list]) -> dict:
    out = {k: v for k, v in graph.items() if k not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    out["nodes"] = nodes
    out["arg_nodes"] = [i for i, n in enumerate(nodes) if n["op"] == "null"]
    out["heads"] = heads
    return out


def _fold_param_casts(b: _Builder, heads: List[list], data: Collection[str], optional: bool) -> None:
    """Store parameters in the low dtype they are cast to, where only casts to it read them:
    always when an op's type rule requires it (a FullyConnected weight after float16 data),
    and for any such cast with ``optional`` (``cast_optional_params``). No op's input dtype
    changes, so the typing stands."""
    consumers: Dict[int, List[int]] = {}
    for j, n in enumerate(b.nodes):
        for e in n["inputs"]:
            consumers.setdefault(e[0], []).append(j)
    outputs = {h[0] for h in heads}
    for j, n in enumerate(b.nodes):
        if n["op"] != "null" or n["name"] in data or j in outputs:
            continue
        required = b.required.get(j, set())
        if not (optional or len(required) == 1):
            continue
        dtype = _foldable(b.nodes, consumers, j)
        if dtype is not None and (optional or {dtype} == required):
            b.dtypes[(j, 0)] = dtype


def _needs_fp32_param(node: dict, dtype: str) -> bool:
    """oneDNN 2.4 cannot reorder stored bfloat16 weights of grouped convolutions."""
    return (dtype == "bfloat16" and node["op"] == "Convolution"
            and int(node.get("attrs", {}).get("num_group", "1")) > 1)


def _foldable(nodes: List[dict], consumers: Mapping[int, List[int]], param: int) -> Optional[str]:
    """The low dtype a parameter can be stored in: every consumer is an ``amp_cast`` to it,
    read by ops that accept it stored so."""
    users = consumers.get(param, [])
    if not users or any(nodes[u]["op"] != "amp_cast" for u in users):
        return None
    dtypes = {nodes[u]["attrs"]["dtype"] for u in users}
    if len(dtypes) != 1 or not dtypes <= set(LOW_PRECISION_DTYPES):
        return None
    dtype = dtypes.pop()
    if any(_needs_fp32_param(nodes[c], dtype) for u in users for c in consumers.get(u, [])):
        return None
    return dtype


def _drop_param_casts(nodes: List[dict], heads: List[list], param_dtypes: Dict[str, str],
                      ours: Collection[int]):
    """Remove the pass's own casts (node indices ``ours``) of parameters now stored in the
    cast's dtype; rewire their consumers. The user's casts stay."""
    drop = {}
    for j, n in enumerate(nodes):
        if j in ours:
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


def params_read_through_casts(graph: dict, names: Collection[str]) -> dict:
    """``graph`` with each parameter in ``names`` that it stores low (``__dtype__``) stored in
    float32 and read through a cast to its low dtype (``<name>_amp_cast_<dtype>``): the
    inverse of ``cast_optional_params``, for training the parameters in float32."""
    nodes = graph["nodes"]
    low = {j: CODE_DTYPE[int(n["attrs"]["__dtype__"])] for j, n in enumerate(nodes)
           if n["op"] == "null" and n["name"] in names
           and CODE_DTYPE.get(int(n.get("attrs", {}).get("__dtype__", "-1")), "") in LOW_PRECISION_DTYPES}
    if not low:
        return graph
    new_index: Dict[int, int] = {}
    out: List[dict] = []
    for j, n in enumerate(nodes):
        n = dict(n, inputs=[[new_index[e[0]], e[1], 0] for e in n["inputs"]])
        if j in low:
            n["attrs"] = {**n["attrs"], "__dtype__": str(DTYPE_CODE["float32"])}
            out.append(n)
            n = {"op": "amp_cast", "name": f"{n['name']}_amp_cast_{low[j]}", "attrs": {"dtype": low[j]},
                 "inputs": [[len(out) - 1, 0, 0]]}
        new_index[j] = len(out)
        out.append(n)
    heads = [[new_index[h[0]], h[1], 0] for h in graph["heads"]]
    return _finish(graph, out, heads)


def params_stored_low(graph: dict, names: Collection[str]) -> Tuple[dict, Dict[str, str]]:
    """``graph`` with each parameter in ``names`` that only casts to one low dtype read (as
    :func:`_foldable` allows) stored in that dtype (``__dtype__``) and its casts gone, and
    those parameters' dtypes: the inverse of :func:`params_read_through_casts`, for running
    an inference graph on casts made once. Inputs keep their order."""
    nodes = graph["nodes"]
    consumers: Dict[int, List[int]] = {}
    for j, n in enumerate(nodes):
        for e in n["inputs"]:
            consumers.setdefault(e[0], []).append(j)
    outputs = {h[0] for h in graph["heads"]}
    low: Dict[str, str] = {}
    for j, n in enumerate(nodes):
        if n["op"] == "null" and n["name"] in names and j not in outputs:
            dtype = _foldable(nodes, consumers, j)
            if dtype is not None:
                low[n["name"]] = dtype
    if not low:
        return graph, {}
    casts = {u for j, n in enumerate(nodes) if n["op"] == "null" and n["name"] in low for u in consumers[j]}
    typed = [dict(n, attrs={**n.get("attrs", {}), "__dtype__": str(DTYPE_CODE[low[n["name"]]])})
             if n["op"] == "null" and n["name"] in low else n for n in nodes]
    kept, heads, _ = _drop_param_casts(typed, graph["heads"], low, casts)
    return _finish(graph, kept, heads), low


def without_amp_casts(graph: dict, keep: Collection[str] = ()) -> dict:
    """``graph`` without its ``amp_cast``/``amp_multicast`` nodes but those named in ``keep``
    (the user's), each read through (a multicast's output ``k`` is its input ``k``): the FP32
    graph of a plan traced under ``init``, whose casts the symbolic wrappers put in for that
    plan's policy."""
    nodes = graph["nodes"]
    moved: Dict[Entry, list] = {}
    at: Dict[int, int] = {}
    out: List[dict] = []

    def entry(e: list) -> list:
        return moved.get((e[0], e[1])) or [at[e[0]], e[1], 0]

    for i, node in enumerate(nodes):
        inputs = [entry(e) for e in node["inputs"]]
        if node["op"] in CAST_OPS and node["name"] not in keep:
            moved.update({(i, k): e for k, e in enumerate(inputs)})
            continue
        out.append({**node, "inputs": inputs})
        at[i] = len(out) - 1
    if len(out) == len(nodes):
        return graph
    return _finish(graph, out, [entry(h) for h in graph["heads"]])
