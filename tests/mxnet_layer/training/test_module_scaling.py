"""Dynamic loss scaling for ``mx.mod.Module`` and ``BucketingModule`` (issue 37, part 1).

The mechanism runs in float32 with a scaler that scales every dtype (``LossScaler(...)``):
powers of two are exact there, so a scaled run must give FP32's weights bit for bit unless a
step is skipped. The emulated-float16 tests (``test_emulated_float16_*`` and the launcher
case) run a float16 plan on any CPU through ``gluon_amp.execution`` (Symbol.simple_bind).
Costs (2 shared cores): each test 1-3 s; the launcher case about 5 s.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import mxnet as mx

import gluon_amp as amp
from gluon_amp import LossScaler
from helpers import ROOT

GOLDEN = os.path.join(ROOT, "tests", "core", "data", "gradscaler_trajectory.json")
BATCH = 16


def mlp(head="SoftmaxOutput", **head_kw):
    data = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=32, name="fc1"), act_type="relu")
    out = mx.sym.FullyConnected(h, num_hidden=4, name="fc2")
    if head == "SoftmaxOutput":
        return mx.sym.SoftmaxOutput(out, name="softmax", **head_kw)
    if head == "MakeLoss":
        label = mx.sym.Variable("softmax_label")
        ce = -mx.sym.pick(mx.sym.log_softmax(out), label, axis=1)
        return mx.sym.MakeLoss(mx.sym.mean(ce), name="loss", **head_kw)
    label = mx.sym.Variable("softmax_label")
    return getattr(mx.sym, head)(mx.sym.FullyConnected(h, num_hidden=1, name="reg"),
                                 mx.sym.reshape(label, (-1, 1)), name="reg_out", **head_kw)


def data(n_batches=50, seed=0, inf_at=()):
    rng = np.random.RandomState(seed)
    x = rng.randn(n_batches * BATCH, 10).astype("float32")
    w = rng.randn(10, 4).astype("float32")
    y = (x @ w).argmax(axis=1).astype("float32")
    for k in inf_at:
        x[k * BATCH, 0] = np.inf
    return x, y


def module(sym=None, seed=1, lr=0.05, optimizer="sgd", scaler=None, bind=True, context=None, **opt):
    mod = mx.mod.Module(sym if sym is not None else mlp(), context=context or mx.cpu())
    if scaler is not None and not bind:
        amp.init_trainer(mod, scaler)
    if bind:
        mod.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))])
        mx.random.seed(seed)
        mod.init_params(mx.init.Xavier())
        mod.init_optimizer(optimizer=optimizer, optimizer_params={"learning_rate": lr, "momentum": 0.9, **opt}
                           if optimizer == "sgd" else {"learning_rate": lr, **opt})
        if scaler is not None:
            amp.init_trainer(mod, scaler)
    return mod


def batches(x, y):
    return [mx.io.DataBatch([mx.nd.array(x[i:i + BATCH])], [mx.nd.array(y[i:i + BATCH])])
            for i in range(0, len(x), BATCH)]


def train_loop(mod, x, y):
    """The hand-written loop; the mean cross-entropy of each batch before its update."""
    losses = []
    for b in batches(x, y):
        mod.forward_backward(b)
        p = mod.get_outputs()[0].asnumpy()
        losses.append(float(-np.log(p[np.arange(BATCH), b.label[0].asnumpy().astype(int)] + 1e-12).mean()))
        mod.update()
    return losses


def params(mod):
    arg, aux = mod.get_params()
    return {k: v.asnumpy() for k, v in {**arg, **aux}.items()}


def test_scale_reaches_every_loss_head_and_the_symbol_stays_the_users():
    """Gradients carry exactly the scale for each head of the loss-output list and MakeLoss;
    the module's own symbol (what save_checkpoint writes) is the user's graph."""
    x, y = data(1)
    b = batches(x, y)[0]
    for head in ("SoftmaxOutput", "MakeLoss", "LinearRegressionOutput", "LogisticRegressionOutput",
                 "MAERegressionOutput"):
        sym = mlp(head)
        plain, scaled = module(sym), module(sym, scaler=LossScaler.static(256.0))
        assert scaled.symbol.tojson() == sym.tojson(), head
        for m in (plain, scaled):
            m.forward_backward(b)
        g0 = [g[0].asnumpy() for g in plain._exec_group.grad_arrays]
        g1 = [g[0].asnumpy() for g in scaled._exec_group.grad_arrays]
        assert any(np.abs(g).max() > 0 for g in g0), head
        for a, c in zip(g0, g1):
            np.testing.assert_array_equal(a * 256.0, c, err_msg=head)
        for m in (plain, scaled):  # the forward is the identity: outputs equal bit for bit
            m.forward(b, is_train=True)
        np.testing.assert_array_equal(plain.get_outputs()[0].asnumpy(), scaled.get_outputs()[0].asnumpy())


def _scaler():
    return LossScaler(init_scale=2.0 ** 10, growth_interval=10)


def test_loop_and_fit_match_fp32_with_scaling():
    """50 steps of forward_backward/update and of fit, scaled (2**10, growing every 10 steps):
    every loss and weight equals FP32's (tolerance 1e-6: exact in float32, no step skipped)."""
    x, y = data(50)
    ref = module()
    ref_losses = train_loop(ref, x, y)
    mod = module(scaler=_scaler())
    losses = train_loop(mod, x, y)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    scaler = amp.get_scaler(mod)
    assert scaler.total_steps == 50 and scaler.skipped_steps == 0 and scaler.loss_scale == 2.0 ** 15
    for k, v in params(ref).items():
        np.testing.assert_allclose(params(mod)[k], v, rtol=1e-6, atol=0)

    fitted = {}
    for name, scaler in (("fp32", None), ("scaled", _scaler())):
        m = mx.mod.Module(mlp(), context=mx.cpu())
        if scaler is not None:
            amp.init_trainer(m, scaler)  # before fit: fit's bind and init_optimizer keep it
        curve = []
        mx.random.seed(1)
        m.fit(mx.io.NDArrayIter(x, y, batch_size=BATCH), num_epoch=1, initializer=mx.init.Xavier(),
              optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9}, eval_metric="ce",
              batch_end_callback=lambda p: curve.append(p.eval_metric.get()[1]))
        fitted[name] = (curve, params(m), m)
    np.testing.assert_allclose(fitted["scaled"][0], fitted["fp32"][0], rtol=1e-6)
    for k, v in fitted["fp32"][1].items():
        np.testing.assert_allclose(fitted["scaled"][1][k], v, rtol=1e-6, atol=0)
    assert amp.get_scaler(fitted["scaled"][2]).total_steps == 50


def _optimizer_state(mod):
    from gluon_amp.mxnet_internals import module as mxm
    states = mxm.module_updater(mod).states
    flat = {}
    for k, s in states.items():
        for j, a in enumerate(s if isinstance(s, (list, tuple)) else [s]):
            if a is not None:
                flat[(k, j)] = a.asnumpy().copy()
    opt = mxm.module_optimizer(mod)
    return flat, opt.num_update, dict(opt._index_update_count)


def test_planted_inf_step_is_skipped_with_weights_and_optimizer_state_unchanged():
    x, y = data(6, inf_at=(4,))
    mod = module(scaler=LossScaler(init_scale=2.0 ** 12), optimizer="adam", lr=0.01)
    bs = batches(x, y)
    for b in bs[:4]:
        mod.forward_backward(b)
        mod.update()
    before_w, before_s = params(mod), _optimizer_state(mod)
    mod.forward_backward(bs[4])
    assert not all(np.isfinite(g[0].asnumpy()).all() for g in mod._exec_group.grad_arrays)
    mod.update()
    scaler = amp.get_scaler(mod)
    assert scaler.last_step_skipped and scaler.loss_scale == 2.0 ** 11
    after_w, after_s = params(mod), _optimizer_state(mod)
    for k in before_w:
        np.testing.assert_array_equal(after_w[k], before_w[k])
    assert after_s[1:] == before_s[1:]
    assert after_s[0].keys() == before_s[0].keys()
    for k in before_s[0]:
        np.testing.assert_array_equal(after_s[0][k], before_s[0][k])
    mod.forward_backward(bs[5])  # the next finite step updates again
    mod.update()
    assert not scaler.last_step_skipped and _optimizer_state(mod)[1] == before_s[1] + 1


with open(GOLDEN) as _f:
    _SCENARIOS = [s for s in json.load(_f)["scenarios"] if len(s["steps"]) <= 40]


@pytest.mark.parametrize("scenario", _SCENARIOS, ids=[s["name"] for s in _SCENARIOS])
def test_scale_follows_the_recorded_gradscaler_trajectory(scenario):
    """The recorded torch GradScaler trajectory of tests/core/test_loss_scale.py, driven by a
    Module whose non-finite steps come from planted inf inputs."""
    steps = scenario["steps"]
    scaler = LossScaler(init_scale=scenario["init_scale"], growth_factor=scenario["growth_factor"],
                        backoff_factor=scenario["backoff_factor"], growth_interval=scenario["growth_interval"],
                        min_scale=0.0, max_scale=float("inf"), max_consecutive_skips=None)
    x, y = data(len(steps), inf_at=[i for i, finite in enumerate(steps) if not finite])
    mod = module(scaler=scaler, lr=0.01)
    scales, skipped = [], []
    for b in batches(x, y):
        mod.forward_backward(b)
        mod.update()
        scales.append(scaler.loss_scale)
        skipped.append(scaler.last_step_skipped)
    assert scales == scenario["scales_after_update"]
    assert skipped == scenario["skipped"]
    assert all(np.isfinite(v).all() for v in params(mod).values())


def test_composes_with_static_grad_scale_and_rescale_grad():
    """A script's static SoftmaxOutput(grad_scale=128) with rescale_grad=1/(128*batch): with a
    dynamic scale on top, the weights are those of the script without gluon_amp."""
    x, y = data(20)
    sym = mlp(grad_scale=128.0)
    opt = {"rescale_grad": 1.0 / (128.0 * BATCH)}
    ref, mod = module(sym, **opt), module(sym, scaler=LossScaler(init_scale=2.0 ** 8, growth_interval=5), **opt)
    plain = module()
    assert train_loop(mod, x, y) == train_loop(ref, x, y)
    train_loop(plain, x, y)
    assert amp.get_scaler(mod).loss_scale == 2.0 ** 12
    for k, v in params(ref).items():
        np.testing.assert_array_equal(params(mod)[k], v)
        np.testing.assert_allclose(params(mod)[k], params(plain)[k], rtol=1e-5, atol=1e-6)


def _scaler_ckpt():
    return LossScaler(init_scale=2.0 ** 10, growth_interval=2)


@pytest.mark.parametrize("devices", [1, 2])
def test_save_checkpoint_and_scaler_state_resume_bit_for_bit(tmp_path, devices):
    """On two devices MXNet updates in the module's local kvstore, whose updater keys its states
    by parameter name: load_states refused the file save_states had written ("the state tree's
    keys are not parameter indices")."""
    ctx = [mx.cpu(i) for i in range(devices)]
    x, y = data(12, inf_at=(3,))
    bs = batches(x, y)
    whole = module(scaler=_scaler_ckpt(), optimizer="adam", lr=0.01, context=ctx)
    for b in bs:
        whole.forward_backward(b)
        whole.update()

    first = module(scaler=_scaler_ckpt(), optimizer="adam", lr=0.01, context=ctx)
    for b in bs[:6]:
        first.forward_backward(b)
        first.update()
    prefix = str(tmp_path / "mlp")
    first.save_checkpoint(prefix, 1, save_optimizer_states=True)
    amp.save_states(first, prefix + "-0001.amp")
    with open(prefix + "-symbol.json") as f:
        assert "gluon_amp" not in f.read()

    resumed = mx.mod.Module.load(prefix, 1, load_optimizer_states=True, context=ctx)
    resumed.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))])
    resumed.init_optimizer(optimizer="adam", optimizer_params={"learning_rate": 0.01})
    amp.init_trainer(resumed, LossScaler())
    amp.load_states(resumed, prefix + "-0001.amp")
    assert amp.get_scaler(resumed).state_dict() == amp.get_scaler(first).state_dict()
    for b in bs[6:]:
        resumed.forward_backward(b)
        resumed.update()
    assert amp.get_scaler(resumed).state_dict() == amp.get_scaler(whole).state_dict()
    for k, v in params(whole).items():
        np.testing.assert_array_equal(params(resumed)[k], v)



def _svrg_epochs(devices, epochs, start=None):
    """An SVRGModule (update_freq 2) on ``devices`` contexts, local kvstore (on two, MXNet
    updates in it, where SVRG also keeps its ``<param>_full`` keys), momentum SGD, a checking
    scaler (an inf batch would poison the full gradients for good). ``start``: (weights, gluon_amp
    checkpoint, SVRG's full-gradient average) to resume from, at epoch 2. Returns the module."""
    from mxnet.contrib.svrg_optimization.svrg_module import SVRGModule
    rng = np.random.RandomState(3)
    x = rng.rand(128, 4).astype("float32")
    y = (x @ np.array([1.5, -2.0, 0.5, 3.0], "float32") + 0.25).astype("float32")
    it = mx.io.NDArrayIter(x, y, batch_size=16, label_name="lr_label")
    sym = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=1, name="fc"),
                                        mx.sym.Variable("lr_label"), name="lro")
    mod = SVRGModule(sym, data_names=["data"], label_names=["lr_label"], update_freq=2,
                     context=[mx.cpu(i) for i in range(devices)])
    mod.bind(it.provide_data, it.provide_label)
    mx.random.seed(1)
    mod.init_params(mx.init.Uniform(0.1), arg_params=start[0] if start else None, force_init=True)
    mod.init_optimizer(kvstore="local", optimizer="sgd", optimizer_params={"learning_rate": 0.1, "momentum": 0.9})
    amp.init_trainer(mod, "dynamic")
    if start:
        amp.load_states(mod, start[1])
        # MXNet 1.9.1's update_full_grads adds the new average to the last one (it never zeroes
        # _param_dict): SVRG's own state, in no checkpoint (MXNet's neither), carried by hand
        mod._param_dict = start[2]
        # and on several contexts its init_optimizer pulls the zeroed '<param>_full' keys over the
        # weights on the devices (the kvstore's copies stay right): MXNet's own resume differs there
        mod.set_params(start[0], {}, force_init=True)
    for epoch in range(2 if start else 0, epochs):
        if epoch % 2 == 0:
            mod.update_full_grads(it)
        it.reset()
        for b in it:
            mod.forward_backward(b)
            mod.update()
    return mod


@pytest.mark.parametrize("devices", [1, 2])
def test_an_svrg_module_resumes_bit_for_bit(tmp_path, devices):
    """On two contexts the kvstore's updater also holds SVRG's ``<param>_full`` keys (no state:
    its assignment optimizer keeps none), which are not parameters: save_states raised
    ``KeyError: 'fc_weight_full'``. Saved at an epoch's end, resumed in a fresh module, it ends
    as the uninterrupted run: weights, optimizer state and scaler."""
    whole = _svrg_epochs(devices, 4)
    first = _svrg_epochs(devices, 2)
    amp.save_states(first, str(tmp_path / "svrg.amp"))
    weights = {k: v.copy() for k, v in first.get_params()[0].items()}
    full = [{k: v.copy() for k, v in d.items()} for d in first._param_dict]
    resumed = _svrg_epochs(devices, 4, start=(weights, str(tmp_path / "svrg.amp"), full))
    assert amp.get_scaler(resumed).state_dict() == amp.get_scaler(whole).state_dict()
    assert amp.get_scaler(whole).total_steps == 32
    for k, v in params(whole).items():
        np.testing.assert_array_equal(params(resumed)[k], v, err_msg=k)

def bucketing(scaler=None):
    def sym_gen(length):
        data, label = mx.sym.Variable("data"), mx.sym.Variable("softmax_label")
        steps = mx.sym.FullyConnected(mx.sym.expand_dims(data, axis=2), num_hidden=8, flatten=False, name="step")
        h = mx.sym.mean(mx.sym.tanh(steps), axis=1)
        out = mx.sym.FullyConnected(h, num_hidden=4, name="fc")
        return mx.sym.SoftmaxOutput(out, label, name="softmax"), ("data",), ("softmax_label",)

    mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=8, context=mx.cpu())
    if scaler is not None:
        amp.init_trainer(mod, scaler)  # before bind: the default bucket and later ones get it
    mod.bind([("data", (BATCH, 8))], [("softmax_label", (BATCH,))])
    mx.random.seed(3)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1, "momentum": 0.9})
    return mod


def bucket_batches(n, inf_at=()):
    rng = np.random.RandomState(0)
    out = []
    for i in range(n):
        length = 8 if i % 2 == 0 else 5
        tokens = rng.randn(BATCH, length).astype("float32")
        label = (tokens[:, :4].argmax(axis=1)).astype("float32")
        out.append(mx.io.DataBatch([mx.nd.array(tokens)], [mx.nd.array(label)], bucket_key=length,
                                   provide_data=[mx.io.DataDesc("data", (BATCH, length))],
                                   provide_label=[mx.io.DataDesc("softmax_label", (BATCH,))]))
    return out


def test_bucketing_module_two_buckets():
    """Two buckets share the weights, the optimizer and one scaler: weights equal FP32's
    (exact powers of two), the scale grows once per step of either bucket."""
    bs = bucket_batches(12)
    ref, mod = bucketing(), bucketing(LossScaler(init_scale=2.0 ** 8, growth_interval=4))
    for m in (ref, mod):
        for b in bs:
            m.forward_backward(b)
            m.update()
    assert sorted(mod._buckets) == [5, 8]
    for key, bucket in mod._buckets.items():
        assert amp.state.process.modules[bucket].scale_arg is not None, key
    scaler = amp.get_scaler(mod)
    assert scaler.total_steps == 12 and scaler.loss_scale == 2.0 ** 11
    for k, v in params(ref).items():
        np.testing.assert_array_equal(params(mod)[k], v)


def test_bucketing_module_scaled_after_bind_skips_inf():
    """init_trainer after init_optimizer binds the buckets again, weights kept; an inf step
    in the second bucket is skipped."""
    bs = bucket_batches(4)
    mod = bucketing()
    for b in bs[:2]:
        mod.forward_backward(b)
        mod.update()
    amp.init_trainer(mod, LossScaler(init_scale=2.0 ** 6))
    before = params(mod)
    bad = bs[3]
    bad.data[0][0, 0] = np.inf
    mod.forward_backward(bs[2])
    mod.update()
    mid = params(mod)
    assert any(not np.array_equal(mid[k], before[k]) for k in before)
    mod.forward_backward(bad)
    mod.update()
    assert amp.get_scaler(mod).last_step_skipped and amp.get_scaler(mod).loss_scale == 2.0 ** 5
    for k, v in mid.items():
        np.testing.assert_array_equal(params(mod)[k], v)


def test_init_attaches_the_default_scaler_and_disable_restores_module():
    """Under init, a Module that initialises its optimizer gets the default scaler (its float32
    graph: scale 1, not checked, so an inf step reaches the weights as in FP32); disable puts
    Module's methods back."""
    originals = {k: mx.mod.Module.__dict__[k] for k in ("bind", "backward", "update", "init_optimizer")}
    sym = mlp()  # built before init: a float32 graph
    amp.init(target_dtype="float16", emulate=True)
    x, y = data(3, inf_at=(2,))
    mod = mx.mod.Module(sym, context=mx.cpu())
    mx.random.seed(1)
    mod.fit(mx.io.NDArrayIter(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH), num_epoch=1,
            initializer=mx.init.Xavier(), optimizer_params={"learning_rate": 0.05})
    scaler = amp.get_scaler(mod)
    assert scaler.total_steps == 2 and scaler.scale_for("float32") == 1.0
    mod.forward_backward(batches(x, y)[2])
    mod.update()
    assert not scaler.last_step_skipped and scaler.total_steps == 3
    assert not all(np.isfinite(v).all() for v in params(mod).values())
    amp.disable()
    assert all(mx.mod.Module.__dict__[k] is v for k, v in originals.items())


def full_loss(mod, x, y):
    """Mean cross-entropy of ``mod``'s weights over all of ``x``."""
    return float(mod.score(mx.io.NDArrayIter(x, y, batch_size=BATCH), "ce")[0][1])


def without(x, y, dropped):
    keep = [i for i in range(len(x) // BATCH) if i not in set(dropped)]
    return (np.concatenate([x[i * BATCH:(i + 1) * BATCH] for i in keep]),
            np.concatenate([y[i * BATCH:(i + 1) * BATCH] for i in keep]))


def test_emulated_float16_fit_and_loop_match_fp32():
    """Emulated float16 (needs gluon_amp.execution at simple_bind): the default dynamic scaler
    scales (2**16 at first: the emulated float16 gradients overflow there, the scaler skips
    those steps and backs off). After 50 steps of the loop and of fit, the loss over the whole
    data is within 3% of FP32's trained on the same batches less the skipped ones."""
    x, y = data(50)
    amp.init(target_dtype="float16", emulate=True)
    sym = mlp()  # the float16 plan
    mod = module(sym, lr=0.05)  # init attached the default scaler at init_optimizer
    scaler = amp.get_scaler(mod)
    skipped = []
    for i, b in enumerate(batches(x, y)):
        mod.forward_backward(b)
        mod.update()
        if scaler.last_step_skipped:
            skipped.append(i)
    assert scaler.total_steps == 50 and scaler.scale_for("float16") >= 2.0 ** 8 and len(skipped) <= 10
    loop_loss = full_loss(mod, x, y)

    fit_skipped = []
    m = mx.mod.Module(sym, context=mx.cpu())
    mx.random.seed(1)
    m.fit(mx.io.NDArrayIter(x, y, batch_size=BATCH), num_epoch=1, initializer=mx.init.Xavier(),
          optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9},
          batch_end_callback=lambda p: fit_skipped.append(p.nbatch) if amp.get_scaler(m).last_step_skipped else None)
    assert amp.get_scaler(m).total_steps == 50 and amp.get_scaler(m).scale_for("float16") > 1
    fit_loss = full_loss(m, x, y)
    amp.disable()
    for loss, dropped in ((loop_loss, skipped), (fit_loss, fit_skipped)):
        ref = module(lr=0.05)
        train_loop(ref, *without(x, y, dropped))
        fp32 = full_loss(ref, x, y)
        assert abs(loss - fp32) <= 0.03 * fp32, (loss, fp32, dropped)


LAUNCHED = """
    import json, sys
    import numpy as np, mxnet as mx
    data = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=32, name="fc1"), act_type="relu")
    sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=4, name="fc2"), name="softmax")
    rng = np.random.RandomState(0)
    x = rng.randn(320, 10).astype("float32"); y = (x @ rng.randn(10, 4)).argmax(1).astype("float32")
    drop = [int(i) for i in sys.argv[1].split(",") if i] if len(sys.argv) > 1 else []
    keep = np.array([k for k in range(320) if k // 16 not in drop])
    mod = mx.mod.Module(sym, context=mx.cpu())
    skipped = []

    def seen(p):
        if "gluon_amp" in sys.modules:
            import gluon_amp
            if gluon_amp.get_scaler(mod).last_step_skipped:
                skipped.append(p.nbatch)

    mx.random.seed(1)
    mod.fit(mx.io.NDArrayIter(x[keep], y[keep], batch_size=16), num_epoch=1, initializer=mx.init.Xavier(),
            optimizer_params={"learning_rate": 0.05, "momentum": 0.9}, batch_end_callback=seen)
    mod.save_checkpoint("ckpt", 1)
    loss = mod.score(mx.io.NDArrayIter(x, y, batch_size=16), "ce")[0][1]
    out = {"loss": loss, "skipped": skipped, "symbol_clean": "gluon_amp" not in open("ckpt-symbol.json").read()}
    if "gluon_amp" in sys.modules:
        import gluon_amp
        s = gluon_amp.get_scaler(mod)
        out.update(scale=s.scale_for("float16"), steps=s.total_steps)
    print(json.dumps(out))
"""


def _launch(tmp_path, *argv):
    (tmp_path / "prog.py").write_text(textwrap.dedent(LAUNCHED))
    root = os.path.dirname(os.path.dirname(os.path.abspath(amp.__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLUON_AMP_TUNE": "0"}
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_launcher_gives_an_unmodified_module_script_dynamic_scaling(tmp_path):
    """``python -m gluon_amp.run --emulate --target-dtype float16 prog.py`` (needs
    gluon_amp.execution): the script's Module is scaled without edits; its loss over the data
    is within 3% of the same script run by python on the batches the scaler did not skip, and
    its checkpoint symbol is its own graph."""
    launched = _launch(tmp_path, "-m", "gluon_amp.run", "--emulate", "--target-dtype", "float16", "--no-tune",
                       "prog.py")
    plain = _launch(tmp_path, "prog.py", ",".join(map(str, launched["skipped"])))
    assert launched["steps"] == 20 and launched["scale"] >= 2.0 ** 8 and launched["symbol_clean"]
    assert abs(launched["loss"] - plain["loss"]) <= 0.03 * plain["loss"], (launched, plain)


def test_a_convert_model_result_with_batch_norm_binds_in_a_module_under_emulation():
    """MXNet's amp_model_conversion.py pattern (issue 36): convert_model's float16 graph with its
    BatchNorm aux states and a SoftmaxOutput head, bound by a Module under emulated float16; the
    Module's loss-head scaling types the heads' inputs by node name (an IndexError before)."""
    x = mx.sym.var("data")
    for k in range(3):  # each BatchNorm holds outputs MXNet's internals list does not show
        x = mx.sym.BatchNorm(mx.sym.Convolution(x, kernel=(3, 3), pad=(1, 1), num_filter=4, name=f"c{k}"),
                             name=f"bn{k}")
    fc = mx.sym.FullyConnected(mx.sym.Flatten(mx.sym.relu(x)), num_hidden=3, name="fc")
    sym = mx.sym.SoftmaxOutput(fc, name="softmax")
    mod = mx.mod.Module(sym, data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (2, 1, 6, 6))], label_shapes=[("softmax_label", (2,))], for_training=False)
    mod.init_params(mx.init.Xavier())
    args, aux = mod.get_params()
    amp.init(target_dtype="float16", emulate=True)
    conv_sym, conv_args, conv_aux = amp.convert_model(sym, args, aux)
    run = mx.mod.Module(conv_sym, data_names=["data"], label_names=["softmax_label"])
    run.bind(data_shapes=[("data", (2, 1, 6, 6))], label_shapes=[("softmax_label", (2,))])
    run.set_params(args, aux)
    batch = mx.io.DataBatch([mx.nd.ones((2, 1, 6, 6))], [mx.nd.ones((2,))])
    run.forward(batch, is_train=False)
    out = run.get_outputs()[0].asnumpy()
    amp.disable()
    mod.forward(batch, is_train=False)
    ref = mod.get_outputs()[0].asnumpy()
    assert np.isfinite(out).all() and np.abs(out - ref).max() < 2e-2


def test_a_method_patch_that_fails_part_way_leaves_the_class_as_it_was():
    """init patches Module's methods as one transition: a failure while making its wrappers (an
    injected exception, a Ctrl-C) must not leave some replaced, which the next init would wrap a
    second time (their signatures then lose MXNet's defaults)."""
    from gluon_amp import mxnet_internals as mxi

    class Target:
        def first(self):
            return 1

        def second(self):
            return 2

    before = dict(Target.__dict__)

    def fail(original):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mxi.module.patch_methods(Target, {"first": lambda f: (lambda self: 10), "second": fail})
    assert Target.__dict__["first"] is before["first"] and Target.__dict__["second"] is before["second"]
    patches = mxi.module.patch_methods(Target, {"first": lambda f: (lambda self: 10 + f(self))})
    assert Target().first() == 11
    assert mxi.module.restore_methods(patches) == [] and Target.__dict__["first"] is before["first"]


def _nce_symbol():
    """MXNet 1.9.1's example/nce-loss/nce.py graph: an Embedding reads the label."""
    pred = mx.sym.Reshape(mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=8, name="fc"), shape=(-1, 1, 8))
    embed = mx.sym.Embedding(mx.sym.Variable("label"), input_dim=20, output_dim=8,
                             weight=mx.sym.Variable("embed_weight"), name="label_embed")
    score = mx.sym.sum(mx.sym.broadcast_mul(pred, embed), axis=2)
    return mx.sym.LogisticRegressionOutput(score, label=mx.sym.Variable("label_weight"), name="nce")


@pytest.mark.parametrize("init", [None, {"target_dtype": "float16", "emulate": True},
                                  {"target_dtype": "bfloat16", "emulate": True}], ids=["fp32", "fp16-emu", "bf16-emu"])
def test_a_label_read_by_an_embedding_binds_from_name_shape_pairs(init):
    """toy_nce.py's iterator gives ``(name, shape)`` pairs, which Module binds as float32: the
    loss-head scaling types the graph from them as MXNet does (it raised MXNet's 'First input
    must have specified type' from the Embedding under emulation before), and the gradients
    carry the scale."""
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.randn(BATCH, 10))],
                            [mx.nd.array(rng.randint(0, 20, (BATCH, 3))),
                             mx.nd.array(np.eye(3)[rng.randint(0, 3, BATCH)])])
    shapes = ([("data", (BATCH, 10))], [("label", (BATCH, 3)), ("label_weight", (BATCH, 3))])
    grads = []
    for scaler in (None, LossScaler.static(256.0)):
        if init is not None:
            amp.init(**init)
        mod = mx.mod.Module(_nce_symbol(), label_names=("label", "label_weight"), context=mx.cpu())
        if scaler is not None:
            amp.init_trainer(mod, scaler)
        mod.bind(*shapes)
        mx.random.seed(1)
        mod.init_params(mx.init.Xavier())
        mod.forward_backward(batch)
        grads.append({n: g[0].asnumpy() for n, g in zip(mod._exec_group.param_names, mod._exec_group.grad_arrays)})
        amp.disable()
    plain, scaled = grads
    assert set(plain) == {"fc_weight", "fc_bias", "embed_weight"}
    for name in plain:
        assert np.abs(plain[name]).max() > 0, name
        np.testing.assert_allclose(scaled[name] / 256.0, plain[name], rtol=0, atol=1e-6 * 256, err_msg=name)


def test_a_graph_mxnet_cannot_type_in_part_still_gets_its_loss_heads_scaled():
    """With no dtype for the Embedding's input (an argument the descriptions leave out), MXNet's
    partial type inference raises rather than leaving it untyped: the heads are scaled with
    their inputs taken as float32, as for a graph that does not type-check."""
    from gluon_amp.training.module import _scaled_symbol
    amp.init(target_dtype="float16", emulate=True)
    try:
        _, heads, dtype, inside = _scaled_symbol(_nce_symbol(), [mx.io.DataDesc("data", (BATCH, 10))])
    finally:
        amp.disable()
    assert heads == ["nce"] and dtype == "float16" and inside


def _bound_args(mod):
    return set(mod._exec_group.execs[0].arg_dict)


@pytest.mark.parametrize("dtype,inside,emulate", [
    ("bfloat16", False, True), ("float16", True, True),
    pytest.param("bfloat16", False, False, marks=pytest.mark.simulated_native, id="bfloat16-native-simulated")])
def test_the_scaled_identity_is_bound_only_where_a_step_can_be_scaled(dtype, inside, emulate):
    """Under init's default scaler (float16 steps only), a bfloat16 graph, emulated or native,
    is bound as the user's (the identity's broadcast backward doubled toy_softmax.py's step);
    float16 takes it."""
    amp.init(target_dtype=dtype, emulate=emulate)
    try:
        mod = module(mlp())
        assert amp.get_scaler(mod).scales(dtype) is inside
        assert ("gluon_amp_loss_scale" in _bound_args(mod)) is inside
        x, y = data(2)
        for b in batches(x, y):
            mod.forward_backward(b)
            mod.update()
        assert amp.get_scaler(mod).total_steps == 2
    finally:
        amp.disable()


def test_a_step_scaled_after_bind_without_the_identity_scales_every_gradient():
    """A scaler attached after a bfloat16 graph was bound without the identity, which scales
    bfloat16 steps: the backward pass's gradients (parameters' and inputs') are multiplied after
    it, exactly, and the update divides them out: weights and gradients / 256 as an unscaled twin's."""
    x, y = data(3)
    runs = []
    for scaler in (None, LossScaler.static(256.0)):
        amp.init(target_dtype="bfloat16", emulate=True)
        try:
            mod = mx.mod.Module(mlp(), context=mx.cpu())
            mod.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))], inputs_need_grad=True)
            mx.random.seed(1)
            mod.init_params(mx.init.Xavier())
            mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
            assert "gluon_amp_loss_scale" not in _bound_args(mod)
            if scaler is not None:
                amp.init_trainer(mod, scaler)
                assert "gluon_amp_loss_scale" not in _bound_args(mod)  # not bound again
            grads = []
            for b in batches(x, y):
                mod.forward_backward(b)
                grads.append([g[0].asnumpy() for g in mod._exec_group.grad_arrays]
                             + [mod.get_input_grads()[0].asnumpy()])
                mod.update()
            runs.append((grads, params(mod)))
        finally:
            amp.disable()
    (plain, plain_w), (scaled, scaled_w) = runs
    for step_plain, step_scaled in zip(plain, scaled):
        for a, b in zip(step_plain, step_scaled):
            assert np.abs(a).max() > 0
            np.testing.assert_array_equal(a * 256.0, b)
    for k in plain_w:
        np.testing.assert_array_equal(plain_w[k], scaled_w[k], err_msg=k)


@pytest.mark.parametrize("cpu,op", [(True, "elemwise_mul"), (False, "broadcast_mul")])
def test_the_identity_multiplies_elementwise_on_cpus_only(cpu, op):
    """On CPUs the scale is broadcast in the forward pass and multiplied elementwise (MXNet's
    broadcast_mul backward is a generic reduction there); elsewhere broadcast_mul, which needs
    no buffer of the head input's size."""
    from gluon_amp.training.module import _scaled_symbol
    sym, heads, _, inside = _scaled_symbol(mlp(), [mx.io.DataDesc("data", (BATCH, 10)),
                                                   mx.io.DataDesc("softmax_label", (BATCH,))],
                                           LossScaler.static(8.0), cpu=cpu)
    ops = {n["name"]: n["op"] for n in json.loads(sym.tojson())["nodes"]}
    assert inside and heads == ["softmax"] and ops["softmax_amp_scale_mul"] == op


@pytest.mark.parametrize("attach", ["before_forward", "between_forward_and_backward"])
def test_a_scaler_attached_after_the_forward_pass_scales_the_step_by_what_it_carries(attach):
    """On CPUs the identity broadcasts the scale in the forward pass. A scaler attached after a
    step's forward and before its backward (``init_trainer`` there) must not divide that step's
    gradients by a scale they never carried: the step counts as carrying what its forward pass
    read, and its update equals an unscaled twin's. Static 256 on an emulated bfloat16 graph
    that accumulates (``grad_req='add'``, so the identity is bound): powers of two are exact."""
    x, y = data(1)
    (b,) = batches(x, y)
    runs = []
    for scaler in (None, LossScaler.static(256.0)):
        amp.init(target_dtype="bfloat16", emulate=True)
        try:
            mod = mx.mod.Module(mlp(), context=mx.cpu())
            mod.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))], grad_req="add")
            mx.random.seed(1)
            mod.init_params(mx.init.Xavier())
            mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
            assert "gluon_amp_loss_scale" in _bound_args(mod)
            if scaler is not None and attach == "before_forward":
                amp.init_trainer(mod, scaler)
            mod.forward(b, is_train=True)
            if scaler is not None and attach != "before_forward":
                amp.init_trainer(mod, scaler)
            mod.backward()
            mod.update()
            runs.append(params(mod))
            if scaler is not None:
                assert amp.get_scaler(mod).total_steps == 1 and not amp.get_scaler(mod).last_step_skipped
        finally:
            amp.disable()
    plain, scaled = runs
    for k in plain:
        np.testing.assert_array_equal(plain[k], scaled[k], err_msg=k)


def _svrg_run(emulate, scaler=None, epochs=6, inf_batch=None):
    """MXNet's contrib SVRGModule on a least-squares problem (its own loop: full gradients each
    other epoch, forward_backward, update); the per-epoch MSE before each epoch's updates."""
    from mxnet.contrib.svrg_optimization.svrg_module import SVRGModule
    rng = np.random.RandomState(3)
    x = rng.rand(256, 4).astype("float32")
    y = (x @ np.array([1.5, -2.0, 0.5, 3.0], "float32") + 0.25).astype("float32")
    if inf_batch is not None:
        x[inf_batch * 32, 0] = np.inf
    it = mx.io.NDArrayIter(x, y, batch_size=32, label_name="lr_label")
    if emulate:
        amp.init(target_dtype="float16", emulate=True)
    try:
        sym = mx.sym.LinearRegressionOutput(  # under init: the float16 plan
            mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=1, name="fc"), mx.sym.Variable("lr_label"),
            name="lro")
        mod = SVRGModule(sym, data_names=["data"], label_names=["lr_label"], update_freq=2)
        mod.bind(it.provide_data, it.provide_label)
        mx.random.seed(1)
        mod.init_params(mx.init.Uniform(0.1))
        mod.init_optimizer(kvstore="local", optimizer="sgd", optimizer_params={"learning_rate": 0.5})
        if scaler is not None:
            amp.init_trainer(mod, scaler)
        bound = _bound_args(mod) | set(mod._mod_aux._exec_group.execs[0].arg_dict)
        metric, costs = mx.metric.create("mse"), []
        for epoch in range(epochs):
            if epoch % 2 == 0:
                mod.update_full_grads(it)
            it.reset()
            metric.reset()
            for b in it:
                mod.forward_backward(b)
                mod.update()
                mod.update_metric(metric, b.label)
            costs.append(metric.get()[1])
        scaler_now = amp.get_scaler(mod) if emulate or scaler is not None else None
        return costs, bound, scaler_now, params(mod)
    finally:
        amp.disable()


def test_an_svrg_module_mixing_its_auxiliary_gradients_is_checked_but_never_scaled():
    """SVRGModule's update mixes its auxiliary module's gradients (per batch, and averaged over
    the data at the epoch's start) into its own: a loss scale on one of them cannot be divided
    out. Under emulated float16 neither module is bound with the identity, init's scaler scales
    nothing and still checks, and training tracks FP32's (it was 1,200x FP32's MSE at the first
    epoch when only the module's own gradients carried the scale)."""
    fp32, _, _, _ = _svrg_run(emulate=False)
    with pytest.warns(RuntimeWarning, match="SVRGModule mixes the gradients"):
        costs, bound, scaler, _ = _svrg_run(emulate=True)
    assert "gluon_amp_loss_scale" not in bound
    assert scaler.scaled_dtypes == frozenset() and scaler.total_steps == 6 * 8
    np.testing.assert_allclose(costs, fp32, rtol=0.05)
    assert costs[-1] < 0.2 * costs[0]


def test_an_svrg_module_skips_a_non_finite_step_and_refuses_a_scale():
    """The check still runs: a batch holding inf is skipped (counted, weights finite). An
    explicit scaler that scales is refused with the reason and what to pass."""
    _, _, scaler, weights = _svrg_run(emulate=True, epochs=1, inf_batch=3)
    assert scaler.skipped_steps >= 1 and all(np.isfinite(v).all() for v in weights.values())
    with pytest.raises(ValueError, match="cannot be divided out.*'dynamic'"):
        _svrg_run(emulate=True, scaler=LossScaler.static(8.0), epochs=1)


def _two_stages():
    """``(first, second, seq)``: a stage without a loss head (its gradients come from the next
    stage's input gradients, as ``out_grads``) and a SoftmaxOutput stage, in a SequentialModule
    (not bound)."""
    d = mx.sym.Variable("data")
    first = mx.mod.Module(mx.sym.Activation(mx.sym.FullyConnected(d, num_hidden=32, name="fc1"),
                                            act_type="relu"), label_names=[], context=mx.cpu())
    second = mx.mod.Module(mx.sym.SoftmaxOutput(mx.sym.FullyConnected(d, num_hidden=4, name="fc2"),
                                                name="softmax"), context=mx.cpu())
    return first, second, mx.mod.SequentialModule().add(first).add(second, take_labels=True, auto_wiring=True)


def _sequential(emulate, steps=20, drop=()):
    """A SequentialModule: a stage without a loss head (its gradients come from the next
    stage's input gradients, as ``out_grads``) and a SoftmaxOutput stage; the loop of ``fit``
    (without the batches ``drop``). Returns the weights, the stages' scalers and, per step,
    how many stages skipped it."""
    x, y = without(*data(steps), drop)
    if emulate:
        amp.init(target_dtype="float16", emulate=True)
    try:
        first, second, seq = _two_stages()
        seq.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))])
        mx.random.seed(1)
        seq.init_params(mx.init.Xavier())
        seq.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
        skips = []
        for b in batches(x, y):
            seq.forward_backward(b)
            before = amp.get_scaler(second).skipped_steps if emulate else 0
            seq.update()
            skips.append(amp.get_scaler(second).skipped_steps - before if emulate else 0)
        scalers = [amp.get_scaler(m) for m in (first, second)] if emulate else []
        return {**params(first), **params(second)}, scalers, skips
    finally:
        amp.disable()


def test_a_sequential_module_stage_fed_the_next_stages_input_gradients_is_not_scaled_twice():
    """The head stage's input gradients carry its scale; handed to the stage before as
    ``out_grads`` they must not be multiplied again (its update divided by one scale only: a
    first stage 65,536x off). Under init the stages share one scaler: a step skipped (the
    first ones, at 65,536) is skipped by both (else the weights below differ). Emulated
    float16 weights after 20 steps within 2% of FP32's trained without the skipped batches
    (relative L2)."""
    emulated, (s1, s2), skips = _sequential(emulate=True)
    assert s1 is s2 and s1.total_steps == 20 and 0 < sum(skips) < 10  # one count per round of both stages
    fp32, _, _ = _sequential(emulate=False, drop=[i for i, k in enumerate(skips) if k])
    for k, v in fp32.items():
        assert np.linalg.norm(emulated[k] - v) <= 0.02 * np.linalg.norm(v), k


class _Delegating(mx.optimizer.Optimizer):
    """An optimizer wrapper as horovod.mxnet.DistributedOptimizer is one: the wrapped optimizer
    in ``_optimizer``, reads forwarded by ``__getattr__``, no ``Optimizer.__init__`` of its own."""

    def __init__(self, inner):  # noqa: D107 - no super().__init__, as Horovod's
        self._optimizer = inner

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def update(self, index, weight, grad, state):
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._optimizer.update_multi_precision(index, weight, grad, state)


@pytest.mark.parametrize("wrappers", [1, 2])
def test_an_optimizer_behind_a_delegating_wrapper_gets_the_unscale(wrappers):
    """The unscale set ``rescale_grad`` on the wrapper, which its update never reads: with
    ``hvd.DistributedOptimizer`` (MXNet's Horovod module example) every step moved the
    weights by the loss scale times the gradient. Scaled (2**10) and wrapped, a run must
    give the unwrapped FP32 run's weights, an inf step skipped in both."""
    x, y = data(12, inf_at=(3,))
    runs = {}
    for name, scaler in (("fp32", None), ("scaled", _scaler())):
        mod = mx.mod.Module(mlp(), context=mx.cpu())
        mod.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))])
        mx.random.seed(1)
        mod.init_params(mx.init.Xavier())
        opt = mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, rescale_grad=1.0 / BATCH)
        for _ in range(wrappers if scaler is not None else 0):
            opt = _Delegating(opt)
        mod.init_optimizer(optimizer=opt)
        amp.init_trainer(mod, scaler if scaler is not None else LossScaler.static(1.0))
        train_loop(mod, x, y)
        runs[name] = params(mod)
        assert amp.get_scaler(mod).skipped_steps == 1
        amp.disable()
    for k, v in runs["fp32"].items():
        np.testing.assert_allclose(runs["scaled"][k], v, rtol=1e-6, atol=0, err_msg=k)


def _sequential_fit(fits, x, y):
    """Under init (emulated float16) a SequentialModule of ``_sequential``'s two stages trained
    by ``fit`` over ``fits`` ((begin_epoch, num_epoch) each, as a script continues training):
    its weights and the first stage's scaler after each fit."""
    amp.init(target_dtype="float16", emulate=True)
    try:
        first, second, seq = _two_stages()
        it = mx.io.NDArrayIter(x, {"softmax_label": y}, batch_size=BATCH)
        seq.bind(it.provide_data, it.provide_label)
        mx.random.seed(1)
        seq.init_params(mx.init.Xavier())
        scalers = []
        for begin, end in fits:
            it.reset()
            seq.fit(it, begin_epoch=begin, num_epoch=end, optimizer="sgd",
                    optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
            scalers.append(amp.get_scaler(first))
        assert amp.get_scaler(second) is scalers[-1]
        return {**params(first), **params(second)}, scalers
    finally:
        amp.disable()


@pytest.mark.parametrize("fits", [[(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]])
def test_a_sequential_module_fit_again_keeps_its_stages_shared_scaler(fits):
    """A later ``fit`` calls ``init_optimizer`` again (MXNet ignores it); the stages' shared
    default scaler, and its scale, counts and loaded state, must stay. It was replaced by a
    fresh one (scale back at 65,536: the early overflow skips again, the counts lost), and the
    weights differed from one ``fit`` over the same epochs. Bit for bit both ways, as a Module."""
    x, y = data(6)
    whole, (one,) = _sequential_fit([(0, 3)], x, y)
    parts, scalers = _sequential_fit(fits, x, y)
    assert all(s is scalers[0] for s in scalers)
    assert scalers[-1].state_dict() == one.state_dict() and one.skipped_steps > 0
    for k, v in whole.items():
        np.testing.assert_array_equal(parts[k], v, err_msg=k)


@pytest.mark.parametrize("loss_scale", ["dynamic", LossScaler.disabled()], ids=["dynamic", "None"])
def test_an_svrg_module_takes_a_scaler_after_bind_without_binding_again(loss_scale):
    """``init_trainer`` after bind/init_optimizer (no ``init``) bound the SVRGModule again, which
    MXNet 1.9.1 cannot (its auxiliary module's bind asserts), and left the scaler attached. Its
    graph takes no identity, so nothing is bound: checked (or disabled) and FP32's bit for bit."""
    fp32_costs, _, _, fp32 = _svrg_run(emulate=False, epochs=2)
    costs, bound, scaler, weights = _svrg_run(emulate=False, scaler=loss_scale, epochs=2)
    assert "gluon_amp_loss_scale" not in bound
    assert not scaler.scaled_dtypes or not scaler.enabled
    assert costs == fp32_costs
    for k, v in fp32.items():
        np.testing.assert_array_equal(weights[k], v, err_msg=k)


@pytest.mark.parametrize("kind", ["module", "bucketing"])
def test_an_attachment_whose_bind_fails_leaves_no_scaler(monkeypatch, kind):
    """All or nothing: where binding again raises (here the second bind: a BucketingModule's
    second bucket), no module keeps the new scaler (a retry said "already has a loss scaler"),
    and the retry attaches it and trains as FP32 bit for bit."""
    from gluon_amp.training import module as training_module
    real, calls = training_module.mxm.rebind, []

    def failing(mod, shared_module=None):
        calls.append(mod)
        if len(calls) == (1 if kind == "module" else 2):
            raise RuntimeError("planted bind failure")
        real(mod, shared_module=shared_module)

    mods = []
    for _ in range(2):
        mods.append(module() if kind == "module" else bucketing())
        bs = batches(*data(4)) if kind == "module" else bucket_batches(4)
        for b in bs[:2]:  # binds a BucketingModule's second bucket
            mods[-1].forward_backward(b)
            mods[-1].update()
    ref, mod = mods
    owners = [mod, *mod._buckets.values()] if kind == "bucketing" else [mod]
    monkeypatch.setattr(training_module.mxm, "rebind", failing)
    with pytest.raises(RuntimeError, match="planted bind failure"):
        amp.init_trainer(mod, LossScaler.static(2.0 ** 10))
    assert len(calls) == (1 if kind == "module" else 2)
    assert all(training_module.attached_scaler(m) is None for m in owners)
    monkeypatch.setattr(training_module.mxm, "rebind", real)
    scaler = amp.init_trainer(mod, LossScaler.static(2.0 ** 10))
    amp.init_trainer(ref, LossScaler.static(1.0))
    for m in (ref, mod):
        for b in bs[2:]:
            m.forward_backward(b)
            m.update()
    assert scaler.total_steps == 2 and all(amp.get_scaler(m) is scaler for m in owners)
    for k, v in params(ref).items():
        np.testing.assert_array_equal(params(mod)[k], v, err_msg=k)



def _staged(attach, scaler=None, steps=8, inf_at=(), drop=()):
    """``_sequential``'s two stages, no ``init``: ``scaler()`` attached with init_trainer to
    ``attach`` ("loss": the head stage only, "first", "both": one scaler, None: FP32) after
    init_optimizer; the hand-written loop. The weights and each stage's scaler (or None)."""
    from gluon_amp.training.module import attached_scaler
    x, y = without(*data(steps, inf_at=inf_at), drop)
    d = mx.sym.Variable("data")
    first = mx.mod.Module(mx.sym.Activation(mx.sym.FullyConnected(d, num_hidden=32, name="fc1"), act_type="relu"),
                          label_names=[], context=mx.cpu())
    second = mx.mod.Module(mx.sym.SoftmaxOutput(mx.sym.FullyConnected(d, num_hidden=4, name="fc2"), name="softmax"),
                           context=mx.cpu())
    seq = mx.mod.SequentialModule().add(first).add(second, take_labels=True, auto_wiring=True)
    seq.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))])
    mx.random.seed(1)
    seq.init_params(mx.init.Xavier())
    seq.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
    if attach in ("loss", "both"):
        shared = amp.init_trainer(second, scaler())
        if attach == "both":
            amp.init_trainer(first, shared)
    elif attach == "first":
        amp.init_trainer(first, scaler())
    for b in batches(x, y):
        seq.forward_backward(b)
        seq.update()
    return {**params(first), **params(second)}, [attached_scaler(m) for m in (first, second)]


def _static():
    return LossScaler.static(2.0 ** 10)


def _dynamic():
    return LossScaler(init_scale=2.0 ** 10, growth_interval=2)


@pytest.mark.parametrize("attach,scaler", [("loss", _static), ("both", _static), ("first", _static),
                                           ("loss", _dynamic), ("both", _dynamic)])
def test_a_sequential_stage_fed_a_scaled_stage_shares_its_scaler(attach, scaler):
    """A scaler on the loss stage only: the stage before it got ``out_grads`` carrying the scale
    and nothing divided it out (its update 1,024x too large, silently). It now joins that stage's
    scaler at its first backward pass: FP32's weights bit for bit with a static 2**10, and with a
    dynamic one a batch holding inf is skipped by both stages (as FP32 trained without it)."""
    inf = scaler is _dynamic
    fp32, _ = _staged(None, drop=[3] if inf else [])
    scaled, (s1, s2) = _staged(attach, scaler, inf_at=[3] if inf else [])
    if attach != "first":
        assert s1 is s2 and s1.total_steps == 8 and s1.skipped_steps == int(inf)
    for k, v in fp32.items():
        np.testing.assert_array_equal(scaled[k], v, err_msg=k)


def test_a_module_with_loss_heads_fed_scaled_out_grads_is_refused_mid_step():
    """Where the module fed a scaled module's input gradients would need the scale argument
    bound in (loss heads of its own), it cannot join mid-step: a RuntimeError saying what to do,
    before its backward runs; done so, it trains."""
    head = module(bind=False)
    head.bind([("data", (BATCH, 10))], [("softmax_label", (BATCH,))], inputs_need_grad=True)
    mx.random.seed(1)
    head.init_params(mx.init.Xavier())
    head.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05})
    scaler = amp.init_trainer(head, _static())
    feeder = mx.mod.Module(mx.sym.MakeLoss(mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=10, name="pre"),
                                           name="reg"), label_names=None, context=mx.cpu())
    feeder.bind([("data", (BATCH, 10))], for_training=True)
    feeder.init_params(mx.init.Xavier())
    feeder.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05})
    x, y = data(1)
    b = batches(x, y)[0]
    head.forward_backward(b)
    feeder.forward(mx.io.DataBatch(b.data, []), is_train=True)
    with pytest.raises(RuntimeError, match=r"outputs \[reg_output\].*init_trainer\(this_module"):
        feeder.backward(head.get_input_grads())
    from gluon_amp.training.module import attached_scaler
    assert attached_scaler(feeder) is None
    amp.init_trainer(feeder, scaler)
    feeder.forward(mx.io.DataBatch(b.data, []), is_train=True)
    feeder.backward(head.get_input_grads())
    head.update()
    feeder.update()
    assert scaler.total_steps == 1


def _float16_module_moved(batch, scaled):
    """How far three updates move a Module's float16 weight, updated in float16 (an
    elementwise graph MXNet runs in float16 on a CPU; no master copy)."""
    rng = np.random.RandomState(0)
    x, w = mx.sym.var("data", dtype="float16"), mx.sym.var("w", shape=(1, 10, 3), dtype="float16")
    out = mx.sym.sum(mx.sym.broadcast_mul(mx.sym.expand_dims(x, axis=2), w), axis=1)
    loss = mx.sym.MakeLoss(mx.sym.sum(mx.sym.softmax_cross_entropy(mx.sym.cast(out, "float32"), mx.sym.var("label"))))
    mod = mx.mod.Module(loss, data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[mx.io.DataDesc("data", (batch, 10), "float16")], label_shapes=[("label", (batch,))])
    mod.init_params(arg_params={"w": mx.nd.array(rng.randn(1, 10, 3) * 0.3, dtype="float16")})
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.5, "rescale_grad": 1.0 / batch})
    if scaled:
        amp.init_trainer(mod)  # dynamic, from 65536
    w0 = mod.get_params()[0]["w"].asnumpy().astype(np.float32)
    data = mx.io.DataBatch([mx.nd.array(rng.randn(batch, 10) * 0.01, dtype="float16")],
                           [mx.nd.array(rng.randint(0, 3, batch))])
    for _ in range(3):
        mod.forward_backward(data)
        mod.update()
    return np.abs(mod.get_params()[0]["w"].asnumpy().astype(np.float32) - w0).max()


@pytest.mark.parametrize("batch", [64, 1024])
def test_a_module_s_float16_weights_updated_in_float16_keep_their_updates(batch):
    """As a Trainer's: the scale folded into rescale_grad, 1 / (65536 * 1024) as the float16 value
    MXNet's kernels take, was 0, and every update was lost silently."""
    plain = _float16_module_moved(batch, False)
    assert plain > 0 and 0.5 * plain <= _float16_module_moved(batch, True) <= 2 * plain


@pytest.mark.parametrize("target,loss_scale", [("float16", "dynamic"), ("bfloat16", 128.0)])
def test_a_model_converted_to_run_emulated_trains_emulated_with_loss_scaling(target, loss_scale):
    """``convert_model(..., emulate=True)`` bound in a Module trained emulated, until
    ``init_trainer``: the graph with the scale at its loss head was a new symbol, bound
    natively ("float16 fully connected layer is currently only supported by CuDNN")."""
    data = mx.sym.var("data")
    sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=2, name="fc"), mx.sym.var("softmax_label"),
                               name="softmax")
    plain = mx.mod.Module(sym)
    plain.bind([("data", (4, 8))], [("softmax_label", (4,))])
    plain.init_params()
    args, aux = plain.get_params()
    low, low_args, low_aux = amp.convert_model(sym, args, aux, target_dtype=target, emulate=True)
    batch = mx.io.DataBatch([mx.nd.ones((4, 8))], [mx.nd.array([0, 1, 0, 1])])
    outs = []
    for scaled in (False, True):
        mod = mx.mod.Module(low)
        mod.bind([("data", (4, 8))], [("softmax_label", (4,))])
        mod.set_params(low_args, low_aux)
        mod.init_optimizer()
        if scaled:
            amp.init_trainer(mod, loss_scale)
        mod.forward_backward(batch)
        mod.update()
        mod.forward(batch, is_train=False)
        outs.append(mod.get_outputs()[0].asnumpy())
    np.testing.assert_array_equal(outs[1], outs[0])  # a power-of-two scale divided out exactly
