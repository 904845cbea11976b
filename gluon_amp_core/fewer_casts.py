"""Fewer casts: move a cast across an op that only follows its inputs' dtype. Pure: no MXNet.

A plan casts where an op's decision needs another dtype than its producer gives, edge by
edge. Where a neutral op sits between the two, that can cast one value once per piece: an
LSTM cell's gates come out of one bfloat16 ``SliceChannel`` as four values, each cast to
float32 for ``sigmoid``/``tanh``; the time steps of an ``NTC`` input come out of one
``SliceChannel`` as 48 values, each cast to bfloat16 for a ``FullyConnected``. Run in the
dtype its readers want, the neutral op needs one cast of its input instead: the value is no
longer cast back and forth between neighbours that can share a dtype.

:func:`fewer_casts` does that for every op node whose outputs are all read through casts to
one dtype, where its float inputs need fewer new casts than the casts it removes. It moves:

- an op the table calls *neutral* (it follows its inputs: ``SliceChannel``, ``elemwise_add``)
  toward float32: exact inputs, no rounding added;
- toward a low dtype only an op that moves data without arithmetic (:data:`MOVES_DATA`),
  where rounding before or after it gives the same values.

The caller checks the result with the framework's type inference, as for every pass.
"""
from __future__ import annotations

import json
from typing import Collection, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from .decide import CAST_OPS
from .dtypes import FLOAT_DTYPES
from .retype import converts_nothing
from .table import OpClass, OpTable

Key = Tuple[str, int]
Entry = Tuple[int, int]
FP32 = "float32"

#: Ops that move or pick values without arithmetic: casting before them or after them
#: gives the same values, so they may run in a low dtype for their readers.
MOVES_DATA = frozenset({
    "SliceChannel", "split", "_split_v2", "slice", "slice_axis", "slice_like", "Reshape", "reshape",
    "Flatten", "flatten", "transpose", "SwapAxis", "swapaxes", "expand_dims", "squeeze", "Concat",
    "concat", "stack", "tile", "repeat", "broadcast_to", "broadcast_like", "broadcast_axis",
    "broadcast_axes", "identity", "_copy", "take", "pick", "reverse", "flip",
})


def fewer_casts(graph: dict, dtypes: Mapping[Key, Optional[str]], table: OpTable,
                keep: Collection[str] = ()) -> Tuple[dict, Dict[Key, Optional[str]], int]:
    """``graph`` (MXNet's JSON form, with its casts) with casts moved up across neutral ops
    where that removes some; the entries' dtypes after the move; and how many casts went.

    ``dtypes`` types every entry of ``graph`` (as the framework infers it); a node whose
    inputs or outputs are not all known is left alone. Every float input of a moved op is
    read in the new dtype (from where its value comes, seen through casts). The casts named
    in ``keep`` (the user's) stay where they are, with their dtype: none is removed, read
    around, or has an op moved across it.
    """
    nodes = [dict(n, inputs=[list(e[:3]) for e in n["inputs"]]) for n in graph["nodes"]]
    heads = [list(h[:3]) for h in graph["heads"]]
    names = [n["name"] for n in nodes]
    # a name given twice (Gluon's scopes can repeat one) types neither node here: left alone
    twice = {n for n in names if names.count(n) > 1} if len(set(names)) < len(names) else set()
    now: Dict[Key, Optional[str]] = {k: v for k, v in dtypes.items() if k[0] not in twice}
    keep = frozenset(keep)
    nodes, heads, removed = _simplify(nodes, heads, now, keep)
    changed = True
    while changed:
        changed = False
        readers = _readers(nodes)
        head_nodes = {h[0] for h in heads}
        for i, node in enumerate(nodes):
            got = _move(i, node, nodes, readers, head_nodes, now, table, keep)
            if got is None:
                continue
            want, new_inputs, dead = got
            nodes, heads, net = _apply(nodes, heads, i, want, new_inputs, dead, now, keep)
            nodes, heads, unread = _prune(nodes, heads, now, keep)
            removed += net + unread
            changed = True
            break
    if not removed:
        return graph, dict(dtypes), 0
    result = {k: v for k, v in graph.items() if k not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    result["nodes"] = nodes
    result["arg_nodes"] = [k for k, n in enumerate(nodes) if n["op"] == "null"]
    result["heads"] = heads
    left = {n["name"] for n in nodes}
    now.update({k: v for k, v in dtypes.items() if k[0] in twice})
    return result, {k: v for k, v in now.items() if k[0] in left}, removed


def _simplify(nodes: List[dict], heads: List[list], dtypes: Dict[Key, Optional[str]],
              keep: FrozenSet[str] = frozenset()) -> Tuple[List[dict], List[list], int]:
    """Without the casts that change nothing (an ``amp_cast`` to the dtype its input has; an
    ``amp_multicast`` whose float inputs share one dtype), and one cast where several cast
    the same value to the same dtype (the op wrappers cast a parameter at every call: an
    unrolled LSTM's weights 48 times)."""
    out: List[dict] = []
    at: Dict[int, int] = {}
    moved: Dict[Entry, List[int]] = {}
    seen: Dict[str, int] = {}
    removed = 0

    def entry(e: Sequence[int]) -> List[int]:
        return moved.get((e[0], e[1])) or [at[e[0]], e[1], 0]

    def dtype_of(e: Sequence[int]) -> Optional[str]:
        return dtypes.get((nodes[e[0]]["name"], e[1]))

    for i, node in enumerate(nodes):
        inputs = [entry(e) for e in node["inputs"]]
        if node["op"] in CAST_OPS and node["name"] not in keep:
            if converts_nothing(node["op"], node.get("attrs", {}), [dtype_of(e) for e in node["inputs"]]):
                moved.update({(i, k): e for k, e in enumerate(inputs)})
                removed += 1
                continue
            key = json.dumps([node["op"], sorted(node.get("attrs", {}).items()), inputs])
            if key in seen:
                twin = seen[key]
                moved.update({(i, k): [twin, k, 0] for k in range(len(inputs))})
                removed += 1
                continue
            seen[key] = len(out)
        out.append({**node, "inputs": inputs})
        at[i] = len(out) - 1
    if not removed:
        return nodes, heads, 0
    kept = {n["name"] for n in out}
    for k in [k for k in dtypes if k[0] not in kept]:
        del dtypes[k]
    return out, [entry(h) for h in heads], removed


def _readers(nodes: Sequence[dict]) -> Dict[int, List[Tuple[int, int]]]:
    """Node -> (reader node, its input slot) for every read of any of its outputs."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for j, n in enumerate(nodes):
        for k, e in enumerate(n["inputs"]):
            out.setdefault(e[0], []).append((j, k))
    return out


def _outputs(name: str, dtypes: Mapping[Key, Optional[str]]) -> List[Key]:
    out, k = [], 0
    while (name, k) in dtypes:
        out.append((name, k))
        k += 1
    return out


def _source(nodes: Sequence[dict], e: Sequence[int], keep: FrozenSet[str] = frozenset()) -> Entry:
    """Where a value comes from, seen through casts (not through the user's, in ``keep``)."""
    while nodes[e[0]]["op"] in CAST_OPS and nodes[e[0]]["name"] not in keep:
        node = nodes[e[0]]
        e = node["inputs"][0 if node["op"] == "amp_cast" else e[1]]
    return e[0], e[1]


def _move(i: int, node: dict, nodes: Sequence[dict], readers: Mapping[int, List[Tuple[int, int]]],
          head_nodes: Set[int], dtypes: Mapping[Key, Optional[str]], table: OpTable,
          keep: FrozenSet[str] = frozenset()) -> Optional[Tuple[str, List[Optional[Entry]], List[int]]]:
    """Whether node ``i`` moves: (the dtype, per input the entry to read or None to cast, the
    output casts that go), or None. An op reading a user's cast (in ``keep``), or read by
    one, stays: its dtype is the user's."""
    op = node["op"]
    if op == "null" or op in CAST_OPS or i in head_nodes or not node["inputs"] or op in ("Cast", "cast"):
        return None
    if any(nodes[e[0]]["name"] in keep for e in node["inputs"]):
        return None
    if table.classes.get(table.canonical(op)) is not OpClass.NEUTRAL:
        return None
    outs = _outputs(node["name"], dtypes)
    reads = readers.get(i, [])
    if not outs or not reads or any(dtypes.get(o) not in FLOAT_DTYPES for o in outs):
        return None
    casts = {j for j, _ in reads}
    if any(nodes[j]["name"] in keep for j in casts):
        return None
    wants = {nodes[j].get("attrs", {}).get("dtype") for j in casts}
    if any(nodes[j]["op"] != "amp_cast" for j in casts) or len(wants) != 1:
        return None
    want = wants.pop()
    if want not in FLOAT_DTYPES or any(dtypes.get(o) == want for o in outs):
        return None
    if want != FP32 and op not in MOVES_DATA:
        return None  # arithmetic in a low dtype is the op table's decision, not this pass's
    plan: List[Optional[Entry]] = []
    new: Set[Entry] = set()
    for e in node["inputs"]:
        have = dtypes.get((nodes[e[0]]["name"], e[1]))
        if have is None:
            return None
        if have not in FLOAT_DTYPES:
            plan.append((e[0], e[1]))
            continue
        src = _source(nodes, e, keep)
        if dtypes.get((nodes[src[0]]["name"], src[1])) == want:
            plan.append(src)
            continue
        existing = _existing_cast(nodes, readers, src, want, i)
        if existing is not None:
            plan.append((existing, 0))
        else:
            plan.append(None)
            new.add(src)
    if len(new) >= len(casts):
        return None
    return want, plan, sorted(casts)


def _existing_cast(nodes: Sequence[dict], readers: Mapping[int, List[Tuple[int, int]]], src: Entry,
                   dtype: str, before: int) -> Optional[int]:
    """A cast of ``src`` to ``dtype`` ahead of node ``before``, if the graph has one."""
    for j, _ in readers.get(src[0], []):
        n = nodes[j]
        if (j < before and n["op"] == "amp_cast" and n.get("attrs", {}).get("dtype") == dtype
                and tuple(n["inputs"][0][:2]) == src):
            return j
    return None


def _prune(nodes: List[dict], heads: List[list], dtypes: Dict[Key, Optional[str]],
           keep: FrozenSet[str] = frozenset()) -> Tuple[List[dict], List[list], int]:
    """Without the casts nothing reads any more (a moved op reads their source directly)."""
    read = {h[0] for h in heads}
    for n in nodes:
        read.update(e[0] for e in n["inputs"])
    dead = {j for j, n in enumerate(nodes) if n["op"] in CAST_OPS and j not in read and n["name"] not in keep}
    if not dead:
        return nodes, heads, 0
    keep = [j for j in range(len(nodes)) if j not in dead]
    at = {j: k for k, j in enumerate(keep)}
    for j in dead:
        for k in range(len(_outputs(nodes[j]["name"], dtypes)) or 1):
            dtypes.pop((nodes[j]["name"], k), None)
    out = [{**nodes[j], "inputs": [[at[e[0]], e[1], 0] for e in nodes[j]["inputs"]]} for j in keep]
    return out, [[at[h[0]], h[1], 0] for h in heads], len(dead)


def _apply(nodes: List[dict], heads: List[list], i: int, want: str, plan: List[Optional[Entry]], dead: List[int],
           dtypes: Dict[Key, Optional[str]], keep: FrozenSet[str] = frozenset()) -> Tuple[List[dict], List[list], int]:
    """Node ``i`` in ``want``: its inputs as ``plan`` says (new casts inserted before it), the
    casts in ``dead`` gone (their readers read node ``i``). Returns the new nodes and heads,
    and the net number of casts removed."""
    node = nodes[i]
    added: List[dict] = []
    inputs = []
    made: Dict[Entry, int] = {}
    for e, how in zip(node["inputs"], plan):
        if how is not None:
            inputs.append([how[0], how[1], 0])
            continue
        src = _source(nodes, e, keep)
        if src not in made:
            base = nodes[src[0]]["name"] + (f"_{src[1]}" if src[1] else "")
            added.append({"op": "amp_cast", "name": f"{base}_amp_moved_{want}", "attrs": {"dtype": want},
                          "inputs": [[src[0], src[1], 0]]})
            made[src] = len(added) - 1
        inputs.append(["new", made[src]])
    # new order: nodes before i, the added casts, node i, the rest without the dead casts
    order: List[Tuple[str, int]] = [("old", j) for j in range(i)] + [("new", k) for k in range(len(added))]
    order += [("old", j) for j in range(i, len(nodes)) if j not in dead]
    index = {key: pos for pos, key in enumerate(order)}
    through = {j: i for j in dead}  # a dead cast's readers read node i's same output

    def remap(e: Sequence) -> List[int]:
        if e[0] == "new":
            return [index[("new", e[1])], 0, 0]
        if e[0] in through:
            return [index[("old", through[e[0]])], nodes[e[0]]["inputs"][0][1], 0]
        return [index[("old", e[0])], e[1], 0]

    out = []
    for kind, j in order:
        n = added[j] if kind == "new" else nodes[j]
        ins = inputs if (kind, j) == ("old", i) else n["inputs"]
        out.append({**n, "inputs": [remap(e) for e in ins]})
    for k in range(len(_outputs(node["name"], dtypes))):
        if dtypes.get((node["name"], k)) in FLOAT_DTYPES:
            dtypes[(node["name"], k)] = want
    for n in added:
        dtypes[(n["name"], 0)] = want
    for j in dead:
        dtypes.pop((nodes[j]["name"], 0), None)
    return out, [remap(h) for h in heads], len(dead) - len(added)
