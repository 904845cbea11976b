"""Precision per layer by timing: MXNet's side of :mod:`gluon_amp_core.tune`.

For a graph and the shapes it runs with: MXNet infers every entry's dtype and shape, the
core lists what to time, this module times what the speed table (the machine's timing
cache) does not hold yet, and the core chooses. ``init(tune=True)`` applies the choices to
each hybridized block's training graph when it is first built (:func:`training_rewriter`);
``convert_hybrid_block(..., tune=True)`` passes them to the converter.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.decide import MeasuredChoice, decide
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import Change, retype
from gluon_amp_core.walk import measured_attrs
from gluon_amp_core.timing_cache import TimingCache
from gluon_amp_core.tune import Problem, choose, groups, problem

from .. import mxnet_internals as mxi
from ..type_inference import infer_dtypes, infer_shapes
from .timing import time_graph, time_op

_log = logging.getLogger(__name__)
_PREFIX = "op/"


@dataclass
class Tuning:
    """What one tuning did: the choices, how many measurements it made or read, its cost."""

    choices: Dict[str, MeasuredChoice] = field(default_factory=dict)
    timed: int = 0
    cached: int = 0
    seconds: float = 0.0
    #: whole-graph trials: (the change tried, its ms), the plan first
    trials: list = field(default_factory=list)


def measure(prob: Problem, cache: TimingCache) -> Tuple[Dict[str, Optional[float]], int, int]:
    """Times of everything ``prob`` needs, from ``cache`` or measured now (and stored).

    Returns the times, how many were measured and how many read. A failure to run an op
    is stored too (as ``None``), so it is not tried again.
    """
    stored = cache.load().entries
    times: Dict[str, Optional[float]] = {}
    new: Dict[str, Optional[float]] = {}
    for t in prob.to_time():
        if _PREFIX + t.key in stored:
            times[t.key] = stored[_PREFIX + t.key]
        else:
            new[_PREFIX + t.key] = times[t.key] = time_op(t.op, dict(t.attrs), t.shapes, t.dtypes, t.train)
    if new:
        _store(cache, new)
    return times, len(new), len(prob.to_time()) - len(new)


#: Groups of changes tried on the whole graph, at most; and by how much a change must
#: speed the whole graph up to be kept (timing noise on a shared machine is a few percent).
MAX_TRIALS = 4
MIN_GAIN = 0.03
#: A change whose first (warm-up) run already takes this many times the plan's step is not
#: timed further: warm-up costs up to ~2 steps (oneDNN primitives are created then).
GIVE_UP = 2.5


def signature(graph: dict, shapes: Mapping[str, Tuple[int, ...]], dtypes: Mapping[str, str],
              train: bool, fused: bool) -> str:
    """A key for a graph's tuning that survives renaming: ops, attributes and wiring by
    position (Gluon's name prefixes count instances), input shapes and dtypes, mode."""
    ops = [[n["op"], sorted((k, str(v)) for k, v in n.get("attrs", {}).items() if not k.startswith("__")),
            [e[:2] for e in n["inputs"]]] for n in graph["nodes"]]
    # inputs by node position too: parameter names carry the instance prefix (ssd0_, ssd1_)
    position = {n["name"]: i for i, n in enumerate(graph["nodes"]) if n["op"] == "null"}
    text = json.dumps([ops, graph["heads"], sorted((position[k], list(v)) for k, v in shapes.items() if k in position),
                       sorted((position[k], v) for k, v in dtypes.items() if k in position), train, fused],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def tune_graph(sym: Symbol, input_dtypes: Mapping[str, str], input_shapes: Mapping[str, Tuple[int, ...]],
               policy: Policy, train: bool, apply: Callable[[Mapping[str, MeasuredChoice]], Symbol],
               cache: TimingCache, fused: bool = False) -> Tuple[Tuning, Dict[Tuple[str, int], Optional[str]]]:
    """Choose dtypes for ``sym``'s low-precision ops (typed by the plan) by measured speed.

    The per-op speed table and :func:`gluon_amp_core.tune.choose` propose; each group of
    proposals (by op, :func:`gluon_amp_core.tune.groups`) is kept only if the whole graph
    with it (``apply(choices)``, run as users run it, training or inference) is at least
    :data:`MIN_GAIN` faster. The outcome is kept in ``cache`` (the machine's timing cache)
    per graph. Returns the tuning and the graph's dtypes as MXNet infers them.
    """
    t0 = time.perf_counter()
    dtypes = infer_dtypes(sym, input_dtypes, partial=True) or {}
    shapes = infer_shapes(sym, input_shapes)
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
    prob = problem(graph["nodes"], graph["heads"], dtypes, shapes, policy.table, op_inputs, train, policy.excluded)
    with cache.lock():  # one process measures at a time; the others then read what it stored
        tuning = _tune_locked(sym, graph, prob, cache, apply, input_shapes, input_dtypes, train, fused)
    tuning.seconds = time.perf_counter() - t0
    _log.info("gluon_amp tune: %d ops timed in both dtypes (%d measurements made, %d read), "
              "%d kept after whole-graph trials %s, in %.1f s", len(prob.candidates), tuning.timed, tuning.cached,
              len(tuning.choices), tuning.trials, tuning.seconds)
    for name, c in sorted(tuning.choices.items()):
        _log.info("gluon_amp tune: %s %s", name, c.describe())
    return tuning, dtypes


def _tune_locked(sym: Symbol, graph: dict, prob: Problem, cache: TimingCache, apply: Callable,
                 input_shapes: Mapping[str, Tuple[int, ...]], input_dtypes: Mapping[str, str],
                 train: bool, fused: bool) -> Tuning:
    times, timed, cached = measure(prob, cache)
    proposals = choose(prob, times)
    tuning = Tuning({}, timed, cached)
    if proposals:
        key = "graph/" + signature(graph, input_shapes, dict(input_dtypes), train, fused)
        names = [n["name"] for n in graph["nodes"]]
        stored = _restore(cache.load().entries.get(key), names)
        if stored is not None:
            tuning.choices = stored
            tuning.cached += 1
        else:
            tuning.choices, tuning.trials = _trials(prob, proposals, apply, input_shapes, train, fused, sym)
            position = {n: i for i, n in enumerate(names)}
            if tuning.trials[0][1] is not None:  # the plan ran: the outcome is worth keeping
                _store(cache, {key: {str(position[n]): [c.dtype, c.low_ms, c.fp32_ms, c.cast_ms, c.target,
                                                        list(c.graph_ms) if c.graph_ms else None]
                                     for n, c in tuning.choices.items()}})
    return tuning


def _restore(stored: Any, names: Sequence[str]) -> Optional[Dict[str, MeasuredChoice]]:
    """A graph's cached outcome (node position -> choice), or None if absent or malformed."""
    if not isinstance(stored, dict):
        return None
    try:
        return {names[int(i)]: MeasuredChoice(str(v[0]), float(v[1]), float(v[2]), float(v[3]), str(v[4]),
                                              graph_ms=(float(v[5][0]), float(v[5][1])) if v[5] else None)
                for i, v in stored.items() if 0 <= int(i) < len(names)}
    except (TypeError, ValueError, IndexError):
        return None


def _trials(prob: Problem, proposals: Mapping[str, MeasuredChoice], apply: Callable, shapes: Mapping,
            train: bool, fused: bool, sym: Symbol) -> Tuple[Dict[str, MeasuredChoice], list]:
    """Keep each group of proposals that makes the whole graph faster, greedily."""
    best = time_graph(sym, shapes, train, fused)
    kept: Dict[str, MeasuredChoice] = {}
    log = [("plan", round(best, 1) if best else None)]
    if best is None:
        return kept, log
    for op, group in groups(prob, proposals)[:MAX_TRIALS]:
        trial = {**kept, **group}
        t = time_graph(apply(trial), shapes, train, fused, give_up_ms=GIVE_UP * best)
        log.append((op, round(t, 1) if t else None))
        if t is not None and t < best * (1 - MIN_GAIN):
            kept = {**kept, **{n: replace(c, graph_ms=(best, t)) for n, c in group.items()}}
            best = t
    return kept, log


def _store(cache: TimingCache, entries: Mapping[str, Any]) -> None:
    try:
        cache.store(entries)
    except OSError as exc:
        _log.info("gluon_amp: could not write %s (%s); measured again next time", cache.path, exc)


def training_rewriter(policy: Policy, cache: Callable[[], TimingCache]
                      ) -> Callable[[HybridBlock, tuple, Sequence[Symbol], Symbol], Symbol]:
    """What ``init(tune=True)`` hooks into every HybridBlock's first graph build: the
    traced training graph, with the ops not faster low kept in float32 (measured forward
    and backward for the call's shapes, kept in ``cache()``). A graph the choices cannot
    be applied to cleanly runs as traced, with a warning."""

    def rewrite(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> Symbol:
        arrays = [a for a in mxi.call_arrays(args) if isinstance(a, NDArray)]
        if getattr(block, "amp_result", None) is not None:
            return out  # converted by gluon_amp: its plan (tuned or not) was fixed then
        if not arrays or any(a.context.device_type != "cpu" for a in arrays):
            return out  # GPUs: float16 is taken as fast; nothing here times them
        known, shapes = mxi.call_inputs(block, args, inputs)
        traced = json.loads(out.tojson(remove_amp_cast=False))
        op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
        typed: Dict[Tuple[str, int], Optional[str]] = {}

        def apply(choices: Mapping[str, MeasuredChoice]) -> Symbol:
            return mx.sym.load_json(json.dumps(retype(traced, _changes(traced, choices, typed, policy), typed,
                                                      op_inputs)))

        typed.update(infer_dtypes(out, known, partial=True) or {})
        tuning, _ = tune_graph(out, known, shapes, policy, True, apply, cache())
        block.amp_tuning = tuning
        if not tuning.choices:
            return out
        tuned = apply(tuning.choices)
        wrong = _check(tuned, known, tuning.choices)
        if wrong:
            warnings.warn(f"gluon_amp: tune=True could not apply its choices to block {block.name!r} "
                          f"({wrong[:3]}); it runs the untuned plan. Please report this with the model.",
                          RuntimeWarning, stacklevel=4)
            return out
        return tuned

    return rewrite


def _changes(graph: dict, choices: Mapping[str, MeasuredChoice], dtypes: Mapping[Tuple[str, int], Optional[str]],
             policy: Policy) -> Dict[str, Change]:
    """The decision of each chosen node, as :func:`decide` takes it with the choice."""
    nodes = graph["nodes"]
    out = {}
    for n in nodes:
        if n["name"] in choices and n["op"] != "null":
            in_types = [dtypes.get((nodes[e[0]]["name"], e[1])) for e in n["inputs"]]
            d = decide(n["op"], n.get("attrs", {}), in_types, policy.table, measured=choices[n["name"]].dtype)
            out[n["name"]] = Change(d, measured_attrs(choices[n["name"]]))
    return out


def _check(sym: Symbol, input_dtypes: Mapping[str, str], choices: Mapping[str, MeasuredChoice]) -> list:
    """What MXNet's type inference disagrees with: each chosen node's output dtype."""
    inferred = infer_dtypes(sym, input_dtypes)
    if inferred is None:
        return ["the tuned graph does not type-check"]
    return [f"{n}: {inferred.get((n, 0))}, want {c.dtype}" for n, c in choices.items()
            if inferred.get((n, 0)) != c.dtype]
