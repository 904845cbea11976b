"""gluon_amp.speed.timing: what measuring leaves behind in the user's process, and its clock."""
import hashlib
import statistics
import threading
import time

import numpy as np
import pytest
import mxnet as mx

from gluon_amp.speed import timing
from helpers import MixedNet


def _next_draw(seed, between):
    mx.random.seed(seed)
    between()
    return mx.nd.random.uniform(shape=(8,)).asnumpy()


def test_timing_leaves_mxnet_random_generator_where_the_user_seeded_it():
    """Tuning runs inside a user's first forward, before deferred weights are drawn: a draw
    from MXNet's generator there gave the tuning run other weights than later runs."""
    net = MixedNet()
    sym = net(mx.sym.var("data"))
    untouched = _next_draw(3, lambda: None)
    assert timing.time_graph(sym, {"data": (2, 3, 8, 8)}, train=True) is not None
    assert np.array_equal(_next_draw(3, lambda: timing.time_graph(sym, {"data": (2, 3, 8, 8)}, train=True)),
                          untouched)
    assert np.array_equal(_next_draw(3, lambda: timing.time_op(
        "FullyConnected", {"num_hidden": "4"}, [(2, 8), (4, 8), (4,)], ["float32"] * 3, True)), untouched)
    # the check can fail: one draw in between moves the generator
    assert not np.array_equal(_next_draw(3, lambda: mx.nd.random.uniform(shape=(1,))), untouched)


def _conv1d_net() -> mx.sym.Symbol:
    x = mx.sym.var("data")
    h = mx.sym.tanh(mx.sym.Convolution(x, kernel=(2,), num_filter=8, name="dilated"))
    return mx.sym.Convolution(h, kernel=(1,), num_filter=4, name="skip")


def test_a_graph_with_a_1d_convolution_is_timed_as_a_whole():
    """A float32 Conv1D leaves its weight in oneDNN's layout after an inference call, and
    MXNet refuses to copy values into it: trial graphs got their values that way, so a
    WaveNet-style graph could not be timed and its tuning never reached a verdict."""
    sym = _conv1d_net()
    for train in (True, False):
        got = timing.time_graphs([sym, sym], {"data": (2, 4, 16)}, train=train)
        assert got is not None and len(got) == 2 and all(t > 0 for t in got)


def test_trial_values_follow_each_parameter_kind():
    rng = np.random.default_rng(0)
    init = timing._TrialInit(rng)
    got = {}
    for name in ("bn_gamma", "bn_running_var", "bn_beta", "fc_bias", "conv_weight"):
        arr = mx.nd.full((4, 3), 5.0)
        init(mx.init.InitDesc(name), arr)
        got[name] = arr.asnumpy()
    assert (got["bn_gamma"] == 1).all() and (got["bn_running_var"] == 1).all()
    assert (got["bn_beta"] == 0).all() and (got["fc_bias"] == 0).all()
    w = got["conv_weight"]
    assert np.abs(w).max() <= 0.07 and len(np.unique(w)) > 1


def _reads(values_ms):
    """A clock returning these readings (ms) in turn, in seconds."""
    it = iter(values_ms)
    return lambda: next(it) / 1e3


def _runs(durations_ms):
    """Readings whose start/end pairs last ``durations_ms`` in turn."""
    out, now = [], 0.0
    for d in durations_ms:
        out += [now, now + d]
        now += d + 100.0
    return out


def test_a_quiet_machine_times_wall_time_a_busy_one_cpu_time(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert timing.timer_now() is timing.WALL and timing.WALL.read is time.perf_counter and timing.WALL.pick is min
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    busy = timing.timer_now()
    assert isinstance(busy.read, timing.OwnCpuTime) and busy.pick is statistics.median
    assert timing.timer_now().read is not busy.read  # each timer its own clock: no state shared
    assert "99.0" in busy.busy and f"{timing.cpus()} CPUs" in busy.busy


@pytest.mark.parametrize("pick, expected", [(min, [1.0, 4.0]), (statistics.median, [3.0, 4.0])])
def test_graphs_taking_turns_are_read_on_the_timers_clock_and_picked_by_it(pick, expected):
    """Warm-ups, then three runs of each graph in turn; the timer's pick of each graph's runs."""
    sym = _conv1d_net()
    clock = _reads(_runs([9.0, 9.0, 1.0, 4.0, 5.0, 4.0, 3.0, 10.0]))
    got = timing.time_graphs([sym, sym], {"data": (2, 4, 16)}, train=True, runs=3, timer=timing.Timer(clock, pick))
    assert got == pytest.approx(expected)


def test_on_a_busy_machine_the_default_timer_reads_cpu_time(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    monkeypatch.setattr(timing, "_thread_cpu_s", lambda native_id: 0.0)  # planted: the whole process's time
    monkeypatch.setattr(timing.time, "process_time", _reads(_runs([9.0, 9.0, 1.0, 4.0, 5.0, 4.0, 3.0, 10.0])))
    got = timing.time_graphs([_conv1d_net()] * 2, {"data": (2, 4, 16)}, train=True, runs=3)
    assert got == pytest.approx([3.0, 4.0])
    monkeypatch.setattr(timing.time, "process_time", _reads(_runs([50.0, 2.0, 7.0, 3.0, 9.0, 1.0])))
    got = timing.time_op("FullyConnected", {"num_hidden": "4"}, [(2, 8), (4, 8), (4,)], ["float32"] * 3, True)
    assert got == pytest.approx(3.0)  # the median of the 5 runs after the warm-up


def _burn(seconds, started=None, stop=None):
    """Hash for ``seconds`` of wall time (or until ``stop`` is set): CPU work that releases the
    GIL, as a loader's does."""
    data = b"x" * (1 << 22)
    if started is not None:
        started.set()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        hashlib.sha256(data).digest()


def _until_the_process_used(cpu0, seconds, limit=10.0):
    """Sleep until the process has used ``seconds`` of CPU since ``cpu0`` (its other threads'
    work: a loaded machine gives them less per second of wall time), or ``limit`` seconds."""
    end = time.perf_counter() + limit
    while time.process_time() - cpu0 < seconds and time.perf_counter() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("begins", ["before the first reading", "between the readings"])
def test_a_busy_machines_clock_leaves_out_the_users_other_threads(begins):
    """A busy machine times graphs in CPU time; a data loader's thread working beside the
    timing was counted as the graph's. The process's CPU time shows the thread's work, the
    clock leaves it out wherever the thread began, and never runs backwards as threads end."""
    clock = timing.OwnCpuTime()
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_burn, args=(30.0, started, stop), daemon=True)
    if begins == "before the first reading":
        worker.start()
        started.wait()
        _until_the_process_used(time.process_time(), 0.05)  # CPU used before the first reading too
    own0, cpu0 = clock(), time.process_time()
    if begins == "between the readings":
        worker.start()
        started.wait()
    _until_the_process_used(cpu0, 0.2)  # wall time varies with the machine's load; CPU does not
    own1, cpu1 = clock(), time.process_time()
    stop.set()
    worker.join()
    own2 = clock()
    assert cpu1 - cpu0 > 0.1  # the worker ran
    assert own1 - own0 < 0.02 + 0.1 * (cpu1 - cpu0)
    assert own0 <= own1 <= own2


def test_a_busy_machines_clock_counts_mxnets_threads():
    """The graph runs on MXNet's engine threads while the caller waits: that work counts."""
    clock = timing.OwnCpuTime()
    a = mx.nd.random.uniform(shape=(768, 768))
    a.wait_to_read()
    own0, cpu0 = clock(), time.process_time()
    for _ in range(20):
        a = mx.nd.dot(a, a) / 768
    a.wait_to_read()
    own1, cpu1 = clock(), time.process_time()
    assert cpu1 - cpu0 > 0.05
    assert own1 - own0 == pytest.approx(cpu1 - cpu0, rel=0.1, abs=0.01)
