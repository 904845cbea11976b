"""When tuning may spend time, and where its decisions carry. Pure.

:mod:`gluon_amp_core.tuning.problem` says *what* to time and chooses from the figures; this module
says *when* the MXNet layer may time, and *whether* a decision made at one input shape
still holds at another:

- :class:`TuneBudget` / :class:`Ledger`: tuning spends at most a share of the wall time the
  process has spent training so far, and at most a fixed number of seconds per process.
  Work starts only when its estimated cost fits; what is not confirmed runs the untuned plan.
- :class:`ShapeHistory`: the input shapes a graph was called with. A shape seen once is not
  tuned for; a dimension that changes at most calls (an R-CNN image's width, the number of
  boxes in a padded batch) is *dynamic* (``torch.compile(dynamic=True)``'s idea) and ignored
  when telling whether a shape repeats.
- :func:`could_flip` / :func:`still_float32`: a graph is tuned once in full, at the first
  shape that repeats; at another shape only a float32 choice near its break-even, on an op
  whose input size moved by more than :data:`SIZE_STEP`, is timed again, and a float32
  choice that no longer pays is withdrawn after the whole graph confirms it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from ..decide import MeasuredChoice

Shapes = Tuple[Tuple[int, ...], ...]

#: The default budget: 1% of the wall time spent training so far, at most 10 minutes a process.
#: A first run may be 3% slower than the untuned plan at most (issue 32), and two runs of one
#: program differ by 1-2% on a quiet machine: tuning gets what is left.
DEFAULT_SHARE = 0.01
DEFAULT_SECONDS = 600.0
ENV = "GLUON_AMP_TUNE_BUDGET"


@dataclass(frozen=True)
class TuneBudget:
    """What tuning may spend in one process.

    Attributes
    ----------
    share : float or None
        At most this share of the wall time since the process first ran a tuned graph
        (tuning included): tuning never costs a run more than ``share / (1 - share)``.
        ``None``: all of ``seconds`` may be spent at once.
    seconds : float
        At most this many seconds in the process (``inf``: no cap; ``0``: measure
        nothing, only use outcomes already in the timing cache).
    """

    share: Optional[float] = DEFAULT_SHARE
    seconds: float = DEFAULT_SECONDS

    def __post_init__(self) -> None:
        if self.share is not None and not (isinstance(self.share, (int, float)) and 0 < self.share < 1):
            raise ValueError(f"tune_budget's share must be in (0, 1) (e.g. 0.02 for 2%), got {self.share!r}")
        if not isinstance(self.seconds, (int, float)) or isinstance(self.seconds, bool) or not self.seconds >= 0:
            raise ValueError(f"tune_budget's seconds must be a number >= 0 (or inf), got {self.seconds!r}")

    def allowance(self, elapsed: float) -> float:
        """Seconds tuning may have spent in all, ``elapsed`` seconds into the run."""
        if self.share is None:
            return float(self.seconds)
        return min(float(self.seconds), self.share * max(0.0, elapsed))

    def describe(self) -> str:
        """e.g. ``1% of the training time so far, at most 600 s per process``."""
        cap = "no cap" if math.isinf(self.seconds) else f"{self.seconds:g} s"
        if self.share is None:
            return f"{cap} per process" if not math.isinf(self.seconds) else "unlimited"
        return f"{self.share * 100:g}% of the training time so far, at most {cap} per process"


DEFAULT_BUDGET = TuneBudget()
_PART = re.compile(r"^\s*(inf|\d+(?:\.\d*)?|\.\d+)\s*(%|s)?\s*$", re.IGNORECASE)
_FORMS = ("seconds ('300', '300s', 'inf'), a share of the training time ('2%'), or both ('2%,300'); "
          "in Python also a number of seconds or a TuneBudget")


def parse_budget(value: Any, where: str = "tune_budget") -> TuneBudget:
    """``value`` as a :class:`TuneBudget`: one, ``None`` (the default), seconds (a number),
    or a string of comma-separated parts ``'<n>%'`` (share) and ``'<n>'``/``'<n>s'``/``'inf'``
    (seconds). A share alone keeps the default cap. Raises ``TypeError``/``ValueError``."""
    if value is None:
        return DEFAULT_BUDGET
    if isinstance(value, TuneBudget):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value >= 0:
            raise ValueError(f"{where} must be >= 0 seconds, got {value!r}; use one of {_FORMS}")
        return TuneBudget(None, float(value))
    if not isinstance(value, str):
        raise TypeError(f"{where} must be {_FORMS}; got {type(value).__name__} {value!r}")
    share: Optional[float] = None
    seconds: Optional[float] = None
    for part in value.split(","):
        m = _PART.match(part)
        if m is None or (m.group(2) == "%" and m.group(1).lower() == "inf"):
            raise ValueError(f"{where}={value!r}: cannot read {part.strip()!r}; use {_FORMS}")
        number = float(m.group(1))
        if m.group(2) == "%":
            if share is not None or not 0 < number < 100:
                raise ValueError(f"{where}={value!r}: give one share, above 0% and below 100%; use {_FORMS}")
            share = number / 100
        else:
            if seconds is not None:
                raise ValueError(f"{where}={value!r}: give one number of seconds; use {_FORMS}")
            seconds = number
    if share is None:
        return TuneBudget(None, DEFAULT_SECONDS if seconds is None else seconds)
    return TuneBudget(share, DEFAULT_SECONDS if seconds is None else seconds)


@dataclass
class Ledger:
    """What tuning spent in this process, against its budget (times in seconds, from the
    caller's clock)."""

    budget: TuneBudget = DEFAULT_BUDGET
    #: when the process first ran a graph that could be tuned (the training time starts)
    started: Optional[float] = None
    spent: float = 0.0
    spent_on: Dict[str, float] = field(default_factory=dict)
    #: the largest amount a step cost beyond its estimate (what the budget may be overdrawn by)
    overrun: float = 0.0

    def start(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def allowance(self, now: float) -> float:
        """What may have been spent by ``now``."""
        return self.budget.allowance(0.0 if self.started is None else now - self.started)

    def allows(self, estimate: float, now: float, cap_only: bool = False) -> bool:
        """True when a step estimated to cost ``estimate`` fits in the budget now
        (``cap_only``: in its seconds cap, whatever the share: work outside a training run)."""
        allowed = float(self.budget.seconds) if cap_only else self.allowance(now)
        return self.spent + max(0.0, estimate) <= allowed

    def allowed_at(self, estimate: float) -> float:
        """The earliest time (on the clock :meth:`start` was given) at which :meth:`allows`
        says True for ``estimate``, spending nothing meanwhile (``inf``: never)."""
        need = self.spent + max(0.0, estimate)
        share = self.budget.share
        if need > float(self.budget.seconds):
            return math.inf  # over the cap (or a fixed allowance): spending only grows
        if share is None or self.started is None:
            return 0.0  # a fixed allowance it fits; or the run's start not known yet: no wait to skip
        return self.started + need / share

    def charge(self, seconds: float, what: str, estimate: Optional[float] = None) -> None:
        """Book ``seconds`` spent on ``what`` (a step estimated at ``estimate``)."""
        seconds = max(0.0, seconds)
        self.spent += seconds
        self.spent_on[what] = self.spent_on.get(what, 0.0) + seconds
        if estimate is not None:
            self.overrun = max(self.overrun, seconds - estimate)

    def to_dict(self, now: float) -> Dict[str, Any]:
        elapsed = 0.0 if self.started is None else now - self.started
        return {"budget": self.budget.describe(), "elapsed_s": round(elapsed, 3),
                "allowance_s": round(self.allowance(now), 3), "spent_s": round(self.spent, 3),
                "spent_on": {k: round(v, 3) for k, v in sorted(self.spent_on.items())},
                "largest_overrun_s": round(self.overrun, 3)}


#: A dimension is dynamic once it has changed at more than half of the calls, after this many.
DYNAMIC_AFTER = 3
#: Distinct shapes remembered per graph (shapes that never repeat would grow without end).
MAX_SHAPES = 256


class ShapeHistory:
    """The input shapes of one graph's calls, and which of their dimensions are dynamic.

    A *key* is a call's shapes with the dynamic dimensions replaced by ``-1``: two calls
    whose shapes differ only there repeat each other. :meth:`count` says how often a key
    was seen (dynamic dimensions as they stand now).
    """

    def __init__(self) -> None:
        self.calls = 0
        self._last: Optional[Shapes] = None
        self._changes: Dict[Tuple[int, int], int] = {}
        self._seen: Dict[Shapes, int] = {}
        self._dynamic: FrozenSet[Tuple[int, int]] = frozenset()
        self._by_key: Dict[Shapes, int] = {}

    @property
    def last(self) -> Optional[Shapes]:
        """The shapes of the last call seen."""
        return self._last

    @property
    def distinct(self) -> int:
        """How many different shapes were seen (up to :data:`MAX_SHAPES`)."""
        return len(self._seen)

    @property
    def dynamic(self) -> FrozenSet[Tuple[int, int]]:
        """(input index, dimension index) of every dynamic dimension."""
        return self._dynamic

    def key(self, shapes: Shapes) -> Shapes:
        """``shapes`` with the dynamic dimensions as ``-1``."""
        if not self._dynamic:
            return shapes
        return tuple(tuple(-1 if (i, d) in self._dynamic else n for d, n in enumerate(s))
                     for i, s in enumerate(shapes))

    def see(self, shapes: Shapes) -> Shapes:
        """Record one call; return its key."""
        last = self._last
        if not self._changes and shapes == last:
            # a training loop's usual call (no dimension ever changed): what the general
            # path below would do, without rebuilding the shapes and the dynamic set
            self.calls += 1
            if last in self._seen:
                self._seen[last] += 1
            self._by_key[last] = self._by_key.get(last, 0) + 1
            return last
        shapes = tuple(tuple(int(n) for n in s) for s in shapes)
        if last is not None and len(last) == len(shapes) and all(len(a) == len(b) for a, b in zip(last, shapes)):
            for i, (a, b) in enumerate(zip(last, shapes)):
                for d, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        self._changes[(i, d)] = self._changes.get((i, d), 0) + 1
        self.calls += 1
        self._last = shapes
        transitions = self.calls - 1
        dynamic = frozenset(k for k, n in self._changes.items() if transitions >= DYNAMIC_AFTER and 2 * n > transitions)
        if shapes in self._seen:
            self._seen[shapes] += 1
        elif len(self._seen) < MAX_SHAPES:
            self._seen[shapes] = 1
        if dynamic != self._dynamic:
            self._dynamic = dynamic
            self._by_key = {}
            for s, n in self._seen.items():
                k = self.key(s)
                self._by_key[k] = self._by_key.get(k, 0) + n
        else:
            k = self.key(shapes)
            self._by_key[k] = self._by_key.get(k, 0) + 1
        return self.key(shapes)

    def count(self, key: Shapes) -> int:
        """How many calls had this key."""
        return self._by_key.get(key, 0)

    def matches(self, key: Shapes, shapes: Shapes) -> bool:
        """True when ``shapes`` (e.g. stored by an earlier process) have this key now."""
        return self.key(tuple(tuple(s) for s in shapes)) == key


#: A float32 choice whose per-op gain is at least this share of the op's slower time stays
#: decided at any shape; and a shape that scales an op's inputs by less than this factor
#: (either way) keeps every decision of it.
FLIP_MARGIN = 0.25
SIZE_STEP = 2.0


def gain(choice: MeasuredChoice, scale: float = 1.0, low_ms: Optional[float] = None,
         fp32_ms: Optional[float] = None) -> float:
    """What running the op in float32 saves (ms; negative: it costs), with its casts scaled
    by ``scale`` and the op's own times replaced where given (re-timed at another shape)."""
    low = choice.low_ms if low_ms is None else low_ms
    fp32 = choice.fp32_ms if fp32_ms is None else fp32_ms
    return low - fp32 - choice.cast_ms * scale


def margin(choice: MeasuredChoice) -> float:
    """The float32 gain as a share of the op's slower time (0 where both took no time)."""
    slower = max(choice.low_ms, choice.fp32_ms)
    return gain(choice) / slower if slower > 0 else 0.0


def could_flip(choice: MeasuredChoice, size_ratio: float) -> bool:
    """True when a float32 choice made at one shape must be timed again at a shape that
    scales the op's inputs by ``size_ratio``: near its break-even (|margin| below
    :data:`FLIP_MARGIN`) and moved by more than :data:`SIZE_STEP`."""
    if choice.dtype != "float32":
        return False
    moved = size_ratio > SIZE_STEP or size_ratio < 1 / SIZE_STEP
    return moved and abs(margin(choice)) < FLIP_MARGIN


def still_float32(choice: MeasuredChoice, size_ratio: float, low_ms: float, fp32_ms: float) -> bool:
    """True when figures re-timed at another shape still favour float32 (casts scaled)."""
    return gain(choice, size_ratio, low_ms, fp32_ms) > 0


def elements(shapes: Sequence[Sequence[int]]) -> int:
    """Total elements of tensors of these shapes."""
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= int(d)
        total += n
    return total


def to_retime(choices: Dict[int, MeasuredChoice], ratios: Dict[int, float]) -> List[int]:
    """The float32 choices (node positions) to time again at a new shape that scales each
    op's inputs by ``ratios[position]`` (unknown: could have moved anywhere); the others
    carry over as they are."""
    return [pos for pos, c in sorted(choices.items()) if could_flip(c, ratios.get(pos, math.inf))]
