"""MXNet's output silenced by many threads at once (gluon_amp.mxnet_internals.quiet): a converted
block first called from four threads left ``sys.stdout`` a ``StringIO`` (every later ``print``
lost), and two overlapping ``dup2``s or environment swaps leave their stand-in for good."""
import io
import os
import random
import sys
import threading
import time

import pytest

from gluon_amp.mxnet_internals import quiet_stderr, quiet_stdout, unfused_binds

THREADS = 6


def _overlapping(enter, rounds=40):
    """Threads enter and leave ``enter()`` at shuffled, overlapping times; returns what each
    thread saw inside (``inside()`` is called there)."""
    start = threading.Barrier(THREADS)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        start.wait()
        try:
            for _ in range(rounds):
                with enter():
                    time.sleep(rng.random() / 2000)
                time.sleep(rng.random() / 2000)
        except Exception as error:  # noqa: BLE001  reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_stdout_is_the_process_s_after_overlapping_quiet_regions(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    _overlapping(quiet_stdout)
    assert sys.stdout is stream


def test_only_the_quiet_thread_s_prints_are_dropped(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    inside, printed = threading.Event(), threading.Event()

    def quiet_one():
        with quiet_stdout():
            print("dropped")
            inside.set()
            printed.wait(10)

    t = threading.Thread(target=quiet_one)
    t.start()
    inside.wait(10)
    print("kept")  # another thread, while the first is inside
    printed.set()
    t.join()
    assert stream.getvalue() == "kept\n"


def test_fd_2_is_the_process_s_after_overlapping_quiet_regions():
    before = os.readlink("/proc/self/fd/2") if os.path.exists("/proc/self/fd/2") else os.fstat(2).st_ino
    _overlapping(quiet_stderr)
    after = os.readlink("/proc/self/fd/2") if os.path.exists("/proc/self/fd/2") else os.fstat(2).st_ino
    assert after == before


@pytest.mark.parametrize("backend", [None, "MKLDNN"])
def test_the_subgraph_backend_is_the_user_s_after_overlapping_unfused_binds(monkeypatch, backend):
    if backend is None:
        monkeypatch.delenv("MXNET_SUBGRAPH_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MXNET_SUBGRAPH_BACKEND", backend)
    _overlapping(unfused_binds, rounds=20)
    assert os.environ.get("MXNET_SUBGRAPH_BACKEND") == backend
