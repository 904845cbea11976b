"""Measured speed: what the probe times, and the verdict its figures give. Pure.

CPU flags cannot tell a fast bfloat16 host from a slow one: an AMD Zen 4 and an Intel Xeon
without AMX both show ``avx512_bf16``, and SSD-512 trains 1.58x faster on the first and
0.67x on the second. So the MXNet layer times a few representative ops in float32 and in
the target dtype (:data:`PROBE_OPS`), forward and backward, and this module turns those
figures into one estimate of a training step's speedup, and that into a verdict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

#: One op to time: (label, op, attrs, input shapes). Inputs are data then parameters, as
#: the op declares them; batch 2 keeps the first run under 2 s on 2 cores.
ProbeSpec = Tuple[str, str, Mapping[str, str], Tuple[Tuple[int, ...], ...]]

PROBE_OPS: Tuple[ProbeSpec, ...] = (
    ("Convolution 3x3 64->64 at 56x56", "Convolution",
     {"kernel": "(3, 3)", "pad": "(1, 1)", "num_filter": "64", "no_bias": "True"},
     ((2, 64, 56, 56), (64, 64, 3, 3))),
    ("Convolution 1x1 256->64 at 28x28", "Convolution",
     {"kernel": "(1, 1)", "num_filter": "64", "no_bias": "True"},
     ((2, 256, 28, 28), (64, 256, 1, 1))),
    ("Convolution 3x3 128->128 at 28x28", "Convolution",
     {"kernel": "(3, 3)", "pad": "(1, 1)", "num_filter": "128", "no_bias": "True"},
     ((2, 128, 28, 28), (128, 128, 3, 3))),
    ("FullyConnected 2048->1000, batch 16", "FullyConnected",
     {"num_hidden": "1000", "no_bias": "True"}, ((16, 2048), (1000, 2048))),
    ("BatchNorm 64 channels at 56x56", "BatchNorm", {"fix_gamma": "False"},
     ((2, 64, 56, 56), (64,), (64,), (64,), (64,))),
    ("Activation relu 64x56x56", "Activation", {"act_type": "relu"}, ((2, 64, 56, 56),)),
    ("add_n of 2, 64x56x56", "add_n", {"num_args": "2"}, ((2, 64, 56, 56), (2, 64, 56, 56))),
)

#: Share of each op in an FP32 training step of a convolutional network, from the SSD-512
#: ResNet-50 profile (``benchmarks/profile_step.py``): the weights of the estimate.
STEP_SHARE: Mapping[str, float] = {"Convolution": 0.85, "BatchNorm": 0.04, "Activation": 0.04,
                                   "add_n": 0.04, "FullyConnected": 0.03}

#: The estimated step speedup the low dtype must reach to be turned on by default. Below it,
#: the casts AMP adds and the probe's noise can eat the gain.
MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class OpTiming:
    """One probe op's median time (ms) in float32 and in the low dtype, forward+backward."""

    label: str
    op: str
    fp32_ms: float
    low_ms: float

    @property
    def ratio(self) -> float:
        """Time in the low dtype over time in float32 (below 1: the low dtype is faster)."""
        return self.low_ms / self.fp32_ms


def step_speedup(timings: Sequence[OpTiming]) -> float:
    """The estimated speedup of a training step: FP32's time over the low dtype's.

    Each op's ratio (summed over its probe shapes) is weighted by its share of an FP32 step
    (:data:`STEP_SHARE`, renormalised over the ops timed).
    """
    by_op: Dict[str, Tuple[float, float]] = {}
    for t in timings:
        fp32, low = by_op.get(t.op, (0.0, 0.0))
        by_op[t.op] = (fp32 + t.fp32_ms, low + t.low_ms)
    weights = {op: STEP_SHARE.get(op, 0.0) for op in by_op}
    total = sum(weights.values())
    if total <= 0 or any(f <= 0 for f, _ in by_op.values()):
        raise ValueError(f"cannot estimate a speedup from {list(by_op)}: need positive float32 "
                         f"times for some of {sorted(STEP_SHARE)}")
    ratio = sum(weights[op] * low / fp32 for op, (fp32, low) in by_op.items()) / total
    return 1.0 / ratio


@dataclass(frozen=True)
class SpeedVerdict:
    """What the probe measured for one low dtype on this machine.

    Attributes
    ----------
    dtype : str
    timings : tuple of OpTiming
    source : {'measured', 'cached'}
    path : str or None
        The cache file the figures were read from or written to.
    seconds : float
        What the probe cost in this process (reading the cache, or timing).
    """

    dtype: str
    timings: Tuple[OpTiming, ...]
    source: str
    path: Optional[str] = None
    seconds: float = 0.0

    @property
    def speedup(self) -> float:
        return step_speedup(self.timings)

    @property
    def faster(self) -> bool:
        """True when the low dtype is worth turning on by default here."""
        return self.speedup >= MIN_SPEEDUP

    def figures(self, limit: int = 3) -> str:
        """The ops with the largest weight, e.g. ``Convolution 3x3 ...: 16.6 vs 12.0 ms``."""
        ranked = sorted(self.timings, key=lambda t: (-STEP_SHARE.get(t.op, 0.0), -t.fp32_ms))
        return "; ".join(f"{t.label}: {t.low_ms:.1f} ms in {self.dtype} vs {t.fp32_ms:.1f} ms in float32"
                         for t in ranked[:limit])

    def describe(self) -> str:
        """One sentence: the estimate, the main figures, and where they come from."""
        where = f"cached in {self.path}" if self.source == "cached" else "measured now"
        return (f"{self.dtype} measured {self.speedup:.2f}x the speed of float32 on this CPU "
                f"(estimated training step; {self.figures()}; {where})")

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "speedup": round(self.speedup, 3), "faster": self.faster,
                "min_speedup": MIN_SPEEDUP, "source": self.source, "path": self.path,
                "seconds": round(self.seconds, 4),
                "ops": [{"label": t.label, "op": t.op, "fp32_ms": round(t.fp32_ms, 3),
                         "low_ms": round(t.low_ms, 3), "ratio": round(t.ratio, 3)} for t in self.timings]}


def timings_from_records(records: Any) -> Tuple[OpTiming, ...]:
    """Timings read back from a cache file's list of dicts; ``ValueError`` if malformed."""
    if not isinstance(records, list) or not records:
        raise ValueError("probe records must be a non-empty list")
    out = []
    for r in records:
        try:
            t = OpTiming(str(r["label"]), str(r["op"]), float(r["fp32_ms"]), float(r["low_ms"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed probe record {r!r}: {exc}") from exc
        if not (math.isfinite(t.fp32_ms) and math.isfinite(t.low_ms)) or t.fp32_ms <= 0 or t.low_ms <= 0:
            raise ValueError(f"probe record with impossible times: {r!r}")
        out.append(t)
    return tuple(out)


def timings_to_records(timings: Sequence[OpTiming]) -> list:
    return [{"label": t.label, "op": t.op, "fp32_ms": t.fp32_ms, "low_ms": t.low_ms} for t in timings]
