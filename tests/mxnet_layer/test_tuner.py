"""tune=True: precision per op chosen by measured speed (gluon_amp.speed.tuner)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp import runtime
from gluon_amp.speed import tuner
from gluon_amp_core.timing_cache import TimingCache
from helpers import ROOT, MixedNet, make_net


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Each test tunes into a cache of its own: an outcome stored for the same graph by an
    earlier test would be read back instead of the figures this test gives."""
    monkeypatch.setattr(runtime, "timing_cache", lambda: TimingCache(str(tmp_path), {"k": 1}))


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
def test_init_tune_trains_with_the_recorded_choice_in_the_training_graph(monkeypatch):
    from mxnet import autograd
    from helpers import sgd_trainer
    monkeypatch.setattr(tuner, "measure", _recorded_times(409.0, 205.0))
    graph_ms = iter([1000.0, 700.0])
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
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


def test_conversion_with_input_shapes_tunes_by_default_and_tune_false_opts_out(monkeypatch):
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)  # the suite turns the default off
    monkeypatch.setattr(tuner, "measure", _recorded_times(409.0, 205.0))
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: 1000.0 if k.get("give_up_ms") is None else 700.0)
    net = make_net()
    net(mx.nd.ones((2, 3, 8, 8)))
    shapes = {"data": (2, 3, 8, 8)}
    tuned = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, input_shapes=shapes)
    plain = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, input_shapes=shapes, tune=False)
    assert "measured" in {r.reason for r in gluon_amp.report(tuned).rows}
    assert "measured" not in {r.reason for r in gluon_amp.report(plain).rows}
    assert tuned.amp_result.policy.tune and not plain.amp_result.policy.tune


def test_cli_tunes_with_input_shapes_and_refuses_no_tune_alone(tmp_path):
    net = make_net()
    net(mx.nd.ones((2, 3, 8, 8)))
    net.export(str(tmp_path / "m"), 0)
    run = [sys.executable, "-m", "gluon_amp.convert", str(tmp_path / "m"), "0", "--target-dtype", "bfloat16",
           "--out", str(tmp_path / "o"), "--no-fuse"]
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run(run + ["--input-shape", "data=2,3,8,8"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tuned:" in r.stdout and os.path.exists(tmp_path / "o-symbol.json")
    r = subprocess.run(run + ["--no-tune"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "--input-shape" in r.stderr
    r = subprocess.run(run + ["--input-shape", "data=2,x"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "positive integers" in r.stderr


def test_tune_defaults_on_except_when_emulating_or_turned_off(monkeypatch):
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)
    assert gluon_amp.make_policy("bfloat16").tune
    assert not gluon_amp.make_policy("bfloat16", tune=False).tune
    assert not gluon_amp.make_policy("bfloat16", emulate=True).tune
    monkeypatch.setenv("GLUON_AMP_TUNE", "0")
    assert not gluon_amp.make_policy("bfloat16").tune
    assert gluon_amp.make_policy("bfloat16", tune=True).tune  # an explicit choice wins


def test_a_graph_tuned_once_is_found_again_under_other_parameter_names():
    """The tuning outcome is cached per graph: the same network built as another instance
    (another name prefix, e.g. after an FP32 copy in the same process) must find it."""
    def key(prefix, shape=(2, 3, 8, 8)):
        net = MixedNet(prefix=prefix)
        graph = json.loads(net(mx.sym.var("data")).tojson())
        params = {p.name: "float32" for p in net.collect_params().values()}
        assert params and all(n.startswith(prefix) for n in params)
        return tuner.signature(graph, {"data": shape}, {"data": "float32", **params}, True, False)

    assert key("first_") == key("second_")
    assert key("first_") != key("third_", (4, 3, 8, 8))  # other shapes: another tuning
