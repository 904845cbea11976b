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
from .retype import converts_nothing, names_given_twice
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

    One move at a time, always the first op in graph order that can move (a move can let the
    ops its inputs come from move next). Nodes keep their identity while casts come and go, so
    a move does not rebuild every node, and after it the search resumes at the first node it
    could have changed, not at the top: GluonTS DeepState's unrolled graph (5,536 nodes, 714
    casts removed) took 4.3 s when each move rebuilt the graph and searched it again, 0.4 s now.
    """
    nodes = [dict(n, inputs=[list(e[:3]) for e in n["inputs"]]) for n in graph["nodes"]]
    heads = [list(h[:3]) for h in graph["heads"]]
    # a name given twice (Gluon's scopes can repeat one) types neither node here: left alone
    twice = names_given_twice(nodes)
    now: Dict[Key, Optional[str]] = {k: v for k, v in dtypes.items() if k[0] not in twice}
    keep = frozenset(keep)
    nodes, heads, removed = _simplify(nodes, heads, now, keep)
    g = _Graph(nodes, heads)
    at = 0
    while at < len(g.order):
        i = g.order[at]
        got = _move(i, g, now, table, keep)
        if got is None:
            at += 1
            continue
        want, new_inputs, dead = got
        net, touched = g.apply(i, want, new_inputs, dead, now, keep)
        unread, producers = g.prune(now, keep)
        removed += net + unread
        # every node before the first one this move changed (its reads, its readers, its
        # inputs' casts) could not move before it, and still cannot
        at = min(g.pos[n] for n in touched | producers if n in g.pos)
    if not removed:
        return graph, dict(dtypes), 0
    nodes, heads = g.lists()
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


def _outputs(name: str, dtypes: Mapping[Key, Optional[str]]) -> List[Key]:
    out, k = [], 0
    while (name, k) in dtypes:
        out.append((name, k))
        k += 1
    return out


def _move(i: int, g: "_Graph", dtypes: Mapping[Key, Optional[str]], table: OpTable,
          keep: FrozenSet[str] = frozenset()) -> Optional[Tuple[str, List[Optional[Entry]], List[int]]]:
    """Whether node ``i`` moves: (the dtype, per input the entry to read or None to cast, the
    output casts that go), or None. An op reading a user's cast (in ``keep``), or read by
    one, stays: its dtype is the user's."""
    node = g.store[i]
    op = node["op"]
    if op == "null" or op in CAST_OPS or not node["inputs"] or op in ("Cast", "cast"):
        return None
    if table.classes.get(table.canonical(op)) is not OpClass.NEUTRAL:
        return None
    if any(h[0] == i for h in g.heads) or any(g.name(e[0]) in keep for e in node["inputs"]):
        return None
    outs = _outputs(node["name"], dtypes)
    reads = g.readers.get(i, [])
    if not outs or not reads or any(dtypes.get(o) not in FLOAT_DTYPES for o in outs):
        return None
    casts = {j for j, _ in reads}
    if any(g.name(j) in keep for j in casts):
        return None
    wants = {g.store[j].get("attrs", {}).get("dtype") for j in casts}
    if any(g.store[j]["op"] != "amp_cast" for j in casts) or len(wants) != 1:
        return None
    want = wants.pop()
    if want not in FLOAT_DTYPES or any(dtypes.get(o) == want for o in outs):
        return None
    if want != FP32 and op not in MOVES_DATA:
        return None  # arithmetic in a low dtype is the op table's decision, not this pass's
    plan: List[Optional[Entry]] = []
    new: Set[Entry] = set()
    for e in node["inputs"]:
        have = g.dtype(e, dtypes)
        if have is None:
            return None
        if have not in FLOAT_DTYPES:
            plan.append((e[0], e[1]))
            continue
        src = g.source(e, keep)
        if g.dtype(src, dtypes) == want:
            plan.append(src)
            continue
        existing = g.existing_cast(src, want, i)
        if existing is not None:
            plan.append((existing, 0))
        else:
            plan.append(None)
            new.add(src)
    if len(new) >= len(casts):
        return None
    return want, plan, sorted(casts, key=g.pos.__getitem__)


class _Graph:
    """A graph whose nodes keep an identity (their index in the list given) while casts are
    added and removed: inputs and heads name nodes by identity, ``order`` is the graph order,
    ``pos`` each node's place in it, ``readers`` each node's (reader, input slot) reads."""

    def __init__(self, nodes: List[dict], heads: List[list]) -> None:
        self.store: Dict[int, dict] = dict(enumerate(nodes))
        self.next_id = len(nodes)  # identities are never reused: removed nodes leave gaps
        self.order: List[int] = list(range(len(nodes)))
        self.heads = heads
        self.readers: Dict[int, List[Tuple[int, int]]] = {}
        for j, n in enumerate(nodes):
            for k, e in enumerate(n["inputs"]):
                self.readers.setdefault(e[0], []).append((j, k))
        self.pos: Dict[int, int] = {}
        self._placed()

    def _placed(self) -> None:
        self.pos = {n: k for k, n in enumerate(self.order)}

    def name(self, n: int) -> str:
        return self.store[n]["name"]

    def dtype(self, e: Sequence[int], dtypes: Mapping[Key, Optional[str]]) -> Optional[str]:
        return dtypes.get((self.store[e[0]]["name"], e[1]))

    def chain(self, e: Sequence[int], keep: FrozenSet[str] = frozenset()) -> List[Entry]:
        """The entries from ``e`` back through casts (not the user's, in ``keep``) to where its
        value comes from, both ends included."""
        out = [(e[0], e[1])]
        while self.store[e[0]]["op"] in CAST_OPS and self.store[e[0]]["name"] not in keep:
            node = self.store[e[0]]
            e = node["inputs"][0 if node["op"] == "amp_cast" else e[1]]
            out.append((e[0], e[1]))
        return out

    def source(self, e: Sequence[int], keep: FrozenSet[str] = frozenset()) -> Entry:
        """Where a value comes from, seen through casts (not through the user's, in ``keep``)."""
        return self.chain(e, keep)[-1]

    def existing_cast(self, src: Entry, dtype: str, before: int) -> Optional[int]:
        """The first cast of ``src`` to ``dtype`` ahead of node ``before``, if the graph has one."""
        found = [j for j, _ in self.readers.get(src[0], [])
                 if self.pos[j] < self.pos[before] and self.store[j]["op"] == "amp_cast"
                 and self.store[j].get("attrs", {}).get("dtype") == dtype
                 and tuple(self.store[j]["inputs"][0][:2]) == src]
        return min(found, key=self.pos.__getitem__) if found else None

    def _read(self, n: int, by: int, slot: int) -> None:
        self.readers.setdefault(n, []).append((by, slot))

    def _unread(self, n: int, by: int, slot: int) -> None:
        self.readers[n].remove((by, slot))

    def apply(self, i: int, want: str, plan: List[Optional[Entry]], dead: List[int],
              dtypes: Dict[Key, Optional[str]], keep: FrozenSet[str] = frozenset()) -> Tuple[int, Set[int]]:
        """Node ``i`` in ``want``: its inputs as ``plan`` says (new casts inserted before it), the
        casts in ``dead`` gone (their readers read node ``i``). Returns the net number of casts
        removed, and the nodes the move changed (their reads, readers, or dtypes)."""
        node = self.store[i]
        touched: Set[int] = {i}
        added: List[int] = []
        made: Dict[Entry, int] = {}
        inputs = []
        for slot, (e, how) in enumerate(zip(node["inputs"], plan)):
            touched.update(n for n, _ in self.chain(e, keep))
            self._unread(e[0], i, slot)
            if how is None:
                src = self.source(e, keep)
                if src not in made:
                    base = self.store[src[0]]["name"] + (f"_{src[1]}" if src[1] else "")
                    new_id, self.next_id = self.next_id, self.next_id + 1
                    self.store[new_id] = {"op": "amp_cast", "name": f"{base}_amp_moved_{want}",
                                          "attrs": {"dtype": want}, "inputs": [[src[0], src[1], 0]]}
                    self._read(src[0], new_id, 0)
                    made[src] = new_id
                    added.append(new_id)
                how = (made[src], 0)
            inputs.append([how[0], how[1], 0])
            self._read(how[0], i, slot)
        node["inputs"] = inputs
        touched.update(added)
        for j in dead:  # a dead cast's readers read node i's same output
            out = self.store[j]["inputs"][0][1]
            self._unread(i, j, 0)
            for by, slot in self.readers.pop(j, []):
                self.store[by]["inputs"][slot] = [i, out, 0]
                self._read(i, by, slot)
            self.heads = [[i, out, 0] if h[0] == j else h for h in self.heads]
        k = self.pos[i]
        gone = set(dead)
        self.order = self.order[:k] + added + [n for n in self.order[k:] if n not in gone]
        self._placed()
        for k in range(len(_outputs(node["name"], dtypes))):
            if dtypes.get((node["name"], k)) in FLOAT_DTYPES:
                dtypes[(node["name"], k)] = want
        for n in added:
            dtypes[(self.store[n]["name"], 0)] = want
        for j in dead:
            dtypes.pop((self.store.pop(j)["name"], 0), None)
        return len(dead) - len(added), touched

    def prune(self, dtypes: Dict[Key, Optional[str]], keep: FrozenSet[str] = frozenset()) -> Tuple[int, Set[int]]:
        """Without the casts nothing reads any more (a moved op reads their source directly).
        Returns how many went and the nodes they read (whose readers changed)."""
        heads = {h[0] for h in self.heads}
        dead = [j for j in self.order if self.store[j]["op"] in CAST_OPS and j not in heads
                and not self.readers.get(j) and self.store[j]["name"] not in keep]
        if not dead:
            return 0, set()
        producers: Set[int] = set()
        for j in dead:
            for slot, e in enumerate(self.store[j]["inputs"]):
                producers.add(e[0])
        gone = set(dead)
        for j in dead:
            for slot, e in enumerate(self.store[j]["inputs"]):
                if e[0] not in gone:
                    self._unread(e[0], j, slot)
            for k in range(len(_outputs(self.store[j]["name"], dtypes)) or 1):
                dtypes.pop((self.store[j]["name"], k), None)
            self.readers.pop(j, None)
        self.order = [n for n in self.order if n not in gone]
        for j in dead:
            del self.store[j]
        self._placed()
        return len(dead), producers - gone

    def lists(self) -> Tuple[List[dict], List[list]]:
        """The nodes in graph order with inputs by index, and the heads likewise."""
        return ([{**self.store[n], "inputs": [[self.pos[e[0]], e[1], 0] for e in self.store[n]["inputs"]]}
                 for n in self.order], [[self.pos[h[0]], h[1], 0] for h in self.heads])


