"""Every transition of the patching lifecycle is all-or-nothing under an interrupt anywhere
(issue 42, items 1 and 2): entering and leaving an ``autocast`` region, the first patch and a
new policy's redirects, ``init`` and ``disable``.

Generated, not hand-picked: a dry run counts the trace events (lines, or opcodes) that
gluon_amp's own frames produce during the transition; then the transition runs once per event
with an interrupt delivered at exactly that event, as CPython delivers SIGINT: SIGINT's handler
in force there is called (Python's default raises ``KeyboardInterrupt``; inside
:class:`gluon_amp.state.interrupts_deferred` it is held to the end of the block). A second
family raises a plain exception at the entry of each gluon_amp function the transition calls
(a callee failing). After each run: the thread is outside every region, the policy in force
and the dtype an op runs agree, SIGINT's handler is Python's again, the next region and
``init`` work, and ``disable()`` puts every op function and hook back by identity.

The op functions are cut to four so that a transition is short (the full set is checked for
identity all the same).
"""
import dis
import linecache
import signal
import sys
import os
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet.gluon import HybridBlock
from mxnet.gluon import block as mx_block
from mxnet.gluon.parameter import Parameter
from mxnet.symbol import Symbol

import gluon_amp
from gluon_amp import mxnet_internals as mxi, state
from gluon_amp.mxnet_internals import gluon as mxg
from helpers import FcDtype

PACKAGE = os.path.dirname(gluon_amp.__file__) + os.sep
KEPT = {mx.nd.FullyConnected, mx.sym.FullyConnected, mx.nd.softmax, mx.nd.elemwise_add}
_FC = FcDtype(seed=3)
_fc, _references = _FC.probe, _FC.kinds


ALL_SITES = [(fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__, fn.__dict__.get("__wrapped__"))
             for _, _, fn, _, _ in mxi.op_function_sites()]
METHODS = [(HybridBlock, "_get_graph"), (HybridBlock, "_call_cached_op"), (HybridBlock, "_infer_attrs"),
           (HybridBlock, "_build_cache"), (Symbol, "bind"), (Symbol, "simple_bind"), (Parameter, "cast"),
           (Parameter, "grad_req")]
ORIGINAL_METHODS = [(cls, name, cls.__dict__.get(name)) for cls, name in METHODS]
assert mxg._GET_GRAPH is HybridBlock.__dict__["_get_graph"]  # nothing patched at import


@pytest.fixture
def few_ops(monkeypatch):
    """Patch only four op functions: a transition is then a few thousand trace events."""
    sites = [s for s in mxi.op_function_sites() if s[2] in KEPT]
    monkeypatch.setattr(mxi, "op_function_sites", lambda: iter(sites))
    ref = _references()
    yield ref
    gluon_amp.disable()


#: CPython may deliver a signal at any function's entry (RESUME), before its first statement
#: can set up a ``try``: no Python ``__exit__`` can be safe there (bpo-29988), so the first event
#: of ``autocast.__exit__`` is the one point where nothing is delivered. (A Ctrl-C at the entry of
#: ``interrupts_deferred.__exit__`` is delivered: its own handler holds it.)
EXIT_CODE = getattr(getattr(gluon_amp.autocast, "__exit__", None), "__code__", None)  # a class here
# 3.12 returns a constant with RETURN_CONST, and calls without PRECALL (3.11 has both ops)
RETURNS = frozenset(dis.opmap[n] for n in ("RETURN_VALUE", "RETURN_CONST") if n in dis.opmap)
BEFORE_WITH = dis.opmap["BEFORE_WITH"]


class _Deliver:
    """A tracer that counts events in gluon_amp's frames and, at event ``at``, delivers an
    interrupt (``how='sigint'``: SIGINT's current handler; ``'error'``: RuntimeError raised
    at the entry of a gluon_amp function, counting only those)."""

    def __init__(self, how: str, at: int = -1, opcodes: bool = False) -> None:
        self.how, self.at, self.opcodes, self.count, self.fired = how, at, opcodes, 0, False
        self.entries = set()

    def _fire(self, frame) -> None:
        self.fired = True
        sys.settrace(None)
        if self.how == "sigint":
            handler = signal.getsignal(signal.SIGINT)
            handler(signal.SIGINT, frame)  # Python's raises KeyboardInterrupt; a deferring one holds it
        else:
            raise RuntimeError("injected")

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if self.how == "error":
            # an exception before an __exit__'s first statement could only be asynchronous
            # (the SIGINT family delivers those); a callee failing runs some of its code first
            if event == "call" and frame.f_code.co_name != "__exit__":
                self.count += 1
                if self.count - 1 == self.at and not self.fired:
                    self._fire(frame)
            return None
        frame.f_trace_opcodes = self.opcodes
        if frame.f_code is EXIT_CODE:
            self.entries.add(id(frame))
        return self._local

    def _local(self, frame, event, arg):
        if event in ("line", "opcode") and event == ("opcode" if self.opcodes else "line"):
            if _before_a_with_exit(frame) or (event == "line" and linecache.getline(
                    frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with ")):
                # the calling of a with-statement's __exit__ (three Nones, the call): no handler
                # runs there either, and a raise would skip the __exit__ (a lock held for good)
                return self._local
            if id(frame) in self.entries:  # the entry of autocast.__exit__: see EXIT_CODE
                self.entries.discard(id(frame))
                return self._local
            if event == "opcode" and (frame.f_code.co_code[frame.f_lasti] in RETURNS
                                      or frame.f_code.co_code[frame.f_lasti - 2] == BEFORE_WITH):
                # CPython runs no handler there (handlers run at a function's start, a backward
                # jump or after a call): at a return it lands in the caller, and right after a
                # with-statement's __enter__ inside the block, where __exit__ runs
                return self._local
            self.count += 1
            if self.count - 1 == self.at and not self.fired:
                self._fire(frame)
        return self._local


LOAD_CONST, CALL, SWAP = (dis.opmap[n] for n in ("LOAD_CONST", "CALL", "SWAP"))
_WITH_EXIT = (LOAD_CONST, LOAD_CONST, LOAD_CONST) + ((dis.opmap["PRECALL"],) if "PRECALL" in dis.opmap else ())


_EXIT_CALLS: dict = {}


def _with_exit_offsets(code) -> frozenset:
    """The offsets of the instructions that call a with-statement's ``__exit__`` on leaving it:
    three ``LOAD_CONST``, ``PRECALL`` (3.11 only) and the ``CALL`` after them (``CALL`` sits past
    ``PRECALL``'s inline cache: the offsets are read through ``dis``, which skips caches), and
    the ``SWAP`` before them where a ``return`` inside the block leaves it (outside the block's
    exception range, as the call is)."""
    found = _EXIT_CALLS.get(code)
    if found is None:
        ins = [(i.opcode, i.offset) for i in dis.get_instructions(code)]
        found = set()
        n = len(_WITH_EXIT)
        for j in range(len(ins) - n):
            if tuple(op for op, _ in ins[j:j + n]) == _WITH_EXIT and ins[j + n][0] == CALL:
                found.update(off for _, off in ins[j:j + n + 1])
                if j and ins[j - 1][0] == SWAP:
                    found.add(ins[j - 1][1])
        found = frozenset(found)
        _EXIT_CALLS[code] = found
    return found


def _before_a_with_exit(frame) -> bool:
    """True at the instructions that call a with-statement's ``__exit__`` on leaving it."""
    return frame.f_lasti in _with_exit_offsets(frame.f_code)


def _run(transition, tracer) -> None:
    here = sys._getframe()
    # CPython 3.12 sends opcode events only if some frame asked for them before sys.settrace
    # (python/cpython#114480); each traced frame still asks for its own (_Deliver.__call__)
    here.f_trace_opcodes = tracer.opcodes
    sys.settrace(tracer)
    try:
        transition()
    except (KeyboardInterrupt, RuntimeError) as exc:
        if not tracer.fired or (isinstance(exc, RuntimeError) and str(exc) != "injected"):
            raise
    finally:
        sys.settrace(None)
        here.f_trace_opcodes = False


def _check_recovers(ref: dict, what: str) -> None:
    assert not state.lock._is_owned(), f"{what}: state.lock left held (every other thread would wait on it)"
    assert gluon_amp.current_policy() is state.process.policy, f"{what}: the thread was left inside a region"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"{what}: SIGINT's handler not back"
    policy = state.process.policy
    assert gluon_amp.is_enabled() == (policy is not None), what
    assert ref[_fc()] == (policy.target_dtype if policy is not None else "float32"), f"{what}: ops run another dtype"
    with gluon_amp.autocast("float16", emulate=True):
        assert ref[_fc()] == "float16", f"{what}: the next region does not work"
        with gluon_amp.autocast(enabled=False):
            assert ref[_fc()] == "float32", what
    if policy is None:
        gluon_amp.init("bfloat16", emulate=True)
        assert ref[_fc()] == "bfloat16", f"{what}: the next init does not work"
    gluon_amp.disable()
    assert gluon_amp.patched_functions() == () and not gluon_amp.is_enabled(), what
    moved = [fn.__qualname__ for fn, code, defaults, kwdefaults, wrapped in ALL_SITES
             if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults
             or fn.__dict__.get("__wrapped__") is not wrapped]
    assert moved == [], f"{what}: not restored by identity: {moved[:5]}"
    methods = [f"{cls.__name__}.{name}" for cls, name, fn in ORIGINAL_METHODS if cls.__dict__.get(name) is not fn]
    assert methods == [], f"{what}: hooks left in MXNet's classes: {methods}"
    assert mx_block.warnings is warnings, f"{what}: MXNet's gluon.block left warning through gluon_amp"
    assert ref[_fc()] == "float32", what


# The regions' bodies run no op: an op's own code (the wrappers, the emulation kernel's loader)
# is not a transition of the lifecycle; _check_recovers runs ops after each run.

def _first_region():
    with gluon_amp.autocast("float16", emulate=True):
        pass


def _same_region_again():
    with gluon_amp.autocast("float16", emulate=True):
        pass


def _new_policy_region():
    with gluon_amp.autocast("bfloat16", emulate=True):
        with gluon_amp.autocast(enabled=False):
            pass


def _init():
    gluon_amp.init("float16", emulate=True)


def _disable():
    gluon_amp.disable()


def _patched_by_a_region():
    with gluon_amp.autocast("float16", emulate=True):
        pass


def _init_first():
    gluon_amp.init("bfloat16", emulate=True)


#: name -> (what runs first, untraced; the transition)
TRANSITIONS = {
    "first region (patches)": (None, _first_region),
    "region again (patched)": (_patched_by_a_region, _same_region_again),
    "region of a new policy, nested": (_patched_by_a_region, _new_policy_region),
    "region inside init": (_init_first, _first_region),
    "init": (None, _init),
    "disable after init": (_init_first, _disable),
    "disable after a region": (_patched_by_a_region, _disable),
}


def _events(before, transition, how: str, opcodes: bool = False) -> int:
    if before is not None:
        before()
    counter = _Deliver(how, opcodes=opcodes)
    _run(transition, counter)
    gluon_amp.disable()
    return counter.count


def _each_event(ref, name, how, opcodes=False, sample=None):
    before, transition = TRANSITIONS[name]
    n = _events(before, transition, how, opcodes)
    assert n > 0
    points = range(n) if sample is None else sorted(set(np.random.RandomState(0).randint(0, n, sample)))
    for k in points:
        if before is not None:
            before()
        _run(transition, _Deliver(how, k, opcodes))
        _check_recovers(ref, f"{name}: {how} at {'opcode' if opcodes else 'event'} {k} of {n}")
    return n


# make test-quick: a fixed-seed sample of each family's points (about 25 per transition);
# make test: 150 points of each (the slow ones below; every point takes minutes per transition).

@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_ctrl_c_at_sampled_lines_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "sigint", sample=25)


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_an_exception_entering_sampled_gluon_amp_calls_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "error", sample=25)


@pytest.mark.parametrize("name", ["first region (patches)", "region again (patched)", "disable after init"])
def test_ctrl_c_at_sampled_opcodes_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "sigint", opcodes=True, sample=40)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_ctrl_c_at_150_lines_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "sigint", sample=150)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_an_exception_entering_150_gluon_amp_calls_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "error", sample=150)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_ctrl_c_at_150_opcodes_of_a_transition_leaves_amp_whole(few_ops, name):
    _each_event(few_ops, name, "sigint", opcodes=True, sample=150)
