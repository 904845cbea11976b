"""gluon_amp.initialize: the O0-O3 table, overrides, misuse errors; float16 at graph level
(never executing a float16 convolution), bfloat16 executed where oneDNN has the kernels."""
import json
import subprocess
import sys
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from helpers import blobs as _blobs, cnn, internal_types, sgd_trainer
from gluon_amp import mxnet_internals as mxi
from helpers import no_bf16_env
from gluon_amp.training import master_weights as mw
from gluon_amp import opt_levels
from gluon_amp.mxnet_internals import BFLOAT16
from gluon_amp_core.dtypes import dtype_name

# level -> (low-precision weights, patching on, keep_batchnorm_fp32, master weights, loss scale)
TABLE = {
    "O0": (False, False, None, False, 1.0),
    "O1": (False, True, None, False, "dynamic"),
    "O2": (True, True, None, True, "dynamic"),
    "O3": (True, True, False, False, 1.0),
}
LOW_PARAMS = ("conv0_weight", "conv0_bias", "dense0_weight", "dense0_bias")
NORM_PARAMS = ("bn_gamma", "bn_beta", "bn_running_mean", "bn_running_var")


def _dtypes(net):
    return {n: dtype_name(p.dtype) for n, p in net.collect_params().items()}


def _fp16(net, trainer=None, level="O2", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "float16 without a GPU": graph work only
        return gluon_amp.initialize(net, trainer, level, target_dtype="float16", **kw)


def _graph_types(net):
    """{node output: dtype} of the net traced symbolically, fed float32 data, and the symbol."""
    out = net(mx.sym.var("data"))
    return internal_types(out, data="float32"), out


# -- the table and its overrides ---------------------------------------------------------

@pytest.mark.parametrize("level", sorted(TABLE))
def test_properties_follow_the_table(level):
    p = opt_levels.properties(level)
    got = (p.cast_weights, p.patch_ops, p.keep_batchnorm_fp32, p.master_weights, p.loss_scale)
    assert got == TABLE[level]


def test_overrides_replace_only_what_they_name():
    scaler = gluon_amp.LossScaler(init_scale=8)
    p = opt_levels.properties("O2", loss_scale=128, master_weights=False, keep_batchnorm_fp32=True)
    got = (p.loss_scale, p.master_weights, p.keep_batchnorm_fp32, p.cast_weights)
    assert got == (128.0, False, True, True)
    assert opt_levels.properties("O1", loss_scale=scaler).loss_scale is scaler
    assert opt_levels.properties("O3", loss_scale="dynamic").loss_scale == "dynamic"
    assert opt_levels.properties("O3", master_weights=True).master_weights is True


@pytest.mark.parametrize("bad", ["O4", "o1", "", None, 2])
def test_unknown_opt_level_lists_the_levels(bad):
    with pytest.raises(ValueError, match="'O0', 'O1', 'O2', 'O3'"):
        opt_levels.properties(bad)


def test_digit_zero_gets_a_hint():
    with pytest.raises(ValueError, match="Did you mean 'O2'"):
        opt_levels.properties("02")


@pytest.mark.parametrize("kw,err,match", [
    ({"loss_scale": -1}, ValueError, "loss_scale=-1"),
    ({"loss_scale": "static"}, ValueError, "'dynamic'"),
    ({"loss_scale": True}, ValueError, "loss_scale=True"),
    ({"keep_batchnorm_fp32": "True"}, TypeError, "keep_batchnorm_fp32"),
    ({"master_weights": 1}, TypeError, "master_weights"),
])
def test_bad_overrides(kw, err, match):
    with pytest.raises(err, match=match):
        opt_levels.properties("O2", **kw)


@pytest.mark.parametrize("level,kw,match", [
    ("O1", {"master_weights": True}, "O2 or O3"),
    ("O0", {"master_weights": True}, "O2 or O3"),
    ("O0", {"keep_batchnorm_fp32": True}, "no effect at O0"),
])
def test_overrides_that_contradict_the_level(level, kw, match):
    with pytest.raises(ValueError, match=match):
        opt_levels.properties(level, **kw)


# -- float16 at graph level --------------------------------------------------------------

@pytest.mark.parametrize("level", sorted(TABLE))
def test_float16_parameter_dtypes_and_loss_scale(level):
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    out_net, out_tr = _fp16(net, tr, level) if level != "O0" else gluon_amp.initialize(net, tr, "O0")
    assert out_net is net and out_tr is tr
    low, patched, _, master, scale = TABLE[level]
    dtypes = _dtypes(net)
    for name in LOW_PARAMS:
        assert dtypes[name] == ("float16" if low else "float32"), name
    for name in NORM_PARAMS:
        assert dtypes[name] == "float32", name
    assert gluon_amp.is_enabled() is patched
    if patched:
        assert gluon_amp.current_policy().table.target_dtype == "float16"
    scaler = gluon_amp.get_scaler(tr)
    assert scaler.dynamic is (scale == "dynamic")
    assert scaler.loss_scale == (2.0 ** 16 if scale == "dynamic" else 1.0)
    assert tr.optimizer.multi_precision is master  # float16: MXNet's own master copies
    assert not any(isinstance(u, mw.MasterWeightUpdater) for u in mxi.trainer_updaters(tr))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_float16_graph_casts_at_the_boundary(level):
    net = cnn(prefixed=True)
    _fp16(net, sgd_trainer(net), level)
    types, out = _graph_types(net)
    assert types[out.list_outputs()[0]] == "float32"  # the loss runs in float32
    conv = next(n for n in types if n.startswith("conv0") and n.endswith("_output"))
    assert types[conv] == "float16"
    args, _, aux = out.infer_type(data="float32")
    arg_types = dict(zip(out.list_arguments(), (dtype_name(t) for t in args)))
    assert arg_types["conv0_weight"] == "float16" and arg_types["bn_gamma"] == "float32"
    assert {dtype_name(t) for t in aux} == {"float32"}  # running statistics
    # the input is cast once, at the entry, before anything else reads it
    nodes = json.loads(out.tojson(remove_amp_cast=False))["nodes"]
    data = next(i for i, n in enumerate(nodes) if n["name"] == "data")
    readers = [n["op"] for n in nodes if any(inp[0] == data for inp in n["inputs"])]
    assert readers == ["amp_cast"]


def test_float16_o1_keeps_float32_weights_and_casts_in_graph():
    net = cnn(prefixed=True)
    _fp16(net, sgd_trainer(net), "O1")
    types, out = _graph_types(net)
    args, _, _ = out.infer_type(data="float32")
    arg_types = dict(zip(out.list_arguments(), (dtype_name(t) for t in args)))
    assert arg_types["conv0_weight"] == "float32"
    conv = next(n for n in types if n.startswith("conv0") and n.endswith("_output"))
    assert types[conv] == "float16"


@pytest.mark.parametrize("level,kbn,bn_dtype", [
    ("O2", None, "float16"), ("O3", None, "float16"), ("O3", True, "float32"), ("O2", True, "float32"),
])
def test_float16_batchnorm_precision(level, kbn, bn_dtype):
    net = cnn(prefixed=True)
    _fp16(net, sgd_trainer(net), level, keep_batchnorm_fp32=kbn)
    types, _ = _graph_types(net)
    bn = next(n for n in types if n.startswith("bn_") and n.endswith("_output"))
    assert types[bn] == bn_dtype


def test_float16_imperative_block_boundary():
    class Probe(nn.Block):
        def __init__(self):
            super().__init__()
            self.w = self.params.get("w", shape=(2,), init=mx.init.One())
            self.seen = None

        def forward(self, x):
            self.seen = dtype_name(x.dtype)
            return x * 2, x.astype("float64")

    net = Probe()
    net.initialize()
    _fp16(net, None, "O2")
    assert dtype_name(net.w.dtype) == "float16"
    y, wide = net(mx.nd.ones((2,)))
    assert net.seen == "float16" and dtype_name(y.dtype) == "float32"
    assert dtype_name(wide.dtype) == "float64"  # only low-precision outputs come back as float32
    np.testing.assert_array_equal(y.asnumpy(), [2, 2])
    ids, _ = net(mx.nd.array([1, 2], dtype="int32"))  # integer inputs are not cast
    assert dtype_name(ids.dtype) == "int32"


def test_loss_scale_override_reaches_the_trainer():
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    _fp16(net, tr, "O2", loss_scale=128)
    s = gluon_amp.get_scaler(tr)
    assert (s.loss_scale, s.dynamic) == (128.0, False)
    assert gluon_amp.init_trainer(tr, 128) is s
    with pytest.raises(RuntimeError, match="from loss_scale=128"):  # the user's scale, not the level's
        gluon_amp.init_trainer(tr)
    net2 = cnn(prefixed=True)
    tr2 = sgd_trainer(net2)
    scaler = gluon_amp.LossScaler(init_scale=4)
    _fp16(net2, tr2, "O2", loss_scale=scaler)
    assert gluon_amp.get_scaler(tr2) is scaler


# -- misuse ------------------------------------------------------------------------------

def _untouched(net, tr):
    assert set(_dtypes(net).values()) == {"float32"}
    assert not gluon_amp.is_enabled()
    with pytest.raises(RuntimeError, match="no loss scaler"):
        gluon_amp.get_scaler(tr)


def test_initialize_twice():
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    gluon_amp.initialize(net, tr, "O0")
    with pytest.raises(RuntimeError, match="already called with this net"):
        gluon_amp.initialize(net, None, "O0")
    with pytest.raises(RuntimeError, match="already called with this Trainer"):
        gluon_amp.initialize(cnn(prefixed=True), tr, "O0")


def test_initialize_after_the_first_step():
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    with autograd.record():
        loss = net(mx.nd.ones((2, 1, 8, 8))).sum()
    loss.backward()
    tr.step(2)
    with pytest.raises(RuntimeError, match="before the first trainer.step"):
        _fp16(net, tr, "O2")
    assert set(_dtypes(net).values()) == {"float32"} and not gluon_amp.is_enabled()


def test_update_on_kvstore_is_refused():
    net = cnn(prefixed=True)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=True)
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        _fp16(net, tr, "O2")
    _untouched(net, tr)


def test_uninitialized_net():
    net = nn.Dense(2, in_units=3)
    with pytest.raises(RuntimeError, match="not initialized yet.*net.initialize"):
        gluon_amp.initialize(net, None, "O1")


def test_deferred_shapes_refused_only_where_weights_are_cast():
    net = nn.Dense(2)
    net.initialize()
    tr = sgd_trainer(net)
    with pytest.raises(RuntimeError, match="forward pass"):
        _fp16(net, tr, "O2")
    _untouched(net, tr)
    _fp16(net, tr, "O1")  # O1 casts at run time: deferred shapes are fine
    assert gluon_amp.get_scaler(tr).dynamic


def test_trainer_with_a_scaler_already():
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    gluon_amp.init_trainer(tr)
    with pytest.raises(RuntimeError, match="initialize attaches one itself"):
        _fp16(net, tr, "O2")


def test_wrong_types():
    with pytest.raises(TypeError, match="mxnet.gluon.Block"):
        gluon_amp.initialize("net", None, "O1")
    with pytest.raises(TypeError, match="Trainer or None"):
        gluon_amp.initialize(cnn(prefixed=True), "sgd", "O1")


def test_target_dtype_at_o0():
    with pytest.raises(ValueError, match="no effect at O0"):
        gluon_amp.initialize(cnn(prefixed=True), None, "O0", target_dtype="bfloat16")


def test_without_a_target_dtype_the_level_follows_the_policy_in_force():
    """``init('float16', emulate=True)`` then ``initialize(net, trainer, 'O1')``: the level picked
    for the machine instead (float32 here), warned that AMP was off, and gave the trainer a
    static scale of 1 while the float16 policy stayed in force: float16 steps, unscaled."""
    policy = gluon_amp.init("float16", emulate=True)
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        gluon_amp.initialize(net, tr, "O1")
    assert gluon_amp.get_scaler(tr).dynamic and gluon_amp.get_scaler(tr).loss_scale == 65536.0
    assert gluon_amp.state.current_policy() is policy
    assert gluon_amp.init_trainer(tr) is gluon_amp.get_scaler(tr)  # the level's scaler, asked for later
    other = sgd_trainer(cnn(prefixed=True))
    with gluon_amp.autocast(enabled=False):  # a region is no setting of the process's: the process's policy
        gluon_amp.initialize(cnn(prefixed=True), other, "O1")
    assert gluon_amp.get_scaler(other).dynamic
    with pytest.raises(ValueError, match="emulated policy in force.*O2 stores the weights"):
        gluon_amp.initialize(cnn(prefixed=True), sgd_trainer(cnn(prefixed=True)), "O2")


def test_a_level_that_clashes_with_the_policy_in_force_names_its_batch_norm_setting():
    """O3 (``keep_batchnorm_fp32=False``) after ``init('float16')``: the refusal read "with
    keep_batchnorm_fp32", the opposite of O3's setting."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "float16 without a GPU": graph work only
        gluon_amp.init("float16")
        with pytest.raises(RuntimeError, match=r"asked for float16 .*with keep_batchnorm_fp32=False\. The policy in "
                           r"force has keep_batchnorm_fp32=None \(batch norm as the op table says\)\."):
            gluon_amp.initialize(cnn(prefixed=True), None, "O3")


# -- bfloat16, executed ------------------------------------------------------------------

def _fit(net, tr, x, y, steps, start=0, bs=32):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for i in range(start, start + steps):
        j = (i * bs) % x.shape[0]
        with autograd.record():
            out = net(x[j:j + bs])
            loss = loss_fn(out, y[j:j + bs])
            with gluon_amp.scale_loss(loss, tr) as scaled:
                autograd.backward(scaled)
        tr.step(bs)
    mx.nd.waitall()
    return out


def _bf16_run(level, seed=0, hybridize=True, steps=60, **kw):
    net = cnn(seed, hybridize, prefixed=True)
    tr = sgd_trainer(net)
    gluon_amp.initialize(net, tr, level, target_dtype="bfloat16" if level != "O0" else None, **kw)
    return net, tr


@pytest.mark.parametrize("hybridize", [True, False])
def test_bfloat16_o2_trains_like_o0_with_float32_master_weights(native_host, hybridize):
    x, y = _blobs()
    xt, yt = _blobs(seed=1)
    ref, ref_tr = _bf16_run("O0")
    _fit(ref, ref_tr, x, y, 60)
    gluon_amp.disable()
    net, tr = _bf16_run("O2", hybridize=hybridize)
    out = _fit(net, tr, x, y, 60)
    assert dtype_name(out.dtype) == "float32"
    acc = lambda n: float((n(xt).argmax(axis=1) == yt).mean().asscalar())  # noqa: E731
    ref_acc, o2_acc = acc(ref), acc(net)
    assert ref_acc > 0.9
    assert o2_acc >= ref_acc - 0.02, (o2_acc, ref_acc)
    masters = mw.master_copies(tr)
    assert sorted(masters) == sorted(LOW_PARAMS)
    params = net.collect_params()
    for name, master in masters.items():
        assert master.dtype == np.float32
        w = params[name].data()
        assert w.dtype == BFLOAT16
        np.testing.assert_array_equal(mx.nd.amp_cast(master, dtype=BFLOAT16).asnumpy(), w.asnumpy())
    assert all(params[n].data().dtype == np.float32 for n in NORM_PARAMS)
    assert gluon_amp.get_scaler(tr).skipped_steps == 0


def test_bfloat16_o2_resume_is_bitwise_exact(native_host, tmp_path):
    x, y = _blobs(n=256)
    straight, tr = _bf16_run("O2", seed=3)
    _fit(straight, tr, x, y, 8)
    want_masters = {k: v.asnumpy() for k, v in mw.master_copies(tr).items()}

    first, tr1 = _bf16_run("O2", seed=3)
    _fit(first, tr1, x, y, 4)
    first.save_parameters(str(tmp_path / "p.params"))
    gluon_amp.save_states(tr1, str(tmp_path / "t.states"))

    second, tr2 = _bf16_run("O2", seed=99)  # different init: everything must come from the files
    second.load_parameters(str(tmp_path / "p.params"))
    gluon_amp.load_states(tr2, str(tmp_path / "t.states"))
    _fit(second, tr2, x, y, 4, start=4)

    got_masters = mw.master_copies(tr2)
    assert sorted(got_masters) == sorted(want_masters)
    for name, want in want_masters.items():
        np.testing.assert_array_equal(got_masters[name].asnumpy(), want, err_msg=name)
    for (name, a), b in zip(straight.collect_params().items(), second.collect_params().values()):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy(), err_msg=name)
    assert gluon_amp.get_scaler(tr2).state_dict() == gluon_amp.get_scaler(tr).state_dict()


def test_bfloat16_o3_updates_without_master_copies(native_host):
    x, y = _blobs(n=64)
    net, tr = _bf16_run("O3")
    before = net.collect_params()["conv0_weight"].data().asnumpy().copy()
    _fit(net, tr, x, y, 2)
    assert mw.master_copies(tr) == {}
    assert not (net.collect_params()["conv0_weight"].data().asnumpy() == before).all()
    assert gluon_amp.get_scaler(tr).loss_scale == 1.0


FALLBACK = r'''
import json, warnings
import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn

net = nn.HybridSequential()
net.add(nn.Conv2D(4, 3, in_channels=1), nn.BatchNorm(in_channels=4), nn.Dense(2, in_units=64))
net.initialize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gluon_amp.initialize(net, trainer, "O2")
with autograd.record():
    loss = net(mx.nd.ones((2, 1, 6, 6))).sum()
    with gluon_amp.scale_loss(loss, trainer) as scaled:
        autograd.backward(scaled)
trainer.step(2)
mx.nd.waitall()
print(json.dumps({"dtypes": sorted({str(p.data().dtype) for p in net.collect_params().values()}),
                  "enabled": gluon_amp.is_enabled(), "scale": gluon_amp.get_scaler(trainer).loss_scale,
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
                  "asked_again": gluon_amp.init_trainer(trainer) is gluon_amp.get_scaler(trainer)}))
'''


def test_without_bf16_kernels_every_level_falls_back_to_o0():
    out = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True,
                         env=no_bf16_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["<class 'numpy.float32'>"]
    assert got["enabled"] is False and got["scale"] == 1.0
    assert got["asked_again"]  # the fallback's scale of 1 was no loss_scale the user asked for
    assert len(got["warnings"]) == 1 and "float32" in got["warnings"][0], got["warnings"]


@pytest.mark.parametrize("level,override,want", [("O2", False, False), ("O3", True, True)])
def test_master_weights_override_float16(level, override, want):
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    _fp16(net, tr, level, master_weights=override)
    assert tr.optimizer.multi_precision is want
    assert dtype_name(net.collect_params()["conv0_weight"].dtype) == "float16"


@pytest.mark.parametrize("override", [False, True])
def test_master_weights_override_bfloat16_wiring(override):
    net = cnn(prefixed=True)
    tr = sgd_trainer(net)
    gluon_amp.initialize(net, tr, "O2", target_dtype="bfloat16", master_weights=override)
    updaters = mxi.trainer_updaters(tr)
    assert all(isinstance(u, mw.MasterWeightUpdater) for u in updaters)  # bf16 updates need float32 math
    assert all(u.keep_master is override for u in updaters)
    assert tr.optimizer.multi_precision is False


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_graph_cached_before_initialize_is_rebuilt(level):
    class ModeDependent(nn.HybridBlock):  # like SSD: other outputs in training than in inference
        def __init__(self):
            super().__init__()
            self.w = self.params.get("w", shape=(1,), init=mx.init.One())

        def hybrid_forward(self, F, x, w):
            return F.broadcast_mul(x, w) * (2 if autograd.is_training() else 1)

    net = ModeDependent()
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.ones((1, 2))
    assert net(x).asnumpy().tolist() == [[1, 1]]  # caches the inference graph
    if level == "O0":
        gluon_amp.initialize(net, None, level)
    else:
        _fp16(net, None, level)
    with autograd.record():
        y = net(x)
    assert y.asnumpy().tolist() == [[2, 2]]


def _with_symbol_block():
    data = mx.sym.var("data")
    inner = gluon.SymbolBlock(mx.sym.FullyConnected(data, num_hidden=2, name="fc"), [data])
    inner.initialize()
    outer = nn.HybridSequential()
    outer.add(inner)
    outer(mx.nd.ones((1, 3)))  # shapes
    return outer, inner


def test_o1_warns_about_graphs_composed_before():
    net, inner = _with_symbol_block()
    with pytest.warns(RuntimeWarning, match=f"O1: 1 SymbolBlock.*{inner.name}"):
        gluon_amp.initialize(net, None, "O1", target_dtype="float16")


def test_o2_carries_symbol_blocks_along():
    net, _ = _with_symbol_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", message=".*float16.*without a GPU")
        warnings.filterwarnings("ignore", message=".*cached its graph")
        gluon_amp.initialize(net, None, "O2", target_dtype="float16")
    assert dtype_name(net.collect_params()["fc_weight"].dtype) == "float16"
    types, out = _graph_types(net)
    fc = next(n for n in types if n.startswith("fc") and n.endswith("_output"))
    assert types[fc] == "float16" and types[out.list_outputs()[0]] == "float32"


def test_bfloat16_o2_clip_global_norm(native_host):
    x, y = _blobs(n=64)
    net, tr = _bf16_run("O2")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = loss_fn(net(x[:32]), y[:32])
        with gluon_amp.scale_loss(loss, tr) as scaled:
            autograd.backward(scaled)
    norm = gluon_amp.clip_global_norm(tr, 1e-3)
    assert np.isfinite(norm) and norm > 1e-3
    grads = [p.grad() for p in net.collect_params().values() if p.grad_req != "null"]
    after = np.sqrt(sum(float((mx.nd.amp_cast(g, dtype="float32") ** 2).sum().asscalar()) for g in grads))
    assert after == pytest.approx(1e-3, rel=0.02)
    tr.step(32)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_bfloat16_weights_on_two_contexts_are_saved_and_loaded_in_bfloat16(native_host, tmp_path, level):
    """save_parameters averages a parameter's copies on several contexts with MXNet's ``add_n``
    and ``/``, ops AMP patches: the table's float32 ``_div_scalar`` saved bfloat16 weights as
    float32, and load_parameters refused the file (dtype incompatible). The file holds the
    weights as they are, as plain MXNet's ``net.cast`` on two contexts writes them."""
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3), nn.Dense(2, in_units=4))
    net.initialize(ctx=ctx)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    net, trainer = gluon_amp.initialize(net, trainer, level, target_dtype="bfloat16")
    params = net._collect_params_with_prefix()  # the names save_parameters writes
    held = {name: dtype_name(p.dtype) for name, p in params.items()}
    assert "bfloat16" in held.values()
    path = str(tmp_path / "two.params")
    net.save_parameters(path)
    saved = mx.nd.load(path)
    assert {k: dtype_name(v.dtype) for k, v in saved.items()} == held
    net.load_parameters(path, ctx=ctx)
    for name, p in params.items():
        for a in p.list_data():
            np.testing.assert_array_equal(mx.nd.amp_cast(a, dtype="float32").asnumpy(),
                                          mx.nd.amp_cast(saved[name], dtype="float32").asnumpy())


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("case", ["numpy-mode", "sparse-gradient"])
def test_bfloat16_weights_mxnet_cannot_hold_are_refused_before_anything_changes(native_host, level, case):
    """MXNet 1.9.1 has no bfloat16 numpy-mode or sparse arrays: casting such weights raised its
    ``KeyError: <class 'numpy.void'>`` half-way, with AMP on and some weights cast. A ValueError
    naming the case and O1 comes first, and the net, the trainer and AMP stay as they were."""
    from mxnet import npx
    if case == "numpy-mode":
        npx.set_np()
    try:
        net = nn.HybridSequential()
        if case == "sparse-gradient":
            net.add(nn.Embedding(10, 4, sparse_grad=True))
        net.add(nn.Dense(3, in_units=4, flatten=False))
        net.initialize()
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
        before = {n: dtype_name(p.dtype) for n, p in net.collect_params().items()}
        with pytest.raises(ValueError, match="numpy-mode" if case == "numpy-mode" else "embedding") as err:
            gluon_amp.initialize(net, trainer, level, target_dtype="bfloat16")
        assert "'O1'" in str(err.value)
        assert {n: dtype_name(p.dtype) for n, p in net.collect_params().items()} == before
        assert not gluon_amp.is_enabled() and getattr(trainer, "_amp_loss_scaler", None) is None
        gluon_amp.initialize(net, trainer, "O1", target_dtype="bfloat16")  # what the message offers works
        assert gluon_amp.is_enabled()
    finally:
        gluon_amp.disable()
        if case == "numpy-mode":
            npx.reset_np()


def _stem_symbolblock():
    """A ResNet stem as a SymbolBlock (GluonCV's SSD builds its features so): a convolution on an
    image's 3 channels, which a shape rule of the bfloat16 table keeps float32, then batch norm,
    ReLU, pooling and a convolution that runs low."""
    data = mx.sym.var("data")
    x = mx.sym.Convolution(data, num_filter=16, kernel=(3, 3), pad=(1, 1), no_bias=True, name="conv0")
    x = mx.sym.Activation(mx.sym.BatchNorm(x, name="bn0"), act_type="relu", name="relu0")
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max", name="pool0")
    x = mx.sym.Convolution(x, num_filter=16, kernel=(3, 3), pad=(1, 1), no_bias=True, name="conv1")
    net = gluon.SymbolBlock(x, [data])
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    return net


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_symbolblock_in_one_dtype_trains_where_a_shape_rule_keeps_its_first_convolution_float32(native_host,
                                                                                                   level):
    """Its graph has no casts (every weight and the input in bfloat16): the float32 values of the
    kept convolution are cast back before the next low op, else MXNet refuses the graph."""
    net = _stem_symbolblock()
    x = mx.nd.random.uniform(-1, 1, shape=(2, 3, 8, 8))
    with autograd.train_mode():
        net(x)
    trainer = sgd_trainer(net)
    gluon_amp.initialize(net, trainer, level, target_dtype="bfloat16")
    with autograd.record():
        loss = net(x).mean()
    loss.backward()
    trainer.step(2)
    rows = {r.name: (r.dtype, r.reason) for r in gluon_amp.report(net).rows if r.op == "Convolution"}
    assert rows == {"conv0": ("float32", "narrow_input"), "conv1": ("bfloat16", "low_precision")}, rows
    assert all(np.isfinite(p.data().astype("float32").asnumpy()).all() for p in net.collect_params().values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("values, kept", [
    ([1.0, 2.0, 3.0], False),            # small integers: exact in both dtypes
    ([0.5, 1e5, -3.25], False),          # not all integers: data, cast as Apex casts it
    ([257.0, 259.0], "bfloat16"),        # valid lengths: bfloat16 holds integers to 256 only
    ([30521.0, 7.0, 0.0], True),         # token ids: beyond both
    ([2049.0, 12.0], True),              # float16 holds integers to 2048
])
def test_the_entry_cast_leaves_integers_the_dtype_cannot_hold_in_float32(dtype, values, kept):
    x = mx.nd.array(values)
    want = kept is True or kept == dtype
    assert opt_levels._holds_inexact_integers(x, dtype) is want
    exact = mx.nd.amp_cast(x, dtype=mxi.to_mx_dtype(dtype)).astype("float32").asnumpy()
    assert want == (not np.array_equal(exact, x.asnumpy()) and np.array_equal(np.round(values), values))
    out = opt_levels._entry_cast((x, [mx.nd.array([1.5])]), dtype)
    assert (out[0] is x) == want and dtype_name(out[1][0].dtype) == dtype


class _Lengths(gluon.HybridBlock):
    """Token ids into an Embedding, masked past each sequence's valid length."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 4)

    def hybrid_forward(self, F, ids, valid_length):
        h = self.embed(ids)  # (batch, time, 4)
        return F.SequenceMask(h, sequence_length=valid_length, use_sequence_length=True, axis=1)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("hybridize", [True, False])
def test_o2_keeps_float32_token_ids_and_lengths_exact(native_host, level, hybridize):
    """MXNet programs feed ids and lengths as float32 (``nd.array``'s default). O2/O3 cast every
    float input at the net's entry: in bfloat16 ``valid_length`` 257 became 256 and 259 became
    260 (an unrolled LSTM masked the wrong steps, silently: helper AA), and token id 999 became
    1000. The rows read and the steps kept are now FP32's."""
    ids = mx.nd.array(np.arange(2 * 300).reshape(2, 300) % 1000 + 400)
    lengths = mx.nd.array([257, 259])
    mx.random.seed(0)
    net = _Lengths()
    net.initialize(mx.init.Uniform(1.0))
    if hybridize:
        net.hybridize()
    gluon_amp.initialize(net, sgd_trainer(net), level, target_dtype="bfloat16")
    out = net(ids, lengths).asnumpy()
    table = net.embed.weight.data().astype("float32").asnumpy()  # stored bfloat16 at O2/O3
    want = table[ids.asnumpy().astype(int)]
    want[0, 257:] = want[1, 259:] = 0
    np.testing.assert_array_equal(out, want)
    assert ids.dtype == lengths.dtype == np.float32  # the caller's arrays as they were


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_entry_cast_takes_float64_inputs(dtype):
    """A float64 input (ids an Embedding reads, float64 data) failed at the O2/O3 entry with MXNet's
    "unknown type for MKLDNN": oneDNN's amp_cast has no float64 (helper BB). It goes through float32."""
    x = mx.nd.array([[1.0, 2.0, 3.0], [0.1, -2.5, 7.0]], dtype="float64")
    out = opt_levels._entry_cast((x,), dtype)[0]
    assert dtype_name(out.dtype) == dtype and dtype_name(x.dtype) == "float64"
    want = mx.nd.amp_cast(x.astype("float32"), dtype=mxi.to_mx_dtype(dtype)).astype("float32").asnumpy()
    np.testing.assert_array_equal(out.astype("float32").asnumpy(), want)


class _SparseNet(gluon.Block):
    def __init__(self):
        super().__init__()
        self.emb = gluon.contrib.nn.SparseEmbedding(20, 4)  # a row_sparse weight
        self.fc = nn.Dense(3, in_units=4)

    def forward(self, x):
        return self.fc(self.emb(x).mean(axis=1))


def test_o1_takes_a_net_with_sparse_weights(native_host):
    """O1 is where the O2/O3 refusal sends sparse users; it said "1 parameter(s) of the net are not
    initialized yet: sparseembedding0_weight" of an initialized net (``list_data`` refuses row_sparse
    storage; helper BB). Uninitialized, it still says so."""
    mx.random.seed(0)
    fresh = _SparseNet()
    with pytest.raises(RuntimeError, match="not initialized yet: .*sparseembedding"):
        gluon_amp.initialize(fresh, None, "O1", target_dtype="bfloat16")  # MXNet's Trainer refuses it first
    net = _SparseNet()
    net.initialize(mx.init.Uniform(0.5))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    gluon_amp.initialize(net, trainer, "O1", target_dtype="bfloat16")
    x, y = mx.nd.array([[1, 2, 3], [4, 5, 6]]), mx.nd.array([0, 2])
    for _ in range(2):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y).mean()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                scaled.backward()
        trainer.step(1)
    assert np.isfinite(net.fc.weight.data().asnumpy()).all()
    assert gluon_amp.get_scaler(trainer).skipped_steps == 0
