"""Start 2-worker jobs on 127.0.0.1 with free ports, a deadline, and guaranteed cleanup.

Every process of a job (and anything it spawns) carries ``GLUON_AMP_TEST_JOB=<tag>`` in its
environment and runs in its own session; leaving the ``Job`` block kills each session, each
process's descendants and any stray process carrying the tag, whether the job passed,
failed or timed out.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")
_TAG_VAR = "GLUON_AMP_TEST_JOB"
# MXNet's segfault handler prints "Segmentation fault: 11" and a stack, then exits with 255
_FIRST_ERROR = re.compile(r"Segmentation fault|Traceback \(most recent call last\)|Fatal Python error|"
                          r"MXNetError|terminate called")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobFailed(AssertionError):
    """A job timed out or a process exited non-zero; carries the tails of every log."""


class Job:
    """Processes started together and always reaped together."""

    def __init__(self, log_dir: str, timeout: float) -> None:
        self.log_dir, self.deadline = log_dir, time.monotonic() + timeout
        self.tag = uuid.uuid4().hex
        self.procs: Dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: Sequence[str], env: Dict[str, str]) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen(
            list(argv), env={**env, _TAG_VAR: self.tag}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait(self) -> None:
        """Wait for every process; raise JobFailed at the first non-zero exit or at the deadline."""
        while True:
            codes = {name: proc.poll() for name, proc in self.procs.items()}
            failed = {n: c for n, c in codes.items() if c not in (None, 0)}
            if failed:
                raise JobFailed(f"exit codes {failed}\n{self.logs()}")
            if all(c == 0 for c in codes.values()):
                return
            if time.monotonic() > self.deadline:
                running = [n for n, c in codes.items() if c is None]
                raise JobFailed(f"{running} still running at the deadline\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 3000) -> str:
        """Each log's tail, and its first error where the tail no longer holds it: in a
        Horovod job the rank that failed first is buried under the others' shutdown errors."""
        parts = []
        for name in self.procs:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                text = f.read().decode("utf-8", "replace")
            first = _FIRST_ERROR.search(text)
            if first is not None and first.start() < len(text) - tail:
                start = text.rfind("\n", 0, max(0, first.start() - 200)) + 1
                parts.append(f"----- {name}: its first error -----\n{text[start:first.start() + tail]}")
            parts.append(f"----- {name} -----\n{text[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        victims: List[psutil.Process] = []
        for proc in self.procs.values():
            try:
                parent = psutil.Process(proc.pid)
                victims += parent.children(recursive=True) + [parent]
            except psutil.NoSuchProcess:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in psutil.process_iter():
            try:
                if p.environ().get(_TAG_VAR) == self.tag:
                    victims.append(p)
            except (psutil.Error, OSError):
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=5)
        for proc in self.procs.values():
            proc.wait(timeout=5)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _base_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_dist_sync(args: Sequence[str], log_dir: str, workers: int = 2, timeout: float = 90,
                  worker: str = WORKER, env_extra: Optional[Dict[str, str]] = None) -> None:
    """Scheduler, one server and ``workers`` workers of ``worker args`` (``dist_worker.py``)
    on 127.0.0.1, every process with ``env_extra`` in its environment."""
    env = {**_base_env(), **(env_extra or {})}
    env.update(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
               DMLC_NODE_HOST="127.0.0.1", DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(workers))
    with Job(log_dir, timeout) as job:
        job.start("scheduler", [sys.executable, "-c", "import gluon_amp, mxnet"], {**env, "DMLC_ROLE": "scheduler"})
        job.start("server", [sys.executable, "-c", "import gluon_amp, mxnet"], {**env, "DMLC_ROLE": "server"})
        for i in range(workers):
            job.start(f"worker{i}", [sys.executable, worker, *args], {**env, "DMLC_ROLE": "worker"})
        job.wait()


def horovodrun() -> str:
    return os.path.join(os.path.dirname(sys.executable), "horovodrun")


def run_horovod(args: Sequence[str], log_dir: str, np_: int = 2, timeout: float = 120,
                worker: str = WORKER) -> None:
    """``horovodrun -np 2 -H localhost:2 --gloo python <worker> args`` (``dist_worker.py``)."""
    argv = [horovodrun(), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
            sys.executable, worker, *args]
    with Job(log_dir, timeout) as job:
        job.start("horovodrun", argv, _base_env())
        job.wait()
