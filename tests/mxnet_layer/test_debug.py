"""gluon_amp.debug: compare finds where a network leaves FP32; bisect finds and fixes the ops."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import debug
from helpers import make_net

TOL = 0.05


class Planted(nn.HybridBlock):
    """dense -> planted dense -> a neutral op that undoes its scale or offset -> dense."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        with self.name_scope():
            self.first = nn.Dense(16, in_units=8, activation="relu")
            self.planted = nn.Dense(16, in_units=16)
            self.last = nn.Dense(4, in_units=16)

    def hybrid_forward(self, F, x):
        y = self.planted(self.first(x))
        y = y * 1e-3 if self.kind == "overflow" else y - 1000.0
        return self.last(y)


def planted(kind):
    """``overflow``: float16 overflows (FP32 ~1e5) at the planted layer. ``offset``: its output is
    1000 plus a signal of ~0.1, which bfloat16 (8 bits) rounds away."""
    mx.random.seed(0)
    net = Planted(kind)
    net.initialize(mx.init.Xavier())
    w = net.planted.weight
    if kind == "overflow":
        w.set_data(w.data() * 60000)
    else:
        w.set_data(w.data() * 0.1)
        net.planted.bias.set_data(mx.nd.full((16,), 1000.0))
    return net


X = mx.nd.random.normal(shape=(8, 8))
CASES = [("overflow", "float16"), ("offset", "bfloat16")]


def _planted_name(net):
    return net.planted.name + "_fwd"


def test_compare_points_at_the_layer_whose_float16_output_overflows(tmp_path):
    net = planted("overflow")
    rep = debug.compare(net, X, target_dtype="float16", emulate=True, tolerance=TOL)
    rows = {r.name: r for r in rep.rows}
    bad = rows[_planted_name(net)]
    assert rep.first_divergence is bad and bad.nonfinite > 0 and bad.overflow > 0
    assert rows[net.first.name + "_fwd"].nonfinite == 0 and rows[net.first.name + "_fwd"].error < 1e-2
    assert math.isinf(rep.output_error) and rep.emulated and rep.target_dtype == "float16"
    assert "first divergence" in str(rep) and bad.name in str(rep)
    rep.to_json(str(tmp_path / "c.json"))
    doc = json.load(open(tmp_path / "c.json"))
    assert doc["first_divergence"] == bad.name and len(doc["rows"]) == len(rep.rows)
    rep.plot(str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000
    # the same network is fine in bfloat16 (its range is float32's)
    assert debug.compare(net, X, target_dtype="bfloat16", emulate=True, tolerance=TOL).first_divergence is None


@pytest.mark.parametrize("kind, dtype", CASES)
def test_bisect_finds_the_planted_layer_and_its_result_fixes_conversion_and_training(kind, dtype):
    net = planted(kind)
    net.hybridize()
    ref = net(X).asnumpy()
    res = debug.bisect(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [_planted_name(net)]
    assert res.error_before > TOL >= res.error_after
    assert res.trials <= math.ceil(math.log2(res.candidates)) + 1  # one culprit: k*ceil(log2 n) + 1
    fixed = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True,
                                           excluded_sym_names=res.excluded_sym_names)
    plain = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True)
    rel = lambda a: np.linalg.norm(a - ref) / np.linalg.norm(ref)  # noqa: E731
    assert rel(fixed(X).asnumpy()) <= TOL and not rel(plain(X).asnumpy()) <= TOL
    gluon_amp.init(target_dtype=dtype, emulate=True, excluded_sym_names=res.excluded_sym_names)
    net.hybridize()
    assert rel(net(X).asnumpy()) <= TOL


def test_a_healthy_network_has_no_divergence_and_needs_nothing_kept():
    net = make_net()
    x = mx.nd.random.normal(shape=(2, 3, 8, 8))
    with pytest.raises(RuntimeError, match="forward pass"):
        debug.compare(net, x)  # deferred shapes: said clearly
    net(x)
    for dtype in ("float16", "bfloat16"):
        rep = debug.compare(net, x, target_dtype=dtype, emulate=True, tolerance=TOL)
        assert rep.first_divergence is None and rep.output_error < TOL
        assert all(r.nonfinite == 0 for r in rep.rows) and max(r.error for r in rep.rows) > 0
        res = debug.bisect(net, x, target_dtype=dtype, emulate=True, tolerance=TOL)
        assert res.excluded_sym_names == [] and res.trials == 1  # the re-validating run only


def test_gradients_and_loss_scale_headroom():
    net = planted("overflow")
    labels = mx.nd.array([0, 1, 2, 3, 0, 1, 2, 3])
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    f16 = debug.compare(net, X, target_dtype="float16", emulate=True, loss_fn=loss, labels=labels)
    b16 = debug.compare(net, X, target_dtype="bfloat16", emulate=True, loss_fn=loss, labels=labels)
    assert {g.name for g in f16.gradients} == {p.name for p in net.collect_params().values()}
    for rep in (f16, b16):
        assert rep.loss_scale_headroom == 2.0 ** round(math.log2(rep.loss_scale_headroom))
    assert f16.loss_scale_headroom < b16.loss_scale_headroom
    peak = max(g.max_abs_fp32 for g in f16.gradients)
    assert peak * f16.loss_scale_headroom <= 65504 < peak * f16.loss_scale_headroom * 2


def test_compare_leaves_the_block_as_it_was():
    net = planted("offset")
    before = {k: v.data().asnumpy().copy() for k, v in net.collect_params().items()}
    debug.compare(net, X, target_dtype="bfloat16", emulate=True)
    assert not gluon_amp.mxnet_internals.has_cached_graph(net) and not gluon_amp.is_enabled()
    assert all(np.array_equal(before[k], v.data().asnumpy()) for k, v in net.collect_params().items())


def test_bad_arguments_are_named():
    net = planted("overflow")
    with pytest.raises(ValueError, match="tolerance"):
        debug.compare(net, X, tolerance=0)
    with pytest.raises(ValueError, match="loss_fn and labels"):
        debug.compare(net, X, loss_fn=gluon.loss.L2Loss())
    with pytest.raises(TypeError, match="HybridBlock"):
        debug.compare(lambda x: x, X)
    with pytest.raises(ValueError, match="max_trials"):
        debug.bisect(net, X, max_trials=0)
    gluon_amp.init(target_dtype="float16", emulate=True)
    with pytest.raises(RuntimeError, match="disable"):
        debug.compare(net, X)


def test_cli_compares_and_bisects_an_exported_model(tmp_path):
    net = planted("overflow")
    net.hybridize()
    net(X)
    net.export(str(tmp_path / "m"), 0)
    r = subprocess.run([sys.executable, "-m", "gluon_amp.debug", str(tmp_path / "m-symbol.json"),
                        str(tmp_path / "m-0000.params"), "--shape", "data:8,8", "--target-dtype", "float16",
                        "--bisect", "--tolerance", str(TOL), "--json", str(tmp_path / "d.json"),
                        "--plot", str(tmp_path / "d.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.load(open(tmp_path / "d.json"))
    assert doc["emulated"] and doc["first_divergence"] == _planted_name(net)
    assert doc["bisect"]["excluded_sym_names"] == [_planted_name(net)]
    assert "keep in float32" in r.stdout and (tmp_path / "d.png").exists()
    bad = subprocess.run([sys.executable, "-m", "gluon_amp.debug", "missing.json", "x.params", "--shape", "data:1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stderr
