"""Precision per layer by timing: MXNet's side of :mod:`gluon_amp_core.tuning.problem`.

For a graph and the shapes it runs with: MXNet infers every entry's dtype and shape, the
core lists what to time, this module times what the speed table (the machine's timing
cache) does not hold yet, and the core chooses. The work is cut into steps (one op's
timing, the whole-graph trials) that a :class:`~gluon_amp_core.tuning.schedule.Ledger` pays
for: :mod:`gluon_amp.tuning.schedule` runs them, between the training calls of a hybridized
block (``init``) or all at once for the converters (:func:`~.schedule.tune_graph`).

A graph's outcome is kept per graph structure, not per shape: tuned once in full at one
input shape, it serves every shape, re-checked only where
:func:`gluon_amp_core.tuning.schedule.could_flip` says a choice could flip (:class:`Job`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.base import MXNetError
from mxnet.symbol import Symbol

from gluon_amp_core.decide import MeasuredChoice, decide, users_cast_readers
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import Change, drop_identity_casts, retype
from gluon_amp_core.timing_cache import TimingCache
from gluon_amp_core.tuning.problem import Problem, Timed, choose, groups, problem
from gluon_amp_core.tuning.schedule import SIZE_STEP, Ledger, elements, still_float32, to_retime
from gluon_amp_core.decide import CAST_OPS
from gluon_amp_core.tuning.verdict import (AMX_TRAINING_ACTIVATION_CAST_SHARE, GUARD_CAST_WEIGHT, WEIGHT_CAST_SHARE,
                                          Verdict, activation_casts, describe_unmeasured, low_op_nodes, op_macs,
                                          unmeasured_runs_fp32)

from .. import mxnet_internals as mxi, runtime
from ..native_run import guarded_batchnorms, guards_layouts, native_passes
from ..type_inference import infer_dtypes, infer_shapes
from ..speed.timing import Timer, time_graph, time_graphs, time_op, timer_now

_log = logging.getLogger(__name__)
_PREFIX = "op/"
_GRAPH = "tune/"

#: Groups of changes tried on the whole graph, at most; and by how much a change must
#: speed the whole graph up to be kept (timing noise on a shared machine is a few percent).
MAX_TRIALS = 4
MIN_GAIN = 0.03
#: A change whose first (warm-up) run already takes this many times the plan's step is not
#: timed further: warm-up costs up to ~2 steps (oneDNN primitives are created then).
GIVE_UP = 2.5
#: Estimates of a step's cost (s): preparing a graph (type and shape inference, the
#: problem) per node; one op's timing beyond its runs (binding); the first whole-graph
#: timing of a job in steps of the graph (a warm-up that creates oneDNN's primitives, about
#: two steps more, then :data:`GRAPH_RUNS` runs) plus building the block that runs it (a
#: fixed part and a part per node; YOLOv3-MobileNet's training graph, 611 nodes, took 5.6 s
#: a timing at 0.74 s a step). Later timings of the job are estimated from the first one's
#: cost. Too high only delays tuning; too low overdraws the budget by that step.
PREPARE_S_PER_NODE = 2e-4
OP_OVERHEAD_S = 0.01
GRAPH_RUNS = 2
GRAPH_TIMING_STEPS = GRAPH_RUNS + 3
GRAPH_BUILD_S = 0.15
GRAPH_BUILD_S_PER_NODE = 5e-3
#: A trial graph costs up to this much more than the plan to time (its casts, new primitives).
TRIAL_COST = 1.25
#: Before any op of a graph is timed, its timing is guessed at this many runs of the op
#: (a warm-up and five runs per dtype, and the bind): its share of the step, by size.
OP_TIMING_RUNS = 7
#: Per-op figures measured but not yet written to the cache are written at least this often (s).
FLUSH_S = 2.0


@dataclass
class Tuning:
    """What tuning did for one graph: the choices in force, how many measurements it made
    or read, what it cost, and where it stands (``status``)."""

    choices: Dict[str, MeasuredChoice] = field(default_factory=dict)
    timed: int = 0
    cached: int = 0
    seconds: float = 0.0
    #: whole-graph trials: (the change tried, its ms), the plan first
    trials: list = field(default_factory=list)
    status: str = "not tuned yet"
    #: input shapes it was tuned at in full, and where it was re-checked since
    tuned_at: Optional[Dict[str, Tuple[int, ...]]] = None
    rechecked: List[str] = field(default_factory=list)
    withdrawn: List[str] = field(default_factory=list)
    #: what the graph runs (its plan or float32) and why: the whole graph against float32, or
    #: the rule where that is not measured yet ("" where it was not looked at)
    verdict: str = ""

    @property
    def summary(self) -> str:
        """Where tuning stands and what the graph runs, in one line (``report()``'s)."""
        return "; ".join(p for p in (self.status, self.verdict) if p)


def signature(graph: dict, dtypes: Mapping[str, str], train: bool, fused: bool) -> str:
    """A key for a graph that survives renaming and serves every input shape: ops,
    attributes and wiring by position (Gluon's name prefixes count instances), input
    dtypes, mode."""
    ops = [[n["op"], sorted((k, str(v)) for k, v in n.get("attrs", {}).items() if not k.startswith("__")),
            [e[:2] for e in n["inputs"]]] for n in graph["nodes"]]
    # inputs by node position too: parameter names carry the instance prefix (ssd0_, ssd1_)
    position = input_positions(graph)
    text = json.dumps([ops, graph["heads"], sorted((position[k], v) for k, v in dtypes.items() if k in position),
                       train, fused], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def input_positions(graph: dict) -> Dict[str, int]:
    """Input name -> its node's position in the graph."""
    return {n["name"]: i for i, n in enumerate(graph["nodes"]) if n["op"] == "null"}


# -- a graph's outcome, as the cache keeps it -----------------------------------------

@dataclass
class Outcome:
    """A graph's tuning: its choices by node position, the input shapes (by input node
    position) it was tuned at, and the shapes where it was re-checked since."""

    choices: Dict[int, MeasuredChoice]
    tuned_at: Dict[int, Tuple[int, ...]]
    rechecked: List[Dict[int, Tuple[int, ...]]] = field(default_factory=list)
    #: choices withdrawn at another shape: position -> why
    withdrawn: Dict[int, str] = field(default_factory=dict)
    #: the whole graph as AMP runs it (these choices) and in float32, ms, at ``tuned_at``;
    #: None where either could not be timed
    check: Optional[Tuple[float, float]] = None
    #: the check is done but not the per-op tuning (a job under way, or a process that stopped)
    partial: bool = False
    #: False for an outcome stored before whole graphs were checked against float32
    checked: bool = True

    @property
    def verdict(self) -> Optional[Verdict]:
        """The whole graph against float32, where both were timed."""
        return Verdict(*self.check) if self.check is not None else None

    @property
    def complete(self) -> bool:
        """True when nothing is left to tune at ``tuned_at`` (else a full tuning runs again)."""
        return self.checked and not self.partial

    def to_json(self) -> Dict[str, Any]:
        return {"choices": {str(p): [c.dtype, c.low_ms, c.fp32_ms, c.cast_ms, c.target,
                                     list(c.graph_ms) if c.graph_ms else None] for p, c in self.choices.items()},
                "tuned_at": {str(p): list(s) for p, s in self.tuned_at.items()},
                "rechecked": [{str(p): list(s) for p, s in r.items()} for r in self.rechecked],
                "withdrawn": {str(p): w for p, w in self.withdrawn.items()},
                "check": list(self.check) if self.check is not None else None, "partial": self.partial}

    @classmethod
    def from_json(cls, doc: Any, nodes: int) -> Optional["Outcome"]:
        """The stored outcome, or None if absent or malformed (then the graph is tuned again)."""
        if not isinstance(doc, dict):
            return None
        try:
            choices = {int(p): MeasuredChoice(str(v[0]), float(v[1]), float(v[2]), float(v[3]), str(v[4]),
                                              graph_ms=(float(v[5][0]), float(v[5][1])) if v[5] else None)
                       for p, v in doc["choices"].items()}
            shapes = [{int(p): tuple(int(d) for d in s) for p, s in r.items()}
                      for r in [doc["tuned_at"], *doc.get("rechecked", [])]]
            withdrawn = {int(p): str(w) for p, w in doc.get("withdrawn", {}).items()}
            check = doc.get("check")
            check = (float(check[0]), float(check[1])) if check is not None else None
            partial = bool(doc.get("partial", False))
        except (TypeError, ValueError, IndexError, KeyError, AttributeError):
            return None
        if any(not 0 <= p < nodes for p in choices):
            return None
        return cls(choices, shapes[0], shapes[1:], withdrawn, check, partial, checked="check" in doc)

    def shapes_tried(self) -> List[Dict[int, Tuple[int, ...]]]:
        """Every input shape where these choices were confirmed."""
        return [self.tuned_at, *self.rechecked]


def choices_to_run(target: "Target", outcome: Optional[Outcome],
                   shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Tuple[Dict[str, MeasuredChoice], str]:
    """The choices ``target`` runs with given its outcome, and why, in words: float32
    everywhere where the whole graph measured no faster than float32 (or, not measured yet,
    where :func:`~gluon_amp_core.tuning.verdict.unmeasured_runs_fp32` says so), else the
    outcome's per-op choices."""
    verdict = outcome.verdict if outcome is not None else None
    target_dtype = target.policy.target_dtype
    if verdict is not None:
        if verdict.runs_fp32:
            return target.fp32_choices(verdict), verdict.describe(target_dtype)
        return target.by_name(outcome.choices), verdict.describe(target_dtype)
    why = "no whole-graph timing yet" if outcome is None or outcome.partial or not outcome.checked else \
        "it could not be timed as a whole graph"
    if target.unmeasured_fp32(shapes):
        return target.fp32_choices(None), target.describe_unmeasured(why, shapes)
    return (target.by_name(outcome.choices) if outcome is not None else {}), target.describe_unmeasured(why, shapes)


def load_outcome(cache: TimingCache, sig: str, nodes: int) -> Optional[Outcome]:
    return Outcome.from_json(cache.load().entries.get(_GRAPH + sig), nodes)


# -- the graph a job tunes -------------------------------------------------------------

@dataclass
class Target:
    """A graph to tune: the plan (as traced or converted), its input dtypes, how choices
    are applied to it, and how it runs (training or inference, fused)."""

    sym: Symbol
    known: Mapping[str, str]
    apply: Callable[[Mapping[str, MeasuredChoice]], Symbol]
    policy: Policy
    train: bool
    fused: bool = False
    #: its parameters are float32 master weights cast at every call (``init``; a training graph
    #: always is), counted in :meth:`figures` as casts
    casts_weights: bool = False
    graph: dict = field(init=False)
    _dtypes: Optional[Dict[Tuple[str, int], Optional[str]]] = field(init=False, default=None, repr=False)
    _figures: Dict[Any, Tuple[Optional[int], Optional[float], int]] = field(init=False, default_factory=dict,
                                                                            repr=False)

    def __post_init__(self) -> None:
        self.graph = json.loads(self.sym.tojson(remove_amp_cast=False))

    def as_run(self, sym: Symbol, shapes: Mapping[str, Tuple[int, ...]]) -> Symbol:
        """``sym`` (the plan, or it with choices applied) as MXNet runs it natively
        (:func:`gluon_amp.native_run.native_passes`: the AMX batch-norm guards and paired casts
        of a training graph), so each whole-graph time is the one of the graph that will run.
        The timing blocks' parameters are written, not accumulated."""
        if self.policy.emulate:
            return sym
        typed = infer_dtypes(sym, self.known, partial=True) or {}
        return native_passes(sym, typed, shapes, ("cpu",), self.train and not self.fused, frozenset(), self.fused)

    @property
    def names(self) -> List[str]:
        return [n["name"] for n in self.graph["nodes"]]

    def by_name(self, choices: Mapping[int, MeasuredChoice]) -> Dict[str, MeasuredChoice]:
        names = self.names
        return {names[p]: c for p, c in choices.items()}

    def by_position(self, choices: Mapping[str, MeasuredChoice]) -> Dict[int, MeasuredChoice]:
        position = {n: i for i, n in enumerate(self.names)}
        return {position[n]: c for n, c in choices.items()}

    def shapes_by_position(self, shapes: Mapping[str, Tuple[int, ...]]) -> Dict[int, Tuple[int, ...]]:
        position = input_positions(self.graph)
        return {position[k]: tuple(v) for k, v in shapes.items() if k in position}

    def shapes_by_name(self, shapes: Mapping[int, Tuple[int, ...]]) -> Dict[str, Tuple[int, ...]]:
        names = self.names
        return {names[p]: tuple(s) for p, s in shapes.items() if 0 <= p < len(names)}

    def plan_dtypes(self) -> Dict[Tuple[str, int], Optional[str]]:
        """Every entry's dtype in the plan, as MXNet infers it (once)."""
        if self._dtypes is None:
            self._dtypes = infer_dtypes(self.sym, self.known, partial=True) or {}
        return self._dtypes

    def head_dtypes(self) -> List[Optional[str]]:
        """The dtypes of the plan's outputs, in order."""
        typed, nodes = self.plan_dtypes(), self.graph["nodes"]
        return [typed.get((nodes[j]["name"], k)) for j, k, _ in self.graph["heads"]]

    def low_ops(self) -> List[str]:
        """The op nodes the plan runs in the low dtype (but those reading a user's cast: theirs)."""
        users = users_cast_readers(self.graph)
        return [n for n in low_op_nodes(self.graph["nodes"], self.plan_dtypes(), self.policy.target_dtype)
                if n not in users]

    def casts(self) -> int:
        """The plan's activation casts (the rule's measure)."""
        return activation_casts(self.graph["nodes"])

    def low_elements(self, shapes: Optional[Mapping[str, Tuple[int, ...]]]) -> Optional[int]:
        """The elements the plan's low-precision ops read at these input shapes, in all
        (None: shapes not given, or not all known)."""
        return self.figures(shapes)[0]

    def figures(self, shapes: Optional[Mapping[str, Tuple[int, ...]]]) -> Tuple[Optional[int], Optional[float]]:
        """The plan's own figures at these input shapes: the elements its low-precision ops read
        in all, and their multiply-adds per element its activation casts convert (``inf``: no
        activation cast); None where shapes are not given or not all known. Once per shapes.
        The batch norms' layout guards of the graph that runs count as casts, at
        ``GUARD_CAST_WEIGHT`` (:meth:`guards`)."""
        return self._counted(shapes)[:2]

    def guards(self, shapes: Optional[Mapping[str, Tuple[int, ...]]]) -> int:
        """How many batch norms of the graph that runs get a layout guard, counted as casts in
        :meth:`figures` (native_run: a training graph on AMX)."""
        return self._counted(shapes)[2]

    def _counted(self, shapes: Optional[Mapping[str, Tuple[int, ...]]]) -> Tuple[Optional[int], Optional[float], int]:
        if not shapes:
            return None, None, 0
        key = tuple(sorted((k, tuple(v)) for k, v in shapes.items()))
        if key not in self._figures:
            self._figures = {key: self._measure_figures(shapes)}  # the last shapes asked: one entry
        return self._figures[key]

    def _measure_figures(self, shapes: Mapping[str, Tuple[int, ...]]) -> Tuple[Optional[int], Optional[float], int]:
        entry = infer_shapes(self.sym, shapes)
        nodes = self.graph["nodes"]
        low = set(self.low_ops())
        total, macs, cast = 0, 0, 0
        share = self.activation_share()
        for n in nodes:
            if n["name"] in low:
                ins = [entry.get((nodes[e[0]]["name"], e[1])) for e in n["inputs"]]
                if any(s is None for s in ins):
                    return None, None, 0
                total += elements(ins)
                macs += op_macs(self.policy.table.canonical(n["op"]), n.get("attrs", {}), ins,
                                entry.get((n["name"], 0)))
            elif n["op"] in CAST_OPS:
                for e in n["inputs"]:
                    # an activation's cast; under init a graph input's too (a parameter's: its
                    # master weight is cast every call), at WEIGHT_CAST_SHARE, where a converted
                    # graph's weights are cast once
                    param = nodes[e[0]]["op"] == "null"
                    if self.train or self.casts_weights or not param:
                        shape = entry.get((nodes[e[0]]["name"], e[1]))
                        if shape is None:
                            return total, None, 0
                        cast += elements([shape]) * (WEIGHT_CAST_SHARE if param else share)
        # a batch norm's layout guard reorders its data forward and its gradient backward, as
        # a cast converts both, and more (GUARD_CAST_WEIGHT): MobileNet's, around every depthwise
        # convolution, made its plan 0.6x float32's speed where its casts alone counted 360
        # multiply-adds per element
        guarded = list(guarded_batchnorms(self.graph, self.plan_dtypes(), entry, self.train and not self.fused))
        for i in guarded:
            e = nodes[i]["inputs"][0]
            cast += elements([entry[(nodes[e[0]]["name"], e[1])]]) * GUARD_CAST_WEIGHT  # a guard needs its shape
        return total, (macs / cast if cast else float("inf")), len(guarded)

    def activation_share(self) -> float:
        """What an element an activation's cast converts counts for in :meth:`figures`:
        ``AMX_TRAINING_ACTIVATION_CAST_SHARE`` in a training graph on AMX (a product saves more
        there: the same test that gives its batch norms layout guards), else 1."""
        return AMX_TRAINING_ACTIVATION_CAST_SHARE if guards_layouts(self.train and not self.fused) else 1.0

    def probe_slower(self) -> Optional[str]:
        """The speed probe's verdict in words where it did not find this plan's dtype faster on
        this machine (the one that keeps the default float32 there; only an explicit
        ``target_dtype`` runs the dtype); None elsewhere: faster, not measured, emulated, or
        a GPU."""
        if self.policy.emulate:
            return None
        verdict = runtime.speed(self.policy.target_dtype, warn=False)
        if verdict is None or verdict.faster:
            return None
        return verdict.describe()

    def unmeasured_fp32(self, shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> bool:
        """The rule without a whole-graph measurement (:func:`unmeasured_runs_fp32`)."""
        return unmeasured_runs_fp32(self.casts(), len(self.low_ops()), *self.figures(shapes),
                                    probe_slower=self.probe_slower() is not None)

    def describe_unmeasured(self, why: str, shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> str:
        return describe_unmeasured(self.casts(), len(self.low_ops()), self.policy.target_dtype, why,
                                   *self.figures(shapes), guards=self.guards(shapes),
                                   probe_slower=self.probe_slower(), activation_share=self.activation_share())

    def fp32_choices(self, verdict: Optional[Verdict]) -> Dict[str, MeasuredChoice]:
        """A float32 choice for every op the plan runs low: the same graph in float32
        (``verdict``'s figures on each, where measured)."""
        amp, fp32 = (verdict.amp_ms, verdict.fp32_ms) if verdict is not None else (0.0, 0.0)
        graph_ms = (amp, fp32) if verdict is not None else None
        low = self.policy.target_dtype
        return {n: MeasuredChoice("float32", amp, fp32, 0.0, low, graph_ms=graph_ms) for n in self.low_ops()}

    def fp32(self) -> Symbol:
        """The same graph in float32 (every op the plan runs low in float32; casts that
        only served them dropped)."""
        return self.apply(self.fp32_choices(None))

    def problem(self, shapes: Mapping[str, Tuple[int, ...]]) -> Problem:
        """The tuning problem at these input shapes (MXNet's type and shape inference)."""
        dtypes = self.plan_dtypes()
        entry_shapes = infer_shapes(self.sym, shapes)
        op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
        return problem(self.graph["nodes"], self.graph["heads"], dtypes, entry_shapes, self.policy.table, op_inputs,
                       self.train, self.policy.excluded | users_cast_readers(self.graph))


def applier(out: Symbol, known: Mapping[str, str], policy: Policy) -> Callable[[Mapping[str, MeasuredChoice]], Symbol]:
    """``apply(choices)``: the traced graph ``out`` with each chosen node run as
    :func:`decide` says with its choice (typed as MXNet infers ``out`` from ``known``, on
    the first call: a graph that runs the plan never pays for it)."""
    typed: Dict[Tuple[str, int], Optional[str]] = {}
    traced: Dict[str, Any] = {}

    def apply(choices: Mapping[str, MeasuredChoice]) -> Symbol:
        if not traced:
            traced.update(json.loads(out.tojson(remove_amp_cast=False)))
            typed.update(infer_dtypes(out, known, partial=True) or {})
        op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
        graph = retype(traced, _changes(traced, choices, typed, policy), typed, op_inputs)
        return without_idle_casts(mx.sym.load_json(json.dumps(graph)), known)

    return apply


def without_idle_casts(sym: Symbol, known: Mapping[str, str]) -> Symbol:
    """``sym`` without the casts that, once some ops run float32, convert nothing: the plan's
    casts of the ops it keeps in float32 and of its widest-type ops read float32 values then.
    A graph all float32 (a float32 verdict) keeps no cast: it runs as the program without AMP,
    where each of those casts cost a copy (GluonTS DeepAR kept 75, at 0.71x float32's speed)."""
    try:
        retyped = infer_dtypes(sym, known, partial=True)
    except MXNetError:  # a trial MXNet cannot type: timed as it is, its timing fails and says so
        return sym
    if not retyped:
        return sym
    graph, dropped = drop_identity_casts(json.loads(sym.tojson(remove_amp_cast=False)), retyped)
    return mx.sym.load_json(json.dumps(graph)) if dropped else sym


def _changes(graph: dict, choices: Mapping[str, MeasuredChoice], dtypes: Mapping[Tuple[str, int], Optional[str]],
             policy: Policy) -> Dict[str, Change]:
    """The decision of each chosen node, as :func:`decide` takes it with the choice."""
    nodes = graph["nodes"]
    out = {}
    for n in nodes:
        if n["name"] in choices and n["op"] != "null":
            in_types = [dtypes.get((nodes[e[0]]["name"], e[1])) for e in n["inputs"]]
            d = decide(n["op"], n.get("attrs", {}), in_types, policy.table, measured=choices[n["name"]].dtype)
            out[n["name"]] = Change(d)
    return out


def check_applied(sym: Symbol, input_dtypes: Mapping[str, str], choices: Mapping[str, MeasuredChoice]) -> list:
    """What MXNet's type inference disagrees with: each chosen node's output dtype."""
    inferred = infer_dtypes(sym, input_dtypes)
    if inferred is None:
        return ["the tuned graph does not type-check"]
    return [f"{n}: {inferred.get((n, 0))}, want {c.dtype}" for n, c in choices.items()
            if inferred.get((n, 0)) != c.dtype]


# -- jobs: the work, in steps a budget can pay for --------------------------------------

def time_one(t: Timed, timer: Timer) -> Optional[float]:
    """One speed-table entry, measured now (ms; ``None``: MXNet cannot run it so)."""
    return time_op(t.op, dict(t.attrs), t.shapes, t.dtypes, t.train, timer=timer)


@dataclass(frozen=True)
class Step:
    """The next piece of a job: its estimated cost (s), what it is, and whether it times
    whole graphs (the block's own graph is released first, so its memory is not held twice)."""

    estimate: float
    what: str
    whole_graph: bool = False
    #: the estimate again from the job's figures now (a whole-graph timing's: the step and the
    #: build measured since the job began); None where it does not depend on them
    again: Optional[Callable[[], float]] = field(default=None, repr=False, compare=False)


class Job:
    """Tuning work for one graph at one set of input shapes, as a sequence of steps.

    ``kind`` is ``'full'`` (the graph has no outcome: time every op the plan runs low, then
    try the proposals on the whole graph) or ``'recheck'`` (an outcome tuned at other
    shapes: time again only the choices that could flip here, and withdraw those the whole
    graph confirms no longer pay). :attr:`next` is the step to pay for next (``None`` when
    done); :meth:`step` does it. :attr:`outcome` is the result once done.
    """

    def __init__(self, target: Target, shapes: Mapping[str, Tuple[int, ...]], cache: TimingCache,
                 outcome: Optional[Outcome] = None, step_s: Optional[float] = None,
                 clock: Callable[[], float] = time.perf_counter, build_s: Optional[float] = None) -> None:
        self.target, self.shapes, self.cache, self.clock = target, dict(shapes), cache, clock
        self.kind = "full" if outcome is None else "recheck"
        self.outcome = outcome
        self.step_s = step_s
        #: what building the user's block of this graph took beyond a step, measured in this
        #: process (None: not measured; the per-node guess stands in)
        self.build_s = build_s
        self.tuning = Tuning()
        #: one clock for all the job's timings, which it compares with each other: wall time,
        #: or CPU time where the machine was busy when the job began (:func:`timer_now`)
        self.timer = timer_now()
        #: per-op figures are kept apart by clock: CPU time counts every thread an op keeps busy
        self._prefix = _PREFIX if self.timer.busy is None else _PREFIX + "cpu/"
        #: a full job's outcome once the whole graph was checked against float32, before
        #: its per-op tuning is done (the verdict serves from then on)
        self.provisional: Optional[Outcome] = None
        self._pending: Dict[str, Optional[float]] = {}
        self._pending_s = 0.0
        #: what timing cost so far, per op and in all: (elements, seconds)
        self._rates: Dict[str, Tuple[int, float]] = {}
        self._steps = self._full() if outcome is None else self._recheck(outcome)
        self.next: Optional[Step] = next(self._steps, None)

    def step(self) -> None:
        """Do :attr:`next`; then :attr:`next` is the one after it."""
        self.next = next(self._steps, None)

    def measured(self, step_s: Optional[float], build_s: Optional[float]) -> None:
        """The graph's step and first build as measured now (None: not yet): :attr:`next`'s
        estimate follows them where it depends on them. A job made at a graph's second call
        knew only its first interval (a step and a build) and the guess per node."""
        step_s = step_s if step_s is not None else self.step_s
        build_s = build_s if build_s is not None else self.build_s
        if (step_s, build_s) == (self.step_s, self.build_s):
            return
        self.step_s, self.build_s = step_s, build_s
        if self.next is not None and self.next.again is not None:
            self.next = replace(self.next, estimate=self.next.again())

    # -- helpers of the steps
    def _prepare_estimate(self) -> float:
        return PREPARE_S_PER_NODE * len(self.target.graph["nodes"]) * (1 if self.kind == "full" else 2)

    def _known_times(self, items: Sequence[Timed]) -> Tuple[Dict[str, Optional[float]], List[Timed]]:
        """The times of ``items`` held by the cache, and the items still to measure."""
        stored = self.cache.load().entries
        times = {t.key: stored[self._prefix + t.key] for t in items
                 if _usable_time(stored.get(self._prefix + t.key, _MISSING))}  # a damaged figure: timed again
        self.tuning.cached += len(times)
        todo = [t for t in items if t.key not in times]
        return times, sorted(todo, key=_work)  # small first: the first estimates are guesses

    def _op_estimate(self, t: Timed, prior_rate: float) -> float:
        """Its size at the cost per element of this op so far (a convolution's is not an
        add's), else of every op so far, else ``prior_rate``."""
        work, cost = self._rates.get(t.op) or self._rates.get("", (0, 0.0))
        return OP_OVERHEAD_S + (cost / work if work else prior_rate) * _work(t)

    def _measure(self, t: Timed, times: Dict[str, Optional[float]]) -> None:
        t0 = self.clock()
        times[t.key] = ms = time_one(t, self.timer)
        cost = self.clock() - t0
        for k in (t.op, ""):
            work, spent = self._rates.get(k, (0, 0.0))
            self._rates[k] = (work + _work(t), spent + cost)
        self._pending[self._prefix + t.key] = ms
        self._pending_s += cost
        self.tuning.timed += 1
        if self._pending_s >= FLUSH_S:
            self._flush()

    def flush(self) -> None:
        """Write the per-op figures measured and not yet stored (a process may stop before
        the job ends: the next one continues from them)."""
        self._flush()

    def _flush(self) -> None:
        if self._pending:
            store(self.cache, self._pending)
            self._pending, self._pending_s = {}, 0.0

    def _prior_rate(self, todo: Sequence[Timed]) -> float:
        total = sum(_work(t) for t in todo)
        return OP_TIMING_RUNS * (self.step_s or 0.0) / total if total else 0.0

    def _graph_estimate(self, graphs: int, prob: Problem, times: Mapping[str, Optional[float]]) -> float:
        """``graphs`` whole-graph timings: each a build, a warm-up and :data:`GRAPH_RUNS` runs
        of a step, the step taken as the larger of the block's and the ops' timings. A build
        is what the user's block's own first build took (its trace, the rewrite, binding and
        warm-up: more than a trial block's), where measured; else the per-node guess."""
        ops_s = sum(min(v for v in (times.get(c.low.key), times.get(c.fp32.key)) if v is not None)
                    for c in prob.candidates.values()
                    if times.get(c.low.key) is not None or times.get(c.fp32.key) is not None) / 1e3
        build = build_estimate(len(self.target.graph["nodes"]), self.build_s)
        return graphs * (GRAPH_TIMING_STEPS * max(self.step_s or 0.0, ops_s) + build)

    # -- the two kinds of job
    def _full(self) -> Iterator[Step]:
        yield Step(self._prepare_estimate(), "preparing")
        target, shapes = self.target, self.shapes
        prob = target.problem(shapes)
        times, todo = self._known_times(prob.to_time())
        # The verdict first: two whole graphs decide more than all the per-op timings
        # (a plan slower than float32 runs float32 from the next call on).
        yield Step(self._graph_estimate(2, prob, times), "whole-graph check against float32", whole_graph=True,
                   again=lambda: self._graph_estimate(2, prob, times))
        t0 = self.clock()
        got = time_graphs([target.as_run(target.sym, shapes), target.fp32()], shapes, target.train, target.fused,
                          runs=GRAPH_RUNS, timer=self.timer)
        one = (self.clock() - t0) / 2
        plan_ms, fp32_ms = got if got else (None, None)
        self.tuning.trials = [("plan", _round(plan_ms)), ("float32", _round(fp32_ms))]
        here = target.shapes_by_position(shapes)
        if plan_ms is not None and fp32_ms is not None:
            self.provisional = Outcome({}, here, check=(plan_ms, fp32_ms), partial=True)
            self._store_outcome(self.provisional)
        prior = self._prior_rate(todo)
        for t in todo:
            yield Step(self._op_estimate(t, prior), "per-op timing")
            self._measure(t, times)
        self._flush()
        proposals = choose(prob, times)
        kept: Dict[str, MeasuredChoice] = {}
        best = plan_ms
        if plan_ms is None:
            self.tuning.status = "the plan could not be timed as a whole graph: it runs untuned"
        elif proposals:
            tried = groups(prob, proposals)[:MAX_TRIALS]
            if tried:
                yield Step(len(tried) * one * TRIAL_COST, "whole-graph trials", whole_graph=True)
                kept, best = _trials(plan_ms, tried, lambda c: target.as_run(target.apply(c), shapes), shapes,
                                     target.train, target.fused, self.tuning.trials, self.timer)
        check = (best, fp32_ms) if best is not None and fp32_ms is not None else None
        self.outcome = Outcome(target.by_position(kept), here, check=check)
        self.tuning.choices = kept
        if check is not None:
            self.tuning.verdict = Verdict(*check).describe(target.policy.target_dtype)
        elif plan_ms is not None:
            self.tuning.verdict = target.describe_unmeasured("float32 could not be timed as a whole graph", shapes)
        if plan_ms is not None:  # the plan ran: an outcome worth keeping
            self._store_outcome()

    def _recheck(self, outcome: Outcome) -> Iterator[Step]:
        yield Step(self._prepare_estimate(), "preparing")
        target, shapes = self.target, self.shapes
        names = target.names
        here = target.problem(shapes)
        there = target.problem(target.shapes_by_name(outcome.tuned_at))
        ratios = {}
        for pos, c in outcome.choices.items():
            a, b = here.candidates.get(names[pos]), there.candidates.get(names[pos])
            if a is not None and b is not None and _work(b.low) > 0:
                ratios[pos] = _work(a.low) / _work(b.low)
        retime = to_retime(outcome.choices, ratios)
        floats = sum(c.dtype == "float32" for c in outcome.choices.values())
        self.tuning.status = (f"{floats - len(retime)} float32 choice(s) carried over (a wide margin, or the shape "
                              f"moved the op less than {SIZE_STEP:g}x), {len(retime)} timed again")
        items = [t for pos in retime if names[pos] in here.candidates
                 for t in (here.candidates[names[pos]].low, here.candidates[names[pos]].fp32)]
        times, todo = self._known_times(items)
        prior = self._prior_rate(todo)
        for t in todo:
            yield Step(self._op_estimate(t, prior), "per-op timing")
            self._measure(t, times)
        self._flush()
        flipped = []
        for pos in retime:
            cand = here.candidates.get(names[pos])
            low, fp32 = (times.get(cand.low.key), times.get(cand.fp32.key)) if cand else (None, None)
            scale = ratios.get(pos, 1.0)  # casts as measured where the size is unknown at one of the shapes
            if low is not None and fp32 is not None and not still_float32(outcome.choices[pos], scale, low, fp32):
                flipped.append(pos)
        if flipped:
            yield Step(self._graph_estimate(2, here, times), "whole-graph re-check", whole_graph=True,
                       again=lambda: self._graph_estimate(2, here, times))
            keep = target.by_name(outcome.choices)
            without = target.by_name({p: c for p, c in outcome.choices.items() if p not in flipped})
            with_ms = time_graph(target.as_run(target.apply(keep), shapes), shapes, target.train, target.fused,
                                 runs=GRAPH_RUNS, timer=self.timer)
            without_ms = time_graph(target.as_run(target.apply(without), shapes), shapes, target.train, target.fused,
                                    runs=GRAPH_RUNS, give_up_ms=GIVE_UP * with_ms if with_ms else None,
                                    timer=self.timer)
            self.tuning.trials = [("as tuned", _round(with_ms)), ("withdrawn", _round(without_ms))]
            if with_ms is not None and without_ms is not None and not with_ms < without_ms * (1 - MIN_GAIN):
                shown = ", ".join(f"{s}" for s in shapes.values())
                for pos in flipped:
                    outcome.withdrawn[pos] = (f"no faster in float32 at input shape {shown} "
                                              f"(whole graph {with_ms:.0f} ms with it, {without_ms:.0f} without)")
                outcome.choices = {p: c for p, c in outcome.choices.items() if p not in flipped}
            self.tuning.status += (f", {len(flipped)} flipped: whole graph {_round(with_ms)} ms as tuned, "
                                   f"{_round(without_ms)} without them")
        outcome.rechecked.append(target.shapes_by_position(shapes))
        self.tuning.choices = target.by_name(outcome.choices)
        self._store_outcome()

    def _store_outcome(self, outcome: Optional[Outcome] = None) -> None:
        outcome = outcome or self.outcome
        if outcome is not None:
            store(self.cache, {_GRAPH + graph_key(self.target): outcome.to_json()})


def graph_key(target: Target) -> str:
    """The shape-free key of a target's outcome."""
    return signature(target.graph, dict(target.known), target.train, target.fused)


_MISSING = object()


def _usable_time(value: Any) -> bool:
    """Whether a per-op figure read from the cache can stand: milliseconds (a finite number,
    not negative), or None for an op whose timing failed."""
    if value is None:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _work(t: Timed) -> int:
    """How big a timed item is (its inputs' elements): its cost, roughly, at other shapes."""
    return elements(t.shapes)


def _round(ms: Optional[float]) -> Optional[float]:
    return round(ms, 1) if ms is not None else None


def _trials(best: float, tried: Sequence[Tuple[str, Dict[str, MeasuredChoice]]], apply: Callable, shapes: Mapping,
            train: bool, fused: bool, log: list, timer: Timer) -> Tuple[Dict[str, MeasuredChoice], float]:
    """Keep each group of proposals that makes the whole graph (the plan: ``best`` ms) faster,
    greedily; each trial's (group, ms) is appended to ``log``. Returns the choices kept and
    the whole graph's time with them."""
    kept: Dict[str, MeasuredChoice] = {}
    for op, group in tried:
        trial = {**kept, **group}
        t = time_graph(apply(trial), shapes, train, fused, runs=GRAPH_RUNS, give_up_ms=GIVE_UP * best, timer=timer)
        log.append((op, _round(t)))
        if t is not None and t < best * (1 - MIN_GAIN):
            kept = {**kept, **{n: replace(c, graph_ms=(best, t)) for n, c in group.items()}}
            best = t
    return kept, best


def store(cache: TimingCache, entries: Mapping[str, Any]) -> None:
    """Merge ``entries`` into the cache; a cache that cannot be written is measured again next time."""
    try:
        cache.store(entries)
    except OSError as exc:
        _log.info("gluon_amp: could not write %s (%s); measured again next time", cache.path, exc)


def build_estimate(nodes: int, measured: Optional[float]) -> float:
    """What building a block of a graph of ``nodes`` nodes costs (s): ``measured`` (the user's
    block's first build beyond a step, in this process) where known, at least
    :data:`GRAPH_BUILD_S`, and the native passes a trial graph goes through (which the user's
    block ran before that measure began) at :data:`PREPARE_S_PER_NODE`; else the guess per
    node. The guess holds for YOLOv3-MobileNet at 608 px, but GluonCV's MobileNet 1.0 at
    112 px (434 nodes) built in 0.2 s against its 2.3: its whole-graph check waited ten
    minutes of a 1% budget for a 0.9 s timing."""
    if measured is not None:
        return max(GRAPH_BUILD_S, measured) + PREPARE_S_PER_NODE * nodes
    return GRAPH_BUILD_S + GRAPH_BUILD_S_PER_NODE * nodes


def new_job(target: Target, shapes: Mapping[str, Tuple[int, ...]], cache: TimingCache,
            outcome: Optional[Outcome], step_s: Optional[float] = None,
            clock: Callable[[], float] = time.perf_counter, build_s: Optional[float] = None) -> Optional[Job]:
    """The job for ``target`` at ``shapes``: a full tuning without a complete outcome (none,
    one whose job stopped after the check against float32, or one stored before that check
    existed); with one, a re-check where it was not tried at these shapes and has float32
    choices to re-check; else None. ``build_s``: a build of the graph's block, measured."""
    if outcome is not None and not outcome.complete:
        return Job(target, shapes, cache, None, step_s, clock, build_s)  # its check or per-op tuning is missing
    if outcome is not None:
        here = target.shapes_by_position(shapes)
        if here in outcome.shapes_tried() or not any(c.dtype == "float32" for c in outcome.choices.values()):
            return None
    return Job(target, shapes, cache, outcome, step_s, clock, build_s)


def run(job: Job, ledger: Ledger, clock: Callable[[], float] = time.perf_counter, cap_only: bool = False,
        before: Optional[Callable[[Step], None]] = None, extra: Optional[Callable[[Step], float]] = None) -> bool:
    """Do ``job``'s steps while ``ledger`` allows them (``cap_only``: its seconds cap alone,
    not its share of a run), calling ``before(step)`` first; True when the job is done.
    ``extra(step)``: what the step costs later, booked then (a graph built again), that must
    fit in the budget with it."""
    while job.next is not None:
        now = clock()
        if not ledger.allows(job.next.estimate + (extra(job.next) if extra is not None else 0.0), now, cap_only):
            return False
        what, estimate = job.next.what, job.next.estimate
        if before is not None:
            before(job.next)
        job.step()
        cost = clock() - now
        ledger.charge(cost, what, estimate)
        job.tuning.seconds += cost
    return True
