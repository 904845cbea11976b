"""Does a mode's loss curve match FP32's? A verdict that compares like with like. Pure.

A dynamic loss scaler starts high (65536) and backs off when a step overflows: it skips
that step's update, as it does on a GPU. From then on the mode's weights are an update behind
FP32's, and its losses at the same step index are not comparable: the old comparison said
"NOT within 2%" for emulated float16 on SSD-512 where only two skipped steps differed.

The rule (:func:`match_curves`):

1. **The first step** is taken by both modes at the same initial weights: its loss measures
   the numerics alone, and is always compared.
2. **Skipped steps** are named, with the scale the scaler went to.
3. **The curves** are compared where both modes have applied the same number of updates:

   - ``same_batch=True`` (the same batch every step: ``ssd_synthetic.py``, the tutorial
     notebook): a loss after ``n`` updates is compared with FP32's loss after ``n`` updates,
     wherever each came (a skipped step only delays a mode, so its curve is shifted);
   - ``same_batch=False`` (a new batch every step: ``convergence.py``): step ``i`` is compared
     only while neither mode has skipped a step before it (afterwards the same update count
     meets other batches).

   A step is compared by the loss of its forward pass, taken before its own update.

"NOT within" then means the numerics differ beyond the tolerance: at equal weights, or after
equal updates. It never comes from a skipped step alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: The default tolerance: the largest relative difference of the total loss that passes.
TOLERANCE = 0.02


@dataclass(frozen=True)
class Step:
    """One training step as a benchmark saw it.

    Attributes
    ----------
    loss : float
        The loss of this step's forward pass (before its update).
    updated : bool
        The optimizer applied this step's update (False: the loss scaler skipped it).
    scale : float or None
        The loss scale after this step, where there is a scaler.
    """

    loss: float
    updated: bool = True
    scale: Optional[float] = None

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Step":
        return cls(float(d["loss"]), bool(d.get("updated", True)), d.get("scale"))

    def to_dict(self) -> Dict[str, Any]:
        return {"loss": self.loss, "updated": self.updated, "scale": self.scale}


@dataclass(frozen=True)
class Pair:
    """A mode's step and FP32's step at the same number of updates, and their relative gap."""

    updates: int
    step: int
    reference_step: int
    rel_diff: float


@dataclass(frozen=True)
class CurveMatch:
    """The verdict of :func:`match_curves` (see the module's rule)."""

    pairs: Tuple[Pair, ...]
    skipped: Tuple[Tuple[int, Optional[float]], ...]
    reference_skipped: Tuple[Tuple[int, Optional[float]], ...]
    tolerance: float
    same_batch: bool
    steps: int = field(default=0)

    @property
    def first_rel_diff(self) -> Optional[float]:
        """Relative gap of the first step's losses, both at the initial weights."""
        first = [p for p in self.pairs if p.step == 0 and p.reference_step == 0]
        return first[0].rel_diff if first else None

    @property
    def max_rel_diff(self) -> Optional[float]:
        return max((p.rel_diff for p in self.pairs), default=None)

    @property
    def within(self) -> bool:
        """Every compared step within the tolerance (and at least one compared)."""
        worst = self.max_rel_diff
        return worst is not None and worst <= self.tolerance

    def to_dict(self) -> Dict[str, Any]:
        return {"within": self.within, "tolerance": self.tolerance, "first_rel_diff": self.first_rel_diff,
                "max_rel_diff": self.max_rel_diff, "compared_steps": len(self.pairs), "steps": self.steps,
                "same_batch": self.same_batch,
                "pairs": [{"updates": p.updates, "step": p.step, "reference_step": p.reference_step,
                           "rel_diff": p.rel_diff} for p in self.pairs],
                "skipped": [{"step": s, "scale": c} for s, c in self.skipped],
                "reference_skipped": [{"step": s, "scale": c} for s, c in self.reference_skipped]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CurveMatch":
        """The verdict back from :meth:`to_dict` (a benchmark's JSON)."""
        return cls(tuple(Pair(p["updates"], p["step"], p["reference_step"], p["rel_diff"]) for p in d["pairs"]),
                   tuple((s["step"], s["scale"]) for s in d["skipped"]),
                   tuple((s["step"], s["scale"]) for s in d["reference_skipped"]),
                   d["tolerance"], d["same_batch"], d["steps"])

    def describe(self, name: str, reference: str = "fp32") -> str:
        """Lines for a log: the first step, the skipped steps, the curves and the verdict."""
        if not self.pairs:
            return f"loss {name} vs {reference}: no step to compare"
        lines = [f"loss {name} vs {reference}, first step (equal weights): rel. diff "
                 + (f"{self.first_rel_diff:.4f}" if self.first_rel_diff is not None else "-")]
        for who, skipped in ((name, self.skipped), (reference, self.reference_skipped)):
            if skipped:
                lines.append(f"  {who}: the loss scaler skipped step " + ", ".join(
                    f"{s} (overflow; scale -> {_scale(c)})" for s, c in skipped))
        how = ("at equal update counts" if self.same_batch else "while neither mode had skipped a step")
        updates = sorted({p.updates for p in self.pairs})
        verdict = (f"within {self.tolerance:.0%}" if self.within else
                   f"NOT within {self.tolerance:.0%}: the numerics differ")
        lines.append(f"  curves {how} ({len(self.pairs)} of {self.steps} steps, {updates[0]}-{updates[-1]} "
                     f"updates): max rel. diff {self.max_rel_diff:.4f} ({verdict})")
        return "\n".join(lines)


def _scale(value: Optional[float]) -> str:
    return "?" if value is None else f"{value:g}"


def _skipped(steps: Sequence[Step]) -> Tuple[Tuple[int, Optional[float]], ...]:
    return tuple((i, s.scale) for i, s in enumerate(steps) if not s.updated)


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def match_curves(mode: Sequence[Step], reference: Sequence[Step], tolerance: float = TOLERANCE,
                 same_batch: bool = True, max_updates: Optional[int] = None) -> CurveMatch:
    """Compare ``mode``'s losses with ``reference``'s (FP32's) by the module's rule.

    Parameters
    ----------
    mode, reference : sequence of Step
        Every step each mode took, from the first (at the shared initial weights).
    tolerance : float
        The largest relative gap that passes.
    same_batch : bool
        Every step trains on the same batch (compare at equal update counts); otherwise
        compare step by step until either mode skips.
    max_updates : int, optional
        Compare only steps taken after fewer than this many updates (a benchmark's horizon).

    Raises
    ------
    ValueError
        If ``tolerance`` is negative or ``max_updates`` is below 1.
    """
    if not tolerance >= 0:
        raise ValueError(f"match_curves: tolerance must be >= 0, got {tolerance!r}")
    if max_updates is not None and max_updates < 1:
        raise ValueError(f"match_curves: max_updates must be >= 1 or None, got {max_updates!r}")
    pairs: List[Pair] = []
    if same_batch:
        first_at: List[Dict[int, int]] = []
        for steps in (mode, reference):
            seen: Dict[int, int] = {}
            done = 0
            for i, s in enumerate(steps):
                seen.setdefault(done, i)
                done += bool(s.updated)
            first_at.append(seen)
        for n in sorted(set(first_at[0]) & set(first_at[1])):
            if max_updates is not None and n >= max_updates:
                break
            i, j = first_at[0][n], first_at[1][n]
            pairs.append(Pair(n, i, j, _rel(mode[i].loss, reference[j].loss)))
    else:
        for i, (a, b) in enumerate(zip(mode, reference)):
            if max_updates is not None and i >= max_updates:
                break
            pairs.append(Pair(i, i, i, _rel(a.loss, b.loss)))
            if not (a.updated and b.updated):
                break
    return CurveMatch(tuple(pairs), _skipped(mode), _skipped(reference), tolerance, same_batch,
                      min(len(mode), len(reference)))
