"""The speed probe: float32 against the target dtype on a few blocks, once per machine.

Times :data:`gluon_amp_core.speed.probe.PROBE` (two ResNet blocks and a dense layer) forward and
backward in float32 and as AMP's plan runs them (well under 2 s on 2 cores), and keeps the
figures in this machine's timing cache, so later processes read them in milliseconds.
``GLUON_AMP_SPEED_PROBE=0`` turns it off: the CPU flags decide alone.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import platform
import statistics
import time
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import mxnet as mx

from gluon_amp_core.graph_pass import convert_graph
from gluon_amp_core.policy import Policy
from gluon_amp_core.speed.probe import (PROBE, OpTiming, SpeedVerdict, contended, timings_from_records,
                                        timings_to_records)
from gluon_amp_core.switches import switched_off
from gluon_amp_core.timing_cache import TimingCache, cache_dir

from .. import mxnet_internals as mxi
from ..type_inference import op_types
from .timing import OwnCpuTime, Timer, cpus, others_cpu_s, time_graphs, timer_now

_log = logging.getLogger(__name__)

#: Set to ``0`` to skip the probe (the CPU flags decide); anything else, or unset: probe.
ENV = "GLUON_AMP_SPEED_PROBE"


def disabled() -> bool:
    """True when the user turned the probe off with ``GLUON_AMP_SPEED_PROBE=0``."""
    return switched_off(os.environ, ENV)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(flags: FrozenSet[str], amx_granted: bool, isa: str, isa_cap: Optional[str]) -> Dict[str, Any]:
    """Everything that changes a measured time on this CPU, as JSON-able values: the CPU
    model and flags, whether AMX was granted, the MXNet version, the oneDNN ISA in effect
    (``isa``), the ``DNNL_MAX_CPU_ISA`` oneDNN read (``isa_cap``), the thread count, and
    gluon_amp's own code (:func:`code_digest`: what it runs for a graph, whose whole-graph
    verdicts the cache keeps)."""
    n = cpus()
    return {"cpu": _cpu_model(), "flags": sorted(flags), "amx_granted": amx_granted,
            "mxnet": mx.__version__, "onednn_isa": isa, "DNNL_MAX_CPU_ISA": isa_cap,
            "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpus": n,
                        "MXNET_OMP_MAX_THREADS": os.environ.get("MXNET_OMP_MAX_THREADS")},
            "gluon_amp": code_digest()}


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """A digest of gluon_amp's and its core's Python sources. A verdict measured on the graph
    one version ran (``float32: the whole graph in bfloat16 measured 0.50x``) says nothing
    about the graph another runs: GluonCV's CIFAR ResNet-20 kept a float32 verdict measured
    before a fix made its bfloat16 graph 1.8x faster than float32."""
    digest = hashlib.sha256()
    for package in ("gluon_amp", "gluon_amp_core"):
        root = os.path.dirname(importlib.import_module(package).__file__)
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def open_cache(key: Dict[str, Any]) -> TimingCache:
    """The timing cache of ``key`` in the user's cache folder (``$XDG_CACHE_HOME``)."""
    return TimingCache(cache_dir(os.environ), key)


def _entry(dtype: str) -> str:
    return f"probe/{dtype}/train"


class _Graph:
    """A graph in MXNet's JSON form, written node by node: the probe never calls MXNet's op
    functions, which :func:`gluon_amp.init` may have patched."""

    def __init__(self) -> None:
        self.nodes: List[dict] = []

    def add(self, op: str, name: str, inputs: Sequence[int] = (), **attrs: Any) -> int:
        self.nodes.append({"op": op, "name": name, "inputs": [[i, 0, 0] for i in inputs],
                           "attrs": {k: str(v) for k, v in attrs.items()}})
        return len(self.nodes) - 1

    def conv(self, x: int, channels: int, kernel: int, name: str) -> int:
        w = self.add("null", f"{name}_weight")
        pad = (kernel // 2, kernel // 2)
        return self.add("Convolution", name, [x, w], kernel=(kernel, kernel), pad=pad,
                        num_filter=channels, no_bias=True)

    def bn(self, x: int, name: str) -> int:
        params = [self.add("null", f"{name}_{p}") for p in ("gamma", "beta", "moving_mean", "moving_var")]
        return self.add("BatchNorm", name, [x, *params], fix_gamma=False)

    def relu(self, x: int, name: str) -> int:
        return self.add("Activation", name, [x], act_type="relu")

    def symbol(self, head: int) -> mx.sym.Symbol:
        graph = {"nodes": self.nodes, "arg_nodes": [i for i, n in enumerate(self.nodes) if n["op"] == "null"],
                 "heads": [[head, 0, 0]], "attrs": {"mxnet_version": ["int", 10901]}}
        return mx.sym.load_json(json.dumps(graph))


def probe_graph(kind: str, p: Mapping[str, int]) -> Tuple[mx.sym.Symbol, Dict[str, Tuple[int, ...]]]:
    """The FP32 graph of one :data:`~gluon_amp_core.speed.probe.PROBE` item and its input shape."""
    g = _Graph()
    x = g.add("null", "data")
    if kind == "dense":
        w, b = g.add("null", "fc_weight"), g.add("null", "fc_bias")
        return g.symbol(g.add("FullyConnected", "fc", [x, w, b], num_hidden=p["units"])), \
            {"data": (p["batch"], p["in_units"])}
    c = p["channels"]
    if kind == "basic_block":  # conv3x3-BN-relu-conv3x3-BN, + input, relu (ResNet v1)
        h = g.relu(g.bn(g.conv(x, c, 3, "conv1"), "bn1"), "relu1")
        h = g.bn(g.conv(h, c, 3, "conv2"), "bn2")
    elif kind == "bottleneck_block":  # 1x1 down, 3x3, 1x1 up, each with BN; + input, relu
        h = g.relu(g.bn(g.conv(x, c // 4, 1, "conv1"), "bn1"), "relu1")
        h = g.relu(g.bn(g.conv(h, c // 4, 3, "conv2"), "bn2"), "relu2")
        h = g.bn(g.conv(h, c, 1, "conv3"), "bn3")
    else:
        raise ValueError(f"unknown probe item kind {kind!r}")
    out = g.relu(g.add("elemwise_add", "add", [h, x]), "relu_out")
    return g.symbol(out), {"data": (p["batch"], c, p["size"], p["size"])}


def _measure(dtype: str, timer: Timer) -> Tuple[OpTiming, ...]:
    """Each probe item in float32 and as AMP's plan runs it in ``dtype`` (typed by the
    converter's pass, as a training graph: parameters stay float32, cast where read)."""
    with mxi.hooks_paused():  # MXNet's own graphs, whatever init installed (time_graphs pauses them too)
        return _measure_items(dtype, timer)


def _measure_items(dtype: str, timer: Timer) -> Tuple[OpTiming, ...]:
    policy = Policy.create(dtype, known_ops=mxi.op_infos().keys(), aliases=mxi.aliases())
    op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
    timings = []
    for label, kind, params in PROBE:
        fp32, shapes = probe_graph(kind, params)
        graph = json.loads(fp32.tojson())
        low = mx.sym.load_json(json.dumps(convert_graph(graph, policy, list(shapes), {}, op_types, op_inputs).graph))
        got = time_graphs([fp32, low], shapes, train=True, runs=RUNS, timer=timer)
        if got is None:
            raise RuntimeError(f"gluon_amp's speed probe could not run {label} in {dtype}; set "
                               f"{ENV}=0 to choose by CPU flags, and please report this")
        timings.append(OpTiming(label, kind, *got))
    return tuple(timings)


#: Runs of each probe item in each dtype after its warm-up, taking turns (the fastest counts).
RUNS = 5


_verdicts: Dict[str, SpeedVerdict] = {}


def verdict(dtype: str, cache: TimingCache) -> SpeedVerdict:
    """The probe's figures for ``dtype`` on this machine: from ``cache``, else measured now
    (and stored there). Once per process.

    Figures a busy machine measured (CPU time, :func:`~gluon_amp.speed.timing.timer_now`) are
    kept apart: processes started together under load (Horovod's workers) read the first
    one's and so choose alike, and the next process started on a quiet machine measures
    wall time again."""
    if dtype in _verdicts:
        return _verdicts[dtype]
    t0 = time.perf_counter()
    with cache.lock():  # processes started together: one measures, the others read its figures
        timer = timer_now()
        entries = cache.load().entries
        keys = [_entry(dtype)] if timer.busy is None else [_entry(dtype), _busy_entry(dtype)]
        timings, source, too_busy = None, "cached", None
        for key in keys:
            try:
                timings = timings_from_records(entries[key])
            except (KeyError, ValueError):
                continue
            too_busy = _busy_reason(entries, key)
            break
        if timings is None:
            (timings, too_busy), source = _measure_alone(dtype, timer), "measured"
        path: Optional[str] = cache.path
        if source == "measured":
            if too_busy:
                _log.info("gluon_amp: %s; the probe timed this process's CPU time instead of wall time, "
                          "and keeps it apart for processes started under load", too_busy)
            stored = {_entry(dtype): timings_to_records(timings)} if not too_busy else {
                _busy_entry(dtype): timings_to_records(timings), _busy_entry(dtype) + "/why": too_busy}
            try:
                cache.store(stored)
            except OSError:
                path = None  # a read-only cache folder: measured again next time
    _verdicts[dtype] = SpeedVerdict(dtype, timings, source, path, time.perf_counter() - t0, too_busy)
    return _verdicts[dtype]


def planted_verdict(dtype: str, timings: Tuple[OpTiming, ...]) -> SpeedVerdict:
    """The verdict of ``timings`` given, not measured (a simulated host whose cache folder
    cannot be written), kept for the process as :func:`verdict` keeps its own."""
    _verdicts[dtype] = SpeedVerdict(dtype, tuple(timings), "cached", None, 0.0, None)
    return _verdicts[dtype]


def _measure_alone(dtype: str, timer: Timer) -> Tuple[Tuple[OpTiming, ...], Optional[str]]:
    """The probe's figures, and why the machine was too busy for wall time (None: it was
    not). Where other work ran beside a wall-clock probe (:func:`contended`: the load
    average did not show it yet), the probe times CPU time again, as on a busy machine."""
    if timer.busy is not None:
        return _measure(dtype, timer), timer.busy
    before, t0 = others_cpu_s(), time.perf_counter()
    timings = _measure(dtype, timer)
    after, wall = others_cpu_s(), time.perf_counter() - t0
    threads = mxi.omp_threads() or cpus()
    why = (contended(after - before, wall, os.cpu_count() or threads, threads)
           if before is not None and after is not None else None)
    if why is None:
        return timings, None
    _log.info("gluon_amp: %s; timing CPU time instead", why)
    return _measure(dtype, Timer(OwnCpuTime(), statistics.median, why)), why


def _busy_entry(dtype: str) -> str:
    return _entry(dtype) + "/cpu-time"


def _busy_reason(entries: Mapping[str, Any], key: str) -> Optional[str]:
    """Why the figures under ``key`` were timed in CPU time (None: wall time, a quiet machine)."""
    if not key.endswith("/cpu-time"):
        return None
    why = entries.get(key + "/why")
    return why if isinstance(why, str) and why else "the machine was busy when the probe ran"


def forget() -> None:
    """Drop this process's figures (tests; a changed environment)."""
    _verdicts.clear()
