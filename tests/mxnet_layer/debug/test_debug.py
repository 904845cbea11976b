"""gluon_amp.debug: compare finds where a network leaves FP32; bisect finds and fixes the ops."""
import json
import math
import subprocess
import sys
import warnings

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


class Chain(nn.HybridBlock):
    """``n`` dense layers joined by tanh; after each planted one, the neutral op that undoes it."""

    def __init__(self, n, plants, kind, **kwargs):
        super().__init__(**kwargs)
        self.plants, self.kind = plants, kind
        with self.name_scope():
            self.layers = nn.HybridSequential()
            for i in range(n):
                self.layers.add(nn.Dense(16, in_units=16 if i else 8))

    def hybrid_forward(self, F, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i not in self.plants:
                x = F.tanh(x)
            else:
                x = x * 1e-4 if self.kind == "overflow" else x - 1000.0
        return x


def chain(n, plants, kind):
    mx.random.seed(0)
    net = Chain(n, plants, kind)
    net.initialize(mx.init.Xavier())
    for i in plants:
        w, b = net.layers[i].weight, net.layers[i].bias
        if kind == "overflow":  # outputs ~3e5
            w.set_data(w.data() * 300000)
        else:
            w.set_data(w.data() * 0.1)
            b.set_data(mx.nd.full((16,), 1000.0))
    return net


mx.random.seed(1)
X = mx.nd.random.normal(shape=(8, 8))
LABELS = mx.nd.array([0, 1, 2, 3, 0, 1, 2, 3])
CASES = [("overflow", "float16"), ("offset", "float16"), ("offset", "bfloat16")]


def rel(a, ref):
    """Relative L2 error; inf when ``a`` has an inf or NaN."""
    return np.linalg.norm(a - ref) / np.linalg.norm(ref) if np.isfinite(a).all() else math.inf


def grads(net):
    """The parameter gradients of one softmax cross-entropy backward, by parameter name."""
    with mx.autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(X), LABELS)
    loss.backward()
    return {p.name: p.grad().astype("float32").asnumpy() for p in net.collect_params().values()}


def _planted_name(net):
    return net.planted.name + "_fwd"


def test_compare_points_at_the_layer_whose_float16_output_overflows(tmp_path):
    net = planted("overflow")
    rep = debug.compare(net, X, target_dtype="float16", emulate=True, tolerance=TOL)
    rows = {r.name: r for r in rep.rows}
    bad = rows[_planted_name(net)]
    assert rep.first_divergence is bad and bad.nonfinite > 0 and bad.overflow > 0 and bad.new_nonfinite
    assert bad.local_error == math.inf and bad.op == "FullyConnected" and bad.reason == "low_precision"
    assert [r.name for r in rep.rows][:bad.index + 1][-1] == bad.name  # rows in graph order
    after = rep.rows[bad.index + 1]
    assert after.nonfinite > 0 and not after.new_nonfinite  # inf it received, not made
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
    ref_grads = grads(net)
    res = debug.bisect(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [_planted_name(net)]
    assert res.error_before > TOL >= res.error_after
    assert res.trials <= math.ceil(math.log2(res.candidates)) + 1  # one culprit: k*ceil(log2 n) + 1
    fixed = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True,
                                           excluded_sym_names=res.excluded_sym_names)
    plain = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True)
    assert rel(fixed(X).asnumpy(), ref) <= TOL and not rel(plain(X).asnumpy(), ref) <= TOL
    # training: the same names under init, on the hybridized net's graph
    gluon_amp.init(target_dtype=dtype, emulate=True, excluded_sym_names=res.excluded_sym_names)
    net.hybridize()
    assert rel(net(X).asnumpy(), ref) <= TOL
    fixed_grads = grads(net)
    assert all(rel(fixed_grads[n], ref_grads[n]) <= TOL for n in ref_grads), \
        {n: rel(fixed_grads[n], ref_grads[n]) for n in ref_grads}
    gluon_amp.disable()
    gluon_amp.init(target_dtype=dtype, emulate=True)  # without the names: broken (the test can fail)
    net.hybridize()
    broken = grads(net)
    assert not all(rel(broken[n], ref_grads[n]) <= TOL for n in ref_grads)


@pytest.mark.parametrize("kind, dtype", [("overflow", "float16"), ("offset", "bfloat16")])
def test_bisect_finds_several_culprits_within_the_trial_bound_one_minimal_and_deterministic(kind, dtype):
    net = chain(8, (2, 5), kind)
    net.hybridize()
    ref = net(X).asnumpy()
    res = debug.bisect(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)
    want = sorted(net.layers[i].name + "_fwd" for i in (2, 5))
    assert res.excluded_sym_names == want and res.candidates == 8
    assert res.trials <= 2 * math.ceil(math.log2(8)) + 1
    assert res.error_after <= TOL
    again = debug.bisect(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)
    assert (again.excluded_sym_names, again.trials, again.ranking) == (want, res.trials, res.ranking)
    for name in want:  # 1-minimal: dropping either name breaks it
        fewer = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True,
                                               excluded_sym_names=[n for n in want if n != name])
        assert rel(fewer(X).asnumpy(), ref) > TOL


def test_bisect_with_validate_and_max_trials():
    net = planted("overflow")
    res = debug.bisect(net, X, target_dtype="float16", emulate=True,
                       validate=lambda outs: all(np.isfinite(o.asnumpy()).all() for o in outs))
    assert res.excluded_sym_names == [_planted_name(net)] and math.isinf(res.error_before)
    net = chain(8, (3,), "overflow")
    with pytest.raises(RuntimeError, match="max_trials=2"):
        debug.bisect(net, X, target_dtype="float16", emulate=True, tolerance=TOL, max_trials=2)
    with pytest.raises(RuntimeError, match="does not meet the tolerance either"):
        debug.bisect(net, X, target_dtype="float16", emulate=True, validate=lambda outs: False)


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
        assert not any(r.unreproducible for r in rep.rows), str(rep)  # float32 ops recompute the same
        res = debug.bisect(net, x, target_dtype=dtype, emulate=True, tolerance=TOL)
        assert res.excluded_sym_names == [] and res.trials == 1  # the re-validating run only


def test_gradients_and_loss_scale_headroom():
    net = planted("offset")
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    f16 = debug.compare(net, X, target_dtype="float16", emulate=True, loss_fn=loss, labels=LABELS)
    b16 = debug.compare(net, X, target_dtype="bfloat16", emulate=True, loss_fn=loss, labels=LABELS)
    assert {g.name for g in f16.gradients} == {p.name for p in net.collect_params().values()}
    ref = grads(net)
    for g in f16.gradients:
        assert g.max_abs_fp32 == pytest.approx(float(np.abs(ref[g.name]).max()), rel=1e-5)
    for rep in (f16, b16):
        assert rep.loss_scale_headroom == 2.0 ** round(math.log2(rep.loss_scale_headroom))
        assert rep.headroom_limited_by and "headroom" in str(rep)
    assert f16.loss_scale_headroom < b16.loss_scale_headroom
    # the peak FP32 gradient (of a parameter or of an activation held in float16) fits, twice it not
    peak = 65504 / f16.loss_scale_headroom
    assert all(g.max_abs_fp32 <= peak for g in f16.gradients)
    scaled = debug.compare(net, X, target_dtype="float16", emulate=True, labels=LABELS,
                           loss_fn=lambda out, y: loss(out, y) * f16.loss_scale_headroom * 4)
    assert any(not math.isfinite(g.error) or g.error > 0.5 for g in scaled.gradients)  # scaled past it: breaks
    unscaled = debug.compare(net, X, target_dtype="float16", emulate=True, labels=LABELS,
                             loss_fn=lambda out, y: loss(out, y) * f16.loss_scale_headroom / 4)
    assert all(math.isfinite(g.error) for g in unscaled.gradients)


def test_values_fp32_itself_makes_non_finite_are_no_divergence():
    class LogNet(nn.HybridBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.dense = nn.Dense(8, in_units=8)

        def hybrid_forward(self, F, x):
            return F.log(F.relu(self.dense(x)))  # log(0) = -inf in FP32 too

    mx.random.seed(0)
    net = LogNet()
    net.initialize()
    assert not np.isfinite(net(X).asnumpy()).all()
    rep = debug.compare(net, X, target_dtype="float16", emulate=True, tolerance=TOL)
    assert rep.first_divergence is None and rep.output_error < TOL, str(rep)


def test_an_op_fp32_itself_does_not_reproduce_is_named_not_blamed_on_precision():
    """A float32 op whose output changes from run to run on the same inputs (here a random op;
    in GluonCV's Mask R-CNN, MXNet 1.9.1's CPU ROIAlign, which leaves the rows of rois with a
    negative batch index unwritten) makes FP32's reference itself differ: compare names it and
    does not call it the first divergence, and bisect says so instead of searching."""
    class Noisy(nn.HybridBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.first = nn.Dense(8, in_units=8)
                self.last = nn.Dense(4, in_units=8)

        def hybrid_forward(self, F, x):
            noise = F.random.uniform_like(x)  # float32 input: a float32 op in the plan
            return self.last(self.first(x + noise * 10))

    mx.random.seed(0)
    net = Noisy()
    net.initialize()
    net.hybridize()
    for dtype in ("float16", "bfloat16"):
        rep = debug.compare(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)
        noisy = [r for r in rep.rows if r.unreproducible]
        assert [r.op for r in noisy] == ["_random_uniform_like"], str(rep)
        assert noisy[0].dtype == "float32" and noisy[0].local_error > TOL
        assert rep.first_divergence is None and rep.output_error > TOL, str(rep)
        assert any(noisy[0].name in n for n in rep.notes) and noisy[0].name in str(rep)
        assert rep.to_dict()["rows"][noisy[0].index]["unreproducible"] is True
        with pytest.raises(RuntimeError, match="not reproducible.*" + noisy[0].name):
            debug.bisect(net, X, target_dtype=dtype, emulate=True, tolerance=TOL)


class Shared(nn.HybridBlock):
    """One planted dense called twice on inputs of different sizes (as an FPN's RPN head runs on
    every level): two graph nodes of one name."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.planted = nn.Dense(16, in_units=8)
            self.last = nn.Dense(4, in_units=16)

    def hybrid_forward(self, F, x):
        both = F.concat(self.planted(x), self.planted(F.slice_axis(x, axis=0, begin=0, end=3)), dim=0)
        return self.last(both * 1e-3)


@pytest.mark.parametrize("hybridize", [False, True])
def test_a_block_called_twice_is_compared_per_call_and_bisected_by_its_name(hybridize):
    mx.random.seed(0)
    net = Shared()
    net.initialize(mx.init.Xavier())
    net.planted.weight.set_data(net.planted.weight.data() * 60000)  # outputs ~1e5: float16 overflows
    if hybridize:
        net.hybridize()
    net(X)
    name = _planted_name(net)
    rep = debug.compare(net, X, target_dtype="float16", emulate=True, tolerance=TOL)
    calls = [r for r in rep.rows if r.op == "FullyConnected" and r.name.startswith(name)]
    assert [r.name for r in calls] == [name, name + "#2"], str(rep)
    assert all(r.overflow > 0 and r.local_error == math.inf for r in calls)
    assert rep.first_divergence is calls[0]
    res = debug.bisect(net, X, target_dtype="float16", emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [name]  # the graph's own name: it keeps both calls in float32
    fixed = debug.compare(net, X, target_dtype="float16", emulate=True, tolerance=TOL,
                          excluded_sym_names=res.excluded_sym_names)
    assert fixed.output_error < TOL and all(r.dtype == "float32" for r in fixed.rows if r.name.startswith(name))
    assert res.error_after < TOL


def test_a_graph_with_its_own_amp_multicast_is_compared():
    """GluonCV's box decoders call ``F.amp_multicast`` themselves; on float32 inputs the pass
    drops it (it changes no dtype), and compare and bisect skip what does not run."""
    class OwnCast(nn.HybridBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.dense = nn.Dense(4, in_units=8)

        def hybrid_forward(self, F, x, y):
            a, b = F.amp_multicast(x, y, num_outputs=2)
            return self.dense(a + b)

    mx.random.seed(0)
    net = OwnCast()
    net.initialize()
    net.hybridize()
    net(X, X)
    for dtype in ("float16", "bfloat16"):
        rep = debug.compare(net, X, X, target_dtype=dtype, emulate=True, tolerance=TOL)
        assert [r.op for r in rep.rows] == ["elemwise_add", "FullyConnected"] and rep.first_divergence is None
        assert debug.bisect(net, X, X, target_dtype=dtype, emulate=True, tolerance=TOL).excluded_sym_names == []


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


class TokenNet(nn.HybridBlock):
    """Token ids -> Embedding; attention over the first ``length`` tokens (softmax's
    ``length``, which must be an integer) and a SequenceMask of the same length."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.emb = nn.Embedding(50, 16)
            self.score = nn.Dense(1, flatten=False, in_units=16)
            self.out = nn.Dense(4, in_units=16)

    def hybrid_forward(self, F, ids, length):
        h = self.emb(ids)
        att = F.softmax(self.score(h).reshape((0, -1)), length, axis=-1, use_length=True)
        masked = F.SequenceMask(h, sequence_length=length, use_sequence_length=True, axis=1)
        return self.out(F.batch_dot(att.expand_dims(1), masked).reshape((0, -1)))


class TinyLM(nn.HybridBlock):
    """Embedding -> LSTM called with its state list, ``net(ids, [h, c])``, as GluonNLP's LMs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.emb = nn.Embedding(50, 16)
            self.lstm = gluon.rnn.LSTM(16, input_size=16)
            self.out = nn.Dense(50, flatten=False, in_units=16)

    def hybrid_forward(self, F, ids, states):
        # the LSTM's states are not graph outputs here: that path is issue 31's defect 4
        # (type_inference's named outputs); the outputs are nested all the same
        y = self.out(self.lstm(self.emb(ids), states)[0])
        return y, [F.relu(y), F.tanh(y)]


IDS = mx.nd.array(np.random.RandomState(0).randint(0, 50, size=(3, 6)), dtype="int32")
LENGTH = mx.nd.array([2, 6, 4], dtype="int32")


def _token_net(hybridize):
    mx.random.seed(0)
    net = TokenNet()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    net(IDS, LENGTH)
    return net


@pytest.mark.parametrize("hybridize", [True, False])
def test_compare_and_bisect_keep_integer_inputs_integer(hybridize):
    """Before: every input was fed as float32, and softmax's length failed in MXNet."""
    net = _token_net(hybridize)
    rep = debug.compare(net, IDS, LENGTH, target_dtype="float16", emulate=True, tolerance=TOL)
    ops = {r.op for r in rep.rows}
    assert {"Embedding", "softmax", "SequenceMask"} <= ops and "low_precision" in {r.reason for r in rep.rows}
    assert rep.first_divergence is None and 0 < rep.output_error < TOL
    res = debug.bisect(net, IDS, LENGTH, target_dtype="float16", emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [] and res.error_before == rep.output_error
    with pytest.raises(RuntimeError, match="integers"):  # a float length: said, not MXNet's raw error
        debug.compare(net, IDS, LENGTH.astype("float32"), target_dtype="float16", emulate=True)


@pytest.mark.parametrize("hybridize", [True, False])
def test_compare_and_bisect_flatten_nested_state_lists(hybridize):
    """Before: ``net(ids, [h, c])``'s three graph inputs against two arguments failed."""
    mx.random.seed(0)
    net = TinyLM()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    ids = mx.nd.array(np.random.RandomState(1).randint(0, 50, size=(5, 2)))
    states = [s + 0.5 for s in net.lstm.begin_state(batch_size=2)]
    ref = net(ids, states)[0].asnumpy()
    rep = debug.compare(net, ids, states, target_dtype="bfloat16", emulate=True, tolerance=TOL)
    assert "RNN" in {r.op for r in rep.rows} and rep.first_divergence is None and 0 < rep.output_error < TOL
    res = debug.bisect(net, ids, states, target_dtype="bfloat16", emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [] and res.error_before == rep.output_error
    zeros = [mx.nd.zeros_like(s) for s in states]  # the states reach the graph: other states, other error
    assert debug.compare(net, ids, zeros, target_dtype="bfloat16", emulate=True).output_error != rep.output_error
    assert np.array_equal(net(ids, states)[0].asnumpy(), ref)
    if hybridize:
        with pytest.raises(ValueError, match="takes 3 inputs"):
            debug.compare(net, ids, states[0], target_dtype="bfloat16", emulate=True)
    with pytest.raises(TypeError, match="NDArrays"):
        debug.compare(net, ids, [states[0], "c"], target_dtype="bfloat16", emulate=True)


def _exported(net, tmp_path):
    net.export(str(tmp_path / "m"), 0)
    return str(tmp_path / "m-symbol.json"), str(tmp_path / "m-0000.params")


def test_input_specs_read_ids_and_lengths_from_the_graph(tmp_path):
    from gluon_amp.debug.inputs import draw, input_specs
    sym = mx.sym.load(_exported(_token_net(True), tmp_path)[0])
    shapes = {"data0": (3, 6), "data1": (3,)}
    ids, length = input_specs(sym, shapes, {})
    assert (ids.dtype, ids.low, ids.high) == ("float32", 0, 50) and "Embedding" in ids.why
    assert (length.dtype, length.low, length.high) == ("int32", 1, 7)  # [1, T]: softmax and SequenceMask
    assert "softmax" in length.why and "SequenceMask" in length.why
    x, n = draw([ids, length], seed=3)
    assert x.dtype == np.float32 and n.dtype == np.int32 and n.shape == (3,)
    assert 0 <= x.asnumpy().min() and x.asnumpy().max() < 50 and (x.asnumpy() == x.asnumpy().round()).all()
    assert 1 <= n.asnumpy().min() and n.asnumpy().max() <= 6
    ids, length = input_specs(sym, shapes, {}, dtypes={"data0": "int64"}, ranges={"data1": (2, 4)})
    assert (ids.dtype, length.low, length.high) == ("int64", 2, 4)
    with pytest.raises(ValueError, match="reads it as integers"):
        input_specs(sym, shapes, {}, dtypes={"data1": "float32"})
    with pytest.raises(ValueError, match="not data inputs"):
        input_specs(sym, shapes, {}, ranges={"lengths": (1, 2)})
    with pytest.raises(ValueError, match="not supported"):
        input_specs(sym, shapes, {}, dtypes={"data0": "bool"})
    lm = TinyLM()
    lm.initialize()
    lm.hybridize()
    lm(mx.nd.ones((5, 2)), lm.lstm.begin_state(batch_size=2))
    lm_sym = mx.sym.load(_exported(lm, tmp_path)[0])
    lm_shapes = {"data0": (5, 2), "data1": (1, 2, 16), "data2": (1, 2, 16)}
    specs = input_specs(lm_sym, lm_shapes, {})
    assert [(s.dtype, s.low) for s in specs] == [("float32", 0), ("float32", None), ("float32", None)]
    with pytest.raises(ValueError, match="--range data1:"):  # an integer input nothing bounds
        input_specs(lm_sym, lm_shapes, {}, dtypes={"data1": "int32"})


def test_cli_draws_valid_token_ids_and_integer_lengths(tmp_path, capsys):
    """Before: random normals for every input; softmax's float length failed in MXNet."""
    from gluon_amp.debug.cli import main
    symbol, params = _exported(_token_net(True), tmp_path)
    args = [symbol, params, "--shape", "data0:3,6", "--shape", "data1:3", "--target-dtype", "float16"]
    assert main(args + ["--bisect", "--json", str(tmp_path / "d.json")]) == 0
    doc = json.load(open(tmp_path / "d.json"))
    assert [(i["name"], i["dtype"], i["low"], i["high"]) for i in doc["inputs"]] == \
        [("data0", "float32", 0, 50), ("data1", "int32", 1, 7)]
    assert doc["emulated"] and doc["bisect"]["excluded_sym_names"] == [] and doc["output_error"] < TOL
    assert "input data1: int32 (3,) integers in [1, 7)" in capsys.readouterr().out
    assert main(args + ["--range", "data1:1,3", "--dtype", "data0:int32"]) == 0
    assert "input data0: int32" in capsys.readouterr().out
    assert main(args + ["--dtype", "data1:float32"]) == 2
    assert "--dtype data1:int32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--range", "data1:3,1"])
    assert "LOW < HIGH" in capsys.readouterr().err


# -- the FP32 reference across init and MXNet's numpy mode -----------------------------------

MODES = ["legacy", "numpy"]
STATES = ["not hybridized", "hybridized, not called", "hybridized and called"]
TARGETS = ["float16", "bfloat16"]
X6 = np.random.RandomState(1).randn(4, 6).astype("float32")
Y4 = np.array([0, 1, 2, 3], "float32")


@pytest.fixture
def frontend(request):
    """``mode`` of the test as MXNet's frontend: numpy mode (``npx.set_np()``) for the test
    only; returns the array maker of that frontend."""
    if request.param == "numpy":
        mx.npx.set_np()
    yield mx.np.array if request.param == "numpy" else mx.nd.array
    if request.param == "numpy":
        mx.npx.reset_np()


def _dense_tanh(array, state="hybridized and called"):
    """Dense -> tanh -> Dense with fixed weights, in the frontend of ``array`` and the given state."""
    net = nn.HybridSequential(prefix="net_")
    with net.name_scope():
        net.add(nn.Dense(8, in_units=6, activation="tanh"), nn.Dense(4, in_units=8))
    net.initialize()
    rs = np.random.RandomState(0)
    for _, p in sorted(net.collect_params().items()):
        p.set_data(array(rs.normal(0, 0.5, p.shape).astype("float32")))
    if state != "not hybridized":
        net.hybridize()
    if state == "hybridized and called":
        net(array(X6))
    return net


def _summary(net, array, target, loss=True):
    """What compare (with gradients) and bisect say, as plain numbers and names."""
    x = array(X6)
    kw = dict(target_dtype=target, emulate=True, tolerance=1e-4)
    if loss:
        seen = []

        def loss_fn(out, labels):
            seen.append(type(out))
            return gluon.loss.SoftmaxCrossEntropyLoss()(out, labels)
        r = debug.compare(net, x, loss_fn=loss_fn, labels=array(Y4), **kw)
        assert seen and all(t is type(x) for t in seen)  # loss_fn gets the frontend's arrays
    else:
        r = debug.compare(net, x, **kw)
    b = debug.bisect(net, x, **kw)
    return ([(q.name, q.op, q.dtype, q.error, q.local_error) for q in r.rows], r.output_error,
            [(g.name, g.error) for g in r.gradients], r.loss_scale_headroom, b.excluded_sym_names, b.error_after)


_LEGACY = {}


def _legacy_reference(target, loss=True):
    """The legacy-mode, never-hybridized summary (no init in this process at this point)."""
    if (target, loss) not in _LEGACY:
        _LEGACY[target, loss] = _summary(_dense_tanh(mx.nd.array, "not hybridized"), mx.nd.array, target, loss)
    return _LEGACY[target, loss]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("frontend", MODES, indirect=True)
def test_compare_and_bisect_give_legacy_modes_numbers_in_either_mode_and_state(frontend, state, target):
    """Before: numpy mode raised TypeError without a cached graph (legacy input symbols), and with
    loss_fn always (a legacy SymbolBlock's outputs, legacy arrays for loss_fn)."""
    with mx.util.np_array(False), mx.util.np_shape(False):
        ref = _legacy_reference(target)
    got = _summary(_dense_tanh(frontend, state), frontend, target)
    assert got == ref
    assert ref[1] > 0 and ref[4]  # something measured, something kept


@pytest.mark.parametrize("how", ["disable()", "autocast(enabled=False)"])
@pytest.mark.parametrize("policy", [("float16", True), ("bfloat16", True)], ids=["float16-emulated",
                                                                               "bfloat16-emulated"])
@pytest.mark.parametrize("frontend", MODES, indirect=True)
def test_compare_after_init_reads_the_fp32_graph_not_the_plan(frontend, policy, how):
    """A block run under init keeps the plan's graph. Before: compare took it as FP32 (bfloat16:
    error 0 and nothing to keep; float16: an MXNet error blamed on the inputs)."""
    before = _summary(_dense_tanh(frontend), frontend, "bfloat16", loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(policy[0], emulate=policy[1])
    net = _dense_tanh(frontend)  # traced and run under init
    if how == "disable()":
        gluon_amp.disable()
        after = _summary(net, frontend, "bfloat16", loss=False)
    else:
        with gluon_amp.autocast(enabled=False):
            after = _summary(net, frontend, "bfloat16", loss=False)
    assert after == before and before[1] > 0


@pytest.mark.parametrize("frontend", MODES, indirect=True)
def test_a_plan_is_refused_as_the_fp32_reference(frontend, tmp_path):
    """A converted block, its export, and a block whose trace under init is forgotten: a clear
    refusal naming the cause. Before: error 0 (numpy mode) or an MXNet error blamed on the inputs."""
    net = _dense_tanh(frontend)
    x = frontend(X6)
    converted = gluon_amp.convert_hybrid_block(net, "bfloat16", emulate=True)
    converted(x)
    with pytest.raises(TypeError, match="converted mixed-precision block.*pass the block it was converted from"):
        debug.compare(converted, x, target_dtype="bfloat16", emulate=True)
    converted.export(str(tmp_path / "c"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        imported = gluon.SymbolBlock.imports(str(tmp_path / "c-symbol.json"), ["data"],
                                             str(tmp_path / "c-0000.params"))
    with pytest.raises(RuntimeError, match="gluon_amp's casts .*amp_cast_bfloat16.*not the FP32 graph"):
        debug.bisect(imported, x, target_dtype="bfloat16", emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("float16", emulate=True)
    traced = _dense_tanh(frontend)
    gluon_amp.state.reset()  # forgets the graph traced under init; the block keeps the plan
    with gluon_amp.autocast(enabled=False):  # AMP off for the thread; disable() would drop the plan
        with pytest.raises(RuntimeError, match="amp_plan_cast.*block.hybridize\\(\\) again"):
            debug.compare(traced, x, target_dtype="bfloat16", emulate=True)
    gluon_amp.disable()
    traced.hybridize()
    traced(x)  # traced again with AMP off: the FP32 graph
    assert debug.compare(traced, x, target_dtype="bfloat16", emulate=True).output_error == \
        debug.compare(net, x, target_dtype="bfloat16", emulate=True).output_error


def test_cli_compares_a_numpy_mode_export_as_the_legacy_one(tmp_path, capsys):
    """Before: exit 2, MXNet's "saved in np shape semantics" error."""
    from gluon_amp.debug.cli import main
    docs = {}
    for mode in MODES:
        if mode == "numpy":
            mx.npx.set_np()
        try:
            array = mx.np.array if mode == "numpy" else mx.nd.array
            _dense_tanh(array).export(str(tmp_path / mode))
        finally:
            mx.npx.reset_np()
        assert main([str(tmp_path / f"{mode}-symbol.json"), str(tmp_path / f"{mode}-0000.params"),
                     "--shape", "data:4,6", "--target-dtype", "bfloat16", "--emulate", "--bisect",
                     "--json", str(tmp_path / f"{mode}.json")]) == 0, capsys.readouterr().err
        docs[mode] = json.load(open(tmp_path / f"{mode}.json"))
    assert not mx.util.is_np_array() and not mx.util.is_np_shape()
    assert docs["numpy"] == docs["legacy"] and docs["legacy"]["output_error"] > 0


@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
def test_compare_reads_a_block_the_user_cast_low_as_the_fp32_graph_of_its_values(stored):
    """GPU-style code casts the block (``net.cast('float16')``): the FP32 reference reads those
    values in float32, as a float32 block holding the same values does (before: the FP32 graph
    refused the float16 weights, and compare blamed the inputs)."""
    def net_of(values=None):
        net = nn.HybridSequential()
        net.add(nn.Dense(16, activation="tanh", in_units=8), nn.Dense(4, in_units=16))
        net.initialize(mx.init.Xavier())
        if values is not None:
            for p, v in zip(net.collect_params().values(), values):
                p.set_data(v)
        net.hybridize()
        return net
    x = mx.nd.array(np.random.RandomState(0).randn(4, 8))
    cast = net_of()
    cast.cast(gluon_amp.mxnet_internals.to_mx_dtype(stored))  # not called: no float16 GEMM on a CPU
    same = net_of([mx.nd.amp_cast(p.data(), dtype="float32") for p in cast.collect_params().values()])
    got, want = (debug.compare(n, x, target_dtype="bfloat16", emulate=True) for n in (cast, same))
    assert got.output_error == want.output_error and got.output_error > 0
    assert [(r.op, r.dtype) for r in got.rows] == [(r.op, r.dtype) for r in want.rows]
    assert {p.dtype for p in cast.collect_params().values()} == {gluon_amp.mxnet_internals.to_mx_dtype(stored)}


class _UnrolledCell(gluon.HybridBlock):
    """An ``LSTMCell`` unrolled with the zero begin state it makes itself (a ``_zeros`` node of
    shape (0, 5): its batch known only from the rest of the graph)."""

    def __init__(self):
        super().__init__()
        self.cell = gluon.rnn.LSTMCell(5, input_size=3)

    def hybrid_forward(self, F, x, *valid_length):
        self.cell.reset()
        out, _ = self.cell.unroll(4, x, layout="NTC", merge_outputs=True,
                                  valid_length=valid_length[0] if valid_length else None)
        return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("lengths", [False, True])
def test_compare_and_bisect_an_unrolled_cell_with_its_own_zero_state(dtype, lengths):
    """Both raised MXNet's "Shape dim size cannot be a negative value -1" (helper AA): the op-alone
    run bound the zero state's node by itself, whose shape only the graph knows."""
    mx.random.seed(0)
    net = _UnrolledCell()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 4, 3)))
    args = [x, mx.nd.array([3, 4])] if lengths else [x]
    want = net(*args).asnumpy()
    rep = debug.compare(net, *args, target_dtype=dtype, emulate=True, tolerance=TOL)
    assert rep.first_divergence is None and 0 < rep.output_error < TOL
    zeros = [r for r in rep.rows if r.op == "_zeros"]
    assert zeros and all(r.local_error == 0 for r in zeros), zeros
    res = debug.bisect(net, *args, target_dtype=dtype, emulate=True, tolerance=TOL)
    assert res.excluded_sym_names == [] and res.error_before == rep.output_error
    assert np.array_equal(net(*args).asnumpy(), want)


def test_a_recurrent_layer_called_without_states_is_told_to_pass_them():
    net = gluon.rnn.LSTM(5, input_size=3)
    net.initialize()
    net.hybridize()
    x = mx.nd.ones((4, 2, 3))
    net(x)
    with pytest.raises(ValueError, match=r"takes 3 inputs.*begin_state\(batch_size\)"):
        debug.compare(net, x, target_dtype="float16", emulate=True)
    assert debug.compare(net, x, net.begin_state(2), target_dtype="float16", emulate=True).output_error < TOL
