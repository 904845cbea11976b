"""A converted block runs float32 where its plan would be slower (issue 48): converted without
``input_shapes``, where it is bound (its first call) the rule ``init`` applies to a graph not
measured yet decides, from the plan's multiply-adds per element its casts convert at that
call's shapes. The plan (its export, its parameters) stays as converted.

MobileNetV3's hard-swish (``x * clip(x + 3, 0, 6) / 6``) runs in float32 in a bfloat16 plan
(MXNet 1.9.1's element-wise bfloat16 loops are slower than float32), so every 1x1 convolution
between two is cast both ways: the default conversion ran at 0.94x FP32's speed on Zen 4, where
its fused float32 graph runs at 1.14x. Decided on a native host: simulated on every CPU, real
where the CPU has bfloat16 kernels.

Where this machine's speed probe measured bfloat16 slower than float32 (a VM that hides AMX),
an explicit ``target_dtype='bfloat16'`` runs float32 until measured, whatever the graph's figures.
"""
import json
import warnings

import numpy as np
import pytest

import gluon_amp
from gluon_amp_core.tuning.verdict import activation_casts
import mxnet as mx
from mxnet import gluon

from helpers import planted_probe, probe_host_items


class HardSwishNet(gluon.HybridBlock):
    """1x1 convolutions with a hard-swish between: few multiply-adds per cast element."""

    def __init__(self):
        super().__init__(prefix="hs_")
        with self.name_scope():
            self.a = gluon.nn.Conv2D(8, 1, in_channels=8)
            self.b = gluon.nn.Conv2D(8, 1, in_channels=8)

    def hybrid_forward(self, F, x):
        h = self.a(x)
        return self.b(h * F.clip(h + 3, 0, 6) / 6)


def _conv_net():
    """3x3 convolutions on 64 channels: hundreds of multiply-adds per cast element."""
    net = gluon.nn.HybridSequential(prefix="cv_")
    with net.name_scope():
        net.add(gluon.nn.Conv2D(64, 3, padding=1, in_channels=3), gluon.nn.Activation("relu"),
                gluon.nn.Conv2D(64, 3, padding=1, in_channels=64))
    return net


@pytest.fixture(autouse=True)
def _tuning_default(monkeypatch):
    """The suite turns ``tune=None`` off (``GLUON_AMP_TUNE=0``); here, a user's default."""
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)


def _probe_finds_bfloat16_faster() -> bool:
    """This machine's (or the simulation's planted) probe verdict, as the rule reads it."""
    verdict = gluon_amp.runtime.speed("bfloat16", warn=False)
    return verdict is None or verdict.faster


@pytest.fixture
def slow_probe(native_host, tmp_path):
    """The native host with the probe figures of one that measured bfloat16 slower (the Intel
    Xeon without AMX of tests/core/data/probe_hosts.json), in a cache of the test's own."""
    with planted_probe(probe_host_items("intel_xeon_no_amx"), tmp_path / "cache") as verdict:
        yield verdict


def _converted(net, x, _call=True, **kwargs):
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    want = net(x).asnumpy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", **kwargs)
        got = converted(x).asnumpy() if _call else None
    return converted, want, got, [str(w.message) for w in caught]


def test_a_plan_slower_than_float32_by_the_rule_runs_float32_without_a_cast(native_host, tmp_path):
    net = HardSwishNet()
    x = mx.nd.random.uniform(-4, 4, shape=(2, 8, 16, 16))
    converted, want, got, said = _converted(net, x)
    ran = gluon_amp.execution.executed_graph(converted)
    graph = json.loads(ran.tojson(remove_amp_cast=False))
    nodes, heads = graph["nodes"], {h[0] for h in graph["heads"]}
    # no cast between ops (the output keeps its node, a float32 copy; weights stored low are read through casts)
    between = [n["name"] for i, n in enumerate(nodes) if n["op"] in ("amp_cast", "amp_multicast") and i not in heads
               and any(nodes[e[0]]["op"] != "null" for e in n["inputs"])]
    assert not between and activation_casts(nodes) <= len(heads), between
    assert all(n["op"] != "amp_cast" or n["attrs"]["dtype"] == "float32" for n in nodes)
    assert not gluon_amp.execution.runs_emulated(converted)  # float32 kernels, not the emulated plan
    rep = gluon_amp.report(converted)
    assert [f for f in rep.fallbacks if "runs float32 until measured" in f], rep.fallbacks
    # the graph's figures say why; on a real host whose probe measured bfloat16 slower, the probe
    expected = ("multiply-adds per cast element" if _probe_finds_bfloat16_faster()
                else gluon_amp.runtime.speed("bfloat16", warn=False).describe())
    assert any(expected in s for s in said), said
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # float32 on the stored weights
    # the weights it stored low are held float32 for that graph from the next call: no cast of a weight
    low = set(converted.stored_low_by_default)
    assert low and set(converted.float32_stand_in_params) == low
    assert set(gluon_amp.mxnet_internals.param_dtypes(converted).values()) == {"float32"}
    again = converted(x).asnumpy()
    np.testing.assert_array_equal(again, got)  # the same values, held wider
    graph = json.loads(gluon_amp.execution.executed_graph(converted).tojson(remove_amp_cast=False))
    assert not [n["name"] for n in graph["nodes"] if n["op"] == "amp_cast"
                and graph["nodes"][n["inputs"][0][0]]["name"] in low], "a weight is still cast on every call"
    # the plan stays as converted: its export is the bfloat16 graph and its weights, with and without a call
    converted.export(str(tmp_path / "after"))
    fresh, _, _, _ = _converted(HardSwishNet(), x, _call=False)
    fresh.export(str(tmp_path / "before"))
    assert (tmp_path / "after-symbol.json").read_text() == (tmp_path / "before-symbol.json").read_text()
    after, before = (mx.nd.load(str(tmp_path / f"{w}-0000.params")) for w in ("after", "before"))
    assert sorted(after) == sorted(before)
    for k in before:
        assert after[k].dtype == before[k].dtype, k
        np.testing.assert_array_equal(after[k].astype("float32").asnumpy(), before[k].astype("float32").asnumpy())
    assert rep.low_ops > 0  # the plan's figures


def test_a_plan_the_rule_finds_fast_keeps_its_low_precision_ops(native_host):
    converted, want, got, _ = _converted(_conv_net(), mx.nd.random.uniform(shape=(2, 3, 16, 16)))
    rep = gluon_amp.report(converted)
    ran = gluon_amp.execution.executed_graph(converted)
    if _probe_finds_bfloat16_faster():
        assert rep.low_ops > 0 and not rep.fallbacks, rep
        assert ran is None or "bfloat16" in ran.tojson(remove_amp_cast=False)
    else:  # a real host whose probe measured bfloat16 slower (test_where_the_probe_measured... below)
        assert rep.low_ops > 0 and [f for f in rep.fallbacks if "runs float32 until measured" in f], rep
        assert "bfloat16" not in ran.tojson(remove_amp_cast=False)
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_where_the_probe_measured_bfloat16_slower_a_plan_the_figures_find_fast_runs_float32(slow_probe):
    assert slow_probe is not None and not slow_probe.faster
    x = mx.nd.random.uniform(shape=(2, 3, 16, 16))
    converted, want, got, said = _converted(_conv_net(), x)
    rep = gluon_amp.report(converted)
    assert rep.low_ops > 0  # the plan as converted: its export is unchanged
    why = [f for f in rep.fallbacks if "runs float32 until measured" in f]
    assert why and slow_probe.describe() in why[0] and "tune=False" in why[0], rep.fallbacks
    assert any(slow_probe.describe() in s for s in said), said
    ran = gluon_amp.execution.executed_graph(converted)
    assert "bfloat16" not in ran.tojson(remove_amp_cast=False)
    assert not gluon_amp.execution.runs_emulated(converted)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # float32 on the weights it stored low
    # tune=False: the plan as converted, as asked
    planned, _, got_plan, _ = _converted(_conv_net(), x, tune=False)
    assert not gluon_amp.report(planned).fallbacks
    ran = gluon_amp.execution.executed_graph(planned)
    assert ran is None or "bfloat16" in ran.tojson(remove_amp_cast=False)


@pytest.mark.parametrize("kwargs", [dict(tune=False), dict(emulate=True), None])
def test_tune_false_or_emulation_runs_the_plan_as_converted(native_host, kwargs, monkeypatch):
    if kwargs is None:  # tuning off by the environment, as tune=False everywhere
        monkeypatch.setenv("GLUON_AMP_TUNE", "0")
    kwargs = kwargs or {}
    converted, _, _, _ = _converted(HardSwishNet(), mx.nd.random.uniform(-4, 4, shape=(2, 8, 16, 16)), **kwargs)
    rep = gluon_amp.report(converted)
    assert rep.low_ops > 0 and rep.casts > 0 and not rep.fallbacks, rep
    ran = gluon_amp.execution.executed_graph(converted)
    assert ran is None or "bfloat16" in ran.tojson(remove_amp_cast=False)


def test_weights_held_float32_for_the_stand_in_then_train_as_the_plan_reads_them(native_host):
    x = mx.nd.random.uniform(-4, 4, shape=(2, 8, 16, 16))
    converted, _, got, _ = _converted(HardSwishNet(), x)
    converted(x)
    assert converted.float32_stand_in_params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "being trained: runs unfused from now on"
        with mx.autograd.record():
            loss = converted(x).mean()
        loss.backward()
    assert not converted.float32_stand_in_params and not converted.stored_low_by_default
    grads = [p.grad().asnumpy() for p in converted.collect_params().values() if p.grad_req != "null"]
    assert grads and all(np.isfinite(g).all() for g in grads) and any(np.abs(g).max() > 0 for g in grads)
    rep = gluon_amp.report(converted)  # the plan reads the float32 weights through its casts
    assert rep.low_ops > 0
