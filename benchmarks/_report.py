"""Shared output for the benchmarks: the JSON document, then the readable table."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Callable, Dict, Iterable, List, Optional


def write_json(report: Dict[str, Any], json_path: Optional[str]) -> None:
    """Write the full JSON ``report`` to ``json_path`` (if given) and say where."""
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(json.dumps(report, indent=2, default=str) + "\n")
        print(f"JSON written to {json_path}")


def emit(report: Dict[str, Any], table: str, json_path: Optional[str] = None) -> None:
    """Print the readable ``table``; write the full JSON ``report`` to ``json_path`` if given."""
    print(table)
    write_json(report, json_path)


def alternate(first: Callable[[], float], second: Callable[[], float], warmup: int, steps: int,
              counts: Callable[[], bool] = lambda: True, second_leads: bool = False) -> Dict[str, Any]:
    """Time two workloads in one process, their steps alternating (which one goes first
    alternates too), so that load on a shared machine hits both alike. ``first`` and ``second``
    each run one step and return its seconds; after ``warmup`` untimed pairs, ``steps`` pairs
    are kept unless ``counts()`` (asked after the pair) says the pair is not one to compare.
    ``first`` runs the process's first step unless ``second_leads``: which side does can
    decide more than the ratio does (model_families.py's ``--mode fp32`` shows it), so callers
    running several processes give each side the lead in turn.

    Returns ``ratios`` (each kept pair's ``second`` time over ``first``'s), ``ratio`` (their
    median, None if none was kept), ``first_seconds``/``second_seconds`` (medians) and
    ``left_out`` (pairs ``counts`` refused)."""
    ratios: List[float] = []
    times: List[List[float]] = [[], []]
    left_out = 0
    for i in range(warmup + steps):
        seconds = [0.0, 0.0]
        for side in ((0, 1) if (i % 2 == 0) != second_leads else (1, 0)):
            seconds[side] = (first, second)[side]()
        if i < warmup:
            continue
        if not counts():
            left_out += 1
            continue
        for side in (0, 1):
            times[side].append(seconds[side])
        ratios.append(seconds[1] / seconds[0])
    return {"ratios": ratios, "ratio": median_of(ratios), "first_seconds": median_of(times[0]),
            "second_seconds": median_of(times[1]), "left_out": left_out}


def median_of(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None (a process whose every pair the scaler
    skipped has none), or None where none is left."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def own_peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``; ``ru_maxrss`` would keep the parent's across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def host_info() -> Dict[str, Any]:
    """The CPU flags that decide what runs where (every figure is given with them), the core count,
    a ``DNNL_MAX_CPU_ISA`` cap, if any, and the OpenMP threads MXNet runs on (half the CPUs
    unless ``OMP_NUM_THREADS`` says: :mod:`gluon_amp_core.threads`)."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    from gluon_amp_core.threads import expected_threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}),
            "cpus": os.cpu_count(), "DNNL_MAX_CPU_ISA": os.environ.get("DNNL_MAX_CPU_ISA"),
            "mxnet_threads": expected_threads(os.environ, cpus), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def threads_text(host: Dict[str, Any]) -> str:
    """``'1 MXNet thread (OMP_NUM_THREADS=unset)'``: the OpenMP threads every figure ran on."""
    n, env = host.get("mxnet_threads"), host.get("OMP_NUM_THREADS")
    return f"{n} MXNet thread{'s' if n != 1 else ''} (OMP_NUM_THREADS={env or 'unset'})"
