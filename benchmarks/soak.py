"""Soak: 4 threads train and serve under gluon_amp for N minutes while a real SIGINT hits the
process every few seconds (issue 42, acceptance).

``python benchmarks/soak.py [--minutes 10] [--sigint-every 3] [--json out.json]``

The threads, each with its own regions (emulated: any CPU):

- ``train-f16`` (the main thread): forward in ``autocast('float16', emulate=True)``, then
  ``scale_loss`` + ``trainer.step``; its loss must be scaled (> 1).
- ``train-bf16``: forward in ``autocast('bfloat16', emulate=True)`` (the same as ``init``'s
  policy: the fast path), a float32 head inside a nested ``autocast(enabled=False)``; scale 1.
- ``serve-f32``: a request per ``autocast(enabled=False)`` (an inference server).
- ``serve-f16``: a request per ``autocast('float16', emulate=True)`` with a nested
  ``autocast()`` (enabled, no target: the outer region's policy).

``init('bfloat16', emulate=True)`` is on for the process. A sender thread delivers SIGINT to the
process every ``--sigint-every`` s (uniform 0.5x-1.5x); Python raises ``KeyboardInterrupt`` in the
main thread wherever it is, gluon_amp's calls included. Recovery, as a notebook or a training
loop that catches Ctrl-C does it: the main thread drops its batch and goes on; the other threads
see the interrupt's generation change and drop their own in-flight batch at their next check.

Every forward's values tell the dtype it ran in (fixed inputs, references from the weights of the
moment); a forward in another dtype than its region's is a wrong-dtype op. A thread that makes no
progress for ``--hang-after`` s is a hang. Printed (and with ``--json`` written): steps, requests,
interrupts, dropped batches, hangs (must be 0), wrong-dtype ops (must be 0), wrong-scale steps,
failures by type, and RSS growth per 1,000 steps after the first minute's warm-up (or a tenth
of the run when shorter).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import gluon_amp  # noqa: E402

IN, OUT = 8, 4
_RNG = np.random.RandomState(0)
X = _RNG.uniform(0.5, 1.5, (2, IN)).astype(np.float32)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


_ROUND = {"float32": lambda a: a.astype(np.float32), "bfloat16": _round_bf16,
          "float16": lambda a: a.astype(np.float16).astype(np.float32)}


def dtype_of(out: np.ndarray, w: np.ndarray, b: np.ndarray) -> str:
    """The dtype whose (emulated) FullyConnected of X with ``w``, ``b`` gives ``out``: the nearest."""
    dist = {}
    for d, r in _ROUND.items():
        dist[d] = float(np.abs(out - r(r(X) @ r(w).T + r(b))).max())
    return min(dist, key=dist.get)


def rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Soak:
    def __init__(self, minutes: float, hang_after: float) -> None:
        self.deadline = time.monotonic() + minutes * 60
        self.hang_after = hang_after
        self.counts: Dict[str, int] = collections.Counter()
        self.failures: Dict[str, int] = collections.Counter()
        self.first_failures: List[str] = []
        self.lock = threading.Lock()
        self.generation = 0  # bumped by the main thread at each interrupt
        self.beats: Dict[str, float] = {}
        self.hung: set = set()
        self.stop = threading.Event()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def failed(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.failures[f"{where}: {type(exc).__name__}"] += 1
            if len(self.first_failures) < 5:
                self.first_failures.append(f"{where}: {''.join(traceback.format_exception_only(exc)).strip()[:300]}")

    def beat(self, name: str) -> None:
        self.beats[name] = time.monotonic()

    def check(self, got: str, want: str) -> None:
        self.count("ops")
        if got != want:
            self.count("wrong_dtype_ops")


def _model() -> tuple:
    net = gluon.nn.Dense(OUT, in_units=IN)
    net.initialize(mx.init.Uniform(1.0))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-4}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)
    return net, trainer


def _forward(soak: Soak, net: gluon.nn.Dense, want: str, record: bool = False) -> Any:
    w, b = net.weight.data().asnumpy(), net.bias.data().asnumpy()
    if record:
        with autograd.record():
            out = net(mx.nd.array(X))
            loss = out.sum()
    else:
        out, loss = net(mx.nd.array(X)), None
    soak.check(dtype_of(out.astype("float32").asnumpy(), w, b), want)
    return loss


def _step(soak: Soak, trainer: gluon.Trainer, loss: Any, scaled_expected: bool) -> None:
    with autograd.record(), gluon_amp.scale_loss(loss, trainer) as scaled:
        ratio = float(scaled.asscalar()) / float(loss.asscalar())
        autograd.backward(scaled)
    trainer.step(1)
    soak.count("steps")
    if (abs(ratio - 1) > 1e-6) != scaled_expected:
        soak.count("wrong_scale_steps")
        soak.count(f"wrong_scale:{threading.current_thread().name}:{'unscaled' if scaled_expected else 'scaled'}")


def train_f16(soak: Soak, net, trainer) -> None:
    with gluon_amp.autocast("float16", emulate=True, tune=False):
        loss = _forward(soak, net, "float16", record=True)
    _step(soak, trainer, loss, scaled_expected=True)


def train_bf16(soak: Soak, net, trainer) -> None:
    with gluon_amp.autocast("bfloat16", emulate=True, tune=False):
        loss = _forward(soak, net, "bfloat16", record=True)
        with gluon_amp.autocast(enabled=False):
            _forward(soak, net, "float32")
    _step(soak, trainer, loss, scaled_expected=False)


def serve_f32(soak: Soak, net, _trainer) -> None:
    with gluon_amp.autocast(enabled=False):
        _forward(soak, net, "float32")
    soak.count("requests")


def serve_f16(soak: Soak, net, _trainer) -> None:
    with gluon_amp.autocast("float16", emulate=True, tune=False):
        with gluon_amp.autocast():
            _forward(soak, net, "float16")
    soak.count("requests")


def worker(soak: Soak, name: str, body: Callable[..., None]) -> None:
    net, trainer = _model()
    seen = soak.generation
    while not soak.stop.is_set() and time.monotonic() < soak.deadline:
        soak.beat(name)
        if soak.generation != seen:  # the main thread was interrupted: drop this batch, go on
            seen = soak.generation
            soak.count("dropped_batches")
            continue
        try:
            body(soak, net, trainer)
        except Exception as exc:  # noqa: BLE001  counted and reported; the soak goes on
            soak.failed(name, exc)
    soak.beat(name)


def main_loop(soak: Soak, body: Callable[..., None]) -> None:
    """The main thread's training loop: Ctrl-C lands here, anywhere; each is counted, the batch
    dropped, and the loop goes on (the try is re-entered even when one lands in the handler)."""
    threading.current_thread().name = "train-f16"
    net, trainer = _model()
    while time.monotonic() < soak.deadline:
        try:
            while time.monotonic() < soak.deadline:
                soak.beat("train-f16")
                try:
                    body(soak, net, trainer)
                except KeyboardInterrupt:
                    soak.generation += 1
                    soak.count("interrupts")
                    _recording_off()
                except Exception as exc:  # noqa: BLE001
                    soak.failed("train-f16", exc)
        except KeyboardInterrupt:  # landed in the handler or the loop's own lines
            soak.generation += 1
            soak.count("interrupts")
            _recording_off()


def _recording_off() -> None:
    """What a loop that catches Ctrl-C must do (plain MXNet too): one that lands in an
    ``autograd.record()`` block's exit leaves recording on, and every later update fails."""
    autograd.set_recording(False)
    autograd.set_training(False)


def sender(soak: Soak, every: float) -> None:
    rnd = random.Random(0)
    while not soak.stop.wait(every * rnd.uniform(0.5, 1.5)):
        os.kill(os.getpid(), signal.SIGINT)
        soak.count("sigints_sent")


def watchdog(soak: Soak) -> None:
    while not soak.stop.wait(1.0):
        now = time.monotonic()
        for name, t in list(soak.beats.items()):
            if now - t > soak.hang_after and name not in soak.hung and now < soak.deadline:
                soak.hung.add(name)
                print(f"soak: {name} made no progress for {soak.hang_after:.0f} s", file=sys.stderr, flush=True)


def run(minutes: float, sigint_every: float, hang_after: float) -> Dict[str, Any]:
    gluon_amp.init("bfloat16", emulate=True, tune=False)
    # builds (once per machine: up to a minute) or loads the emulation kernel before the clock starts
    _forward(Soak(minutes, hang_after), _model()[0], "bfloat16")
    soak = Soak(minutes, hang_after)
    rss0, t0 = rss_mb(), time.monotonic()
    warm = min(60.0, minutes * 6)  # the first minute (a tenth of a short run) settles caches
    base: Optional[tuple] = None
    threads = [threading.Thread(target=worker, args=(soak, name, body), name=name, daemon=True)
               for name, body in (("train-bf16", train_bf16), ("serve-f32", serve_f32), ("serve-f16", serve_f16))]
    helpers = [threading.Thread(target=sender, args=(soak, sigint_every), daemon=True),
               threading.Thread(target=watchdog, args=(soak,), daemon=True)]
    for t in threads + helpers:
        t.start()

    def sample() -> None:
        nonlocal base
        if base is None and time.monotonic() - t0 >= warm:
            base = (rss_mb(), soak.counts["steps"] + soak.counts["requests"])

    sampler = threading.Thread(target=lambda: [sample() for _ in iter(lambda: soak.stop.wait(0.5), True)],
                               daemon=True)
    sampler.start()
    main_loop(soak, train_f16)
    soak.stop.set()
    # a SIGINT still on its way must not end the report: the sender has stopped, absorb stragglers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for t in threads:
        t.join(timeout=hang_after)
        if t.is_alive():
            soak.hung.add(t.name)
    work = soak.counts["steps"] + soak.counts["requests"]
    rss1 = rss_mb()
    per_k = None
    if base is not None and work > base[1]:
        per_k = (rss1 - base[0]) / (work - base[1]) * 1000
    gluon_amp.disable()
    return {"minutes": minutes, "seconds": round(time.monotonic() - t0, 1), "threads": 4,
            "steps": soak.counts["steps"], "requests": soak.counts["requests"],
            "interrupts": soak.counts["interrupts"], "sigints_sent": soak.counts["sigints_sent"],
            "dropped_batches": soak.counts["dropped_batches"], "hangs": len(soak.hung), "hung": sorted(soak.hung),
            "ops_checked": soak.counts["ops"], "wrong_dtype_ops": soak.counts["wrong_dtype_ops"],
            "wrong_scale_steps": soak.counts["wrong_scale_steps"],
            "wrong_scale_by_thread": {k.split(":", 1)[1]: v for k, v in soak.counts.items()
                                      if k.startswith("wrong_scale:")},
            "failures": dict(soak.failures),
            "first_failures": soak.first_failures, "rss_mb_start": round(rss0, 1), "rss_mb_end": round(rss1, 1),
            "rss_growth_mb_per_1000_steps": None if per_k is None else round(per_k, 3),
            "counted_from": "steps and requests after the warm-up"}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    p.add_argument("--sigint-every", type=float, default=3.0, help="mean seconds between SIGINTs (default 3)")
    p.add_argument("--hang-after", type=float, default=60.0, help="seconds without progress that make a hang")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.sigint_every <= 0 or args.hang_after <= 0:
        p.error(f"--minutes, --sigint-every and --hang-after must be > 0, got {args.minutes}, "
                f"{args.sigint_every}, {args.hang_after}")
    figures = run(args.minutes, args.sigint_every, args.hang_after)
    text = json.dumps(figures, indent=2)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = figures["hangs"] == 0 and figures["wrong_dtype_ops"] == 0
    if not ok:
        os._exit(1)  # a hung thread would keep the process alive
    return 0


if __name__ == "__main__":
    sys.exit(main())
