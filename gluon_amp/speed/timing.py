"""Time one op in isolation, forward (and backward), in given input dtypes.

The probe and the tuner both measure through :func:`time_op`: the op is bound alone as a
one-node graph (a Symbol executor, as a hybridized block runs it), its inputs filled with
values in [0.5, 1.5) (positive, so no NaN from a variance or a log), one run warms up the
oneDNN primitives, and the median of the next runs is the figure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

from gluon_amp_core.dtypes import DTYPE_CODE
from gluon_amp_core.speed.probe import busy

from .. import mxnet_internals as mxi

_ONES = ("gamma", "var", "running_var")
_ZEROS = ("beta", "bias", "mean", "running_mean")
#: Runs after the warm-up; fewer when one run is slow, so a big layer costs < ~1 s to time.
RUNS = 5
_SLOW_RUN_S = 0.25


@dataclass(frozen=True)
class Timer:
    """How runs are timed: ``read`` a clock (seconds), ``pick`` one figure of a run's times.

    ``busy`` says why the machine was too busy for wall-clock time (:func:`timer_now`), else None."""

    read: Callable[[], float]
    pick: Callable[[Sequence[float]], float]
    busy: Optional[str] = None


#: A quiet machine: wall time, the fastest run (other work only adds time).
WALL = Timer(time.perf_counter, min)


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _thread_cpu_s(native_id: int) -> Optional[float]:
    """CPU seconds a thread of this process has used (Linux: the kernel's per-thread clock,
    named by the thread's id), or None once it has ended. By id rather than by pthread
    handle: a handle of a thread that has just ended is memory glibc may have reused."""
    try:
        return time.clock_gettime((~native_id << 3) | 6)  # MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)
    except (OSError, OverflowError):
        return None


class OwnCpuTime:
    """This process's CPU time less what its other Python threads used: MXNet's engine
    threads, which run the timed graph, count; a data loader's or a user's own threads
    running beside the timing do not. Threads that ``threading`` did not start (MXNet's,
    and foreign threads calling into Python, such as a custom op's) count.

    Readings differ by the right amount: each reading adds what every other thread used
    since the last one (all of a thread it sees first: it began since). A thread that ends
    between two readings is counted for its last moments. The readings never go back: the
    kernel's process clock and a running thread's own clock are brought up to date at
    different moments, and under load a reading came out 2 ms below the one before. Where
    the kernel gives no per-thread clock (not Linux), it is the process's CPU time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: Dict[Tuple[int, int], float] = {}
        self._others = 0.0
        self._last = 0.0

    def __call__(self) -> float:
        if not sys.platform.startswith("linux"):
            return time.process_time()
        me = threading.get_ident()
        with self._lock:
            total = time.process_time()
            seen: Dict[Tuple[int, int], float] = {}
            for t in threading.enumerate():
                if t.ident == me or t.native_id is None or isinstance(t, threading._DummyThread):
                    continue
                used = _thread_cpu_s(t.native_id)
                if used is None:
                    continue
                key = (t.native_id, id(t))
                before = self._seen.get(key, 0.0)
                self._others += used - before if used >= before else used  # an id reused
                seen[key] = used
            self._seen = seen
            self._last = max(self._last, total - self._others)
            return self._last


def others_cpu_s() -> Optional[float]:
    """CPU seconds the machine has spent on work other than this process (other processes,
    the kernel's, and time a hypervisor gave other machines: ``steal``) since boot, read
    from ``/proc/stat``; None where there is none (not Linux). Differences of two readings
    say what other work ran between them."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        # cpu user nice system idle iowait irq softirq steal ...
        ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
        return ticks / os.sysconf("SC_CLK_TCK") - time.process_time()
    except (OSError, ValueError, IndexError):
        return None


def timer_now() -> Timer:
    """How to time now. On a busy machine (:func:`~gluon_amp_core.speed.probe.busy`: the
    1-minute load above the CPUs) wall time measures the other work: the CPU time of this
    process (its MXNet threads included, its other Python threads not: :class:`OwnCpuTime`),
    median run. Under 4 spinning processes on this project's 2-core Xeon, the probe's
    wall-clock figures put a bottleneck block at 23-28 ms against 17 quiet, its CPU time at 12
    both ways, and the estimate stayed within the quiet run's spread (0.62-0.68x against
    0.67-0.75x)."""
    why = busy(os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0, cpus())
    return WALL if why is None else Timer(OwnCpuTime(), statistics.median, why)  # a clock per timer: no state shared


def _graph(op: str, attrs: Mapping[str, str], dtypes: Sequence[str]) -> mx.sym.Symbol:
    n = len(dtypes)
    nodes = [{"op": "null", "name": f"in{k}", "inputs": [], "attrs": {"__dtype__": str(DTYPE_CODE[t])}}
             for k, t in enumerate(dtypes)]
    nodes.append({"op": op, "name": "op", "attrs": {k: str(v) for k, v in attrs.items()},
                  "inputs": [[k, 0, 0] for k in range(n)]})
    graph = {"nodes": nodes, "arg_nodes": list(range(n)), "heads": [[n, 0, 0]],
             "attrs": {"mxnet_version": ["int", 10901]}}
    return mx.sym.load_json(json.dumps(graph))


def _uniform(rng: np.random.Generator, low: float, high: float, shape: Tuple[int, ...],
             dtype: Any = "float32") -> mx.nd.NDArray:
    """Values drawn from a generator of gluon_amp's own: timing must not advance MXNet's
    (``mx.random.seed`` has no way back), or a user's seeded weights would come out
    otherwise in the run that measures than in the runs that read the cache."""
    values = mx.nd.array(rng.uniform(low, high, size=shape), dtype="float32")
    return mx.nd.amp_cast(values, dtype=dtype)


class _TrialInit(mx.init.Initializer):
    """A trial graph's parameters: ones for scales and variances, zeros for shifts, biases
    and means, small uniform values (from gluon_amp's own generator) for the rest."""

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__()
        self._rng = rng

    def __call__(self, desc: Any, arr: mx.nd.NDArray) -> None:
        name = str(desc)
        if name.endswith(_ONES):
            arr[:] = 1
        elif name.endswith(_ZEROS):
            arr[:] = 0
        else:
            _uniform(self._rng, -0.07, 0.07, arr.shape, arr.dtype).copyto(arr)


def _fill(arr: mx.nd.NDArray, rng: np.random.Generator) -> None:
    _uniform(rng, 0.5, 1.5, arr.shape, arr.dtype).copyto(arr)


def time_op(op: str, attrs: Mapping[str, str], shapes: Sequence[Tuple[int, ...]],
            dtypes: Sequence[str], train: bool, runs: int = RUNS, timer: Optional[Timer] = None) -> Optional[float]:
    """Median milliseconds of ``op`` on inputs of these shapes and dtypes, on the CPU.

    ``train``: forward and backward (every float output's gradient all ones), as in a
    training step; else forward only. ``None`` when MXNet cannot run the op so (a missing
    kernel, a shape it rejects): the caller then keeps its plan. ``timer``: the clock
    (:func:`timer_now` now, where not given); its median counts.
    """
    clock = (timer or timer_now()).read
    sym = _graph(op, attrs, dtypes)
    names = sym.list_arguments()
    given = {f"in{k}": s for k, s in enumerate(shapes) if f"in{k}" in names}
    try:
        with autograd.pause(), mxi.unfused_binds(), mxi.legacy_arrays():  # numpy mode too
            # 1.9.1 binds shapes an op rejects into a segmentation fault: ask first (its
            # refusal is printed on stdout, then raised)
            with mxi.quiet_stdout():
                arg_shapes, _, _ = sym.infer_shape(**given)
            if arg_shapes is None or any(not s for s in arg_shapes):
                return None
            exe = sym.simple_bind(mx.cpu(), grad_req="write" if train else "null", **given)
            rng = np.random.default_rng(0)
            for arr in [*exe.arg_arrays, *exe.aux_arrays]:
                _fill(arr, rng)
            heads = None

            def once() -> float:
                nonlocal heads
                t0 = clock()
                exe.forward(is_train=train)
                if train:
                    if heads is None:
                        heads = [mx.nd.ones(o.shape, dtype=o.dtype) for o in exe.outputs]
                    exe.backward(heads)
                mx.nd.waitall()
                return clock() - t0

            first = once()
            n = runs if first < _SLOW_RUN_S else max(1, min(runs, 3))
            return statistics.median(once() for _ in range(n)) * 1e3
    except MXNetError:
        try:
            mx.nd.waitall()
        except MXNetError:
            pass
        return None


def time_graph(sym: mx.sym.Symbol, shapes: Mapping[str, Tuple[int, ...]], train: bool, fused: bool = False,
               runs: int = 2, give_up_ms: Optional[float] = None, timer: Optional[Timer] = None) -> Optional[float]:
    """Milliseconds of a whole graph run as users run it: a block hybridized with
    ``static_alloc`` and ``static_shape`` (MXNet's CachedOp), forward and backward under
    autograd with ``train``, else forward (through MXNet's oneDNN fusion with ``fused``).

    The fastest of ``runs`` runs after a warm-up: other load on the machine only adds
    time. On a busy machine, the median of their CPU time instead (:func:`timer_now`, the
    clock where ``timer`` is not given: compare figures of one timer only). A bound executor
    would be simpler, but its timings do not follow CachedOp's on large graphs (SSD-512:
    11.6 s bound vs 6.2 s cached for the same bfloat16 plan).
    Parameters are initialised as Gluon does by default (uniform weights; unit variances
    and scales, zero means, shifts and biases), data inputs (``shapes``) drawn in [-1, 1).
    gluon_amp's block hooks are bypassed. A warm-up slower than ``give_up_ms`` ends the
    timing: its figure is returned. ``None`` when MXNet cannot run the graph.
    """
    got = time_graphs([sym], shapes, train, fused, runs, give_up_ms, timer)
    return got[0] if got else None


def time_graphs(syms: Sequence[mx.sym.Symbol], shapes: Mapping[str, Tuple[int, ...]], train: bool,
                fused: bool = False, runs: int = 2, give_up_ms: Optional[float] = None,
                timer: Optional[Timer] = None) -> Optional[List[float]]:
    """:func:`time_graph` of several graphs of the same inputs, their runs taking turns (one
    run of each, then again), so a change of load on the machine falls on all of them alike."""
    timer = timer or timer_now()
    try:
        with mxi.hooks_paused(), autograd.pause(), mxi.legacy_arrays():  # numpy mode too
            return _take_turns([_prepare(sym, shapes, train, fused, timer.read) for sym in syms], runs,
                               give_up_ms, timer.pick)
    except (MXNetError, ValueError, RuntimeError):
        try:
            mx.nd.waitall()
        except MXNetError:
            pass
        return None
    finally:
        release_memory()


def release_memory() -> None:
    """Free the graphs no frame holds any more, now, and hand their pages back to the OS.

    A hybridized block holds its graph's whole memory (static_alloc) and Gluon blocks sit
    in reference cycles: without this they are freed when the collector next runs (trials
    of SSD-512 at batch 8 would pile up several GB each)."""
    gc.collect()
    _trim_heap()


def _take_turns(steps: Sequence[Callable[[], float]], runs: int, give_up_ms: Optional[float],
                pick: Callable[[Sequence[float]], float] = min) -> List[float]:
    """Each step's ``pick`` of its runs after its warm-up (its warm-up alone if that exceeded ``give_up_ms``)."""
    times: List[List[float]] = [[] for _ in steps]
    for _ in range(runs + 1):
        for k, step in enumerate(steps):
            if times[k] and give_up_ms is not None and len(times[k]) == 1 and times[k][0] > give_up_ms:
                continue
            times[k].append(step())
    return [(pick(t[1:]) if len(t) > 1 else t[0]) for t in times]


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc). Freed trial graphs otherwise stay
    in the process, and the next trial, then the real step, are allocated beside them. SSD-512
    tuning at batch 2 (its training step needs 2.0 GB) peaked at 3.5 GB without, 2.9 with."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None  # libc.malloc_trim once looked up; False where there is none


def _prepare(sym: mx.sym.Symbol, shapes: Mapping[str, Tuple[int, ...]], train: bool,
             fused: bool, clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """A block running ``sym``, ready, and a function timing one run of it (ms)."""
    from mxnet.gluon import SymbolBlock
    with warnings.catch_warnings(), mxi.quiet_stdout():
        warnings.simplefilter("ignore")
        block = SymbolBlock(sym, [mx.sym.var(n) for n in shapes])
        rng = np.random.default_rng(0)
        # Values at the deferred init, not copied in after a first call: an inference call may
        # leave a float32 weight in oneDNN's layout (1-D convolutions do), and MXNet refuses to
        # copy into it, so graphs with a Conv1D could not be timed at all.
        block.initialize(_TrialInit(rng))
        block.hybridize(static_alloc=True, static_shape=True, **({"backend": "MKLDNN"} if fused else {}))
        data = [_uniform(rng, -1, 1, s) for s in shapes.values()]
        block(*data)  # gives the deferred parameters their shapes and values
        mx.nd.waitall()

    add_n, total_of = mxi.original_function(mx.nd.add_n), mxi.original_function(mx.nd.sum)  # not AMP's

    def step() -> float:
        t0 = clock()
        if train:
            with autograd.record():
                outs = block(*data)
                outs = outs if isinstance(outs, (list, tuple)) else [outs]
                total = add_n(*[total_of(o.astype("float32")) for o in outs])
            total.backward()
        else:
            block(*data)
        mx.nd.waitall()
        return (clock() - t0) * 1e3

    return step
