"""tune=True: precision per op chosen by measured speed (gluon_amp.tuning.tuner)."""
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
from gluon_amp.speed import probe
from gluon_amp.speed.timing import WALL
from gluon_amp.tuning import schedule, tuner
from gluon_amp_core.speed.probe import timings_to_records
from gluon_amp_core.timing_cache import TimingCache
from gluon_amp_core.tuning.schedule import Ledger
from helpers import ROOT, MixedNet, make_net, no_bf16_env


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Each test tunes into a cache of its own: an outcome stored for the same graph by an
    earlier test would be read back instead of the figures this test gives. It holds the
    simulation's probe figures (bfloat16 faster), so that on a real host too these tests see
    the tuner, not this machine's probe (one that measured bfloat16 slower: below, and
    tests/mxnet_layer/convert/test_conversion_speed_rule.py)."""
    cache = TimingCache(str(tmp_path), {"k": 1})
    cache.store({probe._entry("bfloat16"): timings_to_records(runtime.SIMULATED_PROBE)})
    monkeypatch.setattr(runtime, "timing_cache", lambda: cache)
    # Each job picks its clock by the host's load when it starts, and figures on another clock
    # are not reused: a load crossing the limit between two jobs of one test (CI under
    # make test's load) would make the later job re-time what the test says it reads back.
    monkeypatch.setattr(tuner, "timer_now", lambda: WALL)
    probe.forget()
    yield
    probe.forget()


def _recorded_times(conv_low, conv_fp32):
    """Per-op times as recorded on a host where bfloat16 convolutions are slow (issue 26)."""
    def time_one(t, timer):
        slow = t.op == "Convolution"
        low = "bfloat16" in t.dtypes
        return 0.01 if t.op == "amp_cast" else (conv_low if low else conv_fp32) if slow else 1.0 if low else 1.1
    return time_one


def _check(monkeypatch, plan=1000.0, fp32=1500.0):
    """Planted whole-graph check: the plan and the same graph in float32 (ms), timed together."""
    checks = []

    def time_graphs(syms, *a, **k):
        checks.append(len(syms))
        return [plan, fp32]
    monkeypatch.setattr(tuner, "time_graphs", time_graphs)
    return checks


def test_tune_keeps_an_op_recorded_slower_in_float32_and_the_report_names_it(monkeypatch):
    monkeypatch.setattr(tuner, "time_one", _recorded_times(409.0, 205.0))
    _check(monkeypatch)  # the plan 1000 ms, float32 1500 ms
    graph_ms = iter([700.0])  # the plan with the convolutions in float32
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
    net = make_net()
    x = mx.nd.ones((2, 4, 8, 8))
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


@pytest.mark.parametrize("damage", ["abc", [1.0], {"a": 1}, True, -1.0])
def test_a_damaged_per_op_figure_in_the_cache_is_timed_again(monkeypatch, damage):
    """One per-op figure of another type in the timing cache ("abc") ended a training step with
    Python's "unsupported operand type(s) for +" from the tuner's graph estimate."""
    timed = []
    recorded = _recorded_times(409.0, 205.0)
    monkeypatch.setattr(tuner, "time_one", lambda t, timer: timed.append(t.key) or recorded(t, timer))
    _check(monkeypatch)
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: 700.0)
    net = make_net()
    shapes = {"data": (2, 4, 8, 8)}
    net(mx.nd.ones(shapes["data"]))
    first = gluon_amp.report(gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True,
                                                            input_shapes=shapes))
    cache = runtime.timing_cache()
    entries = cache.load().entries
    ops = [k for k in entries if k.startswith("op/")]
    assert ops and len(timed) == len(ops)
    with open(cache.path) as f:
        doc = json.load(f)
    with open(cache.path, "w") as f:  # as a damaged file holds them: only the per-op figures
        json.dump({**doc, "entries": {
            **{k: v for k, v in entries.items() if k.startswith("probe/")},
            **{k: damage for k in ops}}}, f)
    timed.clear()
    again = gluon_amp.report(gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True,
                                                            input_shapes=shapes))
    assert len(timed) == len(ops)  # every damaged figure timed again, none read
    assert [(r.name, r.dtype) for r in again.rows] == [(r.name, r.dtype) for r in first.rows]


def test_a_change_the_whole_graph_does_not_confirm_is_not_kept(monkeypatch):
    monkeypatch.setattr(tuner, "time_one", _recorded_times(409.0, 205.0))
    _check(monkeypatch)
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: 1000.0)  # no faster as a whole
    net = make_net()
    net(mx.nd.ones((2, 4, 8, 8)))
    block = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes={"data": (2, 4, 8, 8)})
    assert "measured" not in {r.reason for r in gluon_amp.report(block).rows}


def test_conversion_tunes_within_the_budgets_cap_and_converts_the_plan_past_it(monkeypatch, clock):
    timed, graphs = _plant(monkeypatch, clock, op_s_per_element=2e-4)
    net = make_net()
    net(mx.nd.ones((2, 4, 8, 8)))
    shapes = {"data": (2, 4, 8, 8)}
    policy = gluon_amp.make_policy("bfloat16", tune=True, tune_budget=3)  # 3 s: the check (2 s), some ops, no trial
    capped = gluon_amp.convert_hybrid_block(net, policy, fuse=False, input_shapes=shapes)
    assert timed and [g[1] for g in graphs] == [[], "float32"]  # the plan and float32, no trial
    assert "measured" not in {r.reason for r in gluon_amp.report(capped).rows}
    assert schedule.process_ledger().spent <= 3 + schedule.process_ledger().overrun
    n_timed = len(timed)
    tuned = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes=shapes)  # 600 s
    assert "measured" in {r.reason for r in gluon_amp.report(tuned).rows}
    assert all(t.key not in {u.key for u in timed[:n_timed]} for t in timed[n_timed:])  # continued, not redone


@pytest.mark.parametrize("busy", [None, "the machine was busy (planted)"])
def test_a_job_times_everything_on_one_clock_and_keeps_cpu_times_apart(monkeypatch, busy):
    """A job compares its timings with each other: all are read on the clock of the moment it
    began (CPU time on a busy machine), and per-op figures in CPU time are kept apart from
    wall-clock ones, which a quiet process compares them with."""
    import statistics
    from gluon_amp.speed.timing import Timer
    job_timer = WALL if busy is None else Timer(lambda: 0.0, statistics.median, busy)
    monkeypatch.setattr(tuner, "timer_now", lambda: job_timer)
    seen = []
    recorded = _recorded_times(409.0, 205.0)

    def time_one(t, timer):
        seen.append(timer)
        return recorded(t, timer)

    def time_graphs(syms, *a, timer=None, **k):
        seen.append(timer)
        return [1000.0, 1500.0]

    def time_graph(*a, timer=None, **k):
        seen.append(timer)
        return 700.0
    monkeypatch.setattr(tuner, "time_one", time_one)
    monkeypatch.setattr(tuner, "time_graphs", time_graphs)
    monkeypatch.setattr(tuner, "time_graph", time_graph)
    net = make_net()
    net(mx.nd.ones((2, 4, 8, 8)))
    block = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes={"data": (2, 4, 8, 8)})
    assert "measured" in {r.reason for r in gluon_amp.report(block).rows}
    assert len(seen) > 3 and all(t is job_timer for t in seen)
    ops = [k for k in runtime.timing_cache().load().entries if k.startswith("op/")]
    assert ops and all(k.startswith("op/cpu/") == (busy is not None) for k in ops)


def test_tune_needs_input_shapes_and_rejects_emulation_with_clear_errors():
    net = make_net()
    net(mx.nd.ones((1, 4, 8, 8)))
    with pytest.raises(ValueError, match=r"input_shapes=\{'data'"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True)
    with pytest.raises(ValueError, match="missing"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True, input_shapes={"x": (1, 4, 8, 8)})
    with pytest.raises(ValueError, match="positive ints"):
        gluon_amp.convert_hybrid_block(net, "bfloat16", tune=True, input_shapes={"data": (1, -3, 8, 8)})
    with pytest.raises(ValueError, match="emulate=True"):
        gluon_amp.init("bfloat16", emulate=True, tune=True)
    with pytest.raises(TypeError, match="tune"):
        gluon_amp.make_policy("bfloat16", tune="yes")
    assert not gluon_amp.is_enabled()


def test_init_tune_trains_with_the_recorded_choice_in_the_training_graph_from_the_call_a_shape_repeats(
        native_host, monkeypatch):
    """Real training steps at changing shapes: the first call runs the plan, the second (its
    shape repeats) tunes and rebuilds the graph; later shapes keep the choice (decided by a
    wide margin) without timing anything again; no step is lost."""
    from mxnet import autograd
    from helpers import sgd_trainer
    from gluon_amp_core.tuning import verdict
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_ELEMENTS_PER_LOW_OP", 0)  # tiny ops: see _plant
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)
    monkeypatch.setattr(tuner, "time_one", _recorded_times(409.0, 205.0))
    _check(monkeypatch)
    graph_ms = iter([700.0])
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
    kinds = _spy_jobs(monkeypatch)
    gluon_amp.init("bfloat16", tune=True, tune_budget=60)
    net = make_net()
    trainer = sgd_trainer(net)
    scaler = gluon_amp.init_trainer(trainer)
    conv = net.conv.name + "_fwd"
    for k, batch in enumerate([2, 2, 2, 8, 8, 8, 16, 16]):
        x = mx.nd.random.normal(shape=(batch, 4, 8, 8))
        with autograd.record():
            loss = net(x).sum()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(4)
        row = {r.name: r for r in gluon_amp.report(net).rows}[conv]
        assert (row.reason == "measured") == (k >= 1), k  # the plan first; tuned from the call that repeats
    assert row.dtype == "float32" and "409.00 vs 205.00 ms" in row.detail
    assert kinds == ["full", "recheck", "recheck"] and next(graph_ms, None) is None  # no whole graph timed again
    assert net.conv.weight.grad().dtype == np.float32 and np.isfinite(net.conv.weight.grad().asnumpy()).all()
    assert scaler.skipped_steps == 0 and np.isfinite(loss.asnumpy()).all()
    info = gluon_amp.runtime_info()["tune"]
    assert info["graphs"][0]["float32_choices"] == sorted([conv, net.side.name + "_fwd"])  # both recorded slow
    assert "tuned at input shapes" in info["graphs"][0]["status"]
    assert "tuned at input shapes" in gluon_amp.report(net).tuning


def test_init_on_a_host_whose_probe_measured_bfloat16_slower_trains_float32_until_the_graph_measures_faster(
        native_host, monkeypatch):
    """An explicit bfloat16 where the probe measured it slower (a VM that hides AMX): the first
    calls run float32, saying why; once the whole-graph check measures the plan faster, it runs."""
    from mxnet import autograd
    from helpers import probe_host_items, sgd_trainer
    from gluon_amp_core.tuning import verdict
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_ELEMENTS_PER_LOW_OP", 0)  # by its figures alone the
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)  # tiny net would run the plan
    runtime.timing_cache().store({probe._entry("bfloat16"): probe_host_items("intel_xeon_no_amx")})
    probe.forget()
    slow = runtime.speed("bfloat16", warn=False)
    assert not slow.faster
    monkeypatch.setattr(tuner, "time_one", _recorded_times(205.0, 409.0))  # each op faster low
    checks = _check(monkeypatch, plan=1000.0, fp32=1500.0)
    gluon_amp.init("bfloat16", tune=True, tune_budget="inf")
    net = make_net()
    trainer = sgd_trainer(net)
    gluon_amp.init_trainer(trainer)
    conv = net.conv.name + "_fwd"
    dtypes = []
    for _ in range(3):
        x = mx.nd.random.normal(shape=(2, 4, 8, 8))
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
        rep = gluon_amp.report(net)
        dtypes.append({r.name: r for r in rep.rows}[conv].dtype)
        if len(dtypes) == 1:
            assert "runs float32 until measured" in rep.tuning and slow.describe() in rep.tuning, rep.tuning
    assert dtypes[0] == "float32" and dtypes[-1] == "bfloat16", dtypes  # the measurement decided
    assert checks and np.isfinite(loss.asnumpy()).all()


def _symbol_block_of_mixednet():
    """``(net, data, block)``: a hybridized SymbolBlock of MixedNet's graph, traced now (under
    whatever policy is in force), as GluonCV builds its feature extractors."""
    from mxnet import gluon
    net = MixedNet()
    net.initialize()
    data = mx.sym.var("data")
    block = gluon.SymbolBlock(net(data), [data], params=net.collect_params())
    block.hybridize(static_alloc=True)
    return net, data, block


def test_a_symbolblock_built_under_init_tunes_from_its_second_call_too(native_host, monkeypatch):
    """GluonCV builds feature extractors as SymbolBlocks from symbols: the hooks rewrite the
    graph they were given; tuning rebuilds it from that graph, not on its first call."""
    from gluon_amp_core.tuning import verdict
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_ELEMENTS_PER_LOW_OP", 0)  # tiny ops: see _plant
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)
    monkeypatch.setattr(tuner, "time_one", _recorded_times(409.0, 205.0))
    _check(monkeypatch)
    graph_ms = iter([700.0])
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: next(graph_ms))
    gluon_amp.init("bfloat16", tune=True, tune_budget=60)
    net, _, block = _symbol_block_of_mixednet()
    measured = []
    for _ in range(3):
        block(mx.nd.ones((2, 4, 8, 8))).wait_to_read()
        measured.append(sorted(r.name for r in gluon_amp.report(block).rows if r.reason == "measured"))
    assert measured[0] == [] and net.conv.name + "_fwd" in measured[1] and measured[2] == measured[1]


@pytest.mark.parametrize("name, shape, runs_fp32", [("ssd_512_mobilenet1.0_voc", (2, 3, 512, 512), True),
                                                     ("ssd_512_mobilenet1.0_coco", (2, 3, 512, 512), True),
                                                     ("ssd_512_mobilenet1.0_coco", (8, 3, 512, 512), True),
                                                     ("resnext50_32x4d", (4, 3, 224, 224), False),
                                                     ("cifar_resnet20_v1", (32, 3, 32, 32), False)])
def test_the_guards_weight_sits_between_measured_training_graphs(monkeypatch, name, shape, runs_fp32):
    """GUARD_CAST_WEIGHT is fitted between training graphs measured on a 2-core AMX host (plan
    against FP32, steps interleaved in one process): GluonCV's SSD-512 MobileNet 1.0 on VOC at
    batch 2 (train_ssd.py: its plan 0.75x FP32; counted at 1 it ran that plan until measured), on
    COCO at batch 2 and 8 (its plan 0.92x and 0.95x FP32; at 1.5 it ran that plan) run float32 until
    measured; ResNeXt-50 32x4d (its plan 1.73x FP32, 32 guards) keeps its plan, and so does CIFAR
    ResNet-20 (batch 32: its plan 1.47x FP32, 8 guards): its float32 stem's output rides stage 1's
    identity shortcuts, 7 activation casts, which on AMX count at AMX_TRAINING_ACTIVATION_CAST_SHARE
    (docs/speed.md). Without AMX (no guard; activation casts count whole) all keep their plans."""
    from gluoncv.model_zoo import get_model
    from gluon_amp.patching.hooks import graph_rewriter
    data = mx.sym.var("data")
    policy = gluon_amp.make_policy("bfloat16", tune=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gluon_amp.autocast("bfloat16", tune=False):  # built under init, as a script's net is
            net = get_model(name, pretrained=False, **({"pretrained_base": False} if "ssd" in name else {}))
            net.initialize()
            out = net(data)
    out = mx.sym.Group(list(out)) if isinstance(out, (list, tuple)) else out
    known = {"data": "float32"}
    plan = graph_rewriter(policy)[0](net, (mx.nd.zeros(shape),), [data], out)
    for amx in (True, False):
        monkeypatch.setattr(runtime, "amx_active", lambda: amx)
        target = tuner.Target(plan, known, tuner.applier(plan, known, policy), policy, train=True)
        assert target.unmeasured_fp32({"data": shape}) == (runs_fp32 and amx)
        assert (target.guards({"data": shape}) > 0) == amx


class _GatedStack(mx.gluon.HybridBlock):
    """benchmarks/_vs_peer_script.py's WaveNet: dilated causal Conv1D layers with gated
    activations, residual and skip connections (a cast on most edges between them)."""

    def __init__(self, channels=64, layers=16, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.inp = mx.gluon.nn.Conv1D(channels, 1, in_channels=1)
            self.convs, self.res, self.skip = [], [], []
            for i in range(layers):
                d = 2 ** (i % 8)
                self.convs.append(mx.gluon.nn.Conv1D(2 * channels, 2, dilation=d, padding=d, in_channels=channels))
                self.res.append(mx.gluon.nn.Conv1D(channels, 1, in_channels=channels))
                self.skip.append(mx.gluon.nn.Conv1D(channels, 1, in_channels=channels))
                for b in (self.convs[-1], self.res[-1], self.skip[-1]):
                    self.register_child(b)
            self.out = mx.gluon.nn.Conv1D(1, 1, in_channels=channels)

    def hybrid_forward(self, F, x):
        h, skips = self.inp(x), []
        for i, (conv, res, skip) in enumerate(zip(self.convs, self.res, self.skip)):
            d = 2 ** (i % 8)
            a, b = F.split(conv(h).slice_axis(axis=-1, begin=0, end=-d), num_outputs=2, axis=1)
            z = F.tanh(a) * F.sigmoid(b)
            h = h + res(z)
            skips.append(skip(z))
        return self.out(F.relu(F.add_n(*skips) + h))


def test_on_amx_a_training_graphs_activation_casts_count_at_their_share(monkeypatch):
    """vs_peer's WaveNet at batch 32 (its plan trained at 1.2x FP32 on a 2-core AMX host): its
    figure is 96 multiply-adds per cast element with activation casts counted whole, below the
    line; on AMX a training graph counts them at AMX_TRAINING_ACTIVATION_CAST_SHARE, says so in
    its verdict, and keeps its plan. Without AMX, and converted (its converted plan ran no faster
    than float32), they count whole and it runs float32 until measured."""
    from gluon_amp.patching.hooks import graph_rewriter
    from gluon_amp_core.tuning.verdict import AMX_TRAINING_ACTIVATION_CAST_SHARE as SHARE
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_MACS_PER_CAST_ELEMENT as LINE
    net = _GatedStack()
    net.initialize()
    data = mx.sym.var("data")
    shapes, known = {"data": (32, 1, 512)}, {"data": "float32"}
    policy = gluon_amp.make_policy("bfloat16", tune=True)
    plan = graph_rewriter(policy)[0](net, (mx.nd.zeros(shapes["data"]),), [data], _traced(net, data))
    got = {}
    for amx in (True, False):
        monkeypatch.setattr(runtime, "amx_active", lambda: amx)
        for train in (True, False):
            target = tuner.Target(plan, known, tuner.applier(plan, known, policy), policy, train=train)
            said = target.describe_unmeasured("first call", shapes)
            assert (f"an activation's cast counted at {SHARE:g}" in said) == (amx and train), said
            got[amx, train] = (target.figures(shapes)[1], target.unmeasured_fp32(shapes), target.guards(shapes))
    assert [g[2] for g in got.values()] == [0, 0, 0, 0]  # no batch norm: the activation casts alone move
    assert got[False, True][0] < LINE <= got[True, True][0] and got[True, False] == got[False, False]
    assert got[True, True][1] is False and got[False, True][1] is True and got[True, False][1] is True
    # weights (at WEIGHT_CAST_SHARE) are counted whole on both sides: the figure grows by less than 1 / SHARE
    assert 1 < got[True, True][0] / got[False, True][0] < 1 / SHARE


def test_a_symbolblock_whose_plan_runs_float32_until_measured_is_not_called_stale(native_host):
    """A SymbolBlock built under init (GluonCV's SSD feature expander) whose graph the rule
    without a measurement runs in float32: the graph it runs has no cast left, but it was
    built under AMP and rewritten by it. GluonCV's train_ssd.py with mobilenet1.0 was told
    its feature expander "cached its graph before gluon_amp.init()"; a block that did is."""
    from mxnet import gluon
    gluon_amp.init("bfloat16", tune=True, tune_budget=0)
    net, data, block = _symbol_block_of_mixednet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block(mx.nd.ones((2, 4, 8, 8))).wait_to_read()
    assert "runs float32 until measured" in block.amp_tuning.verdict  # tiny ops: the rule's float32
    assert not [w for w in caught if "cached its graph" in str(w.message)]
    gluon_amp.disable()
    stale = gluon.SymbolBlock(net(data), [data], params=net.collect_params())  # built without AMP
    stale.hybridize()
    stale(mx.nd.ones((2, 4, 8, 8))).wait_to_read()
    gluon_amp.init("bfloat16", tune=True, tune_budget=0)
    with pytest.warns(RuntimeWarning, match="runs the graph it was given .*convert_hybrid_block"):
        stale(mx.nd.ones((2, 4, 8, 8))).wait_to_read()


def test_conversion_with_input_shapes_tunes_by_default_and_tune_false_opts_out(monkeypatch):
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)  # the suite turns the default off
    monkeypatch.setattr(tuner, "time_one", _recorded_times(409.0, 205.0))
    _check(monkeypatch)
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: 1000.0 if k.get("give_up_ms") is None else 700.0)
    net = make_net()
    net(mx.nd.ones((2, 4, 8, 8)))
    shapes = {"data": (2, 4, 8, 8)}
    tuned = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, input_shapes=shapes)
    plain = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, input_shapes=shapes, tune=False)
    assert "measured" in {r.reason for r in gluon_amp.report(tuned).rows}
    assert "measured" not in {r.reason for r in gluon_amp.report(plain).rows}
    assert tuned.amp_result.policy.tune and not plain.amp_result.policy.tune


def test_cli_tunes_with_input_shapes_and_refuses_no_tune_alone(tmp_path):
    net = make_net()
    net(mx.nd.ones((2, 4, 8, 8)))
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


@pytest.mark.parametrize("emulate", [False, True])
def test_a_tune_switch_that_is_neither_on_nor_off_is_refused_whether_or_not_it_applies(monkeypatch, emulate):
    """``GLUON_AMP_TUNE=maybe`` was a ValueError natively and accepted without a word under
    emulation (where tuning does not apply), while ``GLUON_AMP_TUNE_BUDGET`` was checked in both."""
    monkeypatch.setenv("GLUON_AMP_TUNE", "maybe")
    with pytest.raises(ValueError, match="GLUON_AMP_TUNE='maybe' is neither on nor off"):
        gluon_amp.make_policy("bfloat16", emulate=emulate)
    assert not gluon_amp.make_policy("bfloat16", emulate=emulate, tune=False).tune  # an explicit choice reads nothing


def test_a_graph_tuned_once_is_found_again_under_other_parameter_names_and_shapes():
    """The tuning outcome is cached per graph structure: the same network built as another
    instance (another name prefix, e.g. after an FP32 copy in the same process), at any
    input shape, must find it; another structure must not."""
    def key(prefix, classes=10):
        net = MixedNet(classes=classes, prefix=prefix)
        graph = json.loads(net(mx.sym.var("data")).tojson())
        params = {p.name: "float32" for p in net.collect_params().values()}
        assert params and all(n.startswith(prefix) for n in params)
        return tuner.signature(graph, {"data": "float32", **params}, True, False)

    assert key("first_") == key("second_")
    assert key("first_") != key("third_", classes=7)


# -- tuning while training: when, how much, and across shapes (planted timings, every host) --

class _Clock:
    """The clock tuning is charged by, moved by the planted costs and steps only."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(schedule, "clock", c)
    monkeypatch.setattr(schedule, "_LEDGER", Ledger())  # the budget is per process: a fresh one per test
    return c


def _spy_jobs(monkeypatch):
    """The kind of every tuning job started ('full' or 'recheck'), in order."""
    kinds = []
    made = schedule.new_job

    def spy(*a, **k):
        job = made(*a, **k)
        if job is not None:
            kinds.append(job.kind)
        return job
    monkeypatch.setattr(schedule, "new_job", spy)
    return kinds


def _plant(monkeypatch, clock, conv=lambda shape: (409.0, 205.0), graph=None, op_s_per_element=1e-5,
           graph_s=1.0, fp32_ms=1500.0, small_ops_rule=False):
    """Planted per-op figures (a 3x3 convolution's (bfloat16, float32) ms by its input shape,
    every other op faster in bfloat16) and whole-graph figures (``graph(choices)`` -> ms;
    by default 1000 ms for the plan, 700 with a choice; the graph in float32 ``fp32_ms``),
    each advancing ``clock`` by a cost. Returns the lists of what was timed (the float32
    graph's entry has ``'float32'`` for its choices). MixedNet's ops at these tiny shapes
    are far below the size the rule without a measurement asks of a plan (``small_ops_rule``:
    as the rule is; else its size limit is lifted, for the tests of what follows a first call)."""
    from gluon_amp_core.tuning import verdict
    if not small_ops_rule:
        monkeypatch.setattr(verdict, "UNMEASURED_MIN_ELEMENTS_PER_LOW_OP", 0)
        monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)
    timed, graphs = [], []

    def time_one(t, timer):
        timed.append(t)
        clock.now += op_s_per_element * sum(int(np.prod(s)) for s in t.shapes)
        if t.op == "amp_cast":
            return 0.01
        low = "bfloat16" in t.dtypes
        if t.op == "Convolution" and ("kernel", "(3, 3)") in t.attrs:
            return conv(t.shapes[0])[0 if low else 1]
        return 1.0 if low else 1.1

    def time_graph(sym, shapes, train, fused=False, runs=2, give_up_ms=None, timer=None):
        if not _low_entries(sym):
            graphs.append((tuple(shapes["data"]), "float32"))
            clock.now += graph_s
            return fp32_ms
        kept = _float32_low_ops(sym)
        graphs.append((tuple(shapes["data"]), kept))
        clock.now += graph_s
        return (graph or (lambda k: 700.0 if k else 1000.0))(kept)

    def time_graphs(syms, shapes, train, fused=False, runs=2, give_up_ms=None, timer=None):
        return [time_graph(s, shapes, train, fused, runs, give_up_ms) for s in syms]

    monkeypatch.setattr(tuner, "time_one", time_one)
    monkeypatch.setattr(tuner, "time_graph", time_graph)
    monkeypatch.setattr(tuner, "time_graphs", time_graphs)
    return timed, graphs


class _Training:
    """init's tuner driven as the block hooks drive it: ``rewrite`` at the first call and
    whenever ``called`` asks for a rebuild; the graph itself is never run (no bfloat16
    kernels needed), each call costs ``step_s`` on the clock."""

    def __init__(self, clock, budget, step_s=0.5, classes=10, rebuild_s=0.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a host without bfloat16 kernels warns: nothing runs here
            with gluon_amp.autocast("bfloat16", tune=False):
                self.net = MixedNet(classes=classes)
                self.net.initialize()
                self.data = mx.sym.var("data")
                self.plan = self.net(self.data)
            self.policy = gluon_amp.make_policy("bfloat16", tune=True, tune_budget=budget)
        self.tuner = schedule.Tuner(self.policy, runtime.timing_cache)
        self.clock, self.step_s, self.rebuild_s = clock, step_s, rebuild_s
        self.graph, self.rebuilds = None, 0
        self.ledger_ok = True

    def call(self, shape):
        x = mx.nd.zeros(shape)
        if self.graph is None:
            self.graph = self.tuner.rewrite(self.net, (x,), [self.data], self.plan)
            self.clock.now += self.rebuild_s  # the first call builds the graph too
        elif self.tuner.called(self.net, (x,)):
            self.graph = self.tuner.rewrite(self.net, (x,), [self.data], self.plan)
            self.rebuilds += 1
            self.clock.now += self.rebuild_s  # tracing, binding and warming the graph up again
        ledger = self.tuner.ledger
        self.ledger_ok &= ledger.spent <= ledger.allowance(self.clock()) + ledger.overrun + 1e-9
        self.clock.now += self.step_s

    def float32_ops(self):
        if self.graph is None:
            return []
        return _float32_low_ops(self.graph)


#: MixedNet's ops that its bfloat16 plan runs low: in float32 only by a tuner's choice.
_LOW_IN_PLAN = ("Convolution", "FullyConnected", "BatchNorm")


def _low_entries(sym):
    """The entries a graph holds in bfloat16 (none: the graph runs float32)."""
    from gluon_amp.type_inference import infer_dtypes
    dtypes = infer_dtypes(sym, {"data": "float32"}, partial=True) or {}
    return sorted(k for k, t in dtypes.items() if t == "bfloat16")


def _float32_low_ops(sym):
    """The ops a tuned graph runs in float32 that the plan runs low (read from MXNet's type
    inference: the graph's nodes carry no attribute of gluon_amp's)."""
    from gluon_amp.type_inference import infer_dtypes
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    assert not any(k.startswith("__amp_") for n in nodes for k in n.get("attrs", {}))
    dtypes = infer_dtypes(sym, {"data": "float32"}, partial=True) or {}
    return sorted(n["name"] for n in nodes if n["op"] in _LOW_IN_PLAN and dtypes.get((n["name"], 0)) == "float32")


def test_a_shape_seen_once_does_not_tune_and_shapes_that_never_repeat_tune_the_graph_once(monkeypatch, clock):
    timed, graphs = _plant(monkeypatch, clock)
    kinds = _spy_jobs(monkeypatch)
    run = _Training(clock, budget="inf")
    for batch in (5, 6, 7):  # each shape once
        run.call((batch, 4, 8, 8))
    assert kinds == [] and timed == [] and graphs == [] and run.float32_ops() == []
    assert "until an input shape repeats" in run.net.amp_tuning.status
    for k in range(20):  # a batch size of its own every call (as R-CNN's image sizes): dynamic after 3 changes
        run.call((9 + k, 4, 8, 8))
    assert kinds == ["full"], kinds  # once for the graph, never per shape
    assert run.float32_ops() == [run.net.conv.name + "_fwd"] and run.rebuilds == 1
    assert "input 0 dim 0" in run.tuner.info()["graphs"][0]["dynamic_dims"]


def test_a_graph_seen_at_k_shapes_tunes_once_in_full_and_a_wide_margin_is_carried_without_timing(monkeypatch, clock):
    timed, graphs = _plant(monkeypatch, clock)  # bfloat16 2.0x slower: a wide margin
    kinds = _spy_jobs(monkeypatch)
    run = _Training(clock, budget="inf")
    run.call((2, 4, 8, 8))
    run.call((2, 4, 8, 8))
    full_timed, full_graphs = len(timed), len(graphs)
    assert kinds == ["full"] and full_timed > 0 and full_graphs == 3 and run.rebuilds == 1  # plan, float32, trial
    for batch in (3, 8, 16):  # K = 4 shapes in all, each for a few calls, as train_yolo3.py does
        for _ in range(3):
            run.call((batch, 4, 8, 8))
    assert kinds == ["full", "recheck", "recheck", "recheck"]
    assert (len(timed), len(graphs)) == (full_timed, full_graphs)  # nothing timed again: decided
    rechecked = run.tuner.info()["graphs"][0]["rechecked"]
    assert len(rechecked) == 3 and all("1 float32 choice(s) carried over" in r for r in rechecked)
    assert run.float32_ops() == [run.net.conv.name + "_fwd"] and run.rebuilds == 1


def test_a_graph_whose_ops_are_all_faster_low_is_checked_against_float32_once_and_keeps_its_plan(monkeypatch, clock):
    timed, graphs = _plant(monkeypatch, clock, conv=lambda shape: (1.0, 2.0))
    run = _Training(clock, budget="inf")
    for _ in range(3):
        run.call((2, 4, 8, 8))
    # built again once: its graph was released while the check ran
    assert timed and [g[1] for g in graphs] == [[], "float32"] and run.rebuilds == 1 and run.float32_ops() == []
    assert "tuned at input shapes" in run.net.amp_tuning.status
    assert "keeps bfloat16: the whole graph measured 1.50x float32's speed" in run.net.amp_tuning.verdict


def test_a_choice_near_break_even_is_timed_again_where_the_shape_moved_it_and_withdrawn_if_it_flipped(monkeypatch,
                                                                                                       clock):
    def conv(shape):  # 10% slower in bfloat16 at batch 2; 10% faster from batch 8 on
        return (1.1, 1.0) if shape[0] <= 4 else (0.9, 1.0)

    def graph(kept):  # confirmed at batch 2; at batch 8 the whole graph is no faster with it
        return 1000.0 if not kept else 900.0 if len(graphs) <= 3 else 995.0
    timed, graphs = _plant(monkeypatch, clock, conv=conv, graph=graph)
    kinds = _spy_jobs(monkeypatch)
    run = _Training(clock, budget="inf")
    conv_name = run.net.conv.name + "_fwd"
    for batch in (2, 2, 2, 4, 4, 4):  # batch 4 moves the convolution's inputs 1.6x: within the step
        run.call((batch, 4, 8, 8))
    assert kinds == ["full", "recheck"] and run.float32_ops() == [conv_name]
    full_timed = len(timed)
    for batch in (8, 8, 8, 16, 16, 16):  # 2.9x: timed again, flipped, the whole graph agrees
        run.call((batch, 4, 8, 8))
    assert kinds == ["full", "recheck", "recheck"]  # none at batch 16: no float32 choice left to re-check
    again = timed[full_timed:]
    assert len(again) == 2 and {t.op for t in again} == {"Convolution"} and all(t.shapes[0][0] == 8 for t in again)
    assert [g[0][0] for g in graphs] == [2, 2, 2, 8, 8] and run.float32_ops() == [] and run.rebuilds == 2
    withdrawn = run.tuner.info()["graphs"][0]["withdrawn"]
    assert len(withdrawn) == 1 and withdrawn[0].startswith(conv_name) and "no faster in float32" in withdrawn[0]


def test_the_outcome_serves_the_same_graph_at_other_shapes_in_later_processes_and_op_times_every_graph(
        monkeypatch, clock):
    timed, graphs = _plant(monkeypatch, clock)
    first = _Training(clock, budget="inf")
    first.call((2, 4, 8, 8))
    first.call((2, 4, 8, 8))
    assert first.float32_ops() == [first.net.conv.name + "_fwd"]
    monkeypatch.setattr(schedule, "_LEDGER", Ledger())  # as a new process would
    later = _Training(clock, budget=0)  # reads the cache only
    later.call((8, 4, 8, 8))  # its first call, at another shape: tuned already
    assert later.float32_ops() == [later.net.conv.name + "_fwd"]
    assert "read from the cache" in later.net.amp_tuning.status
    # another graph (another dense layer) with the same convolutions at the same shapes:
    # only what differs is measured
    n_timed = len(timed)
    other = _Training(clock, budget="inf", classes=7)
    other.call((2, 4, 8, 8))
    other.call((2, 4, 8, 8))
    measured = timed[n_timed:]
    assert measured and all(t.op != "Convolution" for t in measured)
    assert other.float32_ops() == [other.net.conv.name + "_fwd"]


@pytest.mark.parametrize("budget", [None, "3"])
def test_tuning_spends_within_its_budget_and_the_untuned_plan_runs_meanwhile(monkeypatch, clock, budget):
    """The default (1% of the training time so far) and a cap of 3 s: tuning this graph
    costs about 6 s (per-op timings, then two whole-graph runs of 2 s)."""
    timed, graphs = _plant(monkeypatch, clock, op_s_per_element=2e-4, graph_s=2.0)
    run = _Training(clock, budget=budget, step_s=0.5)
    calls = 0
    while run.float32_ops() == [] and calls < 3000:
        run.call((2, 4, 8, 8))
        calls += 1
        assert run.ledger_ok, (calls, run.tuner.info())
    info = run.tuner.info()
    if budget == "3":  # never enough: the plan runs, and runtime_info says why
        assert run.float32_ops() == [] and info["spent_s"] <= 3 + info["largest_overrun_s"]
        assert "waits for the budget" in info["graphs"][0]["status"] and graphs == []
    else:  # done once 1% of the run paid for it; never ahead of it
        assert run.float32_ops() == [run.net.conv.name + "_fwd"] and len(graphs) == 3
        assert info["spent_s"] <= 0.02 * info["elapsed_s"] + info["largest_overrun_s"] + 1e-9
        # the run is slower by at most 1/99 of its training time (tuning counts in the elapsed time)
        assert info["spent_s"] <= 0.01 / 0.99 * calls * 0.5 + info["largest_overrun_s"] + 1e-9
    assert info["largest_overrun_s"] < 0.5  # an estimate is at most one op's timing off


def test_a_step_waiting_for_the_budget_is_looked_at_once_a_second_until_it_fits(monkeypatch, clock, tmp_path):
    """The default budget (1% of the run) and steps of 50 ms: each tuning step waits for
    thousands of calls. Those calls skip the look at the job (it cost a GluonTS-style LSTM 40 us
    of its 6 ms step) but once a second of the clock, and each tuning step starts at the call
    it starts at with a look at every call."""
    def tune(skip):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runtime, "timing_cache", lambda: TimingCache(str(tmp_path / str(skip)), {"k": 1}))
            timed, graphs = _plant(mp, clock, op_s_per_element=2e-4, graph_s=2.0)
            looks = []
            real = schedule.Tuner._work

            def look(self, *a):
                start = clock()
                try:
                    return real(self, *a)
                finally:
                    looks.append((start, clock()))
            mp.setattr(schedule.Tuner, "_work", look)
            if not skip:
                mp.setattr(schedule._Graph, "waits", lambda self, key, at: False)
            mp.setattr(schedule, "_LEDGER", Ledger())  # as a new process would
            clock.now = 0.0
            run = _Training(clock, budget=None, step_s=0.05)
            started, calls = [], 0
            while len(timed) < 3 and calls < 40000:
                seen = (len(graphs), len(timed))
                run.call((2, 4, 8, 8))
                calls += 1
                if (len(graphs), len(timed)) != seen:
                    started.append(calls)
            return started, looks, calls

    started, looks, calls = tune(skip=True)
    every_call, _, _ = tune(skip=False)
    assert started and started == every_call
    assert len(looks) < calls / 10  # about one a second: 20 calls
    assert all(b[0] - a[1] <= 1.0 + 0.05 + 1e-9 for a, b in zip(looks, looks[1:]))


def test_the_whole_graph_check_waits_for_the_blocks_own_first_build_not_a_guess_per_node(monkeypatch, clock,
                                                                                          tmp_path):
    """A block whose first build took 0.1 s where the guess per node says seconds (planted: 0.1 s
    a node): its whole-graph check is estimated from its own build, and starts sooner, within the
    budget all along (GluonCV's MobileNet 1.0 waited ten minutes at 0.58x FP32 for a 0.9 s check
    estimated at 5.6 s)."""
    monkeypatch.setattr(tuner, "GRAPH_BUILD_S_PER_NODE", 0.1)

    def check_starts(measured):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runtime, "timing_cache", lambda: TimingCache(str(tmp_path / str(measured)), {"k": 1}))
            timed, graphs = _plant(mp, clock, conv=lambda shape: (1.0, 2.0), graph_s=0.2)
            if not measured:
                mp.setattr(schedule._Graph, "first_build_s", lambda self, key: None)
            mp.setattr(schedule, "_LEDGER", Ledger())
            clock.now = 0.0
            run = _Training(clock, budget=None, step_s=0.05, rebuild_s=0.1)
            calls = 0
            while not graphs and calls < 100000:
                run.call((2, 4, 8, 8))
                calls += 1
                assert run.ledger_ok
            g = next(iter(run.tuner.graphs.values()))
            return calls, g.first_build_s(next(iter(g.intervals)))

    calls, build = check_starts(measured=True)
    guessed_calls, _ = check_starts(measured=False)
    assert build == pytest.approx(0.1) and calls < 100000 and guessed_calls < 100000
    assert calls < guessed_calls / 2


def test_whole_graph_trials_release_the_blocks_own_graph_first(monkeypatch, clock):
    """Memory: a hybridized block holds its graph's memory; trials build the graph again."""
    released = []
    _plant(monkeypatch, clock)
    run = _Training(clock, budget="inf")
    monkeypatch.setattr(schedule.mxi, "drop_cached_graph", lambda block: released.append((block, len(graphs_at))))
    graphs_at = []
    plant_graph, plant_graphs = tuner.time_graph, tuner.time_graphs
    monkeypatch.setattr(tuner, "time_graph", lambda *a, **k: (graphs_at.append(1), plant_graph(*a, **k))[1])
    monkeypatch.setattr(tuner, "time_graphs", lambda *a, **k: (graphs_at.append(2), plant_graphs(*a, **k))[1])
    run.call((2, 4, 8, 8))
    run.call((2, 4, 8, 8))
    assert released == [(run.net, 0)] and graphs_at == [2, 1] and run.rebuilds == 1  # check, then one trial


def test_tune_budget_is_checked_and_read_from_the_environment(monkeypatch):
    from gluon_amp_core.tuning.schedule import TuneBudget
    assert gluon_amp.make_policy("bfloat16", tune=True, tune_budget="5%,120").tune_budget == TuneBudget(0.05, 120.0)
    assert gluon_amp.make_policy("bfloat16", tune=True, tune_budget=30).tune_budget == TuneBudget(None, 30.0)
    monkeypatch.setenv("GLUON_AMP_TUNE_BUDGET", "inf")
    assert gluon_amp.make_policy("bfloat16", tune=True).tune_budget == TuneBudget(None, float("inf"))
    monkeypatch.setenv("GLUON_AMP_TUNE_BUDGET", "lots")
    with pytest.raises(ValueError, match=r"\$GLUON_AMP_TUNE_BUDGET='lots'.*'2%'"):
        gluon_amp.make_policy("bfloat16", tune=True)
    monkeypatch.delenv("GLUON_AMP_TUNE_BUDGET")
    with pytest.raises(ValueError, match="tune_budget='150%'"):
        gluon_amp.init("bfloat16", tune=True, tune_budget="150%")
    with pytest.raises(ValueError, match=">= 0 seconds"):
        gluon_amp.make_policy("bfloat16", tune=True, tune_budget=-1)
    with pytest.raises(TypeError, match="tune_budget must be"):
        gluon_amp.make_policy("bfloat16", tune=True, tune_budget=[3])
    assert not gluon_amp.is_enabled()


def test_variable_shape_benchmark_without_bf16_kernels_says_why_and_exits_0(tmp_path, no_bf16_why):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "variable_shape.py"), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=no_bf16_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cannot measure" in r.stdout and no_bf16_why in r.stdout
    doc = json.loads(out.read_text())
    assert doc["modes"] == [] and no_bf16_why in doc["not_measured"]


# -- never slower, per graph: the whole plan against the same graph in float32 (issue 43) --

def _all_float32(sym):
    return _low_entries(sym) == []


@pytest.mark.parametrize("plan_ms, fp32_ms, runs_fp32", [(1000.0, 650.0, True), (1000.0, 1000.0, True),
                                                         (1000.0, 1500.0, False)])
def test_a_graph_whose_plan_is_no_faster_than_float32_runs_float32_once_tuned_and_a_faster_one_keeps_it(
        monkeypatch, clock, plan_ms, fp32_ms, runs_fp32):
    """Planted whole-graph times (no hardware): the plan (its per-op choices included) at
    ``plan_ms``, the same graph in float32 at ``fp32_ms``; a tie runs float32."""
    timed, graphs = _plant(monkeypatch, clock, conv=lambda shape: (1.0, 2.0), graph=lambda kept: plan_ms,
                           fp32_ms=fp32_ms)
    run = _Training(clock, budget="inf")
    for _ in range(3):
        run.call((2, 4, 8, 8))
    assert _all_float32(run.graph) == runs_fp32
    tuning = run.net.amp_tuning
    shown = f"({plan_ms:.1f} ms vs {fp32_ms:.1f} ms in float32, casts included)"
    assert shown in tuning.verdict and tuning.verdict.startswith("runs float32" if runs_fp32 else "keeps bfloat16")
    assert run.tuner.info()["graphs"][0]["verdict"] == tuning.verdict
    # the verdict is cached with the graph's outcome: a later process (budget 0: reads only) runs the same
    monkeypatch.setattr(schedule, "_LEDGER", Ledger())
    later = _Training(clock, budget=0)
    later.call((8, 4, 8, 8))
    assert _all_float32(later.graph) == runs_fp32 and shown in later.net.amp_tuning.verdict
    assert [g[1] for g in graphs].count("float32") == 1  # measured once


def test_the_report_says_once_why_a_graph_runs_float32_with_the_figures(monkeypatch, clock):
    _plant(monkeypatch, clock, conv=lambda shape: (1.0, 2.0), graph=lambda kept: 1000.0, fp32_ms=650.0)
    run = _Training(clock, budget="inf")
    for _ in range(3):
        run.call((2, 4, 8, 8))
    rep = gluon_amp.report(run.graph, "bfloat16")
    rep.tuning = run.net.amp_tuning.summary  # what report(block) shows of a block trained under init
    assert {r.dtype for r in rep.rows} == {"float32"}
    assert str(rep).count("0.65x float32's speed (1000.0 ms vs 650.0 ms in float32, casts included)") == 1


def test_the_verdict_comes_first_and_serves_while_the_per_op_tuning_waits_for_the_budget(monkeypatch, clock):
    """A budget that pays for the two whole-graph timings but not yet for every op: the graph
    runs float32 from the call after the check, before its tuning is done, and a process
    that stops there leaves the verdict to the next one (which still tunes in full)."""
    timed, graphs = _plant(monkeypatch, clock, graph=lambda kept: 1000.0, fp32_ms=650.0, op_s_per_element=2e-3,
                           graph_s=0.5)
    kinds = _spy_jobs(monkeypatch)
    run = _Training(clock, budget="2", step_s=0.05)  # the check, 2 x 0.5 s, and the rebuild it causes
    for _ in range(4):
        run.call((2, 4, 8, 8))
    assert [g[1] for g in graphs] == [[], "float32"] and _all_float32(run.graph) and run.rebuilds >= 1
    assert "waits for the budget" in run.net.amp_tuning.status and "runs float32" in run.net.amp_tuning.verdict
    monkeypatch.setattr(schedule, "_LEDGER", Ledger())
    later = _Training(clock, budget="inf")
    later.call((2, 4, 8, 8))
    assert _all_float32(later.graph)  # the stored check serves at once
    later.call((2, 4, 8, 8))
    assert kinds == ["full", "full"] and "tuned at input shapes" in later.net.amp_tuning.status


class _Recurrent(mx.gluon.HybridBlock):
    """An LSTM-like stack: products between float32 gates, a cast on every edge between them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.a = mx.gluon.nn.Dense(8, flatten=False)
            self.b = mx.gluon.nn.Dense(8, flatten=False)

    def hybrid_forward(self, F, x):
        h = F.sigmoid(self.a(x)) * F.tanh(self.b(x))
        return F.sigmoid(self.b(h)) * F.tanh(self.a(h))


def _traced(net, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gluon_amp.autocast("bfloat16", tune=False):
            return net(data)


@pytest.mark.parametrize("recurrent", [False, True])
def test_without_a_measurement_the_rule_runs_a_plan_that_casts_more_than_once_per_low_op_in_float32(
        monkeypatch, clock, recurrent):
    """The rule where no whole-graph timing decides (budget 0, first call) and the graph's
    figures are unknown (a shape MXNet could not infer): the activation casts per
    low-precision op of the plan, against the limit in docs/speed.md."""
    from gluon_amp_core.tuning.verdict import UNMEASURED_MAX_CASTS_PER_LOW_OP, activation_casts
    _plant(monkeypatch, clock)
    monkeypatch.setattr(tuner.Target, "figures", lambda self, shapes: (None, None))
    run = _Training(clock, budget=0)
    if recurrent:
        run.net = _Recurrent()
        run.net.initialize()
        run.plan = _traced(run.net, run.data)
    run.call((2, 4, 8, 8))
    nodes = json.loads(run.plan.tojson(remove_amp_cast=False))["nodes"]
    low = [n for n in nodes if n["op"] in ("FullyConnected", "Convolution", "BatchNorm")]
    ratio = activation_casts(nodes) / len(low)
    assert (ratio > UNMEASURED_MAX_CASTS_PER_LOW_OP) == recurrent
    assert _all_float32(run.graph) == recurrent
    said = "runs float32 until measured" if recurrent else "runs the plan until measured"
    assert said in run.net.amp_tuning.verdict


def test_converting_a_graph_whose_plan_is_slower_than_float32_gives_the_float32_graph(monkeypatch, clock):
    _plant(monkeypatch, clock, conv=lambda shape: (1.0, 2.0), graph=lambda kept: 1000.0, fp32_ms=650.0)
    net = make_net()
    x = mx.nd.ones((2, 4, 8, 8))
    ref = net(x).asnumpy()
    block = gluon_amp.convert_hybrid_block(net, "bfloat16", fuse=False, tune=True, input_shapes={"data": x.shape})
    rep = gluon_amp.report(block)
    rows = rep.rows
    assert {r.dtype for r in rows} == {"float32"} and {r.reason for r in rows if r.op == "Convolution"} == {"measured"}
    assert rep.casts == 0  # the float32 graph: no cast left
    assert "whole graph 1000 -> 650 ms" in next(r.detail for r in rows if r.op == "Convolution")
    assert np.abs(block(x).asnumpy() - ref).max() < 1e-5  # runs on any host: float32


@pytest.mark.parametrize("batch, side, runs_fp32", [(2, 8, True), (64, 32, False)])
def test_without_a_measurement_the_rule_runs_a_plan_of_tiny_ops_in_float32(monkeypatch, clock, batch, side,
                                                                          runs_fp32):
    """The rule's other half: the elements a low-precision op reads on average, at the first call's shapes."""
    from gluon_amp_core.tuning import verdict
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_ELEMENTS_PER_LOW_OP
    _plant(monkeypatch, clock, small_ops_rule=True)
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)  # this size alone
    run = _Training(clock, budget=0)
    run.call((batch, 4, side, side))
    target = run.tuner.graphs[next(iter(run.tuner.graphs))].target
    per_op = target.low_elements({"data": (batch, 4, side, side)}) / len(target.low_ops())
    assert (per_op < UNMEASURED_MIN_ELEMENTS_PER_LOW_OP) == runs_fp32
    assert _all_float32(run.graph) == runs_fp32
    assert f"{per_op:,.0f} input elements per op" in run.net.amp_tuning.verdict


# -- a float32 verdict gives a float32 graph: no casts (issue 46) -------------------------

def _casts(sym):
    """The cast nodes a graph holds (``amp_cast``, ``amp_multicast``), by name."""
    return [n["name"] for n in json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
            if n["op"] in ("amp_cast", "amp_multicast")]


@pytest.mark.parametrize("path", ["unmeasured rule", "whole-graph check"])
def test_a_graph_that_runs_float32_by_its_verdict_keeps_no_cast(monkeypatch, clock, path):
    """Planted timings, no kernels run: the recurrent plan (float32 gates, a widest-type
    product, casts on every edge) runs float32 by the rule at its first call (budget 0) or by
    a planted whole-graph check (float32 650 ms, the plan 1000 ms). Every cast of the plan
    converts nothing then, and each would cost a copy per step: none is left (at 4057852 the
    graph kept the float32 ops' and the products' casts, as GluonTS DeepAR kept 75)."""
    _plant(monkeypatch, clock, graph=lambda kept: 1000.0, fp32_ms=650.0, small_ops_rule=path == "unmeasured rule")
    run = _Training(clock, budget=0 if path == "unmeasured rule" else "inf")
    run.net = _Recurrent()
    run.net.initialize()
    run.plan = _traced(run.net, run.data)
    assert len(_casts(run.plan)) > 4
    for _ in range(1 if path == "unmeasured rule" else 3):
        run.call((2, 3, 8))
    said = "runs float32 until measured" if path == "unmeasured rule" else "runs float32: the whole graph"
    assert run.net.amp_tuning.verdict.startswith(said)
    assert _all_float32(run.graph) and _casts(run.graph) == []


def test_the_float32_graph_a_whole_graph_check_times_against_the_plan_keeps_no_cast(monkeypatch, clock):
    """The check's float32 side is the program without AMP: timed with idle casts, it would
    measure float32 slower than it runs, and favour the plan."""
    timed_fp32 = []
    _plant(monkeypatch, clock)
    plant = tuner.time_graphs

    def time_graphs(syms, *a, **k):
        timed_fp32.append(syms[1])
        return plant(syms, *a, **k)
    monkeypatch.setattr(tuner, "time_graphs", time_graphs)
    run = _Training(clock, budget="inf")
    for _ in range(2):
        run.call((2, 4, 8, 8))
    assert len(timed_fp32) == 1 and _all_float32(timed_fp32[0]) and _casts(timed_fp32[0]) == []


def test_a_block_built_under_autocast_enabled_false_runs_without_casts():
    """``enabled=False`` inside ``init``: the block's graph is the program without AMP (float32
    everywhere, no cast), and its output is FP32's bit for bit."""
    net = MixedNet()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.ones((2, 4, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a host without bfloat16 kernels warns: nothing low runs here
        gluon_amp.init("bfloat16")
    with gluon_amp.autocast(enabled=False):
        got = net(x).asnumpy()
    graph = gluon_amp.mxnet_internals.cached_graph(net, "gluon_amp")[1]
    assert _casts(graph) == [] and _all_float32(graph)
    gluon_amp.disable()
    net.hybridize()  # drops the graph cached under init: the program without AMP
    assert np.array_equal(got, net(x).asnumpy())


def test_with_shapes_changing_every_3_calls_tuning_stays_within_its_budget_from_the_first_call_rebuilds_included(
        monkeypatch, clock):
    """Planted costs (no kernels run): a step of 0.5 s, each whole-graph timing 2 s, and the
    block's own graph, built at the first call and again after it was released for them or for
    new choices, 3 s to build and warm up. Shapes change every 3 calls, cycling through three sizes (as
    benchmarks/variable_shape.py). At every call, from the first, what tuning spent (the whole-graph
    check, the trials and the rebuilds they cause included) stays within 1% of the run so far,
    and the run is done tuning within the calls given (at 4057852 a rebuild was booked only after
    it happened, overdrawing the budget by it)."""
    def conv(shape):  # 10% slower in bfloat16 at batch 2; 10% faster at batch 8: re-checked there
        return (1.1, 1.0) if shape[0] <= 4 else (0.9, 1.0)

    def graph(kept):  # the float32 convolution pays at batch 2 (900 ms), not at batch 8 (995 ms)
        return 1000.0 if not kept else 900.0 if len(graphs) <= 3 else 995.0
    timed, graphs = _plant(monkeypatch, clock, conv=conv, graph=graph, op_s_per_element=2e-5, graph_s=2.0)
    kinds = _spy_jobs(monkeypatch)
    run = _Training(clock, budget=None, step_s=0.5, rebuild_s=3.0)
    sizes = (2, 4, 8)
    over = []
    done = None
    for k in range(9000):
        run.call((sizes[(k // 3) % 3], 4, 8, 8))
        if done is None and len(graphs) == 5 and all(g.job is None for g in run.tuner.graphs.values()):
            done = k
        if done is not None and k == done + 3:  # the calls after the last rebuild booked it
            break
        ledger = run.tuner.ledger
        allowed = ledger.allowance(clock())
        if ledger.spent > allowed + 0.05:  # an op's timing may cost a little more than its estimate
            over.append((k, round(ledger.spent, 2), round(allowed, 2)))
    info = run.tuner.info()
    assert over == [], (over[:5], info)
    # the check, a trial, and the re-check at batch 8 ran (within the budget), and withdrew the choice
    assert [(g[0][0], g[1]) for g in graphs][:2] == [(2, []), (2, "float32")], info["graphs"]
    assert [g[0][0] for g in graphs] == [2, 2, 2, 8, 8] and kinds[0] == "full" and len(kinds) <= 3
    # every rebuild booked, the first call's build not (the run's own), whatever shape came next
    assert run.rebuilds >= 2 and info["spent_on"]["rebuilding graphs"] == pytest.approx(3.0 * run.rebuilds)
    assert info["spent_on"]["whole-graph re-check"] == pytest.approx(4.0)
    assert run.float32_ops() == [] and run.tuner.info()["graphs"][0]["withdrawn"]


def test_a_rebuild_is_booked_when_the_next_call_comes_at_another_shape(monkeypatch, clock):
    """The block's graph, released for the whole-graph check at the second call, is built again
    at the third, which comes at a new shape (as every third call of variable_shape.py does):
    the ledger books its 3 s all the same (at 4057852 it booked nothing, and tuning's cost to a
    run whose shapes change was what the budget saw, minus its rebuilds)."""
    _plant(monkeypatch, clock)
    run = _Training(clock, budget="inf", step_s=0.5, rebuild_s=3.0)
    for batch in (2, 2, 4, 4):
        run.call((batch, 4, 8, 8))
    assert run.rebuilds == 1 and run.tuner.info()["spent_on"]["rebuilding graphs"] == pytest.approx(3.0)


# -- a transformer's GEMMs: the graph's own figures decide, not the probe's blocks (issue 48) --

class _Encoder(mx.gluon.HybridBlock):
    """A transformer's sublayers at BERT-base's width: products between float32 layer norms,
    so each product casts its input and its output (more than one cast per low-precision op)."""

    def __init__(self, units=768, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.a = mx.gluon.nn.Dense(units, flatten=False)
            self.b = mx.gluon.nn.Dense(units, flatten=False)
            self.na = mx.gluon.nn.LayerNorm()
            self.nb = mx.gluon.nn.LayerNorm()

    def hybrid_forward(self, F, x):
        return self.nb(self.b(self.na(self.a(x))))


@pytest.mark.parametrize("net, shape, runs_fp32", [("encoder", (8, 128, 768), False), ("recurrent", (32, 3, 8), True),
                                                   ("encoder", (4, 1, 768), True), ("encoder", (1, 128, 768), False)])
def test_without_a_measurement_the_graphs_own_gemm_work_per_cast_element_decides(monkeypatch, clock, net, shape,
                                                                             runs_fp32):
    """A BERT-sized encoder (Dense(768) on (8, 128, 768), 604 million multiply-adds a product, 1.5
    activation casts per product) runs its GEMMs in bfloat16 from the first call; the small
    recurrent products (a cast per edge, a few multiply-adds per cast element) run float32. At
    4057852 the casts per op alone decided, from the speed probe's blocks: the encoder ran float32.
    The same encoder on 4 rows runs float32: each call casts its 768 x 768 master weights for 4
    multiply-adds per weight element (AlexNet's dense layers at batch 4 trained at 0.58x FP32 in
    bfloat16, their weights not counted); on 128 rows it keeps its plan (BERT-base's encoder at
    1 x 128 tokens ran 1.66x FP32 in bfloat16), which weights counted whole would not."""
    _plant(monkeypatch, clock, small_ops_rule=True)
    run = _Training(clock, budget=0)
    run.net = _Encoder() if net == "encoder" else _Recurrent()
    run.net.initialize()
    run.plan = _traced(run.net, run.data)
    run.call(shape)
    if net == "encoder":
        assert activation_casts_per_low_op(run.plan) > 1  # what the probe's blocks' limit sent to float32
    assert _all_float32(run.graph) == runs_fp32
    gemms = [n for n in json.loads(run.graph.tojson(remove_amp_cast=False))["nodes"] if n["op"] == "FullyConnected"]
    low = set(k[0] for k in _low_entries(run.graph))
    assert len(gemms) == (2 if net == "encoder" else 4) and all((g["name"] in low) != runs_fp32 for g in gemms)
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_MACS_PER_CAST_ELEMENT
    intensity = run.tuner.graphs[next(iter(run.tuner.graphs))].target.figures({"data": shape})[1]
    assert (intensity < UNMEASURED_MIN_MACS_PER_CAST_ELEMENT) == runs_fp32
    assert f"{intensity:,.0f} multiply-adds per cast element" in run.net.amp_tuning.verdict


def test_a_converted_graph_does_not_count_its_weights_casts():
    """Training casts each master weight every step; a converter's graph (``train=False``) is
    judged on its activations' casts, as before: the 4-row encoder keeps bfloat16 there."""
    net = _Encoder()
    net.initialize()
    plan = _traced(net, mx.sym.var("data"))
    policy = gluon_amp.make_policy("bfloat16", tune=True)
    figures = {train: tuner.Target(plan, {"data": "float32"}, tuner.applier(plan, {"data": "float32"}, policy),
                                   policy, train=train).figures({"data": (4, 1, 768)})[1] for train in (True, False)}
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_MACS_PER_CAST_ELEMENT as LINE
    assert figures[True] < LINE <= figures[False]


def activation_casts_per_low_op(sym):
    """The plan's activation casts per product (its low-precision ops)."""
    from gluon_amp_core.tuning.verdict import activation_casts
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    return activation_casts(nodes) / len([n for n in nodes if n["op"] == "FullyConnected"])


@pytest.mark.parametrize("plan_ms, fp32_ms", [(600.0, 1000.0), (1000.0, 600.0)])
def test_once_measured_the_encoders_gemms_run_on_the_faster_side(monkeypatch, clock, plan_ms, fp32_ms):
    """Planted whole-graph timings of the same encoder: the side that measured faster runs."""
    _plant(monkeypatch, clock, conv=lambda shape: (1.0, 2.0), graph=lambda kept: plan_ms, fp32_ms=fp32_ms)
    run = _Training(clock, budget="inf")
    run.net = _Encoder()
    run.net.initialize()
    run.plan = _traced(run.net, run.data)
    for _ in range(3):
        run.call((8, 128, 768))
    assert _all_float32(run.graph) == (fp32_ms < plan_ms)
    if fp32_ms < plan_ms:
        assert _casts(run.graph) == []


def test_a_trial_graph_mxnet_cannot_type_is_left_as_it_is_for_its_timing_to_fail():
    """Dropping idle casts types the graph first; a graph MXNet rejects (a trial whose product
    reads a float32 input and a bfloat16 weight) comes back unchanged, not as an exception in
    the middle of a training step (YOLOv3's tuning raised MXNet's 'requires uniform type' there)."""
    data, weight = mx.sym.var("data"), mx.sym.var("w")
    sym = mx.sym.FullyConnected(data, weight, num_hidden=4, no_bias=True, name="fc")
    assert tuner.without_idle_casts(sym, {"data": "float32", "w": "bfloat16"}) is sym


def test_the_whole_graph_check_times_the_graph_that_will_run(native_host, monkeypatch):
    """A training graph's plan is timed as MXNet runs it natively (native_run.native_passes):
    on a planted AMX host, with its batch norms' layout guards and paired casts. Timing the bare
    plan kept GluonCV's CIFAR ResNet-20 in float32 ("0.52x") where what runs is 1.9x faster."""
    from mxnet import autograd, gluon
    from gluon_amp_core.layout_guards import GUARD_SUFFIX
    from gluon_amp_core.paired_casts import PAIRED_SUFFIX
    from gluon_amp_core.tuning import verdict
    from helpers import sgd_trainer
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_ELEMENTS_PER_LOW_OP", 0)
    monkeypatch.setattr(verdict, "UNMEASURED_MIN_MACS_PER_CAST_ELEMENT", 0)
    monkeypatch.setattr(runtime, "amx_active", lambda: True)
    monkeypatch.setattr(tuner, "time_one", _recorded_times(1.0, 2.0))
    timed = []

    def time_graphs(syms, *a, **k):
        timed.extend(json.loads(s.tojson(remove_amp_cast=False))["nodes"] for s in syms)
        return [500.0, 1000.0]
    monkeypatch.setattr(tuner, "time_graphs", time_graphs)
    gluon_amp.init("bfloat16", tune=True, tune_budget="inf")
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, in_channels=4), gluon.nn.BatchNorm(in_channels=16),
            gluon.nn.Activation("relu"), gluon.nn.Conv2D(16, 3, padding=1, in_channels=16), gluon.nn.Dense(4))
    net.initialize()
    net.hybridize(static_alloc=True)
    trainer = sgd_trainer(net)
    gluon_amp.init_trainer(trainer)
    for _ in range(3):
        with autograd.record():
            loss = net(mx.nd.ones((2, 4, 8, 8))).sum()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(2)
    assert len(timed) == 2, "the whole-graph check did not run"
    plan, fp32 = timed
    assert [n["op"] for n in plan if n["name"].endswith(GUARD_SUFFIX)] == ["Reshape"]
    assert any(n["name"].endswith(PAIRED_SUFFIX) for n in plan)
    assert not any(n["name"].endswith((GUARD_SUFFIX, PAIRED_SUFFIX)) for n in fp32)
    assert "keeps bfloat16" in gluon_amp.report(net).tuning


def test_the_unmeasured_rule_counts_what_the_layout_guards_reorder(monkeypatch):
    """On an AMX host a training graph's batch norms next to a depthwise convolution get a layout
    guard (native_run), which reorders their data forward and their gradient backward, as a cast
    does both ways. GluonCV's MobileNet 1.0 (batch 4, 112 px) counted its casts alone, 360
    multiply-adds per element, kept its plan, and trained at 0.6x FP32 until measured; counted
    with the elements its guards reorder (those of the graph that runs, at GUARD_CAST_WEIGHT) it
    runs float32.
    Without AMX (no guards) and for a converted graph (no backward pass) the figure is as before."""
    from gluoncv.model_zoo import get_model
    from gluon_amp.native_run import native_passes
    from gluon_amp.type_inference import infer_dtypes, infer_shapes
    from gluon_amp_core.layout_guards import GUARD_SUFFIX
    from gluon_amp_core.tuning.verdict import UNMEASURED_MIN_MACS_PER_CAST_ELEMENT as LINE
    from gluon_amp.patching.hooks import graph_rewriter
    net = get_model("mobilenet1.0", pretrained=False, classes=10)
    net.initialize()
    data = mx.sym.var("data")
    policy = gluon_amp.make_policy("bfloat16", tune=True)
    shapes, known = {"data": (4, 3, 112, 112)}, {"data": "float32"}
    plan = graph_rewriter(policy)[0](net, (mx.nd.zeros(shapes["data"]),), [data], _traced(net, data))  # init's plan

    def figures(amx, train, only=None):
        monkeypatch.setattr(runtime, "amx_active", lambda: amx)
        if only is not None:  # the first guard alone
            real = tuner.guarded_batchnorms
            monkeypatch.setattr(tuner, "guarded_batchnorms", lambda *a: list(real(*a))[:only])
        got = tuner.Target(plan, known, tuner.applier(plan, known, policy), policy, train=train).figures(shapes)
        monkeypatch.undo()
        return got

    (elements, plain), (elements_amx, guarded) = figures(False, True), figures(True, True)
    _, one = figures(True, True, only=1)
    _, none = figures(True, True, only=0)  # on AMX without its guards (activation casts at their AMX share)
    assert guarded < LINE <= plain and elements == elements_amx
    assert figures(True, False) == figures(False, False)
    # what it counts is what the graph that runs reorders: with a figure m / c, 1/figure grows by
    # the reordered elements / m, so the growth of all guards over that of the first is their ratio
    # (both on AMX: there activation casts count at AMX_TRAINING_ACTIVATION_CAST_SHARE)
    monkeypatch.setattr(runtime, "amx_active", lambda: True)
    ran = native_passes(plan, infer_dtypes(plan, known, partial=True), shapes, ("cpu",), True, frozenset())
    nodes = json.loads(ran.tojson(remove_amp_cast=False))["nodes"]
    entry = infer_shapes(ran, shapes)
    sizes = [int(np.prod(entry[(nodes[n["inputs"][0][0]]["name"], n["inputs"][0][1])]))
             for n in nodes if n["name"].endswith(GUARD_SUFFIX)]
    assert len(sizes) > 20  # nearly every batch norm: each is next to a depthwise convolution
    said = tuner.Target(plan, known, tuner.applier(plan, known, policy), policy,
                        train=True).describe_unmeasured("first call", shapes)
    assert said.startswith("runs float32 until measured")
    assert f" and {len(sizes)} batch norms whose layout guards" in said
    assert np.isclose((1 / guarded - 1 / none) / (1 / one - 1 / none), sum(sizes) / sizes[0])
