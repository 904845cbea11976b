"""Kernel speed facts: which ops' kernels in a low dtype are slower than float32 with the casts
around them, as data. Pure.

A kernel can be right and still not worth running: MXNet 1.9.1's element-wise loops outside
oneDNN convert every bfloat16 element to float32 and back, one at a time (``x + y`` on two
bfloat16 arrays of 800k elements: 11 ms, against 0.5 ms in float32). A plan that runs such an op
in the low dtype is slower than one that casts its inputs to float32, runs it there and casts its
output back. ``python -m gluon_amp.conformance --speed --write`` times both sides of every op a
plan may place in bfloat16, one process per group of ops, and records a :class:`Timing` per case;
:func:`slow_verdicts` turns those into ``slow`` verdicts, which the op table applies beside the
conformance verdicts (:func:`gluon_amp_core.table.apply_verdicts`): the op runs float32 where it
would run in the low dtype, and as before in any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, Iterable, Mapping, Tuple

from .verdicts import Verdict

#: An op's kernel in the low dtype is slow where it takes more than this many times as long as
#: float32 with the casts around it (its float inputs cast up, its outputs cast down). The loops
#: this catches measure 3-35x; oneDNN's kernels 0.2-1.3x. The margin keeps a kernel about as fast
#: as float32 (a timing's noise) in its class, where no cast is added for it.
SLOW_FACTOR = 1.5


@dataclass(frozen=True)
class Timing:
    """One op's case timed in one low dtype on one host.

    Attributes
    ----------
    key : str
        ``'op'``, or ``'op:attr=value'`` for one value of an attribute a conditional rule reads.
    dtype : str
    host : str
        Key of the host that timed it (``MEASURED_HOST`` of its data module).
    case : str
        The input shapes and attributes timed.
    fp32_ms : float
        Milliseconds per call in float32, its float inputs cast from the low dtype and its float
        outputs cast back to it.
    low_ms : float
        Milliseconds per call in the low dtype.
    """

    key: str
    dtype: str
    host: str
    case: str
    fp32_ms: float
    low_ms: float

    @property
    def ratio(self) -> float:
        """The low dtype's time over float32's with its casts."""
        return self.low_ms / self.fp32_ms if self.fp32_ms > 0 else float("inf")

    @property
    def slow(self) -> bool:
        """Whether the low dtype's kernel is slower than float32 with its casts by
        :data:`SLOW_FACTOR`."""
        return self.ratio > SLOW_FACTOR


def timing_from_row(row: Tuple) -> Timing:
    """A timing from the data file's tuple ``(key, dtype, host, case, fp32_ms, low_ms)``."""
    if len(row) != 6:
        raise ValueError(f"a timing row has 6 fields (key, dtype, host, case, fp32_ms, low_ms), got "
                         f"{len(row)}: {row!r}")
    key, dtype, host, case, fp32_ms, low_ms = row
    return Timing(key, dtype, host, case, float(fp32_ms), float(low_ms))


def slow_verdicts(timings: Iterable[Timing], dtype: str) -> Mapping[str, Verdict]:
    """Key -> ``slow`` for each op (or attribute value) that every host which timed it in
    ``dtype`` found slow in one of its cases.

    Every host, because a plan runs on any host: a kernel fast on one (oneDNN's on AMX) keeps
    its class there, where the tuner and the per-graph verdict measure what a graph gains.
    """
    by_host: Dict[str, Dict[str, bool]] = {}
    for t in timings:
        if t.dtype == dtype:
            seen = by_host.setdefault(t.key, {})
            seen[t.host] = seen.get(t.host, False) or t.slow
    return MappingProxyType({key: Verdict.SLOW for key, hosts in sorted(by_host.items()) if all(hosts.values())})
