"""MXNet's output silenced while gluon_amp asks it something, safely with threads.

MXNet prints on stdout the arguments its ``infer_shape``/``infer_type`` reject, logs a line per
bind on fd 2 (1.9.1 src/executor/graph_executor.cc), and reads ``MXNET_SUBGRAPH_BACKEND`` at
every bind. Swapping a process-wide value per call (``contextlib.redirect_stdout``, a ``dup2``,
an environment variable) races between threads: two overlapping swaps restore each other's
stand-in, and the process keeps it. A converted block first called from four threads at once
left ``sys.stdout`` a ``StringIO`` (every later ``print`` lost, exit code 0). Here each swap is
counted: the first thread in makes it, the last one out undoes it.

- stdout is never replaced for other threads: a stand-in forwards their writes to the stream
  it replaced, and drops only the writes of threads inside :func:`quiet_stdout`.
- fd 2 and the environment are the process's: other threads' C++ log lines are dropped while
  any thread is inside, and binds they make meanwhile partition nothing, as this thread's do.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator, Optional

__all__ = ["quiet_stdout", "quiet_stderr", "unfused_binds"]

_lock = threading.Lock()


class _Held:
    """A process-wide swap made while at least one thread holds it."""

    def __init__(self) -> None:
        self.count = 0
        self.saved: Any = None


class _QuietThreads:
    """``sys.stdout`` while some threads are quiet: their writes are dropped, others' pass."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.quiet: dict = {}  # thread ident -> depth

    def write(self, text: str) -> int:
        if threading.get_ident() in self.quiet:
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["stream"], name)


_stdout: Optional[_QuietThreads] = None
_stderr = _Held()
_unfused = _Held()


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """What this thread prints on ``sys.stdout`` inside is dropped; other threads print as before."""
    global _stdout
    me = threading.get_ident()
    with _lock:
        if _stdout is None or sys.stdout is not _stdout:
            _stdout = _QuietThreads(sys.stdout)
            sys.stdout = _stdout
        stand_in = _stdout
        stand_in.quiet[me] = stand_in.quiet.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            depth = stand_in.quiet.pop(me) - 1
            if depth:
                stand_in.quiet[me] = depth
            elif not stand_in.quiet and sys.stdout is stand_in:  # a stream set meanwhile stays
                sys.stdout = stand_in.stream
                _stdout = None


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """MXNet's C++ log lines (written to fd 2) are dropped while any thread is inside;
    Python exceptions still propagate."""
    with _lock:
        if not _stderr.count:
            saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
            _stderr.saved = saved
        _stderr.count += 1
    try:
        yield
    finally:
        with _lock:
            _stderr.count -= 1
            if not _stderr.count:
                os.dup2(_stderr.saved, 2)
                os.close(_stderr.saved)
                _stderr.saved = None


@contextlib.contextmanager
def unfused_binds() -> Iterator[None]:
    """Symbol.bind inside the block partitions nothing: every op's own output stays readable.
    (MXNet logs a line per such bind; it is dropped.)

    1.9.1 src/executor/graph_executor.cc: Symbol.bind partitions the graph with the subgraph
    backend named by MXNET_SUBGRAPH_BACKEND, read on every bind, MKLDNN by default on CPU
    ("Subgraph backend MKLDNN is activated"). Fused nodes hide their inner outputs."""
    with _lock:
        if not _unfused.count:
            _unfused.saved = os.environ.get("MXNET_SUBGRAPH_BACKEND")
            os.environ["MXNET_SUBGRAPH_BACKEND"] = "NONE"
        _unfused.count += 1
    try:
        with quiet_stderr():
            yield
    finally:
        with _lock:
            _unfused.count -= 1
            if not _unfused.count:
                if _unfused.saved is None:
                    os.environ.pop("MXNET_SUBGRAPH_BACKEND", None)
                else:
                    os.environ["MXNET_SUBGRAPH_BACKEND"] = _unfused.saved
