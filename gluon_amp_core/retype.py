"""Change the dtype of some op nodes in a graph AMP has already cast. Pure: no MXNet.

A hybridized block's graph under ``init`` is traced with symbols, before any shape is
known, with the casts the op wrappers put in. Decisions that need more than that are taken
once the first call gives shapes, by :func:`~gluon_amp_core.decide.decide` as always: the
table's input-shape rules (``input_shapes=``) and the tuner's measured choices
(``measured=``). :func:`retype` then rewires the graph for them. The converter needs none
of this: it types an FP32 graph with those decisions directly.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Collection, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from .decide import CAST_OPS, Decision
from .dtypes import FLOAT_DTYPES

Key = Tuple[str, int]
Entry = Tuple[int, int]


@dataclass(frozen=True)
class Change:
    """A node's new decision. Its reason and figures are the caller's to keep, beside the
    graph (:class:`gluon_amp_core.walk.Note`): the graph's nodes get no attribute."""

    decision: Decision


def source_through_casts(nodes: Sequence[dict], e: Entry, keep: Collection[str] = ()) -> Entry:
    """Where the value at entry ``e`` of ``nodes`` comes from, seen through the casts on the way
    (but those named in ``keep``, the user's, which are read from)."""
    while nodes[e[0]]["op"] in CAST_OPS and nodes[e[0]]["name"] not in keep:
        node = nodes[e[0]]
        e = tuple(node["inputs"][0 if node["op"] == "amp_cast" else e[1]][:2])
    return e


def retype(graph: dict, changes: Mapping[str, Change], dtypes: Mapping[Key, Optional[str]],
           op_inputs: Mapping[str, Sequence[str]], keep: Collection[str] = ()) -> dict:
    """``graph`` (MXNet's JSON form, with its casts) with each changed node run in its
    decision's dtype.

    Each float input of a changed node (but those its decision keeps in float32, such as
    normalisation statistics) is read from where the value comes from, seen through the
    casts on the way (no rounding to the old dtype first): directly when that already has
    the dtype, else through a new ``amp_cast`` shared by the nodes that need it. ``dtypes``
    is the graph's typing before the change, where known; a value of unknown dtype is cast
    (``amp_cast`` leaves non-float tensors as they are). Other nodes keep their casts, and
    follow their inputs as MXNet types them; casts nobody reads any more are dropped. The
    casts named in ``keep`` (the user's, :func:`~gluon_amp_core.decide.users_casts`) are read
    from, never around. The caller checks the result with MXNet's type inference.
    """
    nodes = graph["nodes"]
    name_of = [n["name"] for n in nodes]
    now: Dict[Entry, Optional[str]] = {}  # an entry's dtype after the change; None: unknown
    users = frozenset(keep)  # read from, never around: the user's rounding stays

    def before(e: Entry) -> Optional[str]:
        return dtypes.get((name_of[e[0]], e[1]))

    def source(e: Entry) -> Entry:
        return source_through_casts(nodes, e, users)

    out: List[dict] = []
    index: Dict[int, int] = {}
    casts: Dict[Tuple[Entry, str], int] = {}

    def cast(e: Entry, dtype: str) -> List[int]:
        if (e, dtype) not in casts:
            base = name_of[e[0]] + (f"_{e[1]}" if e[1] else "")
            out.append({"op": "amp_cast", "name": f"{base}_amp_retyped_{dtype}", "attrs": {"dtype": dtype},
                        "inputs": [[index[e[0]], e[1], 0]]})
            casts[(e, dtype)] = len(out) - 1
        return [casts[(e, dtype)], 0, 0]

    for i, node in enumerate(nodes):
        inputs = [tuple(e[:2]) for e in node["inputs"]]
        new = {**node, "inputs": [[index[e[0]], e[1], 0] for e in inputs]}
        change = changes.get(node["name"]) if node["op"] != "null" else None
        if change is not None and change.decision.dtype is not None:
            want, names = change.decision.dtype, op_inputs.get(node["op"], ())
            wired = []
            for k, e in enumerate(inputs):
                src = source(e)
                have = now.get(src, before(src))
                if (k < len(names) and names[k] in change.decision.keep_fp32) or (
                        have is not None and have not in FLOAT_DTYPES):
                    wired.append(new["inputs"][k])
                elif have == want:
                    wired.append([index[src[0]], src[1], 0])
                else:
                    wired.append(cast(src, want))
            new["inputs"] = wired
            for k in range(_n_outputs(dtypes, node["name"])):
                if before((i, k)) in FLOAT_DTYPES and before((i, k)) != "float32":
                    now[(i, k)] = want  # its low outputs; float32 statistics stay
            if not _n_outputs(dtypes, node["name"]):
                now[(i, 0)] = None
        elif node["op"] not in ("null", "amp_cast") and any(now.get(e, before(e)) != before(e) for e in inputs):
            for k in range(max(_n_outputs(dtypes, node["name"]), 1)):
                now[(i, k)] = None  # follows inputs that moved: MXNet will tell
        out.append(new)
        index[i] = len(out) - 1
    heads = [[index[h[0]], h[1], 0] for h in graph["heads"]]
    return _reachable(graph, out, heads)


def _n_outputs(dtypes: Mapping[Key, Optional[str]], name: str) -> int:
    k = 0
    while (name, k) in dtypes:
        k += 1
    return k


def _reachable(graph: dict, nodes: List[dict], heads: List[list]) -> dict:
    """The graph of ``nodes`` keeping only what the heads read (and every variable)."""
    used: Set[int] = {h[0] for h in heads}
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


class _Rebuilt:
    """A graph's nodes copied in order, some replaced: each old entry maps to its new one."""

    def __init__(self, graph: dict) -> None:
        self.graph = graph
        self.out: List[dict] = []
        self.moved: Dict[Entry, List[int]] = {}  # old entry -> new entry, where not the node's own
        self.at: Dict[int, int] = {}  # old node -> new node

    def entry(self, e: list) -> List[int]:
        return self.moved.get((e[0], e[1])) or [self.at[e[0]], e[1], 0]

    def add(self, node: dict) -> int:
        """Append ``node`` (its inputs already new entries); its new index."""
        self.out.append(node)
        return len(self.out) - 1

    def keep(self, i: int, node: dict, inputs: List[List[int]]) -> None:
        self.at[i] = self.add({**node, "inputs": inputs})

    def result(self) -> dict:
        return _reachable(self.graph, self.out, [self.entry(h) for h in self.graph["heads"]])


#: The dtypes ``amp_cast`` converts; it passes any other through (MXNet's type rule).
AMP_CAST_DTYPES = frozenset({"float16", "bfloat16", "float32"})


def converts_nothing(op: str, attrs: Mapping[str, object], input_dtypes: Sequence[Optional[str]]) -> bool:
    """True for a cast node that leaves its values and dtypes as they are: an ``amp_cast`` to the
    dtype its input has, or an ``amp_multicast`` whose inputs all have one float dtype."""
    if not input_dtypes or None in input_dtypes:
        return False
    if op == "amp_cast":
        return input_dtypes[0] == attrs.get("dtype")
    first = input_dtypes[0]
    return op == "amp_multicast" and first in FLOAT_DTYPES and all(d == first for d in input_dtypes)


def names_given_twice(nodes: Sequence[dict]) -> FrozenSet[str]:
    """The node names more than one node of ``nodes`` has (Gluon names a block's ops by its
    scope, so a block called twice in one trace gives two nodes one name): ``(name, output)``
    keys cannot tell their dtypes apart."""
    counts = Counter(n["name"] for n in nodes)
    return frozenset(name for name, k in counts.items() if k > 1)


def unique_op_names(graph: dict, ops: Optional[Collection[str]] = None) -> Tuple[dict, int]:
    """``graph`` with each op node that repeats an earlier node's name renamed
    ``<name>_<index>``, and how many were. A block called twice in one trace gives two nodes
    one name, and every pass types entries by ``(name, output)``; the first keeps its name.
    ``ops``: rename only nodes of these ops (default: every op)."""
    nodes = graph["nodes"]
    twice = names_given_twice(nodes)
    if not twice:
        return graph, 0
    taken, seen, out = {n["name"] for n in nodes}, set(), []
    for i, n in enumerate(nodes):
        if n["name"] in seen and n["op"] != "null" and (ops is None or n["op"] in ops):
            name = f"{n['name']}_{i}"
            while name in taken:
                name += "_"
            taken.add(name)
            n = {**n, "name": name}
        seen.add(n["name"])
        out.append(n)
    return {**graph, "nodes": out}, sum(1 for a, b in zip(nodes, out) if a is not b)


def drop_identity_casts(graph: dict, dtypes: Mapping[Key, Optional[str]]) -> Tuple[dict, int]:
    """``graph`` without the casts that leave their value as it is, and how many inputs
    went around one.

    The op wrappers cast every input of a decided op while a graph is traced, before any
    dtype is known: token ids, indices, lengths, conditions and float64 values too.
    ``amp_cast`` passes a value of a dtype outside :data:`AMP_CAST_DTYPES` through, as
    ``amp_multicast`` does non-float ones, yet MXNet's CPU kernels of both reject some of
    them (1.9.1 with oneDNN: int64, float64). So an ``amp_cast`` of such an entry (typed
    by ``dtypes``) is dropped, and such an input of an ``amp_multicast`` goes around it (the
    multicast keeps its other inputs, or goes when one or none is left: a multicast of one
    value is that value). A multicast with a float64 input (numpy mode promotes mixed dtypes)
    goes: float64 and float32 inputs go around it, float16/bfloat16 ones are cast to float32,
    and the op promotes them as in FP32 (the multicast would convert them to float64, which
    oneDNN's arrays refuse).

    An ``amp_cast`` of an entry that has the cast's dtype already is dropped too, and so is an
    ``amp_multicast`` whose inputs all have one float dtype (unless the node is an output of
    the graph, whose name the caller may read): such a node converts nothing, yet
    it changes how MXNet runs the op that reads it (1.9.1's oneDNN deconvolution backward
    crashes when its weight is any op's output: :data:`gluon_amp_core.emulate.DIRECT_INPUTS`).
    """
    nodes = graph["nodes"]

    heads = {h[0] for h in graph["heads"]}  # an output keeps its node (and its name)

    def dtype_of(e: list) -> Optional[str]:
        return dtypes.get((nodes[e[0]]["name"], e[1]))

    def identity(i: int, node: dict) -> bool:
        return i not in heads and converts_nothing(
            node["op"], node.get("attrs", {}), [dtype_of(e) for e in node["inputs"]])

    def passed(e: list, kept: frozenset) -> bool:
        t = dtype_of(e)
        return t is not None and t not in kept

    def integer(e: list) -> bool:
        return passed(e, FLOAT_DTYPES)

    g = _Rebuilt(graph)
    moved = g.moved
    dropped = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node["inputs"]]
        if node["op"] == "amp_cast" and (passed(node["inputs"][0], AMP_CAST_DTYPES) or identity(i, node)):
            moved[(i, 0)] = inputs[0]
            dropped += 1
            continue
        if node["op"] == "amp_multicast" and identity(i, node):
            moved.update({(i, k): e for k, e in enumerate(inputs)})
            dropped += len(inputs)
            continue
        if node["op"] == "amp_multicast" and any(dtype_of(e) == "float64" for e in node["inputs"]):
            # a float64 among them (numpy mode promotes mixed dtypes): the multicast would convert
            # the others to float64, which oneDNN's arrays refuse; as imperatively, they come in
            # float32 and the op promotes them as in FP32
            for k, e in enumerate(node["inputs"]):
                if dtype_of(e) in ("float16", "bfloat16"):
                    moved[(i, k)] = [g.add({"op": "amp_cast", "name": f"{node['name']}_{k}_float32",
                                            "attrs": {"dtype": "float32"}, "inputs": [inputs[k]]}), 0, 0]
                else:
                    moved[(i, k)] = inputs[k]
            dropped += len(inputs)
            continue
        if node["op"] == "amp_multicast" and any(integer(e) for e in node["inputs"]):
            floats = [k for k, e in enumerate(node["inputs"]) if not integer(e)]
            dropped += len(inputs) - len(floats)
            if len(floats) > 1:
                j = g.add({**node, "attrs": {**node.get("attrs", {}), "num_outputs": str(len(floats))},
                           "inputs": [inputs[k] for k in floats]})
                moved.update({(i, k): [j, n, 0] for n, k in enumerate(floats)})
            moved.update({(i, k): e for k, e in enumerate(inputs) if (i, k) not in moved})
            continue
        g.keep(i, node, inputs)
    if not dropped:
        return graph, 0
    return g.result(), dropped


#: dtypes ordered by width, as ``amp_multicast`` picks the widest (or, ``cast_narrow``, the narrowest)
_WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def heads_cast(graph: dict, dtype_for: Callable[[int, str, int], Optional[str]], suffix: str) -> dict:
    """``graph`` with output ``i`` (node name, output index) cast to ``dtype_for(i, name, index)``
    where that gives a dtype, one ``amp_cast`` named ``<name><suffix><index>`` per entry shared
    by the outputs that are it; ``graph`` itself where none is cast."""
    nodes, heads, made = list(graph["nodes"]), [], {}
    for i, (j, k, v) in enumerate(graph["heads"]):
        name = nodes[j]["name"]
        dtype = dtype_for(i, name, k)
        if dtype is not None:
            if (j, k) not in made:
                nodes.append({"op": "amp_cast", "name": f"{name}{suffix}{k}", "attrs": {"dtype": dtype},
                              "inputs": [[j, k, 0]]})
                made[(j, k)] = len(nodes) - 1
            j, k = made[(j, k)], 0
        heads.append([j, k, v])
    if not made:
        return graph
    out = {**graph, "nodes": nodes, "heads": heads}
    out.pop("node_row_ptr", None)
    return out


def cast_each_input(graph: dict, dtypes: Mapping[Key, Optional[str]], dtype: str) -> Tuple[dict, int]:
    """``graph`` with each ``amp_multicast`` that has an input of ``dtype`` replaced by one
    ``amp_cast`` per input, to the dtype the multicast would give them all; and how many
    multicasts went.

    1.9.1's CPU ``amp_multicast`` runs in oneDNN, which has no float16 ("unknown type for
    MKLDNN :2"), while ``amp_cast`` converts float16 on a CPU: a script's own float16 mask
    meeting a float32 score in ``where`` (GluonNLP's attention under ``--dtype float16``) made
    the plan's multicast fail where plain MXNet runs the op. Only where the target dtype is
    decided by a wider input (float32 or float64 among them); the plan itself keeps its
    multicasts (a GPU runs them): this is for the graph a CPU executes."""
    nodes = graph["nodes"]

    def dtype_of(e: list) -> Optional[str]:
        return dtypes.get((nodes[e[0]]["name"], e[1]))

    g = _Rebuilt(graph)
    split = 0
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node["inputs"]]
        have = [dtype_of(e) for e in node["inputs"]]
        if node["op"] == "amp_multicast" and dtype in have and None not in have:
            narrow = str(node.get("attrs", {}).get("cast_narrow", "False")).lower() in ("true", "1")
            floats = [t for t in have if t in _WIDTH]
            wider = [t for t in floats if _WIDTH[t] > _WIDTH[dtype]]
            if wider:
                want = min(floats, key=_WIDTH.__getitem__) if narrow else max(wider, key=_WIDTH.__getitem__)
                for k, (e, t) in enumerate(zip(inputs, have)):
                    g.moved[(i, k)] = e if t == want or t not in _WIDTH else [
                        g.add({"op": "amp_cast", "name": f"{node['name']}_{k}_{want}",
                               "attrs": {"dtype": want}, "inputs": [e]}), 0, 0]
                split += 1
                continue
        g.keep(i, node, inputs)
    return (g.result(), split) if split else (graph, 0)


def in_float32(graph: dict, names: Collection[str], dtypes: Mapping[Key, Optional[str]],
               keep: Collection[str] = (), follows: Optional[Callable[[dict], bool]] = None) -> dict:
    """``graph`` (MXNet's JSON form, typed ``dtypes``) with each op node named in ``names``
    computing in float32: each low-precision float input read in float32 (where a gluon_amp
    cast made it low, its source; else through a new ``amp_cast``).

    Without ``follows``, each low output is cast back to its dtype at once: nothing else moves.
    With it, the float32 values flow on through the nodes ``follows(node)`` says follow their
    inputs' dtype (their other low inputs read in float32 too), as the converter types the ops
    after a float32 one; any other node (a low-precision op, a cast that gives several outputs)
    and the graph's outputs get their old dtype back through a cast. A plan whose casts were
    elided between ops of one dtype (a converter's) stays typed either way; following keeps a
    convolution, its batch norm and its residual add in one dtype, as MXNet's oneDNN fusion
    needs them. The casts named in ``keep`` (the user's) are read from, never around.
    """
    nodes = graph["nodes"]
    users = frozenset(keep)
    out: List[dict] = []
    index: Dict[int, int] = {}
    now: Dict[Entry, List[int]] = {}  # an old low entry computed in float32 now -> its new entry
    wide: Dict[Entry, List[int]] = {}  # a low entry -> the float32 value it was made from (or a cast to it)
    back: Dict[Entry, List[int]] = {}  # an entry now float32 -> a cast of it to its old dtype
    low_dtypes = FLOAT_DTYPES - {"float32", "float64"}

    def dtype(e: Entry) -> Optional[str]:
        return dtypes.get((nodes[e[0]]["name"], e[1]))

    def plain(e: Entry) -> List[int]:
        return [index[e[0]], e[1], 0]

    def cast(src: List[int], name: str, to: str) -> List[int]:
        out.append({"op": "amp_cast", "name": f"{name}_amp_retyped_{to}", "attrs": {"dtype": to}, "inputs": [src]})
        return [len(out) - 1, 0, 0]

    def label(e: Entry) -> str:
        return nodes[e[0]]["name"] + (f"_{e[1]}" if e[1] else "")

    def float32_of(e: Entry) -> List[int]:
        if e in now:
            return now[e]
        if e not in wide:
            node = nodes[e[0]]
            src = tuple(node["inputs"][0][:2]) if node["op"] == "amp_cast" else None
            if src is not None and node["name"] not in users and (src in now or dtype(src) == "float32"):
                wide[e] = now[src] if src in now else plain(src)
            else:
                wide[e] = cast(plain(e), label(e), "float32")
        return wide[e]

    def as_before(e: Entry) -> List[int]:
        if e not in now:
            return plain(e)
        if e not in back:
            back[e] = cast(now[e], label(e), dtype(e))
        return back[e]

    for i, node in enumerate(nodes):
        inputs = [tuple(e[:2]) for e in node["inputs"]]
        chosen = node["op"] != "null" and node["name"] in names
        moved = any(e in now for e in inputs)
        grow = chosen or (moved and follows is not None and node["op"] not in CAST_OPS and follows(node))
        if grow:
            wired = [float32_of(e) if e in now or dtype(e) in low_dtypes else plain(e) for e in inputs]
        elif node["op"] == "amp_cast" and node["name"] not in users:
            wired = [now.get(e) or plain(e) for e in inputs]  # it gives its own dtype
        else:
            wired = [as_before(e) for e in inputs]
        out.append({**node, "inputs": wired})
        index[i] = len(out) - 1
        if grow:
            for k in range(_n_outputs(dtypes, node["name"])):
                if dtypes.get((node["name"], k)) in low_dtypes:
                    now[(i, k)] = plain((i, k))
    heads = [as_before(tuple(h[:2])) for h in graph["heads"]]
    return _reachable(graph, out, heads)
