"""The speed probe: float32 against the target dtype on a few ops, once per machine.

Times :data:`gluon_amp_core.speed.PROBE_OPS` forward and backward in both dtypes (well
under 2 s on 2 cores), and keeps the figures in this machine's timing cache,
so later processes read them in milliseconds. ``GLUON_AMP_SPEED_PROBE=0`` turns it off:
the CPU flags decide alone.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Any, Dict, FrozenSet, Optional

import mxnet as mx

from gluon_amp_core.speed import (PROBE_OPS, OpTiming, SpeedVerdict, timings_from_records,
                                  timings_to_records)
from gluon_amp_core.table import default_table
from gluon_amp_core.timing_cache import TimingCache, cache_dir

from .timing import time_op

#: Set to ``0`` to skip the probe (the CPU flags decide); anything else, or unset: probe.
ENV = "GLUON_AMP_SPEED_PROBE"


def disabled() -> bool:
    """True when the user turned the probe off with ``GLUON_AMP_SPEED_PROBE=0``."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(flags: FrozenSet[str], amx_granted: bool, isa: str) -> Dict[str, Any]:
    """Everything that changes a measured time on this CPU, as JSON-able values: the CPU
    model and flags, whether AMX was granted, the MXNet version, the oneDNN ISA in effect
    (``isa``), ``DNNL_MAX_CPU_ISA`` and the thread count."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": _cpu_model(), "flags": sorted(flags), "amx_granted": amx_granted,
            "mxnet": mx.__version__, "onednn_isa": isa, "DNNL_MAX_CPU_ISA": os.environ.get("DNNL_MAX_CPU_ISA"),
            "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpus": cpus}}


def open_cache(key: Dict[str, Any]) -> TimingCache:
    """The timing cache of ``key`` in the user's cache folder (``$XDG_CACHE_HOME``)."""
    return TimingCache(cache_dir(os.environ), key)


def _entry(dtype: str) -> str:
    return f"probe/{dtype}/train"


def _measure(dtype: str) -> tuple:
    keep = default_table(dtype).keep_fp32_inputs
    timings = []
    for label, op, attrs, shapes in PROBE_OPS:
        names = _input_names(op)
        low = ["float32" if k < len(names) and names[k] in keep.get(op, ()) else dtype
               for k in range(len(shapes))]
        fp32 = time_op(op, attrs, shapes, ["float32"] * len(shapes), train=True)
        lp = time_op(op, attrs, shapes, low, train=True)
        if fp32 is None or lp is None:
            raise RuntimeError(f"gluon_amp's speed probe could not run {label} in {dtype}; set "
                               f"{ENV}=0 to choose by CPU flags, and please report this")
        timings.append(OpTiming(label, op, fp32, lp))
    return tuple(timings)


def _input_names(op: str) -> tuple:
    from .. import mxnet_internals as mxi
    info = mxi.op_infos().get(op)
    return tuple(info.inputs) if info is not None else ()


_verdicts: Dict[str, SpeedVerdict] = {}


def verdict(dtype: str, cache: TimingCache) -> SpeedVerdict:
    """The probe's figures for ``dtype`` on this machine: from ``cache``, else measured now
    (and stored there). Once per process."""
    if dtype in _verdicts:
        return _verdicts[dtype]
    t0 = time.perf_counter()
    loaded = cache.load()
    try:
        timings, source = timings_from_records(loaded.entries[_entry(dtype)]), "cached"
    except (KeyError, ValueError):
        timings, source = _measure(dtype), "measured"
    path: Optional[str] = cache.path
    if source == "measured":
        try:
            cache.store({_entry(dtype): timings_to_records(timings)})
        except OSError:
            path = None  # a read-only cache folder: measured again next time
    _verdicts[dtype] = SpeedVerdict(dtype, timings, source, path, time.perf_counter() - t0)
    return _verdicts[dtype]


def forget() -> None:
    """Drop this process's figures (tests; a changed environment)."""
    _verdicts.clear()
