"""The speed probe, the decision it feeds, and tune=True (gluon_amp.speed)."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp import runtime
from gluon_amp.speed import probe, tuner
from gluon_amp_core.capability import Bf16, Capability
from gluon_amp_core.speed import PROBE, SpeedVerdict, timings_from_records
from gluon_amp_core.tune import Timed
from helpers import ROOT, make_net, no_bf16_env

HOSTS = json.load(open(os.path.join(ROOT, "tests", "core", "data", "probe_hosts.json")))["hosts"]
SLOW = SpeedVerdict("bfloat16", timings_from_records(HOSTS["intel_xeon_no_amx"]["items"]), "cached", "/c.json")
NATIVE = Capability(0, Bf16.NATIVE, "AVX512_CORE_BF16", "oneDNN runs bfloat16 natively", amx_hint="AMX is hidden")


@pytest.fixture
def native_host(monkeypatch):
    """This process believes it has native bfloat16, whatever the CPU; probe state isolated."""
    monkeypatch.setattr(runtime, "capability", lambda: NATIVE)
    monkeypatch.setattr(runtime, "_warned", set())
    monkeypatch.delenv(probe.ENV, raising=False)
    probe.forget()
    yield
    probe.forget()


def test_measured_slower_keeps_float32_with_one_warning_and_an_explicit_target_is_obeyed(native_host, monkeypatch):
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


def test_the_override_variable_keeps_the_flag_rule_and_says_so(native_host, monkeypatch):
    monkeypatch.setenv(probe.ENV, "0")
    monkeypatch.setattr(probe, "verdict", lambda *a: pytest.fail("the probe ran although turned off"))
    with pytest.warns(RuntimeWarning, match="GLUON_AMP_SPEED_PROBE=0"):
        assert runtime.resolve(None).dtype == "bfloat16"
    assert "GLUON_AMP_SPEED_PROBE=0" in gluon_amp.runtime_info()["speed"]["source"]


@pytest.mark.bf16_kernels
def test_the_probe_measures_once_then_reads_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(probe.ENV, raising=False)
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


def _recorded_times(conv_low, conv_fp32):
    """Per-op times as recorded on a host where bfloat16 convolutions are slow (issue 26)."""
    def measure(prob, cache):
        times = {}
        for t in prob.to_time():
            slow = t.op == "Convolution"
            low = "bfloat16" in t.dtypes
            times[t.key] = 0.01 if t.op == "amp_cast" else (conv_low if low else conv_fp32) if slow else 1.0 if low else 1.1
        return times, len(times), 0
    return measure


def test_tune_keeps_an_op_recorded_slower_in_float32_and_the_report_names_it(monkeypatch):
    monkeypatch.setattr(tuner, "measure", _recorded_times(409.0, 205.0))
    graph_ms = iter([1000.0, 700.0])  # the plan, then the plan with the convolutions in float32
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
    net = make_net()
    x = mx.nd.ones((2, 3, 8, 8))
    ref = net(x).asnumpy()
    block = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes={"data": x.shape})
    rows = {r.name: r for r in gluon_amp.report(block).rows}
    conv = rows[net.conv.name + "_fwd"]
    assert (conv.dtype, conv.reason) == ("float32", "measured")
    assert conv.detail.startswith("float32: measured 2.0x slower in bfloat16 (409.00 vs 205.00 ms)")
    assert "1000 -> 700 ms" in conv.detail and "float32: measured 2.0x slower" in str(gluon_amp.report(block))
    assert rows[net.dense.name + "_fwd"].dtype == "bfloat16"  # recorded faster: stays low
    if gluon_amp.runtime.executable("bfloat16", "cpu"):
        assert np.abs(block(x).asnumpy() - ref).max() < 5e-2


def test_a_change_the_whole_graph_does_not_confirm_is_not_kept(monkeypatch):
    monkeypatch.setattr(tuner, "measure", _recorded_times(409.0, 205.0))
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: 1000.0)  # no faster as a whole
    net = make_net()
    net(mx.nd.ones((2, 3, 8, 8)))
    block = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes={"data": (2, 3, 8, 8)})
    assert "measured" not in {r.reason for r in gluon_amp.report(block).rows}


def test_tune_needs_input_shapes_and_rejects_emulation_with_clear_errors():
    net = make_net()
    net(mx.nd.ones((1, 3, 8, 8)))
    with pytest.raises(ValueError, match=r"input_shapes=\{'data'"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True)
    with pytest.raises(ValueError, match="missing"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True, input_shapes={"x": (1, 3, 8, 8)})
    with pytest.raises(ValueError, match="positive ints"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True, input_shapes={"data": (1, -3, 8, 8)})
    with pytest.raises(ValueError, match="emulate=True"):
        gluon_amp.init("bfloat16", emulate=True, tune=True)
    with pytest.raises(TypeError, match="tune"):
        gluon_amp.make_policy("bfloat16", tune="yes")
    assert not gluon_amp.is_enabled()


@pytest.mark.bf16_kernels
def test_init_tune_trains_with_the_recorded_choice_in_the_training_graph(monkeypatch, tmp_path):
    from mxnet import autograd
    from helpers import sgd_trainer
    monkeypatch.setattr(tuner, "measure", _recorded_times(409.0, 205.0))
    graph_ms = iter([1000.0, 700.0])
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
    monkeypatch.setattr(runtime, "timing_cache", lambda: __import__("gluon_amp_core.timing_cache", fromlist=["x"]).TimingCache(str(tmp_path), {"k": 1}))
    gluon_amp.init("bfloat16", tune=True)
    net = make_net()
    trainer = sgd_trainer(net)
    scaler = gluon_amp.init_trainer(trainer)
    x = mx.nd.random.normal(shape=(4, 3, 8, 8))
    for _ in range(3):
        with autograd.record():
            loss = net(x).sum()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(4)
    rows = {r.name: r for r in gluon_amp.report(net).rows}
    assert rows[net.conv.name + "_fwd"].reason == "measured" and rows[net.conv.name + "_fwd"].dtype == "float32"
    assert net.conv.weight.grad().dtype == np.float32 and np.isfinite(net.conv.weight.grad().asnumpy()).all()
    assert scaler.skipped_steps == 0 and np.isfinite(loss.asnumpy()).all()
