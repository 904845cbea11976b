"""Issue 42, acceptance: a stateful property test of gluon_amp's process and thread state.

Hypothesis (``RuleBasedStateMachine``) drives 2 to 4 worker threads through random sequences of
``init``/``disable``, nested ``autocast`` regions of each kind (float16 and bfloat16 emulated,
``enabled=False``, ``enabled=True`` without a target), forwards, ``scale_loss`` + ``trainer.step``,
checkpoint save/load, and bursts where every thread runs at once. Any call may get an injected
``KeyboardInterrupt`` or exception at a random line inside gluon_amp's own code (``sys.settrace``
on that thread; not where no signal handler can run: a ``with`` line, where a raise skips the
``__exit__`` and leaks a lock, a ``try:`` line, the same right after a ``with``'s ``__enter__``,
and the first line of ``autocast.__exit__``, before its ``try``).
A model says what must hold; after every rule the invariants are checked:

========================================  ======================================================
invariant                                 issue 42 item it guards
========================================  ======================================================
A. each thread's ops run in its region's  2 (Ctrl-C in a region's entry leaves the thread in it),
   dtype (its innermost ``autocast``,     1 (Ctrl-C while patching: functions redirected with no
   else ``init``'s, else float32)         record), 6 (a region equal to init's follows other
                                          threads' ``init``/``disable``)
B. each step's loss scale follows its     7 (scaled because another thread entered a float16
   own thread's policies: > 1 for a       region), 4 (a fault in ``scale_loss`` leaves the
   float16 forward; 1 unless float16 was  gradient scale stale), 3 (Ctrl-C in ``step``: round
   in force on that thread since its      stuck open, SystemError, lock error)
   trainer's last step (the documented
   rule, ``state.dtypes_since``); the
   next call after any fault works
C. no call hangs (a watchdog, 60 s)       3 (the next step hangs forever)
D. ``load_states`` is whole or nothing,   11 (half-loaded trainer), 9 (damage not
   the scale is what was saved            ``CheckpointError``)
E. ``disable()`` at the end restores      1, 2 (``disable()`` cannot restore MXNet's functions)
   every function by identity (object
   and code)
========================================  ======================================================

Item 8 (a change log that overflows after ~2,000 regions) needs thousands of regions per step:
``repro/state/policy_log_eviction_unscaled_step.py`` and the trainstate branch's tests cover it.

Runs: ``test_state_machine_quick`` (make test-quick): derandomized, 10 examples of up to 25 steps,
about 10 s on 2 shared cores (plus the emulation kernel's build in a fresh cache); at aeec3b5 this
seed fails on item 6 after 5 s.
``test_state_machine_long`` (slow): 40 random examples of up to 50 steps, under a minute.
"""
from __future__ import annotations

import dis
import functools
import linecache
import os
import queue
import shutil
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon

hypothesis = pytest.importorskip("hypothesis")  # the test extra (setup.py) installs it
from hypothesis import HealthCheck, Phase, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

import gluon_amp  # noqa: E402
from gluon_amp import emulation_kernel, state  # noqa: E402

WATCHDOG_S = 20.0
#: Set at the first hang: the process's state is stuck, every later call fails at once.
POISONED: List[str] = []
#: Where a call left ``state.lock`` held (released again, so the run goes on to say so).
LEAKS: List[str] = []
#: ``where``: the line the calling thread's last injected fault was raised at.
_injection = threading.local()
_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))), m.__name__) + os.sep
              for m in (gluon_amp, __import__("gluon_amp_core")))
REGION_KINDS = ("float16", "bfloat16", "off", "on")
_EXIT_CODE = gluon_amp.autocast.__exit__.__code__
_NOP = dis.opmap["NOP"]


class Injected(Exception):
    """The exception injected into gluon_amp's code (beside KeyboardInterrupt)."""


class Hang(AssertionError):
    pass


# ---------------------------------------------------------------- what dtype an op ran in

def _round_bf16(a: np.ndarray) -> np.ndarray:
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


_ROUND = {"float32": lambda a: a.astype(np.float32), "bfloat16": _round_bf16,
          "float16": lambda a: a.astype(np.float16).astype(np.float32)}
_RNG = np.random.RandomState(42)
X = _RNG.uniform(0.5, 1.5, (1, 8)).astype(np.float32)
W = _RNG.uniform(-1, 1, (4, 8)).astype(np.float32)
B = _RNG.uniform(-1, 1, (4,)).astype(np.float32)


def _reference(dtype: str) -> np.ndarray:
    r = _ROUND[dtype]
    return r(r(X) @ r(W).T + r(B))


REFERENCES = {d: _reference(d) for d in _ROUND}


def dtype_of(out: np.ndarray) -> str:
    """The dtype whose emulated (or real) FullyConnected gives ``out``: the nearest reference."""
    dist = {d: float(np.abs(out - ref).max()) for d, ref in REFERENCES.items()}
    return min(dist, key=dist.get)


# ---------------------------------------------------------------- a worker thread

def _ours(filename: str) -> bool:
    return filename.startswith(_OURS)


def injected(fn: Callable[[], Any], inject: Optional[Tuple[type, int]]) -> Any:
    """``fn()``, with ``inject = (exception type, n)`` raised at the n-th line gluon_amp's own code
    runs on this thread (not at all when it runs fewer)."""
    _injection.where = "no injection"
    if inject is None:
        return fn()
    kind, n = inject
    count = [0]
    where: List[str] = []

    def at_line(frame) -> None:
        count[0] += 1
        if count[0] == n:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            raise kind(f"injected at line {n} of gluon_amp ({where[0]})")

    try:
        return _traced(fn, at_line)
    finally:
        _injection.where = f"{kind.__name__} injected at {where[0] if where else 'no line (not reached)'}"


def _traced(fn: Callable[[], Any], at_line: Callable[[Any], None]) -> Any:
    """``fn()``, calling ``at_line(frame)`` at each line of gluon_amp's own code on this thread
    where a signal's handler could run (what :func:`injected` counts and raises at)."""
    entries = set()

    def local(frame, event, arg):
        if event == "line":
            if id(frame) in entries:
                # the first line of autocast.__exit__: before its try is set up, a point only a
                # signal at the function's entry reaches, where no Python code can be safe
                entries.discard(id(frame))
                return local
            if linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with "):
                return local  # a with-statement's exit runs there: no handler runs, a raise skips __exit__
            if frame.f_code.co_code[frame.f_lasti] == _NOP:
                # a `try:` line: no handler runs at a NOP, and right after a with-statement's
                # __enter__ a raise there skips its __exit__ (CPython 3.11 and 3.12): once it
                # "leaked" state.lock at disable()'s `try:` inside `with state.interrupts_deferred()`
                return local
            at_line(frame)
        return local

    def tracer(frame, event, arg):
        if not _ours(frame.f_code.co_filename):
            return None
        if frame.f_code is _EXIT_CODE:
            entries.add(id(frame))
        return local

    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(None)


class Worker:
    """A thread that runs what it is given, one call at a time; ``call`` waits with a watchdog."""

    def __init__(self, index: int, label: Optional[str] = None) -> None:
        self.index = index
        self.label = label or f"thread {index}"  # what the failures call it
        self.jobs: "queue.Queue[Any]" = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"stateful-{index}", daemon=True)
        self.thread.start()
        # the model: this thread's regions (context manager, what the region runs)
        self.regions: List[Tuple[Any, Optional[str]]] = []
        self.pending: Optional[Tuple[Any, str]] = None  # a recorded forward: (loss, its dtype)
        #: float16 may have been in force on this thread since its trainer's last step (then a
        #: float32/bfloat16 forward's step may be scaled: the rule is per thread and per step,
        #: not per forward); set wherever gluon_amp may have noted it, a fault included
        self.f16_since_step = False
        self.saved: Optional[Tuple[str, float]] = None
        self.net = self.trainer = None

    def __repr__(self) -> str:
        return f"thread{self.index}"

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                result = (True, fn())
            except BaseException as exc:  # noqa: BLE001  handed to the caller, KeyboardInterrupt included
                result = (False, exc)
            if state.lock._is_owned():  # every later call would hang: say where, and let go
                LEAKS.append(f"invariant C: {self.label}'s call returned holding state.lock "
                             f"({getattr(_injection, 'where', 'no injection')})")
                while state.lock._is_owned():
                    state.lock.release()
            done.put(result)

    def call(self, fn: Callable[[], Any], inject: Optional[Tuple[type, int]] = None) -> Tuple[bool, Any]:
        if POISONED:
            raise Hang(POISONED[0])
        done: "queue.Queue[Any]" = queue.Queue()
        self.jobs.put((lambda: injected(fn, inject), done))
        try:
            result = done.get(timeout=WATCHDOG_S)
        except queue.Empty:
            POISONED.append(f"issue 42 item 3 (invariant C): {self.label} did not return in {WATCHDOG_S} s; "
                            f"where the threads are:\n{_stacks()}")
            raise Hang(POISONED[0]) from None
        assert not LEAKS, LEAKS[0]
        return result

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)


def _stacks() -> str:
    """Where every thread is, and which one holds ``state.lock`` (its repr names the owner)."""
    frames = sys._current_frames()
    out = [f"state.lock: {state.lock!r}"]
    for t in threading.enumerate():
        if t.ident in frames:
            stack = traceback.extract_stack(frames[t.ident])[-8:]
            out.append(f"{t.name} (ident {t.ident}):\n" + "".join(traceback.format_list(stack)))
    return "\n".join(out)


def _on_main(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` for the main thread's own calls, on a worker of its own under the watchdog: a
    call that cannot return (a lock left held) fails the test with every thread's stack
    instead of hanging the suite."""
    w = Worker(-1, label=f"the main thread's {what}")
    try:
        ok, res = w.call(fn)
    finally:
        w.stop()
    if not ok:
        raise res
    return res


def _net_and_trainer() -> Tuple[gluon.nn.Dense, gluon.Trainer]:
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize()
    net.weight.set_data(mx.nd.array(W))
    net.bias.set_data(mx.nd.array(B))
    # learning rate 0: the weights never change, so a forward's values tell its dtype
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)
    return net, trainer


def _functions() -> Dict[Tuple[str, str], Tuple[Any, Any]]:
    """Every op function of MXNet's generated modules: (object, code), to compare by identity."""
    mods = [mx.nd, mx.nd.op, mx.nd.contrib, mx.nd._internal, mx.sym, mx.sym.op, mx.sym.contrib,
            mx.sym._internal, mx.nd.linalg, mx.sym.linalg, mx.nd.random, mx.sym.random]
    out = {}
    for mod in mods:
        for name, fn in vars(mod).items():
            if callable(fn) and hasattr(fn, "__code__"):
                out[(mod.__name__, name)] = (fn, fn.__code__)
    return out


_PRISTINE = _functions()
with __import__("warnings").catch_warnings():
    __import__("warnings").simplefilter("ignore")
    _DEFAULT_POLICY = gluon_amp.make_policy(None, tune=False)
_MACHINE_DEFAULT = _DEFAULT_POLICY.target_dtype if _DEFAULT_POLICY.enabled else None


# ---------------------------------------------------------------- the machine

#: The first failure of a run, as it happened: threads make a replay differ (a broken state
#: breaks every later example), so Hypothesis may report it as flaky; the test then shows this.
FIRST: List[str] = []


def recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AssertionError as exc:
            FIRST.append(f"{fn.__name__}: {exc}")
            raise
    return wrapper

injections = st.one_of(st.none(), st.none(), st.tuples(st.sampled_from([KeyboardInterrupt, Injected]),
                                                       st.integers(1, 400)))


class AmpStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.workers: List[Worker] = []
        self.process: Optional[str] = None  # init's dtype (None: no init)
        self.tmp = tempfile.mkdtemp(prefix="gluon-amp-stateful-")

    @initialize(n=st.integers(2, 4))
    @recorded
    def start(self, n: int) -> None:
        _on_main(gluon_amp.disable, "disable at the start")
        self.workers = [Worker(i) for i in range(n)]
        for w in self.workers:
            ok, made = w.call(_net_and_trainer)
            assert ok, made
            w.net, w.trainer = made

    # ---------------------------------------------------------- the model

    def expected(self, w: Worker) -> str:
        """The dtype ``w``'s ops run in: its innermost region's, else init's, else float32."""
        if w.regions:
            return w.regions[-1][1] or "float32"
        return self.process or "float32"

    def _entered_dtype(self, w: Worker, kind: str) -> Optional[str]:
        if kind in ("float16", "bfloat16"):
            return kind
        if kind == "off":
            return None
        for _cm, dtype in reversed(w.regions):  # enabled=True: the outer policy, else init's
            if dtype is not None:
                return dtype
        if self.process is not None:
            return self.process
        return _MACHINE_DEFAULT  # autocast() with no policy anywhere: init's default for this machine

    def _forward(self, w: Worker) -> str:
        ok, out = w.call(lambda: w.net(mx.nd.array(X)).astype('float32').asnumpy())
        assert ok, f"a forward on thread {w.index} failed: {type(out).__name__}: {out}"
        return dtype_of(out)

    def _adopt_process(self) -> None:
        policy = state.process.policy
        self.process = policy.target_dtype if policy is not None and policy.enabled else None

    # ---------------------------------------------------------- rules

    @rule(data=st.data(), dtype=st.sampled_from(["float16", "bfloat16"]), inject=injections)
    @recorded
    def init(self, data, dtype: str, inject) -> None:
        w = data.draw(st.sampled_from(self.workers))
        refused = self.process not in (None, dtype)  # another policy is in force: init refuses
        if dtype == "float16":  # noted when it comes in force, before an interrupt can land
            for other in self.workers:
                other.f16_since_step = True
        ok, res = w.call(lambda: gluon_amp.init(dtype, emulate=True, tune=False), inject)
        if ok:
            assert not refused, f"init({dtype!r}) over init({self.process!r}) was accepted"
            self.process = dtype
        elif refused and isinstance(res, RuntimeError):
            pass
        elif isinstance(res, (KeyboardInterrupt, Injected)):
            self._adopt_process()  # all or nothing: either is fine, invariant A checks it holds
        else:
            raise AssertionError(f"init failed: {type(res).__name__}: {res}")

    @rule(data=st.data(), inject=injections)
    @recorded
    def disable(self, data, inject) -> None:
        w = data.draw(st.sampled_from(self.workers))
        ok, res = w.call(gluon_amp.disable, inject)
        if ok:
            self.process = None
        elif isinstance(res, (KeyboardInterrupt, Injected)):
            self._adopt_process()
        else:
            raise AssertionError(f"disable failed: {type(res).__name__}: {res}")

    @rule(data=st.data(), kind=st.sampled_from(REGION_KINDS), inject=injections)
    @recorded
    def enter(self, data, kind: str, inject) -> None:
        w = data.draw(st.sampled_from(self.workers))
        if len(w.regions) >= 4:
            return
        args = {"float16": dict(target_dtype="float16", emulate=True, tune=False),
                "bfloat16": dict(target_dtype="bfloat16", emulate=True, tune=False),
                "off": dict(enabled=False), "on": {}}[kind]
        dtype = self._entered_dtype(w, kind)
        if dtype == "float16":  # its entry is noted first (state.enter): a fault after still counts
            w.f16_since_step = True

        def go():
            cm = gluon_amp.autocast(**args)
            cm.__enter__()
            return cm

        ok, res = w.call(go, inject)
        if ok:
            w.regions.append((res, dtype))
        else:  # an exception out of __enter__: the with-block never ran, the region is not entered
            assert isinstance(res, (KeyboardInterrupt, Injected)), f"autocast({kind}) failed: {res!r}"

    @precondition(lambda self: any(w.regions for w in self.workers))
    @rule(data=st.data(), inject=injections)
    @recorded
    def leave(self, data, inject) -> None:
        w = data.draw(st.sampled_from([w for w in self.workers if w.regions]))
        cm, _dtype = w.regions.pop()  # whatever happens in __exit__, the with-statement is over
        ok, res = w.call(lambda: cm.__exit__(None, None, None), inject)
        assert ok or isinstance(res, (KeyboardInterrupt, Injected)), f"leaving a region failed: {res!r}"

    @precondition(lambda self: any(len(w.regions) > 1 for w in self.workers))
    @rule(data=st.data(), inject=injections)
    @recorded
    def leave_out_of_order(self, data, inject) -> None:
        """A region left while one inside it is open (a generator closed in a later region)."""
        w = data.draw(st.sampled_from([w for w in self.workers if len(w.regions) > 1]))
        cm, _dtype = w.regions.pop(data.draw(st.integers(0, len(w.regions) - 2)))
        ok, res = w.call(lambda: cm.__exit__(None, None, None), inject)
        assert ok or isinstance(res, (KeyboardInterrupt, Injected)), f"leaving a region failed: {res!r}"

    @rule(data=st.data())
    @recorded
    def forward(self, data) -> None:
        w = data.draw(st.sampled_from(self.workers))
        got, want = self._forward(w), self.expected(w)
        assert got == want, (f"issue 42 items 1/2/6 (invariant A): thread {w.index} ran {got}, its regions "
                             f"and init say {want}")

    @rule(data=st.data(), inject=injections)
    @recorded
    def record_forward(self, data, inject) -> None:
        w = data.draw(st.sampled_from(self.workers))
        want = self.expected(w)

        def go():
            with autograd.record():
                out = w.net(mx.nd.array(X))
                loss = out.sum()
            return loss, out.astype('float32').asnumpy()

        ok, res = w.call(go, inject)
        if ok:
            loss, out = res
            assert dtype_of(out) == want, f"invariant A: thread {w.index}'s recorded forward ran {dtype_of(out)}"
            w.pending = (loss, want)

    @precondition(lambda self: any(w.pending for w in self.workers))
    @rule(data=st.data(), inject=injections)
    @recorded
    def step(self, data, inject) -> None:
        w = data.draw(st.sampled_from([w for w in self.workers if w.pending]))
        (loss, fwd_dtype), w.pending = w.pending, None

        def go():
            with autograd.record(), gluon_amp.scale_loss(loss, w.trainer) as scaled:
                ratio = float(scaled.asscalar()) / float(loss.asscalar())
                autograd.backward(scaled)
            w.trainer.step(1)
            return ratio

        ok, res = w.call(go, inject)
        if ok:
            scaled = abs(res - 1.0) > 1e-6
            if fwd_dtype == "float16":
                assert scaled, (f"issue 42 item 4/8 (invariant B): thread {w.index}'s float16 forward had its "
                                f"loss multiplied by {res:g}")
            else:
                assert not scaled or w.f16_since_step or self.expected(w) == "float16", (
                    f"issue 42 item 7 (invariant B): thread {w.index}'s {fwd_dtype} forward had its loss "
                    f"multiplied by {res:g}, and float16 was not in force on its thread since its last step")
            w.f16_since_step = self.expected(w) == "float16"
        else:
            assert isinstance(res, (KeyboardInterrupt, Injected)), (
                f"issue 42 item 3/4 (invariant B): a step on thread {w.index} failed after earlier faults: "
                f"{type(res).__name__}: {res}")

    @rule(data=st.data(), inject=injections)
    @recorded
    def save(self, data, inject) -> None:
        w = data.draw(st.sampled_from(self.workers))
        path = os.path.join(self.tmp, f"w{w.index}.states")
        ok, res = w.call(lambda: (gluon_amp.save_states(w.trainer, path),
                                  gluon_amp.get_scaler(w.trainer).loss_scale)[1], inject)
        if ok:
            w.saved = (path, res)
        else:
            assert isinstance(res, (KeyboardInterrupt, Injected)), f"save_states failed: {res!r}"

    @precondition(lambda self: any(w.saved for w in self.workers))
    @rule(data=st.data(), inject=injections)
    @recorded
    def load(self, data, inject) -> None:
        w = data.draw(st.sampled_from([w for w in self.workers if w.saved]))
        path, scale = w.saved
        before = w.call(lambda: gluon_amp.get_scaler(w.trainer).loss_scale)[1]
        ok, res = w.call(lambda: gluon_amp.load_states(w.trainer, path), inject)
        after = w.call(lambda: gluon_amp.get_scaler(w.trainer).loss_scale)[1]
        if ok:
            assert after == scale, f"invariant D: loaded scale {after}, saved {scale}"
        else:
            assert isinstance(res, (KeyboardInterrupt, Injected)), f"load_states failed: {res!r}"
            assert after in (before, scale), f"issue 42 item 11 (invariant D): scale {after} is neither"

    @rule()
    @recorded
    def burst(self) -> None:
        """Every thread runs forwards at once, each in its own regions."""
        want = {w.index: self.expected(w) for w in self.workers}
        done = []
        for w in self.workers:
            q: "queue.Queue[Any]" = queue.Queue()
            w.jobs.put((lambda w=w: [dtype_of(w.net(mx.nd.array(X)).astype('float32').asnumpy()) for _ in range(5)], q))
            done.append((w, q))
        for w, q in done:
            try:
                ok, got = q.get(timeout=WATCHDOG_S)
            except queue.Empty:
                POISONED.append(f"invariant C: thread {w.index} hung in a burst:\n{_stacks()}")
                raise Hang(POISONED[0]) from None
            assert ok, got
            assert set(got) == {want[w.index]}, (
                f"issue 42 item 6 (invariant A): thread {w.index} ran {got} beside other threads, expected "
                f"{want[w.index]}")

    # ---------------------------------------------------------- invariants

    @invariant()
    @recorded
    def every_thread_runs_its_regions_dtype(self) -> None:
        for w in self.workers:
            if self.expected(w) == "float16":
                w.f16_since_step = True
            got, want = self._forward(w), self.expected(w)
            assert got == want, (f"issue 42 items 1/2/6 (invariant A): thread {w.index} runs {got}; its "
                                 f"{len(w.regions)} region(s) and init say {want}")

    def teardown(self) -> None:
        try:
            self._teardown()
        finally:  # each example's checkpoint folder, whatever the example did
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _teardown(self) -> None:
        if POISONED:  # a thread is stuck: nothing more can be checked in this process
            return
        try:
            for w in self.workers:
                while w.regions:
                    cm, _ = w.regions.pop()
                    w.call(lambda cm=cm: cm.__exit__(None, None, None))
            for w in self.workers:
                w.call(gluon_amp.disable)  # another thread's disable: a worker's, as a user's would be
            _on_main(gluon_amp.disable, "disable at the end")
            assert gluon_amp.patched_functions() == (), "issue 42 items 1/2 (invariant E): still redirected"
            now = _functions()
            changed = sorted(k for k, (fn, code) in _PRISTINE.items()
                             if now.get(k, (None, None))[0] is not fn or fn.__code__ is not code)
            assert not changed, f"issue 42 items 1/2 (invariant E): not restored by identity: {changed[:8]}"
        finally:
            for w in self.workers:
                w.stop()
            if not POISONED:  # else a thread holds the state stuck: the failure says where
                _on_main(gluon_amp.disable, "disable after the example")
                state.reset()  # here: it also clears the main thread's own records


# no shrinking: threads make a replay differ, and the first failure is the one to read
_COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None,
               phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=False)


def _run(**options: Any) -> None:
    FIRST.clear()
    POISONED.clear()
    LEAKS.clear()
    emulation_kernel.load()  # built once per machine (seconds to a minute): not inside a watched call
    AmpStateMachine.TestCase.settings = settings(**options, **_COMMON)
    try:
        AmpStateMachine.TestCase().runTest()
    except BaseException as exc:
        if FIRST and not isinstance(exc, AssertionError):  # e.g. Flaky: say what failed first
            raise AssertionError(f"first failure: {FIRST[0]}") from exc
        raise


def test_state_machine_quick():
    """Fixed seed (derandomized): 10 examples of up to 25 steps; runs in make test-quick."""
    _run(max_examples=10, stateful_step_count=25, derandomize=True)


@pytest.mark.slow
def test_state_machine_long():
    """Random: 40 examples of up to 50 steps (under a minute on 2 cores; 150 took up to 2.7
    minutes, a seventh of the suite's 20)."""
    _run(max_examples=40, stateful_step_count=50)


@pytest.mark.parametrize("name", ["init", "disable"])
def test_each_line_of_init_and_disable_themselves_can_be_interrupted(name):
    """Generated from a run of the call: each line of ``init``'s or ``disable``'s own frame where
    the state machine may inject (their helpers' lines are its random runs' to reach). After each
    fault, state.lock is free and AMP turns on and off again. A long run once failed here, at
    disable()'s ``try:`` right after a with's ``__enter__``, where CPython runs no handler and a
    raise skips the ``__exit__``: a point :func:`_traced` no longer counts."""
    fn = getattr(gluon_amp, name)
    call = (lambda: fn(target_dtype="bfloat16", emulate=True)) if name == "init" else fn
    count, first = [0], {}

    def record(frame) -> None:  # the first time each line of the function's own frame runs
        count[0] += 1
        if frame.f_code is fn.__code__:
            first.setdefault(frame.f_lineno, count[0])

    emulation_kernel.load()
    try:
        if name == "disable":
            gluon_amp.init(target_dtype="bfloat16", emulate=True)
        _traced(call, record)
        points = sorted(first.values())
        assert len(points) >= 5, (count, first)
        for n in points:
            if name == "disable":
                gluon_amp.init(target_dtype="bfloat16", emulate=True)
            else:
                gluon_amp.disable()
            try:
                injected(call, (Injected, n))
            except Injected:
                pass
            held = state.lock._is_owned()
            while state.lock._is_owned():
                state.lock.release()
            assert not held, f"{name}: state.lock held after a fault ({_injection.where})"
            gluon_amp.disable()  # a fault leaves the call done or not done: either way, AMP still
            gluon_amp.init(target_dtype="float16", emulate=True)  # turns off, on and off again
            gluon_amp.disable()
            assert not gluon_amp.is_enabled()
    finally:
        gluon_amp.disable()
