"""When the tuner runs, within the process's one budget: during training, paid for as it
goes (``init``'s side, :class:`Tuner`), and at once for the converters (:func:`tune_graph`).

A hybridized block's first call runs the plan (or the choices its graph structure already
has in the timing cache). From then on, each call of the block first gives the tuner a
turn (:meth:`Tuner.called`): it records the call's input shapes; once a shape repeats it
starts a :class:`~gluon_amp.tuning.tuner.Job` for the graph, and does as many of its steps
as the process's budget (:class:`~gluon_amp_core.tuning.schedule.Ledger`) has paid for by
then; the rest waits for later calls. When a job changes the graph's choices, the block's
graph is built again with them for that call (and for every other block of the same
structure at its next call). Whole-graph trials release the block's own graph first, so
its memory is not held twice.
"""
from __future__ import annotations

import logging
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.decide import MeasuredChoice, Reason
from gluon_amp_core.policy import Policy
from gluon_amp_core.timing_cache import TimingCache
from gluon_amp_core.tuning.schedule import Ledger, ShapeHistory, Shapes, TuneBudget
from gluon_amp_core.walk import Note, measured_note

from .. import mxnet_internals as mxi, plan_notes
from ..speed.timing import release_memory
from ..type_inference import infer_dtypes
from .tuner import (Job, build_estimate, Outcome, Target, Tuning, applier, check_applied,
                    choices_to_run, graph_key, load_outcome, new_job, run)

_log = logging.getLogger(__name__)
#: The clock tuning is charged by (tests plant one of their own).
clock: Callable[[], float] = time.perf_counter
_LEDGER = Ledger()
#: Call-to-call times kept per shape key (the median is the graph's step there), and keys kept.
_INTERVALS = 8
#: a job waiting for the budget is looked at again within this (s), whatever it needs
_RECHECK_WAIT_S = 1.0
_KEYS = 64


def process_ledger(budget: Optional[TuneBudget] = None) -> Ledger:
    """This process's ledger (one budget per process, whatever the number of ``init`` calls
    or converters); ``budget`` replaces its budget when given."""
    if budget is not None:
        _LEDGER.budget = budget
    return _LEDGER


@dataclass
class _Graph:
    """One graph structure, as the blocks of this process run it."""

    target: Target
    key: str
    data_names: List[str]
    outcome: Optional[Outcome]
    tuning: Tuning
    history: ShapeHistory = field(default_factory=ShapeHistory)
    #: bumped when the choices change: blocks built with an older one are built again
    version: int = 0
    job: Optional[Job] = None
    job_key: Optional[Shapes] = None
    done_keys: Set[Shapes] = field(default_factory=set)
    intervals: Dict[Shapes, List[float]] = field(default_factory=dict)
    broken: bool = False
    blocks: "weakref.WeakSet[HybridBlock]" = field(default_factory=weakref.WeakSet)
    #: the dtype of each chosen node in the graph its blocks were last built with
    running: Dict[str, str] = field(default_factory=dict)
    #: what building one of its blocks' graphs again took beyond a step (s), the most seen
    #: (0: none seen yet); and the longest first interval of a block (a step and a build)
    build_s: float = 0.0
    first_s: float = 0.0
    #: intervals that held a rebuild, with their shapes: booked once a step is known
    unbooked: List[Tuple[Shapes, float]] = field(default_factory=list)
    #: (the job, its shapes, until when) a job waits for the budget: calls before skip the look
    wait: Tuple[Optional[Job], Optional[Shapes], float] = (None, None, 0.0)

    def step_s(self, key: Shapes) -> Optional[float]:
        """The median call-to-call time at ``key`` (the training step, as the user runs it);
        before one is seen there, the first interval (a step and a build: estimates start
        high, never low)."""
        got = self.intervals.get(key)
        return statistics.median(got) if got else (self.first_s or None)

    def any_step_s(self) -> Optional[float]:
        """The smallest median call-to-call time seen at any shape (None: none yet)."""
        got = [statistics.median(v) for v in self.intervals.values() if v]
        return min(got) if got else None

    def first_build_s(self, key: Shapes) -> Optional[float]:
        """What its blocks' first build took beyond a step (s): the longest first interval less
        a step at ``key``; None before a step there is seen (the first interval alone is not one)."""
        got = self.intervals.get(key)
        if not self.first_s or not got:
            return None
        return max(0.0, self.first_s - statistics.median(got))

    def waits(self, key: Shapes, at: float) -> bool:
        """Whether a call at ``key`` and time ``at`` finds its job still waiting for the budget
        (:meth:`Tuner._waiting`): nothing to look at before then."""
        job, job_key, until = self.wait
        return job is not None and job is self.job and key == job_key and at < until

    def note(self, key: Shapes, seconds: float) -> None:
        """Record one call-to-call time at ``key`` (the last few per key, for a few keys)."""
        if key in self.intervals or len(self.intervals) < _KEYS:
            kept = self.intervals.setdefault(key, [])
            kept.append(seconds)
            del kept[:-_INTERVALS]


@dataclass
class _Block:
    """One block of a graph: the choices it was built with (``version``), its last call."""

    graph: _Graph
    version: int
    last: Optional[float] = None
    last_key: Optional[Shapes] = None
    rebuilt: bool = False
    #: no call since its first: the next interval holds the graph's first build
    fresh: bool = True


class Tuner:
    """What ``init`` (with ``tune``) hooks into every HybridBlock: :meth:`rewrite` on each
    graph build, :meth:`called` on each later call. One per ``init``; the budget is the
    process's."""

    def __init__(self, policy: Policy, cache: Callable[[], TimingCache]) -> None:
        self.policy, self.cache = policy, cache
        self.ledger = process_ledger(policy.tune_budget)
        self.graphs: Dict[str, _Graph] = {}
        self.blocks: "weakref.WeakKeyDictionary[HybridBlock, _Block]" = weakref.WeakKeyDictionary()

    # -- a graph build (first call, or a rebuild this tuner or the shape rules asked for)
    def rewrite(self, block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> Symbol:
        """The block's traced training graph with its structure's choices (none yet: the plan)."""
        plan_notes.record(block, "tuner", {})
        plan_notes.record_plan_heads(block, None)
        if getattr(block, "amp_result", None) is not None:
            return out  # converted by gluon_amp: its plan (tuned or not) was fixed then
        arrays = [a for a in mxi.call_arrays(args) if isinstance(a, NDArray)]
        if not arrays or any(a.ctx.device_type != "cpu" for a in arrays):
            return out  # GPUs: float16 is taken as fast; nothing here times them
        known, _ = mxi.call_inputs(block, args, inputs)
        target = Target(out, known, applier(out, known, self.policy), self.policy, train=True)
        g = self._graph(target, [s.name for s in inputs])
        b = self.blocks.get(block)
        if b is None or b.graph is not g:  # a first build: this call is the graph's first
            g.history.see(_shapes(arrays))
            self.ledger.start(clock())
            # the first interval includes the warm-up: step estimates start high, never low
            b = self.blocks[block] = _Block(g, g.version, last=clock(), last_key=g.history.key(g.history.last or ()))
        b.version = g.version
        g.blocks.add(block)
        block.amp_tuning = g.tuning
        if g.broken:
            return out
        choices, why = choices_to_run(target, g.outcome, self._last_shapes(g))
        g.tuning.verdict = why
        g.running = {n: c.dtype for n, c in choices.items()}
        if not choices:
            return out
        tuned = target.apply(choices)
        wrong = check_applied(tuned, known, choices)
        if wrong:
            g.broken = True
            g.tuning.status = f"its choices could not be applied ({wrong[:3]}): it runs the plan"
            warnings.warn(f"gluon_amp: tuning could not apply its choices to block {block.name!r} "
                          f"({wrong[:3]}); it runs the untuned plan. Please report this with the model.",
                          RuntimeWarning, stacklevel=5)
            return out
        plan_notes.record_plan_heads(block, target.head_dtypes())  # its outputs as the plan's (execution.py)
        everywhere = set(choices) == set(target.low_ops()) and all(c.dtype == "float32" for c in choices.values())
        plan_notes.record(block, "tuner", {n: Note(Reason.MEASURED.value, f"float32: the whole graph {why}")
                                           if everywhere else measured_note(c) for n, c in choices.items()})
        return tuned

    def _graph(self, target: Target, data_names: List[str]) -> _Graph:
        key = graph_key(target)
        g = self.graphs.get(key)
        if g is None:
            outcome = load_outcome(self.cache(), key, len(target.graph["nodes"]))
            tuning = Tuning()
            if outcome is not None:
                tuning.choices = target.by_name(outcome.choices)
                tuning.tuned_at = target.shapes_by_name(outcome.tuned_at)
                tuning.cached = 1
                tuning.status = f"read from the cache: tuned at input shapes {_shown(tuning.tuned_at)}"
            elif self.ledger.budget.seconds == 0:
                tuning.status = "not tuned: the tuning budget is 0 s (only outcomes in the cache are used)"
            else:
                tuning.status = "tuning waits until an input shape repeats"
            g = self.graphs[key] = _Graph(target, key, data_names, outcome, tuning)
        return g

    # -- every later call
    def called(self, block: HybridBlock, args: tuple) -> bool:
        """Record the call and do the tuning work the budget allows; True when the block's
        graph must be built again for this call (new choices, or released for trials)."""
        b = self.blocks.get(block)
        if b is None:
            return False
        g = b.graph
        at = clock()
        self.ledger.start(at)
        key = g.history.see(_shapes(a for a in mxi.call_arrays(args) if isinstance(a, NDArray)))
        if b.last is not None:
            if b.rebuilt:  # the call after a rebuild paid for it, whatever its shape: booked below
                g.unbooked.append((b.last_key, at - b.last))
            elif b.fresh:  # the block's first interval: a step and the graph's first build
                g.first_s = max(g.first_s, at - b.last)
            elif b.last_key == key:
                g.note(key, at - b.last)
        b.fresh = False
        self._book_rebuilds(g)
        released = False
        if b.version == g.version and not g.broken and self.ledger.budget.seconds > 0 and not g.waits(key, at):
            released = self._work(g, block, key)
        rebuild = released or b.version != g.version
        b.version = g.version
        b.last, b.last_key, b.rebuilt = clock(), key, rebuild
        return rebuild

    def _work(self, g: _Graph, block: HybridBlock, key: Shapes) -> bool:
        if g.job is None:
            g.job = self._new_job(g, key)
            g.job_key = key
            if g.job is None:
                return False
        job = g.job
        job.measured(g.step_s(key) if g.intervals.get(key) else None, g.first_build_s(key))
        rebuild = self._rebuild_estimate(g, key)
        need = job.next.estimate + (rebuild if job.next.whole_graph else 0.0) if job.next is not None else 0.0
        if job.next is not None and not self.ledger.allows(need, clock()):
            self._waiting(g, job, need)
            return False
        released = False

        def extra(step: Any) -> float:
            # the block's own graph, released for whole-graph timings, is built again at the next
            # call: booked then, it must fit now with the step that causes it
            return rebuild if step.whole_graph and not released else 0.0

        def before(step: Any) -> None:
            nonlocal released
            if step.whole_graph and not released:
                mxi.drop_cached_graph(block)  # its memory is not held twice; built again for this call
                release_memory()
                released = True

        with self.cache().lock(blocking=False) as mine:
            if not mine:
                g.tuning.status = "tuning waits: another process is measuring on this machine"
                return False
            mx.nd.waitall()  # the step the user queued is not tuning's to pay for
            done = run(job, self.ledger, now, before=before, extra=extra)
            if not done:
                t0 = clock()
                job.flush()
                self.ledger.charge(clock() - t0, "writing the cache", estimate=0.0)
        if done:
            self._finish(g, job)
        else:
            if job.provisional is not None and g.outcome is not job.provisional:
                self._adopt(g, job.provisional)
            self._waiting(g, job)
        return released

    def _book_rebuilds(self, g: _Graph) -> None:
        """Book what each rebuild took beyond a step, once a step (at its shape, else the fastest
        at any) is known."""
        for key, interval in list(g.unbooked):
            typical = g.intervals.get(key) and g.step_s(key) or g.any_step_s()
            if typical is None:
                return
            self.ledger.charge(interval - typical, "rebuilding graphs")
            g.build_s = max(g.build_s, interval - typical)
            g.unbooked.remove((key, interval))

    @staticmethod
    def _rebuild_estimate(g: _Graph, key: Shapes) -> float:
        """What building a block's graph again will cost beyond a step (s): the most seen, and
        at least a build (:func:`~.tuner.build_estimate`: the block's first, measured where
        known) and a warm-up of two steps."""
        step = g.step_s(key) or g.any_step_s() or 0.0
        guess = build_estimate(len(g.target.graph["nodes"]), g.first_build_s(key)) + 2 * step
        return max(g.build_s, g.first_s - step, guess)

    def _adopt(self, g: _Graph, outcome: Optional[Outcome]) -> None:
        """Run ``outcome`` from the next call on (a new version where what runs changes)."""
        g.outcome = outcome
        after, why = choices_to_run(g.target, outcome, self._last_shapes(g))
        g.tuning.verdict = why
        if {n: c.dtype for n, c in after.items()} != g.running:
            g.version += 1

    def _new_job(self, g: _Graph, key: Shapes) -> Optional[Job]:
        if key in g.done_keys:
            return None
        if g.history.count(key) < 2:
            if g.outcome is None:
                g.tuning.status = "tuning waits until an input shape repeats (a shape seen once is not tuned for)"
            return None
        if g.outcome is not None and g.outcome.complete and any(
                g.history.matches(key, self._ordered(g, s)) for s in g.outcome.shapes_tried()):
            g.done_keys.add(key)
            return None
        shapes = dict(zip(g.data_names, g.history.last or ()))
        job = new_job(g.target, shapes, self.cache(), g.outcome, g.step_s(key), now, g.first_build_s(key))
        if job is None:
            g.done_keys.add(key)
        return job

    @staticmethod
    def _last_shapes(g: _Graph) -> Dict[str, Tuple[int, ...]]:
        """The data input shapes of the graph's last call."""
        return dict(zip(g.data_names, g.history.last or ()))

    def _ordered(self, g: _Graph, shapes: Dict[int, tuple]) -> Shapes:
        by_name = g.target.shapes_by_name(shapes)
        return tuple(by_name.get(n, ()) for n in g.data_names)

    def _waiting(self, g: _Graph, job: Job, need: Optional[float] = None) -> None:
        """``job`` waits for the budget. Where its next step needs ``need`` seconds (with its
        rebuild), the calls until the share allows it skip :meth:`_work` (a second at most:
        the estimates move with the step times): a training step pays for no look here."""
        at = clock()
        step = job.next
        what = "a full tuning" if job.kind == "full" else "a re-check"
        g.tuning.status = (f"{what} at input shapes {_shown(job.shapes)} waits for the budget: next {step.what} "
                           f"~{step.estimate:.2f} s; spent {self.ledger.spent:.2f} s of "
                           f"{self.ledger.allowance(at):.2f} s allowed so far ({self.ledger.budget.describe()})")
        if need is not None:
            g.wait = (job, g.job_key, min(at + _RECHECK_WAIT_S, self.ledger.allowed_at(need)))

    def _finish(self, g: _Graph, job: Job) -> None:
        t = g.tuning
        t.timed += job.tuning.timed
        t.cached += job.tuning.cached
        t.seconds += job.tuning.seconds
        t.trials = job.tuning.trials or t.trials
        g.job, g.wait = None, (None, None, 0.0)  # the finished job held no longer
        if g.job_key is not None:
            g.done_keys.add(g.job_key)
        if job.outcome is None:
            return
        self._adopt(g, job.outcome)
        t.choices = g.target.by_name(g.outcome.choices)
        names = g.target.names
        t.withdrawn = [f"{names[p]}: {w}" for p, w in g.outcome.withdrawn.items()]
        kept = sum(c.dtype == "float32" for c in g.outcome.choices.values())
        if job.kind == "full":
            t.tuned_at = dict(job.shapes)
            t.status = (job.tuning.status if "could not" in job.tuning.status else
                        f"tuned at input shapes {_shown(job.shapes)}: {kept} op(s) kept in float32 "
                        f"({job.tuning.timed} measured, {job.tuning.cached} read; trials {job.tuning.trials})")
        else:
            t.rechecked.append(f"{_shown(job.shapes)}: {job.tuning.status}")
            t.status = (f"tuned at input shapes {_shown(t.tuned_at or {})}, re-checked at {_shown(job.shapes)}: "
                        f"{kept} op(s) in float32" + (f", {len(t.withdrawn)} withdrawn" if t.withdrawn else ""))

    # -- what runtime_info() shows
    def info(self) -> Dict[str, Any]:
        at = clock()
        graphs = []
        for g in self.graphs.values():
            busy = g.job.tuning if g.job is not None else Tuning()  # a job under way: what it did so far
            graphs.append({"blocks": sorted(b.name for b in g.blocks), "status": g.tuning.status,
                           "verdict": g.tuning.verdict,
                           "calls": g.history.calls, "distinct_shapes": g.history.distinct,
                           "dynamic_dims": sorted(f"input {i} dim {d}" for i, d in g.history.dynamic),
                           "tuned_at": g.tuning.tuned_at, "rechecked": list(g.tuning.rechecked),
                           "float32_choices": sorted(n for n, c in g.tuning.choices.items() if c.dtype == "float32"),
                           "withdrawn": list(g.tuning.withdrawn), "trials": list(busy.trials or g.tuning.trials),
                           "measured": g.tuning.timed + busy.timed,
                           "read": g.tuning.cached + busy.cached, "seconds": round(g.tuning.seconds + busy.seconds, 3)})
        return {**self.ledger.to_dict(at), "graphs": graphs}


def now() -> float:
    """:data:`clock`'s time, looked up at each call (a planted clock replaces the module's)."""
    return clock()


def _shapes(arrays: Any) -> Shapes:
    return tuple(tuple(a.shape) for a in arrays)


def _shown(shapes: Dict[Any, tuple]) -> str:
    return ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items()) or "?"


# -- the converters: a whole tuning at once -------------------------------------------

def tune_graph(sym: Symbol, input_dtypes: Mapping[str, str], input_shapes: Mapping[str, Tuple[int, ...]],
               policy: Policy, train: bool, apply: Callable[[Mapping[str, MeasuredChoice]], Symbol],
               cache: TimingCache, fused: bool = False, ledger: Optional[Ledger] = None
               ) -> Tuple[Tuning, Dict[Tuple[str, int], Optional[str]]]:
    """Choose dtypes for ``sym``'s low-precision ops (typed by the plan) by measured speed,
    at once (the converters: no training run to pay from, so only the budget's seconds cap
    applies, shared with the rest of the process through ``ledger``).

    An outcome stored for this graph at other shapes is re-checked here as the rule says;
    without one, the per-op speed table and :func:`gluon_amp_core.tuning.problem.choose` propose, and
    each group of proposals is kept only if the whole graph with it (``apply(choices)``,
    run as users run it) is at least :data:`~.tuner.MIN_GAIN` faster. What the budget does not pay
    for is left as the plan has it. Returns the tuning and the graph's dtypes as MXNet infers them.
    """
    ledger = ledger or process_ledger(policy.tune_budget)
    dtypes = infer_dtypes(sym, input_dtypes, partial=True) or {}
    target = Target(sym, dict(input_dtypes), apply, policy, train, fused)
    outcome = load_outcome(cache, graph_key(target), len(target.graph["nodes"]))
    job = new_job(target, input_shapes, cache, outcome, clock=now)
    if job is None:  # an outcome that holds at these shapes
        held, why = choices_to_run(target, outcome, input_shapes)
        return Tuning(held, cached=1, status="read from the cache", verdict=why), dtypes
    with cache.lock():  # one process measures at a time; the others then read what it stored
        finished = run(job, ledger, now, cap_only=True)
        job.flush()
    tuning = job.tuning
    if finished:
        tuning.status = tuning.status if "could not" in tuning.status else f"tuned ({job.kind})"
        tuning.choices, tuning.verdict = choices_to_run(target, job.outcome, input_shapes)
    else:
        spent = ledger.spent
        tuning.status = (f"stopped by the budget ({ledger.budget.describe()}: {spent:.1f} s spent): "
                         f"the untimed rest runs the plan")
        # what was decided so far: a re-check that did not finish keeps the choices as they
        # were; a full tuning, its check against float32 where that was done, else the rule
        tuning.choices, tuning.verdict = choices_to_run(target, job.provisional or outcome, input_shapes)
    _log.info("gluon_amp tune: %s; %d measurements made, %d read, whole-graph trials %s, %.1f s",
              tuning.summary, tuning.timed, tuning.cached, tuning.trials, tuning.seconds)
    for name, c in sorted(tuning.choices.items()):
        _log.info("gluon_amp tune: %s %s", name, c.describe())
    return tuning, dtypes
