"""How many OpenMP threads MXNet 1.9 runs its CPU operators on, and when that leaves cores idle.

MXNet's operators and oneDNN's kernels share libgomp's thread count. When neither
``OMP_NUM_THREADS`` nor ``MXNET_OMP_MAX_THREADS`` is set, MXNet 1.9 on x86 sets it to half the
CPUs the process may run on, taking every core to have two hardware threads. On a CPU with one
thread per core (many cloud VMs) half the cores then stay idle, in float32 and AMP alike: on a
2-CPU Xeon VM a ResNet-18 training step took 274 ms against 120 ms with ``OMP_NUM_THREADS=2``.
This module predicts the count from the environment and words the note; ``gluon_amp`` reads
the count libgomp holds (the prediction where it cannot) into ``runtime_info()["threads"]``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

#: Environment variables that set the count, in the order MXNet 1.9 reads them.
MXNET_MAX = "MXNET_OMP_MAX_THREADS"
OMP = "OMP_NUM_THREADS"


def _int_of(text: Optional[str]) -> Optional[int]:
    """The first entry of an OpenMP thread list (``'4'``, ``'4,2'``) as a positive int, or None."""
    if text is None:
        return None
    try:
        n = int(text.split(",")[0].strip())
    except ValueError:
        return None
    return n if n > 0 else None


def expected_threads(env: Mapping[str, str], cpus: int, x86: bool = True) -> int:
    """libgomp's thread count once MXNet 1.9 has started, from the environment and the CPUs
    this process may run on (its affinity mask)."""
    cpus = max(1, cpus)
    if OMP in env:
        return _int_of(env[OMP]) or cpus  # libgomp ignores a value it cannot read
    if MXNET_MAX in env or not x86:
        return cpus  # MXNet leaves libgomp's default alone
    return max(1, cpus // 2)


def set_by(env: Mapping[str, str]) -> str:
    """Which setting decided the count."""
    if OMP in env:
        return OMP
    if MXNET_MAX in env:
        return f"libgomp's default ({MXNET_MAX} set, {OMP} not)"
    return f"MXNet's default: half the CPUs ({OMP} not set)"


@dataclass(frozen=True)
class ThreadUse:
    """The OpenMP threads MXNet's CPU operators run on here.

    Attributes
    ----------
    threads : int
        libgomp's count (measured where it could be read, else :func:`expected_threads`).
    cpus : int
        CPUs this process may run on.
    threads_per_core : int or None
        Hardware threads per core, where the OS says.
    set_by : str
        What decided ``threads``.
    note : str or None
        Where cores stay idle: why, and what to set; else None.
    """

    threads: int
    cpus: int
    threads_per_core: Optional[int]
    set_by: str
    note: Optional[str]

    def to_dict(self) -> Dict[str, Any]:
        """The fields, for ``runtime_info()`` and JSON."""
        return asdict(self)


def thread_use(env: Mapping[str, str], cpus: int, threads_per_core: Optional[int],
               measured: Optional[int] = None, x86: bool = True) -> ThreadUse:
    """What MXNet runs on and, where it leaves whole cores idle without being asked to, a note
    naming the setting that uses them."""
    threads = measured if measured is not None and measured > 0 else expected_threads(env, cpus, x86)
    note = None
    if OMP not in env and MXNET_MAX not in env and threads < cpus and threads_per_core == 1:
        note = (f"MXNet runs {threads} OpenMP thread{'s' if threads > 1 else ''} on {cpus} CPUs: with "
                f"{OMP} unset it takes half of them, assuming 2 hardware threads per core, and this "
                f"CPU has 1. Start Python with {OMP}={cpus} to use every core (float32 and AMP alike).")
    return ThreadUse(threads, max(1, cpus), threads_per_core, set_by(env), note)
