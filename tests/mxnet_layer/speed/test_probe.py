"""The speed probe (gluon_amp.speed.probe), its cache, and the decision it feeds."""
import json
import os
import subprocess
import sys

import pytest

import gluon_amp
from gluon_amp import runtime
from gluon_amp.speed import probe, timing
from gluon_amp_core.capability import Bf16, Capability
from gluon_amp_core.speed.probe import PROBE, SpeedVerdict, timings_from_records
from helpers import ROOT, no_bf16_env

HOSTS = json.load(open(os.path.join(ROOT, "tests", "core", "data", "probe_hosts.json")))["hosts"]
SLOW = SpeedVerdict("bfloat16", timings_from_records(HOSTS["intel_xeon_no_amx"]["items"]), "cached", "/c.json")
NATIVE = Capability(0, Bf16.NATIVE, "AVX512_CORE_BF16", "oneDNN runs bfloat16 natively", amx_hint="AMX is hidden")


@pytest.fixture
def believes_native(monkeypatch):
    """This process believes it has native bfloat16, whatever the CPU; probe state isolated."""
    monkeypatch.setattr(runtime, "capability", lambda: NATIVE)
    monkeypatch.setattr(gluon_amp.state.process, "said", set())
    monkeypatch.delenv(probe.ENV, raising=False)
    probe.forget()
    yield
    probe.forget()


def test_measured_slower_keeps_float32_with_one_warning_and_an_explicit_target_is_obeyed(believes_native, monkeypatch):
    monkeypatch.setattr(probe, "verdict", lambda dtype, cache: SLOW)
    with pytest.warns(RuntimeWarning) as caught:
        policy = gluon_amp.init()
    assert policy.target_dtype == "float32" and not policy.enabled and not gluon_amp.is_enabled()
    said = [str(w.message) for w in caught if "mixed precision is off" in str(w.message)]
    assert len(said) == 1 and "0.78x" in said[0] and "target_dtype='bfloat16'" in said[0] and "AMX is hidden" in said[0]
    info = gluon_amp.runtime_info()
    assert info["default_target_dtype"] == "float32" and info["speed"]["decision"] == "float32"
    assert info["speed"]["source"] == "cached" and info["speed"]["path"] == "/c.json" and not info["speed"]["faster"]
    with pytest.warns(RuntimeWarning, match="as asked"):
        assert gluon_amp.init("bfloat16").target_dtype == "bfloat16"


def test_the_override_variable_keeps_the_flag_rule_and_says_so(believes_native, monkeypatch):
    monkeypatch.setenv(probe.ENV, "0")
    monkeypatch.setattr(probe, "verdict", lambda *a: pytest.fail("the probe ran although turned off"))
    with pytest.warns(RuntimeWarning, match="GLUON_AMP_SPEED_PROBE=0"):
        assert runtime.resolve(None).dtype == "bfloat16"
    assert "GLUON_AMP_SPEED_PROBE=0" in gluon_amp.runtime_info()["speed"]["source"]


@pytest.mark.bf16_kernels
def test_the_probe_measures_once_then_reads_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(probe.ENV, raising=False)
    # a quiet machine, planted: under a real load the probe rightly keeps nothing (tested below)
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(probe, "others_cpu_s", lambda: 0.0)  # nor beside other work (the suite's)
    runtime.timing_cache.cache_clear()
    probe.forget()
    try:
        first = runtime.speed(None)
        assert first.source == "measured" and os.path.dirname(first.path) == str(tmp_path / "gluon-amp")
        assert [t.kind for t in first.timings] == [kind for _, kind, _ in PROBE]
        assert all(t.fp32_ms > 0 and t.low_ms > 0 for t in first.timings)
        probe.forget()
        again = runtime.speed(None)
        assert again.source == "cached" and again.timings == first.timings and again.path == first.path
    finally:
        runtime.timing_cache.cache_clear()
        probe.forget()


def test_without_bf16_kernels_the_probe_does_not_run_and_writes_nothing(tmp_path):
    code = ("import warnings, json, gluon_amp; warnings.simplefilter('ignore'); i = gluon_amp.runtime_info();"
            "print(json.dumps([i['default_target_dtype'], i['speed']['source'], i['bf16']]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**no_bf16_env(), "XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    dtype, source, bf16 = json.loads(r.stdout.strip().splitlines()[-1])
    assert (dtype, bf16) == ("float32", "none") and source.startswith("not run") and not os.listdir(tmp_path)


def _scripted_clock(deltas):
    """A clock whose successive reads advance by ``deltas`` in turn (seconds)."""
    state = {"now": 0.0, "k": 0}

    def read():
        state["now"] += deltas[state["k"] % len(deltas)]
        state["k"] += 1
        return state["now"]
    return read


def _plant_cpu_time(monkeypatch, tmp_path, fp32_ms, low_ms):
    """A fresh cache in ``tmp_path``, and CPU time planted: each float32 run of a probe item
    takes ``fp32_ms`` of it, each low run ``low_ms``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(probe.ENV, raising=False)
    # each item's runs take turns, float32 first: its start and end, then the low graph's
    monkeypatch.setattr(probe.time, "process_time", _scripted_clock([0.0, fp32_ms / 1e3, 0.0, low_ms / 1e3]))
    # the planted clock is the whole process's: no other thread's real CPU time is taken from it
    monkeypatch.setattr(timing, "_thread_cpu_s", lambda native_id: 0.0)
    runtime.timing_cache.cache_clear()
    probe.forget()


def _figures(verdict):
    return [v for t in verdict.timings for v in (t.fp32_ms, t.low_ms)]


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("fp32_ms, low_ms, dtype", [(10.0, 5.0, "bfloat16"), (5.0, 10.0, "float32")])
def test_a_probe_on_a_busy_machine_times_cpu_time_decides_by_it_and_keeps_it_apart(
        tmp_path, monkeypatch, fp32_ms, low_ms, dtype):
    """Wall time on a loaded machine measures the load, so the probe reads the process's CPU
    time there (planted: each float32 run takes ``fp32_ms`` of it, each low run ``low_ms``).
    The figures decide as measured, where the CPU flags alone chose bfloat16 before (on this
    project's Xeon without AMX, 0.67x float32's speed). They are kept apart: a process
    started under load reads them (ranks started together choose alike), a quiet one
    measures wall time again."""
    load = [99.0]
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (load[0],) * 3)
    monkeypatch.setattr(probe, "others_cpu_s", lambda: 0.0)  # the quiet run below: nothing beside it
    _plant_cpu_time(monkeypatch, tmp_path, fp32_ms, low_ms)
    try:
        verdict = runtime.speed(None)
        assert verdict.source == "measured" and verdict.busy and "99.0" in verdict.busy
        assert _figures(verdict) == pytest.approx([fp32_ms, low_ms] * len(PROBE))
        assert runtime.resolve(None, warn=False).dtype == dtype
        assert gluon_amp.runtime_info()["speed"]["busy"] == verdict.busy
        probe.forget()  # another process started under load: reads them, and chooses alike
        again = runtime.speed(None)
        assert (again.source, again.timings, again.busy) == ("cached", verdict.timings, verdict.busy)
        assert runtime.resolve(None, warn=False).dtype == dtype
        probe.forget()  # a quiet machine: wall time, measured again and kept as the machine's figures
        load[0] = 0.0
        quiet = runtime.speed(None)
        assert quiet.source == "measured" and quiet.busy is None and quiet.timings != verdict.timings
        probe.forget()
        load[0] = 99.0  # and from then on even a busy process reads the quiet figures
        assert runtime.speed(None).timings == quiet.timings and runtime.speed(None).busy is None
    finally:
        runtime.timing_cache.cache_clear()
        probe.forget()


@pytest.mark.bf16_kernels
def test_a_probe_beside_other_work_times_cpu_time_and_keeps_it_apart(tmp_path, monkeypatch):
    """The load average lags: a probe it calls quiet can still share its CPUs with other
    work, and then its wall-clock figures measure that work (an AMX host's basic block at
    40 ms in bfloat16 against 27 in float32, both ways round from quiet). Planted: other
    work used 50 CPU seconds while the first timing ran. The probe times CPU time again
    (planted: float32 10 ms, bfloat16 5 ms a run), decides by it, says why, and keeps those
    figures apart; a later probe with nothing beside it measures wall time and keeps it."""
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    others = iter([0.0, 50.0])
    monkeypatch.setattr(probe, "others_cpu_s", lambda: next(others, 50.0))
    _plant_cpu_time(monkeypatch, tmp_path, 10.0, 5.0)
    try:
        verdict = runtime.speed(None)
        assert verdict.source == "measured" and verdict.busy and "other work used" in verdict.busy
        assert _figures(verdict) == pytest.approx([10.0, 5.0] * len(PROBE))
        assert runtime.resolve(None, warn=False).dtype == "bfloat16"
        probe.forget()  # nothing beside it now: wall time, measured again and kept as the machine's
        monkeypatch.setattr(probe, "others_cpu_s", lambda: 0.0)
        quiet = runtime.speed(None)
        assert quiet.source == "measured" and quiet.busy is None and quiet.timings != verdict.timings
        probe.forget()
        assert runtime.speed(None).source == "cached" and runtime.speed(None).timings == quiet.timings
    finally:
        runtime.timing_cache.cache_clear()
        probe.forget()


def test_the_cache_key_changes_with_gluon_amps_code(tmp_path, monkeypatch):
    """A whole-graph verdict holds for the graph the measuring version ran: a new gluon_amp
    (any source of it or of its core) measures again."""
    import importlib
    import types

    key = probe.machine_key(frozenset({"avx2"}), False, "AVX2", None)
    assert key["gluon_amp"] == probe.code_digest() and len(key["gluon_amp"]) == 16
    for pkg in ("gluon_amp", "gluon_amp_core"):
        (tmp_path / pkg / "sub").mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("x = 1\n")
        (tmp_path / pkg / "sub" / "m.py").write_text("y = 2\n")
        (tmp_path / pkg / "sub" / "built.so").write_text("not a source")
    fakes = {p: types.SimpleNamespace(__file__=str(tmp_path / p / "__init__.py"))
             for p in ("gluon_amp", "gluon_amp_core")}
    monkeypatch.setattr(importlib, "import_module", lambda name: fakes[name])
    probe.code_digest.cache_clear()
    try:
        first = probe.code_digest()
        (tmp_path / "gluon_amp" / "sub" / "built.so").write_text("rebuilt")  # not a source: same
        probe.code_digest.cache_clear()
        assert probe.code_digest() == first
        (tmp_path / "gluon_amp_core" / "sub" / "m.py").write_text("y = 3\n")
        probe.code_digest.cache_clear()
        assert probe.code_digest() != first
    finally:
        monkeypatch.undo()
        probe.code_digest.cache_clear()
    assert probe.code_digest() == key["gluon_amp"]


def test_a_simulated_host_whose_cache_folder_cannot_be_written_reads_its_planted_figures(tmp_path):
    """``XDG_CACHE_HOME`` naming a file: the simulated host's ``init`` ended in a raw
    ``NotADirectoryError`` (a real host's probe measures and goes on)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    env = {**os.environ, "XDG_CACHE_HOME": str(blocker), "GLUON_AMP_SIMULATE_NATIVE_BF16": "1",
           "PYTHONPATH": ROOT}
    code = ("import json, warnings; warnings.simplefilter('ignore'); import gluon_amp\n"
            "p = gluon_amp.init(target_dtype='bfloat16')\n"
            "print(json.dumps([p.enabled, gluon_amp.runtime.speed('bfloat16', False).timings[0].low_ms]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [True, runtime.SIMULATED_PROBE[0].low_ms]
