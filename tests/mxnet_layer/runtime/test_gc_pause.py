"""gc_pause: the cyclic collector off while gluon_amp rewrites and binds a graph, as it was after."""
import gc
import threading

import pytest
import mxnet as mx

import gluon_amp
from gluon_amp import execution, gc_pause
from gluon_amp.patching import hooks


def test_nested_pauses_restore_the_collector_once_the_outermost_ends():
    assert gc.isenabled()
    with gc_pause.gc_paused():
        assert not gc.isenabled()
        with gc_pause.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer one still holds it
    assert gc.isenabled()


def test_an_error_inside_still_turns_it_back_on():
    with pytest.raises(KeyError):
        with gc_pause.gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_a_program_that_turned_it_off_keeps_it_off():
    gc.disable()
    try:
        with gc_pause.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_two_threads_rewriting_at_once_leave_it_on_when_both_are_done():
    inside, go = threading.Barrier(3), threading.Event()

    def rewrite():
        with gc_pause.gc_paused():
            inside.wait()
            go.wait()

    threads = [threading.Thread(target=rewrite) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        inside.wait()  # both threads are inside their pause
        assert gc_pause._depth == 2 and not gc.isenabled()
    finally:
        go.set()
        for t in threads:
            t.join()
    assert gc.isenabled() and gc_pause._depth == 0


def test_a_blocks_first_call_rewrites_its_graph_with_the_collector_paused(monkeypatch):
    """The hook's rewrite (init's plan: fewer casts) and the binding (execution) run paused;
    the training step around them does not."""
    seen = []
    real = hooks.with_fewer_casts

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(hooks, "with_fewer_casts", recording)
    real_emulate = execution.emulate_symbol

    def emulating(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_emulate(*args, **kwargs)

    monkeypatch.setattr(execution, "emulate_symbol", emulating)
    gluon_amp.init("bfloat16", emulate=True)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(4), mx.gluon.nn.Dense(2))
    net.initialize()
    net.hybridize()
    out = net(mx.nd.ones((2, 3)))
    assert seen == [False, False] and gc.isenabled()
    assert out.shape == (2, 2)
