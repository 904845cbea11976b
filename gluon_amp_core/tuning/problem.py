"""Precision per layer by timing (TensorRT's idea, for MXNet training and deployment). Pure.

The op table says which ops *may* run low; only the machine knows which are faster there.
Given a graph as the plan types it (every entry's dtype and shape), :func:`problem` lists
what to time: each op the plan runs in the low dtype (a *candidate*), in both dtypes, and
the casts between them. The MXNet layer times them (and caches the figures: the speed
table, keyed by op, attributes, input shapes, dtypes and training). :func:`choose` then
gives every candidate the dtype that minimises the total time of ops plus casts, exactly:
two dtypes and a cast cost on each edge whose ends differ is a minimum cut.

Its result is data for the one rule, :func:`gluon_amp_core.decide.decide` (``measured``):
a candidate kept in float32, and a candidate kept low although its producer no longer is.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ..decide import CAST_OPS, MeasuredChoice as Choice
from ..shape_limits import keeps_fp32
from ..dtypes import FLOAT_DTYPES
from ..graph_pass import is_kept
from ..table import OpClass, OpTable

Key = Tuple[str, int]          # (node name, output index)
Shape = Tuple[int, ...]
FP32 = "float32"


@dataclass(frozen=True)
class Timed:
    """One thing to time: an op with its attributes on inputs of these shapes and dtypes."""

    op: str
    attrs: Tuple[Tuple[str, str], ...]
    shapes: Tuple[Shape, ...]
    dtypes: Tuple[str, ...]
    train: bool

    @property
    def key(self) -> str:
        """The speed table's key (stable text: cached across processes)."""
        return json.dumps([self.op, self.attrs, self.shapes, self.dtypes, self.train], separators=(",", ":"))


def cast_timed(shape: Shape, src: str, dst: str, train: bool) -> Timed:
    """An ``amp_cast`` of one tensor from ``src`` to ``dst``."""
    return Timed("amp_cast", (("dtype", dst),), (tuple(shape),), (src,), train)


@dataclass(frozen=True)
class Candidate:
    """An op the plan runs in the low dtype, and its two timings."""

    name: str
    op: str
    low: Timed
    fp32: Timed
    follows: bool  # its class lets it follow its inputs (not a low-precision op)


@dataclass
class Problem:
    """What :func:`choose` needs besides the times.

    ``links`` are (producer, consumer, shape) between candidates; ``fixed`` lists, per
    candidate, the casts a neighbour whose dtype does not change imposes on it: (the
    candidate's dtype that pays it, the cast).
    """

    target: str
    candidates: Dict[str, Candidate] = field(default_factory=dict)
    links: List[Tuple[str, str, Shape]] = field(default_factory=list)
    fixed: Dict[str, List[Tuple[str, Timed]]] = field(default_factory=dict)
    #: entry -> the candidates reading it, for which a change of its dtype matters
    readers: Dict[Key, Set[str]] = field(default_factory=dict)
    #: op nodes that are not candidates but follow their inputs' dtype
    followers: Dict[str, List[Key]] = field(default_factory=dict)

    def to_time(self) -> List[Timed]:
        """Everything to measure, once each."""
        seen: Dict[str, Timed] = {}
        for c in self.candidates.values():
            seen.setdefault(c.low.key, c.low)
            seen.setdefault(c.fp32.key, c.fp32)
        for producer, _, shape in self.links:
            for src, dst in ((self.target, FP32), (FP32, self.target)):
                t = cast_timed(shape, src, dst, self.candidates[producer].low.train)
                seen.setdefault(t.key, t)
        for casts in self.fixed.values():
            for _, t in casts:
                seen.setdefault(t.key, t)
        return list(seen.values())


def _attrs(node: dict) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in node.get("attrs", {}).items() if not k.startswith("__")))


def problem(nodes: Sequence[dict], heads: Sequence[Sequence[int]], dtypes: Mapping[Key, Optional[str]],
            shapes: Mapping[Key, Optional[Shape]], table: OpTable,
            op_inputs: Mapping[str, Sequence[str]], train: bool,
            excluded: Collection[str] = ()) -> Problem:
    """The tuning problem of a graph typed by its plan.

    Parameters
    ----------
    nodes, heads : MXNet's JSON form of the graph (with the plan's casts).
    dtypes, shapes : every entry's dtype and shape, as MXNet infers them.
    table : OpTable of the plan (which inputs stay float32; which ops follow their inputs).
    op_inputs : op name -> declared input names.
    train : time forward and backward (a training graph) or forward only.
    excluded : op node names the user keeps in float32 (never candidates).

    A candidate is an op node (not a cast, a fused op or a graph output) whose outputs the
    plan holds in the low dtype, with only float inputs and known shapes, and no input-shape
    rule of the table keeping it float32 there (its low kernel fails: timing it could kill the
    process).
    """
    low = table.target_dtype
    prob = Problem(low)
    head_nodes = {h[0] for h in heads}

    def entry_key(e: Sequence[int]) -> Key:
        return nodes[e[0]]["name"], e[1]

    def source(e: Sequence[int]) -> Tuple[Key, Optional[str]]:
        """The entry a value comes from, seen through casts, and the dtype a cast on the
        way fixes (``None``: it arrives as its source has it)."""
        fixed = None
        while nodes[e[0]]["op"] in CAST_OPS:
            node = nodes[e[0]]
            if node["op"] == "amp_cast":
                fixed = fixed or node.get("attrs", {}).get("dtype")
                e = node["inputs"][0]
            else:
                e = node["inputs"][e[1]]
        return entry_key(e), fixed

    def outputs(name: str) -> List[Key]:
        out, k = [], 0
        while (name, k) in dtypes:
            out.append((name, k))
            k += 1
        return out

    # Pass 1: who is a candidate.
    for i, node in enumerate(nodes):
        op, name = node["op"], node["name"]
        if op == "null" or op in CAST_OPS or is_kept(node) or i in head_nodes or name in excluded:
            continue
        outs = outputs(name)
        ins = [entry_key(e) for e in node["inputs"]]
        if (not outs or dtypes.get(outs[0]) != low or any(dtypes.get(o) not in FLOAT_DTYPES for o in outs)
                or any(dtypes.get(k) not in FLOAT_DTYPES for k in ins)
                or any(shapes.get(k) is None for k in ins + outs)):
            continue
        if keeps_fp32(table.narrow_fp32.get(table.canonical(op), ()), shapes[ins[0]] if ins else None,
                      node.get("attrs", {})):
            continue  # its low kernel fails at this shape: never timed (it can take the process down)
        names = op_inputs.get(op, ())
        keep = table.keep_fp32_inputs.get(table.canonical(op), frozenset())
        kept = [k < len(names) and names[k] in keep for k in range(len(ins))]
        in_shapes = tuple(tuple(shapes[k]) for k in ins)
        cls = table.classes.get(table.canonical(op), OpClass.NEUTRAL)
        prob.candidates[name] = Candidate(
            name, op,
            Timed(op, _attrs(node), in_shapes, tuple(FP32 if kp else low for kp in kept), train),
            Timed(op, _attrs(node), in_shapes, tuple(FP32 for _ in kept), train),
            follows=cls is not OpClass.LOW_PRECISION)
    # Pass 2: how candidates meet each other and the rest.
    for node in nodes:
        op, name = node["op"], node["name"]
        if op == "null" or op in CAST_OPS:
            continue
        names = op_inputs.get(op, ())
        keep = table.keep_fp32_inputs.get(table.canonical(op), frozenset())
        for k, e in enumerate(node["inputs"]):
            src, cast_to = source(e)
            if dtypes.get(src) not in FLOAT_DTYPES or shapes.get(src) is None:
                continue
            shape = tuple(shapes[src])
            if name in prob.candidates:
                if k < len(names) and names[k] in keep:
                    continue  # read in float32 whatever the op's dtype
                prob.readers.setdefault(src, set()).add(name)
                if src[0] in prob.candidates:
                    prob.links.append((src[0], name, shape))
                else:  # a fixed producer (data, a parameter, a float32 op)
                    have = dtypes[src]
                    pays = FP32 if have == low else low
                    prob.fixed.setdefault(name, []).append((pays, cast_timed(shape, have, pays, train)))
            elif src[0] in prob.candidates:
                if cast_to in FLOAT_DTYPES:  # a fixed consumer that reads it cast to its dtype
                    pays = low if cast_to != low else FP32
                    prob.fixed.setdefault(src[0], []).append((pays, cast_timed(shape, pays, cast_to, train)))
                else:
                    prob.followers.setdefault(name, []).append(src)
            elif cast_to is None:
                prob.followers.setdefault(name, []).append(src)
    return prob


class _MaxFlow:
    """Dinic's maximum flow on float capacities."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.head: List[List[int]] = [[] for _ in range(n)]
        self.to: List[int] = []
        self.cap: List[float] = []

    def add(self, u: int, v: int, c: float) -> None:
        if c <= 0:
            return
        self.head[u].append(len(self.to)); self.to.append(v); self.cap.append(c)  # noqa: E702
        self.head[v].append(len(self.to)); self.to.append(u); self.cap.append(0.0)  # noqa: E702

    def _levels(self, s: int) -> List[int]:
        level = [-1] * self.n
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for e in self.head[u]:
                if self.cap[e] > 1e-12 and level[self.to[e]] < 0:
                    level[self.to[e]] = level[u] + 1
                    q.append(self.to[e])
        return level

    def source_side(self, s: int, t: int) -> Set[int]:
        """Push the maximum flow, then return the nodes still reachable from ``s``."""
        while True:
            level = self._levels(s)
            if level[t] < 0:
                break
            it = [0] * self.n

            def push(u: int, f: float) -> float:
                if u == t:
                    return f
                while it[u] < len(self.head[u]):
                    e = self.head[u][it[u]]
                    v = self.to[e]
                    if self.cap[e] > 1e-12 and level[v] == level[u] + 1:
                        got = push(v, min(f, self.cap[e]))
                        if got > 0:
                            self.cap[e] -= got
                            self.cap[e ^ 1] += got
                            return got
                    it[u] += 1
                return 0.0

            while push(s, float("inf")) > 0:
                pass
        level = self._levels(s)
        return {u for u in range(self.n) if level[u] >= 0}


def choose(prob: Problem, times: Mapping[str, Optional[float]]) -> Dict[str, Choice]:
    """The dtype of every candidate that differs from the plan, or must be held to it.

    ``times`` maps :attr:`Timed.key` to milliseconds (``None`` or missing: could not be
    timed, and the candidate keeps the plan's dtype). The total of op and cast times is
    minimal; a tie goes to float32 (a low dtype must be *faster* to be kept).
    """
    low = prob.target

    def ms(t: Timed) -> float:
        v = times.get(t.key)
        return float(v) if v is not None else 0.0

    op_ms = {n: {low: times[c.low.key], FP32: times[c.fp32.key]} for n, c in prob.candidates.items()
             if times.get(c.low.key) is not None and times.get(c.fp32.key) is not None}
    unary = {n: {low: 0.0, FP32: 0.0} for n in op_ms}  # casts a node's own dtype makes it pay
    for n in op_ms:
        for pays, t in prob.fixed.get(n, ()):
            unary[n][pays] += ms(t)
    links = []
    for u, v, shape in prob.links:
        train = prob.candidates[u].low.train
        links.append((u, v, ms(cast_timed(shape, low, FP32, train)), ms(cast_timed(shape, FP32, low, train))))
    for u, v, down, up in links:  # an untimed candidate stays low: a fixed neighbour
        if u not in op_ms and v in op_ms:
            unary[v][FP32] += down
        elif v not in op_ms and u in op_ms:
            unary[u][FP32] += up
    index = {n: i + 2 for i, n in enumerate(op_ms)}  # 0: low side (source), 1: float32 side (sink)
    flow = _MaxFlow(len(index) + 2)
    tie = 1e-9  # in favour of float32
    for n, i in index.items():
        flow.add(0, i, op_ms[n][FP32] + unary[n][FP32])        # cut when n is float32
        flow.add(i, 1, op_ms[n][low] + unary[n][low] + tie)    # cut when n is low
    for u, v, down, up in links:
        if u in index and v in index:
            flow.add(index[u], index[v], down)  # u low, v float32
            flow.add(index[v], index[u], up)    # u float32, v low
    low_side = flow.source_side(0, 1)
    label = {n: (low if index[n] in low_side else FP32) for n in index}
    label.update({n: low for n in prob.candidates if n not in index})
    changed = {n for n, d in label.items() if d == FP32}
    if not changed:
        return {}

    def casts(n: str, d: str) -> float:
        """What the casts around ``n`` cost with ``n`` in ``d``, its neighbours as labelled."""
        total = unary[n][d]
        for u, v, down, up in links:
            if v == n and label[u] != d:
                total += down if label[u] == low else up
            elif u == n and label[v] != d:
                total += down if d == low else up
        return total

    def choice(n: str) -> Choice:
        other = FP32 if label[n] == low else low
        return Choice(label[n], op_ms[n][low], op_ms[n][FP32], casts(n, label[n]) - casts(n, other), low)

    out = {n: choice(n) for n in changed}
    moved = _moved_entries(prob, changed)
    for n, cand in prob.candidates.items():
        if label[n] == low and n in op_ms and cand.follows and any(n in prob.readers.get(k, ()) for k in moved):
            out[n] = choice(n)
    return out


def _moved_entries(prob: Problem, changed: Set[str]) -> Set[Key]:
    """Entries whose dtype may change: outputs of the changed candidates, and of the
    followers they reach (ops that take their inputs' dtype)."""
    moved_nodes = set(changed)
    grew = True
    while grew:
        grew = False
        for name, srcs in prob.followers.items():
            if name not in moved_nodes and any(s[0] in moved_nodes for s in srcs):
                moved_nodes.add(name)
                grew = True
    return {k for k in prob.readers if k[0] in moved_nodes}


def groups(prob: Problem, choices: Mapping[str, Choice]) -> List[Tuple[str, Dict[str, Choice]]]:
    """``choices`` split by the op of the nodes they keep in float32, most promising first.

    Each group holds its float32 choices and the low ones they force (followers whose input
    moved). Per-op times miss what only the whole graph shows (MXNet's oneDNN ops pass
    blocked layouts to each other; a cast in between makes both sides reorder), so the
    MXNet layer times each group's change on the whole graph before keeping it.
    """
    by_op: Dict[str, Dict[str, Choice]] = {}
    for n, c in choices.items():
        if c.dtype == FP32:
            by_op.setdefault(prob.candidates[n].op, {})[n] = c
    out = []
    for op, demoted in by_op.items():
        moved = _moved_entries(prob, set(demoted))
        held = {n: c for n, c in choices.items()
                if c.dtype != FP32 and any(n in prob.readers.get(k, ()) for k in moved)}
        gain = sum(c.low_ms - c.fp32_ms - c.cast_ms for c in demoted.values())
        out.append((gain, op, {**demoted, **held}))
    return [(op, group) for gain, op, group in sorted(out, key=lambda g: -g[0])]
