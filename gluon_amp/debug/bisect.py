"""``bisect``: a smallest set of ops to keep in float32 so a network meets a tolerance."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np

from gluon_amp_core.policy import Policy

from .capture import outputs_error, run_internals
from .compare import _compare, low_precision


@dataclass
class BisectResult:
    """What :func:`bisect` found; ``excluded_sym_names`` goes unchanged to
    ``convert_hybrid_block(..., excluded_sym_names=...)`` and ``init(excluded_sym_names=...)``."""

    excluded_sym_names: List[str]
    trials: int
    error_before: float
    error_after: float
    candidates: int
    target_dtype: str
    emulated: bool
    ranking: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"keep in float32: {self.excluded_sym_names or 'nothing'} ({self.trials} trials over "
                f"{self.candidates} low-precision ops, {self.target_dtype}"
                f"{' emulated' if self.emulated else ''}); output error {self.error_before:.3e} -> "
                f"{self.error_after:.3e}")


class _Trials:
    """Runs the network with a set of ops kept in float32; counts the runs, none twice."""

    def __init__(self, model: Any, policy: Policy, data: dict, reference: List[np.ndarray],
                 tolerance: float, validate: Optional[Callable], max_trials: Optional[int]) -> None:
        self.model, self.policy, self.data, self.reference = model, policy, data, reference
        self.tolerance, self.validate, self.max_trials = tolerance, validate, max_trials
        self.count = 0
        self.seen: Dict[frozenset, Tuple[bool, float]] = {}

    def judge(self, outputs: List[np.ndarray]) -> Tuple[bool, float]:
        err = outputs_error(outputs, self.reference)
        if self.validate is not None:
            return bool(self.validate([mx.nd.array(o) for o in outputs])), err
        return err <= self.tolerance, err

    def passes(self, excluded: Sequence[str], again: bool = False) -> bool:
        return self.error(excluded, again)[0]

    def error(self, excluded: Sequence[str], again: bool = False) -> Tuple[bool, float]:
        """``(passes, output error)`` with ``excluded`` in float32; ``again`` runs a set seen before."""
        key = frozenset(excluded)
        if key in self.seen and not again:
            return self.seen[key]
        if self.max_trials is not None and self.count >= self.max_trials:
            raise RuntimeError(f"bisect used its max_trials={self.max_trials} runs without a verdict; "
                               "raise max_trials (or None for no limit)")
        self.count += 1
        policy = replace(self.policy, excluded_sym_names=tuple(sorted(excluded)) or None)
        sym, args, aux, _ = low_precision(self.model, policy)
        out = run_internals(sym, self.data, args, aux, self.model.ctx, outputs_only=True)
        self.seen[key] = self.judge([out[("", k)] for k in range(len(out))])
        return self.seen[key]


def _ranking(rows: List[Any], graph: dict) -> List[str]:
    """The low-precision ops, worst first. An op's score is the largest local error of itself
    and of the neutral ops it feeds (up to the next low-precision op): an offset that a
    bfloat16 dense layer rounds away only shows where a later op subtracts it."""
    inputs = {n["name"]: [graph["nodes"][e[0]]["name"] for e in n["inputs"]] for n in graph["nodes"]}
    owners: Dict[str, set] = {}
    score: Dict[str, float] = {}
    for r in rows:  # graph order: producers first
        mine = {r.name} if r.reason == "low_precision" else set().union(*(owners.get(i, set()) for i in inputs[r.name]))
        owners[r.name] = mine
        err = r.local_error if r.local_error == r.local_error else float("inf")
        for c in mine:
            score[c] = max(score.get(c, 0.0), err)
    index = {r.name: r.index for r in rows}
    return sorted(score, key=lambda c: (-score[c], index[c]))


def _smallest_passing_prefix(trials: _Trials, kept: List[str], rest: List[str], lo: int, hi: int) -> int:
    """The smallest ``m`` in ``[lo, hi]`` with ``kept + rest[:m]`` passing, ``m = hi`` taken
    to pass: a binary search, ``ceil(log2(hi - lo + 1))`` runs."""
    while lo < hi:
        mid = (lo + hi) // 2
        if trials.passes(kept + rest[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _search(trials: _Trials, ranked: List[str]) -> List[str]:
    """The culprits among ``ranked`` (worst first), found one at a time.

    Each round finds the smallest prefix of the remaining ranking that passes with the
    culprits found so far; its last op is a culprit. That prefix minus the culprit bounds
    the next round (any further culprit lies within it), so rounds shrink: with the culprits
    ranked first, k culprits cost about ``ceil(log2 n) + k`` runs."""
    kept: List[str] = []
    rest = list(ranked)
    m = _smallest_passing_prefix(trials, kept, rest, 1, len(rest))  # kept=[] fails: known
    if m == len(rest) and not trials.passes(rest):
        raise RuntimeError(f"keeping all {len(rest)} low-precision ops in float32 does not meet the tolerance "
                           "either: the difference is not in the precision of the low-precision ops (check "
                           "the tolerance or validate, and the ops that already run in float32)")
    while m > 0:
        kept.append(rest.pop(m - 1))
        m = _smallest_passing_prefix(trials, kept, rest, 0, m - 1)
    return kept


def _one_minimal(trials: _Trials, kept: List[str]) -> List[str]:
    """Drop every name the rest passes without, until dropping any one breaks it."""
    changed = True
    while changed and len(kept) > 1:
        changed = False
        for name in list(kept):
            if trials.passes([k for k in kept if k != name]):
                kept = [k for k in kept if k != name]
                changed = True
                break
    return kept


def bisect(block: Any, *inputs: mx.nd.NDArray, target_dtype: Any = None, emulate: Optional[bool] = None,
           tolerance: float = 1e-2, validate: Optional[Callable[[List[mx.nd.NDArray]], bool]] = None,
           max_trials: Optional[int] = None) -> BisectResult:
    """Find a smallest set of op nodes to keep in float32 so the output meets ``tolerance``
    (relative L2 against FP32) or ``validate(outputs)`` returns True.

    The candidates are the ops the plan runs in low precision (reason ``low_precision``),
    ranked by the local error they cause (:func:`compare`, whose run also gives
    ``error_before``). Culprits are found by group testing over that ranking: binary
    searches for the smallest passing prefix, each bounded by the last (about
    ``k * ceil(log2 n) + 1`` runs for k culprits among n ops, none repeated). The set is
    then made 1-minimal (dropping any one name breaks it) and re-validated by a final run,
    counted in ``trials``. Deterministic.

    Parameters
    ----------
    block, *inputs, target_dtype, emulate, tolerance :
        As for :func:`compare`.
    validate : callable, optional
        ``validate(outputs) -> bool`` on the low-precision outputs (a list of float32
        NDArrays); replaces the tolerance test of the output error.
    max_trials : int, optional
        Stop with a ``RuntimeError`` after this many runs.

    Returns
    -------
    BisectResult
        ``excluded_sym_names`` goes unchanged to ``convert_hybrid_block``, the converter CLI
        (``--exclude``) and ``init(excluded_sym_names=...)``.
    """
    if max_trials is not None and (isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1):
        raise ValueError(f"max_trials must be a positive int or None (no limit), got {max_trials!r}")
    if validate is not None and not callable(validate):
        raise TypeError(f"validate must be callable as validate(outputs) -> bool, got {type(validate).__name__}")
    report, run = _compare(block, inputs, target_dtype, emulate, tolerance, None, None, None,
                           "gluon_amp.debug.bisect")
    trials = _Trials(run.model, run.policy, run.data, run.fp32_outputs, tolerance, validate, max_trials)
    ranked = _ranking(report.rows, run.model.graph)
    trials.seen[frozenset()] = first = trials.judge(run.low_outputs)
    kept: List[str] = []
    if not first[0]:
        unreproducible = [r.name for r in report.rows if r.unreproducible]
        if unreproducible:
            raise RuntimeError(f"bisect: the FP32 reference is not reproducible, so no op kept in float32 can "
                               f"meet it (output error {first[1]:.3e}): {', '.join(unreproducible)} gave another "
                               "output when run again in float32 on the same inputs (a random kernel, or one "
                               "that leaves part of its output unwritten, as MXNet 1.9.1's CPU ROIAlign does "
                               "for rois whose batch index is below 0). Fix or remove that op's input case "
                               "first; gluon_amp.debug.compare shows the rows")
        if not ranked:
            raise RuntimeError("the plan runs no op in low precision by its own decision (no candidate to keep "
                               f"in float32), yet the output fails (error {first[1]:.3e}): check the tolerance "
                               "or validate")
        kept = _one_minimal(trials, _search(trials, ranked))
    ok, after = trials.error(kept, again=True)  # the final, re-validating run
    if not ok:
        raise RuntimeError(f"bisect's result {kept} did not re-validate (error {after:.3e}); the network "
                           "does not run the same twice: check for randomness (dropout) in inference mode")
    # the graph's own names: one excludes every node of that name (a block called several times)
    names = sorted({run.model.renamed.get(k, k) for k in kept})
    return BisectResult(names, trials.count, first[1], after, len(ranked), run.policy.target_dtype,
                        run.policy.emulate, ranked)
