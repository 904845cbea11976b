"""Python's cyclic garbage collector paused while gluon_amp rewrites a graph.

A first call's rewrite parses and rebuilds the graph's JSON several times: tens of thousands
of dicts and lists a pass, all freed by reference counting when the pass ends. Each parse
also counts towards the collector's thresholds, so a rewrite in a large program (GluonTS's
DeepState: 5,500 nodes beside everything GluonTS and pandas hold) set off full collections
of the whole heap, about 0.1 s each: 0.6 s of DeepState's 1.8 s rewrite. Paused, those
objects are freed as usual and the collector runs again after; cycles made meanwhile wait
for its next run.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_depth = 0          # rewrites in progress, all threads
_paused_here = False  # whether gluon_amp disabled the collector (it was on)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off inside the block, if it was on when the outermost such block began,
    and on again when the last one ends. A program that turned it off keeps it off."""
    global _depth, _paused_here
    with _lock:
        if _depth == 0 and gc.isenabled():
            gc.disable()
            _paused_here = True
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _paused_here:
                _paused_here = False
                gc.enable()


def while_gc_paused(fn: F) -> F:
    """``fn`` run inside :func:`gc_paused`."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)
    return paused  # type: ignore[return-value]
