"""Measured speed: what the probe times, and the verdict its figures give. Pure.

CPU flags cannot tell a fast bfloat16 host from a slow one: an AMD Zen 4 and an Intel Xeon
without AMX both show ``avx512_bf16``, and SSD-512 trains 1.58x faster on the first and
0.67x on the second. So the MXNet layer times a few representative blocks in float32 and
in the target dtype (:data:`PROBE`), forward and backward, and this module turns those
figures into one estimate of a training step's speedup, and that into a verdict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

#: What the probe times: (label, kind, parameters). Whole blocks as networks run them, not
#: ops alone: MXNet's oneDNN ops hand blocked layouts to each other, and BatchNorm, relu or
#: add_n timed alone on plain tensors hit bfloat16 paths (reference kernels) that real
#: networks mostly avoid. Batch 2 keeps the first run under 2 s on 2 cores.
PROBE: Tuple[Tuple[str, str, Mapping[str, int]], ...] = (
    ("ResNet basic block, 64 channels at 56x56, batch 2", "basic_block",
     {"channels": 64, "size": 56, "batch": 2}),
    ("ResNet bottleneck block, 256 channels at 28x28, batch 2", "bottleneck_block",
     {"channels": 256, "size": 28, "batch": 2}),
    ("FullyConnected 2048->1000, batch 16", "dense", {"in_units": 2048, "units": 1000, "batch": 16}),
)

#: The estimated step speedup the low dtype must reach to be turned on by default. Below it,
#: the casts AMP adds elsewhere in a network and the probe's noise can eat the gain.
MIN_SPEEDUP = 1.05


#: Where the 1-minute load average exceeds this many runnable threads per CPU the process
#: may use, wall-clock time measures other work more than the process's own: timings there
#: read the process's CPU time instead, and the probe keeps those figures apart from a quiet
#: machine's. Oversubscribed, a Horovod worker here timed a bottleneck block at 273 ms of
#: wall time instead of 10.
BUSY_LOAD_PER_CPU = 1.0


def busy(load_1min: float, cpus: int) -> Optional[str]:
    """Why a machine is too busy to time on, or ``None``."""
    if cpus > 0 and load_1min > BUSY_LOAD_PER_CPU * cpus:
        return f"the machine was busy when the probe ran (1-minute load {load_1min:.1f} on {cpus} CPUs)"
    return None


#: Other work (other processes, and a hypervisor's steal) using more CPUs than the probe's
#: threads leave free, by more than this many on average, while the probe timed wall time
#: makes those figures the other work's. The load average lags: one busy process beside a
#: 2-thread probe on 2 CPUs leaves it near 1 (below :data:`BUSY_LOAD_PER_CPU`), and there the
#: probe put an AMX host's ResNet basic block at 40 ms in bfloat16 against 27 in float32
#: (13 against 21 quiet): bfloat16 off, and cached.
CONTENDED_CPUS = 0.25


def contended(others_cpu_s: float, wall_s: float, machine_cpus: int, threads: int) -> Optional[str]:
    """Why wall-clock figures timed over ``wall_s`` seconds by ``threads`` threads measured
    other work too, where that work used ``others_cpu_s`` CPU seconds of the machine's
    ``machine_cpus``; ``None`` if it fit in the CPUs the probe left free."""
    used = others_cpu_s / wall_s if wall_s > 0 else 0.0
    if used > max(0, machine_cpus - threads) + CONTENDED_CPUS:
        return (f"other work used {used:.1f} of the machine's {machine_cpus} CPUs while the probe timed "
                f"{threads} threads (wall-clock figures measure it)")
    return None


@dataclass(frozen=True)
class OpTiming:
    """One probe item's time (ms) in float32 and in the low dtype, forward+backward.

    ``kind`` names what was timed (a :data:`PROBE` kind, or an op for figures recorded
    op by op)."""

    label: str
    kind: str
    fp32_ms: float
    low_ms: float

    @property
    def ratio(self) -> float:
        """Time in the low dtype over time in float32 (below 1: the low dtype is faster)."""
        return self.low_ms / self.fp32_ms


def step_speedup(timings: Sequence[OpTiming]) -> float:
    """The estimated speedup of a training step: the items' total float32 time over their
    total time in the low dtype (the largest items weigh most, as in a network)."""
    fp32, low = sum(t.fp32_ms for t in timings), sum(t.low_ms for t in timings)
    if not timings or fp32 <= 0 or low <= 0:
        raise ValueError(f"cannot estimate a speedup from {len(timings)} timings: need positive times")
    return fp32 / low


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
    busy : str or None
        Why wall-clock time could not be trusted (:func:`busy`): the figures are then the
        process's CPU time, which the load leaves alone (kept apart from wall-clock ones).
    """

    dtype: str
    timings: Tuple[OpTiming, ...]
    source: str
    path: Optional[str] = None
    seconds: float = 0.0
    busy: Optional[str] = None

    @property
    def speedup(self) -> float:
        return step_speedup(self.timings)

    @property
    def faster(self) -> bool:
        """True when the low dtype is worth turning on by default here."""
        return self.speedup >= MIN_SPEEDUP

    def figures(self, limit: int = 3) -> str:
        """The largest items, e.g. ``ResNet basic block ...: 16.6 ms in bfloat16 vs 12.0 ms ...``."""
        ranked = sorted(self.timings, key=lambda t: -t.fp32_ms)
        return "; ".join(f"{t.label}: {t.low_ms:.1f} ms in {self.dtype} vs {t.fp32_ms:.1f} ms in float32"
                         for t in ranked[:limit])

    def describe(self) -> str:
        """One sentence: the estimate, the main figures, and where they come from."""
        where = f"cached in {self.path}" if self.source == "cached" else "measured now"
        if self.busy:
            where += f", in CPU time: {self.busy}"
        return (f"{self.dtype} measured {self.speedup:.2f}x the speed of float32 on this CPU "
                f"(estimated training step; {self.figures()}; {where})")

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "speedup": round(self.speedup, 3), "faster": self.faster,
                "min_speedup": MIN_SPEEDUP, "source": self.source, "path": self.path, "busy": self.busy,
                "seconds": round(self.seconds, 4),
                "items": [{"label": t.label, "kind": t.kind, "fp32_ms": round(t.fp32_ms, 3),
                         "low_ms": round(t.low_ms, 3), "ratio": round(t.ratio, 3)} for t in self.timings]}


def timings_from_records(records: Any) -> Tuple[OpTiming, ...]:
    """Timings read back from a cache file's list of dicts; ``ValueError`` if malformed."""
    if not isinstance(records, list) or not records:
        raise ValueError("probe records must be a non-empty list")
    out = []
    for r in records:
        try:
            t = OpTiming(str(r["label"]), str(r["kind"]), float(r["fp32_ms"]), float(r["low_ms"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed probe record {r!r}: {exc}") from exc
        if not (math.isfinite(t.fp32_ms) and math.isfinite(t.low_ms)) or t.fp32_ms <= 0 or t.low_ms <= 0:
            raise ValueError(f"probe record with impossible times: {r!r}")
        out.append(t)
    return tuple(out)


def timings_to_records(timings: Sequence[OpTiming]) -> list:
    return [{"label": t.label, "kind": t.kind, "fp32_ms": t.fp32_ms, "low_ms": t.low_ms} for t in timings]
