"""Shared output for the benchmarks: the JSON document, then the readable table."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional


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
