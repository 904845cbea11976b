"""Finding inf/NaN in gradients: one read pass over them, one host-side decision per step."""
from __future__ import annotations

import os
import queue
import threading
from typing import Any, Dict, List, Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd
from mxnet.gluon import Parameter

from .. import mxnet_internals as mxi


def grads_by_context(params: Sequence[Parameter], stored: bool = True) -> Dict[mx.Context, List[mx.nd.NDArray]]:
    """Every gradient array of ``params``, grouped by the context it lives on. ``stored``: a
    sparse gradient as its stored values (``.data``: a copy, to read); else the sparse array
    itself (to change in place: ``*=`` and MXNet's clipping keep its storage)."""
    # A plain dict, not an OrderedDict: iterating an OrderedDict looks each key up again, and a
    # Ctrl-C that lands in mx.Context.__eq__ there is swallowed by CPython and comes out as
    # ``KeyError: cpu(0)``. A dict's iteration runs no Python code.
    groups: Dict[mx.Context, List[mx.nd.NDArray]] = {}
    for p in params:
        if not mxi.has_grad(p):
            continue
        for g in map(mxi.legacy, p.list_grad()):  # all_finite and amp_cast refuse numpy-mode arrays
            if stored and g.stype != "default":
                g = g.data  # row_sparse / csr: check the stored values
            groups.setdefault(g.ctx, []).append(g)
    return groups


def _part(chunk: List[np.ndarray]) -> bool:
    with np.errstate(all="ignore"):  # inf/NaN is what is looked for, not an error (per thread)
        return all(np.isfinite(v.sum()) or np.isfinite(v).all() for v in chunk)


def _finite_on_host(views: List[np.ndarray]) -> bool:
    """One read pass: a finite sum proves every value finite (inf and NaN propagate through
    a sum); a non-finite one is confirmed value by value, since finite values can overflow
    it. The values are cut into chunks (views, no copy) and balanced over one thread per
    core (NumPy's reductions release the GIL); the calling thread takes one share."""
    total = sum(v.size for v in views)
    threads = min(_THREADS, max(1, total // _MIN_PER_THREAD))
    if threads == 1:
        return _part(views)
    step = max(1 << 20, -(-total // (4 * threads)))  # a few chunks per thread: a big gradient is split
    chunks = sorted((v.reshape(-1)[i:i + step] for v in views for i in range(0, v.size, step)),
                    key=lambda c: -c.size)
    bins: List[List[np.ndarray]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for c in chunks:  # largest first into the lightest bin
        k = loads.index(min(loads))
        bins[k].append(c)
        loads[k] += c.size
    bins = [b for b in bins if b]
    # Interrupt-safe: no lock or condition of Python code is held across a wait. The jobs
    # and each check's answers go through SimpleQueues (C: a put or get is whole, and a
    # Ctrl-C in the wait raises with the queue intact); workers never see signals. An
    # interrupted check leaves its jobs to finish into a queue nobody reads.
    answers: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
    _start_workers(len(bins) - 1)
    for b in bins[1:]:
        _JOBS.put((b, answers))
    results = [_part(bins[0])]
    for _ in bins[1:]:
        results.append(answers.get())
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return all(results)


_THREADS = max(1, min(os.cpu_count() or 1, 8))
_MIN_PER_THREAD = 1 << 20  # values: below this, a thread's hand-off costs more than it saves
#: the workers' jobs: (chunks, the queue their answer goes to)
_JOBS: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_WORKERS: List[threading.Thread] = []


def _work() -> None:
    while True:
        chunks, answers = _JOBS.get()
        try:
            answers.put(_part(chunks))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            answers.put(exc)
        del chunks, answers


def _start_workers(n: int) -> None:
    """At least ``n`` worker threads (daemons; two callers racing may start a spare one)."""
    while len(_WORKERS) < n:
        t = threading.Thread(target=_work, name="gluon_amp_finite", daemon=True)
        t.start()
        _WORKERS.append(t)


def all_finite(params: Sequence[Parameter]) -> bool:
    """True when every gradient on every context is finite.

    float32/float16 gradients on a CPU are read in place (no copy) by NumPy, one pass split
    across the cores; the others (bfloat16, as float32; GPUs) are chained into one
    ``all_finite`` flag per context. One host-side decision either way.
    """
    return arrays_finite(grads_by_context(params))


def arrays_finite(groups: Dict[mx.Context, List[mx.nd.NDArray]]) -> bool:
    """True when every array of ``groups`` (arrays by context, as :func:`grads_by_context`
    gives them) is finite: the one read pass of :func:`all_finite`, for arrays that are not
    a Gluon parameter's (a Module's gradients)."""
    flags, views = [], []
    with autograd.pause():
        for ctx, grads in groups.items():
            chained = []
            for g in grads:
                view = mxi.host_view(g)
                if view is None:
                    chained.append(g)
                else:
                    views.append(view)
            if chained:
                flag = mx.nd.ones((1,), ctx=ctx)
                for g in chained:
                    if mxi.FLOAT_NAMES.get(g.dtype) == "bfloat16":  # all_finite has no bfloat16 kernel
                        g = mx.nd.amp_cast(g, dtype="float32")
                    mx.nd.all_finite(g, init_output=False, out=flag)
                flags.append(flag if ctx == mx.cpu() else flag.as_in_context(mx.cpu()))
        if views and not _finite_on_host(views):
            return False
        if not flags:
            return True
        total = flags[0] if len(flags) == 1 else mx.nd.add_n(*flags)
        return float(total.asscalar()) == float(len(flags))


def _finite(g: mx.nd.NDArray) -> bool:
    g = mxi.legacy(g if g.stype == "default" else g.data)
    view = mxi.host_view(g)
    if view is not None:
        return bool(np.isfinite(view).all())
    if mxi.FLOAT_NAMES.get(g.dtype) == "bfloat16":
        g = mx.nd.amp_cast(g, dtype="float32")
    return mx.nd.all_finite(g).asscalar() == 1


def non_finite_names(params: Sequence[Parameter]) -> List[str]:
    """Names of parameters with a non-finite gradient on any context (slow; diagnostics)."""
    with autograd.pause():
        return [p.name for p in params if mxi.has_grad(p) and not all(_finite(g) for g in p.list_grad())]
