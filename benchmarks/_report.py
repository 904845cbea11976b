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
    """The CPU flags that decide what runs where (every figure is given with them), the core count
    and a ``DNNL_MAX_CPU_ISA`` cap, if any."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    return {"flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}),
            "cpus": os.cpu_count(), "DNNL_MAX_CPU_ISA": os.environ.get("DNNL_MAX_CPU_ISA")}
