"""Loss scaling only where it buys something (issue 31, defects 5 and 6).

The default scaler (``init_trainer(trainer)``) multiplies the loss by its dynamic scale
only in float16 (real or emulated); where AMP is off and in bfloat16 it multiplies by 1,
so scripts that clip or read gradients between ``backward`` and ``update`` see what
they see without AMP. Skip-on-overflow comes with every float16 step and every scaler that
scales (a bfloat16 or float32 step the default does not scale is FP32's, unchecked), and the trainer's
``_amp_loss_scaler`` answers ``loss_scale`` as the peer's does (GluonNLP's
``finetune_squad.py`` clips at ``size * trainer._amp_loss_scaler.loss_scale``).
"""
import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import LossScaler
from gluon_amp.training import early_update, overflow
from helpers import ROOT, backward, no_bf16_env

MODES = {
    "off": None,
    "bfloat16-emulated": {"target_dtype": "bfloat16", "emulate": True},
    "float16-emulated": {"target_dtype": "float16", "emulate": True},
    "bfloat16-native": {"target_dtype": "bfloat16"},
    "bfloat16-simulated": {"target_dtype": "bfloat16"},  # native, on the simulated host (every CPU)
}
#: the scale the default scaler multiplies the loss by, per mode
DEFAULT_SCALE = {"off": 1.0, "bfloat16-emulated": 1.0, "float16-emulated": 2.0 ** 16, "bfloat16-native": 1.0,
                 "bfloat16-simulated": 1.0}


def _modes(*names):
    """``bfloat16-native`` where bfloat16 kernels run, and its simulated twin everywhere."""
    out = []
    for n in names:
        if n == "bfloat16-native":
            out += [pytest.param(n, marks=pytest.mark.bf16_kernels),
                    pytest.param("bfloat16-simulated", marks=pytest.mark.simulated_native)]
        else:
            out.append(n)
    return out


def _start(mode):
    if MODES[mode] is not None:
        gluon_amp.init(**MODES[mode])


def _mlp(seed=0):
    mx.random.seed(seed)
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation="relu", in_units=8), nn.Dense(16, activation="relu", in_units=16),
            nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _trainer(net):
    return gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, update_on_kvstore=False)


_RNG = np.random.RandomState(0)
BATCHES = [(mx.nd.array(_RNG.normal(0, 1, (6, 8))), mx.nd.array(_RNG.randint(0, 3, 6))) for _ in range(3)]
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def _classifier_pattern(net, trainer, amp, poison_step=None):
    """GluonNLP finetune_classifier.py's loop: backward, allreduce_grads, clip the global
    norm to 1, update. Returns the gradients as backward left them, the norms and losses."""
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    grads, norms, losses = [], [], []
    for i, (x, y) in enumerate(BATCHES):
        with autograd.record():
            loss = LOSS(net(x), y).mean()
            if i == poison_step:
                loss = loss * float("inf")
            if amp:
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        trainer.allreduce_grads()
        grads.append([p.grad().asnumpy().copy() for p in params])
        norms.append(float(gluon.utils.clip_global_norm([p.grad() for p in params], 1.0,
                                                        check_isfinite=False).asscalar()))
        trainer.update(1)
        losses.append(float(loss.asscalar()))
    return grads, norms, losses


def _weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


@pytest.mark.parametrize("mode", _modes("off", "bfloat16-emulated", "bfloat16-native"))
def test_where_scaling_buys_nothing_clipped_training_is_the_unscaled_one_bit_for_bit(mode):
    """Defect 6: the default scaler leaves the gradients between backward and update, and
    the trained weights, exactly as training without loss scaling has them."""
    _start(mode)
    ref = _mlp()
    ref_grads, ref_norms, ref_losses = _classifier_pattern(ref, _trainer(ref), amp=False)
    net = _mlp()
    trainer = _trainer(net)
    gluon_amp.init_trainer(trainer)
    grads, norms, losses = _classifier_pattern(net, trainer, amp=True)
    assert norms == ref_norms and losses == ref_losses
    for step, (a, b) in enumerate(zip(grads, ref_grads)):
        assert all(np.array_equal(g, r) for g, r in zip(a, b)), f"gradients differ at step {step}"
    assert all(np.array_equal(w, r) for w, r in zip(_weights(net), _weights(ref)))


FINETUNE_CLASSIFIER_FALLBACK = r'''
import json, warnings
import numpy as np
import gluon_amp as amp
import mxnet as mx
import gluonnlp as nlp
from mxnet import autograd, gluon
warnings.simplefilter("ignore")
policy = amp.init()  # no bfloat16 kernels: the float32 fallback, AMP off

def bert_classifier():
    mx.random.seed(0)
    enc = nlp.model.BERTEncoder(num_layers=2, units=32, hidden_size=64, max_length=16, num_heads=2,
                                dropout=0.0)
    bert = nlp.model.BERTModel(enc, vocab_size=50, token_type_vocab_size=2, units=32, embed_size=32,
                               use_pooler=True, use_decoder=False, use_classifier=False)
    net = nlp.model.BERTClassifier(bert, num_classes=2, dropout=0.0)
    net.initialize(mx.init.Normal(0.02))
    return net

rng = np.random.RandomState(0)
batches = [(mx.nd.array(rng.randint(1, 50, (4, 8))), mx.nd.array(rng.randint(0, 2, (4, 8))),
            mx.nd.array([8, 6, 5, 8]), mx.nd.array(rng.randint(0, 2, 4))) for _ in range(4)]

def run(use_amp, poison_step=None):
    net = bert_classifier()
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    trainer = gluon.Trainer(net.collect_params(), "bertadam", {"learning_rate": 1e-3, "epsilon": 1e-6,
                                                                "wd": 0.01}, update_on_kvstore=False)
    scaler = amp.init_trainer(trainer) if use_amp else None
    loss_fn = gluon.loss.SoftmaxCELoss()
    grads, norms, losses, weights_at_poison = [], [], [], None
    for i, (ids, seg, valid, label) in enumerate(batches):  # finetune_classifier.py's loop
        if i == poison_step:
            weights_at_poison = [p.data().asnumpy().copy() for p in params]
        with autograd.record():
            ls = loss_fn(net(ids, seg, valid), label).mean()
            if i == poison_step:
                ls = ls * float("inf")
            if use_amp:
                with amp.scale_loss(ls, trainer) as scaled_loss:
                    autograd.backward(scaled_loss)
            else:
                ls.backward()
        trainer.allreduce_grads()
        grads.append([p.grad().asnumpy().copy() for p in params])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            norms.append(float(nlp.utils.clip_grad_global_norm(params, 1).asscalar()))
        trainer.update(1)
        losses.append(float(ls.asscalar()))
    weights = [p.data().asnumpy() for p in params]
    kept = weights_at_poison is not None and all(np.array_equal(a, b) for a, b in zip(weights_at_poison, weights))
    return grads, norms, losses, weights, scaler, kept

g0, n0, l0, w0, _, _ = run(False)
g1, n1, l1, w1, scaler, _ = run(True)
*_, wp0, _, _ = run(False, poison_step=3)
*_, wp1, poisoned, kept = run(True, poison_step=3)
print(json.dumps({
    "enabled": policy.enabled, "norms": n1, "fp32_norms": n0, "losses": l1, "fp32_losses": l0,
    "grads_equal": [all(np.array_equal(a, b) for a, b in zip(s1, s0)) for s1, s0 in zip(g1, g0)],
    "weights_equal": all(np.array_equal(a, b) for a, b in zip(w1, w0)),
    "poison_skipped": poisoned.skipped_steps, "poison_last_skipped": poisoned.last_step_skipped,
    "weights_kept_on_skip": kept,
    "poison_as_fp32": all(np.array_equal(a, b, equal_nan=True) for a, b in zip(wp1, wp0)),
    "poison_finite": all(np.isfinite(w).all() for w in wp1),
}))
'''


def test_float32_fallback_runs_finetune_classifier_as_fp32_bit_for_bit():
    """Defect 6 on a host without bfloat16 kernels, with GluonNLP's BERT classifier and its
    clip: gradients before the update, clipped norms, losses and weights are FP32's, and so
    is a planted inf step: not checked, its inf reaches the weights as in FP32."""
    r = subprocess.run([sys.executable, "-c", FINETUNE_CLASSIFIER_FALLBACK], capture_output=True,
                       text=True, timeout=300, env=no_bf16_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["enabled"] is False
    assert out["norms"] == out["fp32_norms"] and out["losses"] == out["fp32_losses"]
    assert all(out["grads_equal"]) and out["weights_equal"]
    assert out["poison_skipped"] == 0 and not out["poison_last_skipped"] and not out["weights_kept_on_skip"]
    assert out["poison_as_fp32"] and not out["poison_finite"]


@pytest.mark.parametrize("mode", _modes("off", "bfloat16-emulated", "float16-emulated"))
def test_squad_pattern_reads_the_scale_the_loss_was_multiplied_by(mode):
    """Defect 5: finetune_squad.py reads ``trainer._amp_loss_scaler.loss_scale`` inside
    ``scale_loss`` to clip the still-scaled gradients; it is the scale of that loss."""
    _start(mode)
    net = _mlp()
    trainer = _trainer(net)
    gluon_amp.init_trainer(trainer)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    ref = _mlp()
    ref_trainer = _trainer(ref)
    ref_params = [p for p in ref.collect_params().values() if p.grad_req != "null"]
    for x, y in BATCHES:
        with autograd.record():
            loss = LOSS(net(x), y).mean()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
                norm_clip = 1.0 * trainer._amp_loss_scaler.loss_scale
            ref_loss = LOSS(ref(x), y).mean()
            ref_loss.backward()
        assert norm_clip == DEFAULT_SCALE[mode]
        for p, r in zip(params, ref_params):  # the gradients carry exactly that scale
            np.testing.assert_allclose(p.grad().asnumpy() / norm_clip, r.grad().asnumpy(), rtol=2e-3, atol=1e-7)
        gluon.utils.clip_global_norm([p.grad() for p in params], norm_clip, check_isfinite=False)
        gluon.utils.clip_global_norm([p.grad() for p in ref_params], 1.0, check_isfinite=False)
        trainer.update(1)
        ref_trainer.update(1)
    for w, r in zip(_weights(net), _weights(ref)):
        np.testing.assert_allclose(w, r, rtol=1e-2, atol=1e-4)
    assert trainer._amp_loss_scaler.loss_scale == DEFAULT_SCALE[mode]  # between steps: the next one's


@pytest.mark.parametrize("spec", ["dynamic", 1.0])
@pytest.mark.parametrize("mode", _modes("off", "bfloat16-emulated", "float16-emulated", "bfloat16-native"))
def test_a_planted_inf_step_is_skipped_where_float16_runs_or_the_scaler_scales(mode, spec):
    """The default skips float16 steps on inf/NaN; a bfloat16 or float32 step it does not scale
    is FP32's: its inf reaches the weights, as in FP32 and PyTorch's bfloat16. A scaler that
    scales every step (``1.0``: static, scale 1) checks and skips in every mode."""
    _start(mode)
    net = _mlp()
    trainer = _trainer(net)
    scaler = gluon_amp.init_trainer(trainer, spec)
    _classifier_pattern(net, trainer, amp=True, poison_step=None)
    before = _weights(net)
    with autograd.record():
        loss = LOSS(net(BATCHES[0][0]), BATCHES[0][1]).mean() * float("inf")
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(1)
    skips = spec == 1.0 or mode == "float16-emulated"
    assert scaler.last_step_skipped is skips and scaler.skipped_steps == int(skips) and scaler.total_steps == 4
    kept = all(np.array_equal(a, b) for a, b in zip(before, _weights(net)))
    assert kept is skips and all(np.isfinite(w).all() for w in _weights(net)) is skips
    # float16 backs its scale off; elsewhere the loss was not scaled, so there is nothing to back off
    scale = DEFAULT_SCALE[mode] / (2 if mode == "float16-emulated" else 1) if spec == "dynamic" else 1.0
    assert trainer._amp_loss_scaler.loss_scale == scale


def _poisoned_step(net, trainer, clip=False):
    """One step whose loss, and so every gradient, is inf; True when the scaler skipped it.
    ``clip``: gluon_amp.clip_global_norm between backward and step."""
    with autograd.record():
        loss = LOSS(net(BATCHES[0][0]), BATCHES[0][1]).mean() * float("inf")
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    if clip:
        assert not np.isfinite(gluon_amp.clip_global_norm(trainer, 1.0))
    trainer.step(1)
    return gluon_amp.get_scaler(trainer).last_step_skipped


@pytest.mark.parametrize("mode", _modes("bfloat16-native"))
@pytest.mark.parametrize("case", ["float32 graph", "low imperative ops", "AMP off", "float16",
                                  "explicit scaler", "float32 graph, clipped"])
def test_the_default_scaler_checks_float16_steps_only(mode, case, monkeypatch):
    """A step the default scaler does not scale, in bfloat16 or float32, is FP32's step: not
    checked (the check's wait for the backward pass made MobileNet train at 0.92x FP32), and
    its inf reaches the weights as it does in FP32: a graph AMP kept all float32 (this MLP's
    products are too small for the rule that decides a graph not measured yet), bfloat16 ops
    run one by one, AMP off. A float16 step is checked and skipped; so is one whose scaler
    scales, and one whose gradients ``clip_global_norm`` found non-finite (it leaves them for
    ``step`` to skip)."""
    checks = []
    for name in ("all_finite", "arrays_finite"):
        real = getattr(overflow, name)
        monkeypatch.setattr(overflow, name, lambda *a, _real=real, **k: checks.append(1) or _real(*a, **k))
    monkeypatch.setattr(early_update, "begin", lambda *a, **k: checks.append(1) or None)
    if case == "float16":
        gluon_amp.init(target_dtype="float16", emulate=True)
    elif case != "AMP off":
        gluon_amp.init(target_dtype="bfloat16", tune=True, tune_budget=0)  # the rule, no timing
    net = _mlp()
    if case == "low imperative ops":
        net = nn.Sequential()  # not hybridized: each Dense runs bfloat16, op by op
        with net.name_scope():
            net.add(nn.Dense(16, activation="relu", in_units=8), nn.Dense(3, in_units=16))
        net.initialize(mx.init.Xavier())
    trainer = _trainer(net)
    gluon_amp.init_trainer(trainer, LossScaler(init_scale=8.0) if case == "explicit scaler" else "dynamic")
    _classifier_pattern(net, trainer, amp=True)
    if case.startswith("float32 graph") or case == "explicit scaler":
        assert {r.dtype for r in gluon_amp.report(net).rows} == {"float32"}  # what AMP kept
    checks.clear()
    skipped = _poisoned_step(net, trainer, clip=case.endswith("clipped"))
    weights_finite = all(np.isfinite(w).all() for w in _weights(net))
    if case in ("float32 graph", "low imperative ops", "AMP off"):
        assert not skipped and not checks and not weights_finite  # as FP32 does with an inf loss
    else:
        assert skipped and checks and weights_finite


def test_the_scale_follows_the_policy_where_it_is_used_and_explicit_scalers_are_obeyed():
    net = _mlp()
    trainer = _trainer(net)
    gluon_amp.init_trainer(trainer)  # before any init: AMP is off now, not for good
    hook = trainer._amp_loss_scaler
    x, y = BATCHES[0]

    def scaled_by(tr):
        with autograd.record():
            loss = LOSS(net(x), y).mean()
            with gluon_amp.scale_loss(loss, tr) as scaled:
                factor = 1.0 if scaled is loss else float(scaled.asscalar()) / float(loss.asscalar())
                autograd.backward(scaled)
        tr.step(1)
        return factor

    assert hook.loss_scale == 1.0 and scaled_by(trainer) == 1.0
    with gluon_amp.autocast("float16", emulate=True):
        assert hook.loss_scale == 2.0 ** 16 and scaled_by(trainer) == 2.0 ** 16
    with gluon_amp.autocast("bfloat16", emulate=True):
        # float16 stayed in force after that step until its region ended: the one step after a
        # float16 region is scaled (docs/training.md; a float16 forward run there is), the next not
        assert hook.loss_scale == 2.0 ** 16 and scaled_by(trainer) == 2.0 ** 16
        assert hook.loss_scale == 1.0 and scaled_by(trainer) == 1.0
    assert scaled_by(trainer) == 1.0
    # a number, or a LossScaler built by hand, is obeyed as given, AMP off included
    for spec, scale in ((128.0, 128.0), (LossScaler(init_scale=1024.0), 1024.0)):
        t = _trainer(net)
        gluon_amp.init_trainer(t, spec)
        assert t._amp_loss_scaler.loss_scale == scale and scaled_by(t) == scale
    # the peer's scaler attributes that scripts set or read (Sockeye sets _scale_seq_len)
    hook._scale_seq_len = 100
    assert gluon_amp.get_scaler(trainer).growth_interval == 100 and hook._scale_seq_len == 100


def test_the_bfloat16_default_rests_on_what_this_host_measures(tmp_path):
    """benchmarks/loss_scale_need.py, cut to one BERT step: in bfloat16 (native where the host
    has it, and emulated) scaling the loss by 65536 changes no gradient bit, while in the
    float16 control it saves gradients from underflow (docs/training.md)."""
    out = tmp_path / "need.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "loss_scale_need.py"),
                        "--workloads", "bert", "--steps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["workloads"]["bert"]
    native = gluon_amp.runtime.capability().bf16.value == "native"
    assert ("bfloat16 (native)" in rows) == native
    for mode in [m for m in rows if m.startswith("bfloat16")]:
        assert rows[mode]["bits_differ_between_scales"] == 0.0, mode
        assert rows[mode]["losses"]["scale 1"] == rows[mode]["losses"]["scale 65536"], mode
    f16 = rows["float16 (emulated)"]
    assert f16["scale 1"]["zero_where_fp32_nonzero"] > 10 * f16["scale 65536"]["zero_where_fp32_nonzero"]


def test_loss_output_ops_use_the_step_scale_also_when_init_follows_init_trainer():
    w = gluon.Parameter("w_lo_scale", shape=(2, 3))
    w.initialize(mx.init.Constant(0.1))
    x, y = mx.nd.array([[1.0, 2.0, 3.0]]), mx.nd.array([1.0])
    trainer = gluon.Trainer([w], "sgd", {"learning_rate": 0.0}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)

    def grad():
        with autograd.record():
            out = mx.nd.SoftmaxOutput(mx.nd.dot(x, w.data(), transpose_b=True), y)
            with gluon_amp.scale_loss(out, trainer) as scaled:
                autograd.backward(scaled)
        g = w.grad().asnumpy().copy()
        gluon_amp.unscale(trainer)
        unscaled = w.grad().asnumpy().copy()
        trainer.update(1)
        return g, unscaled

    plain, _ = grad()  # AMP off: scale 1, grad_scale untouched
    with gluon_amp.autocast("float16", emulate=True):
        scaled, unscaled = grad()  # the first step under the new init is scaled too
    np.testing.assert_allclose(scaled, 2.0 ** 16 * plain, rtol=1e-3)
    np.testing.assert_allclose(unscaled, plain, rtol=1e-3)


def test_a_forward_under_autocast_scales_its_loss_when_scale_loss_comes_after_the_scope():
    """PyTorch's pattern: the forward pass inside ``autocast``, the backward after it. The
    step ran float16, so its loss is scaled (it was decided from the policy at scale_loss
    time: 1 there, and float16's small gradients underflowed); a later step without AMP is not."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(mx.init.Constant(0.5))
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)
    x = mx.nd.full((2, 3), 1e-6)
    used = []
    for fp16 in (True, True, False):
        with autograd.record():
            with (gluon_amp.autocast("float16", emulate=True) if fp16 else contextlib.nullcontext()):
                loss = net(x).sum()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
            used.append(trainer._amp_loss_scaler.loss_scale)
        trainer.step(1)
    assert used[0] == gluon_amp.get_scaler(trainer).init_scale and used[1] > 1 and used[2] == 1.0


@pytest.mark.parametrize("mode", _modes("off", "float16-emulated", "bfloat16-emulated", "bfloat16-native"))
@pytest.mark.parametrize("as_list", [False, True])
def test_scale_loss_outside_record_trains_as_backward_there_does(mode, as_list):
    """``backward`` outside ``autograd.record()`` on a loss recorded inside works in MXNet, so
    ``scale_loss`` there must too: float16's scaled loss was made outside the graph ("Cannot
    differentiate node", found by a helper) while bfloat16 (scale 1) trained."""
    def grads(amp):
        net = _mlp()
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
        if amp:
            gluon_amp.init_trainer(trainer)
        x = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (4, 8)))
        with autograd.record():
            loss = net(x).mean()  # small enough for float16 at the first scale: no skip
        if amp:
            with gluon_amp.scale_loss([loss] if as_list else loss, trainer) as scaled:
                autograd.backward(scaled)
            scale = trainer._amp_loss_scaler.loss_scale
        else:
            loss.backward()
            scale = 1.0
        return [p.grad().asnumpy() / scale for p in net.collect_params().values()], trainer

    want, _ = grads(False)
    _start(mode)
    got, trainer = grads(True)
    tol = {"off": 0, "float16-emulated": 2e-2, "bfloat16-emulated": 3e-2}.get(mode, 3e-2)
    for g, w in zip(got, want):
        assert np.isfinite(g).all() and np.abs(g - w).max() <= tol * max(np.abs(w).max(), 1e-6)
    trainer.step(4)  # the step takes the gradients: nothing skipped


@pytest.mark.parametrize("mode", _modes("off", "float16-emulated", "bfloat16-emulated", "bfloat16-native"))
def test_a_scaled_step_without_scale_loss_is_said_once_at_the_users_line(mode):
    """Gluon's Estimator (its default fit_batch) and loops written without ``scale_loss`` step
    unscaled: where the scaler scales (float16), say so once per trainer, at the user's line;
    elsewhere (scale 1) nothing is missed and nothing is said."""
    import warnings
    _start(mode)
    net = _mlp()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)
    x = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (4, 8)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for use_scale_loss in (True, False, False):
            with autograd.record():
                backward(net(x).mean(), trainer if use_scale_loss else None)
            trainer.step(4)
    said = [w for w in seen if "did not go through" in str(w.message)]
    if DEFAULT_SCALE[mode] == 1.0:
        assert not said, [str(w.message) for w in said]
    else:
        assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in said]
        assert "scale_loss" in str(said[0].message) and "65536" in str(said[0].message)


class _Float16Weights(nn.HybridBlock):
    """An elementwise model MXNet runs in float16 on a CPU: float16 weights, no master copy."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.w = self.params.get("w", shape=(1, 10, 3), dtype="float16")

    def hybrid_forward(self, F, x, w):
        return F.sum(F.broadcast_mul(F.expand_dims(x, 2), w), axis=1)


def _float16_weights_moved(batch, optimizer, scaled, multi_precision=False):
    """How far three steps move float16 weights, the update in float16 unless ``multi_precision``."""
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(batch, 10) * 0.01, dtype="float16")
    y = mx.nd.array(rng.randint(0, 3, batch))
    net = _Float16Weights()
    net.initialize()
    net.w.set_data(mx.nd.array(rng.randn(1, 10, 3) * 0.3, dtype="float16"))
    w0 = net.w.data().asnumpy().astype(np.float32)
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.5, "multi_precision": multi_precision},
                            update_on_kvstore=False)
    if scaled:
        scaler = gluon_amp.init_trainer(trainer)  # the default: dynamic, from 65536, for float16 weights
    for _ in range(3):
        with autograd.record():
            loss = mx.nd.softmax_cross_entropy(net(x).astype("float32"), y)  # summed over the batch
            backward(loss, trainer if scaled else None)
        trainer.step(batch)
    if scaled:
        assert scaler.skipped_steps == 0
    return np.abs(net.w.data().asnumpy().astype(np.float32) - w0).max()


@pytest.mark.parametrize("optimizer", ["sgd", "nag"])
@pytest.mark.parametrize("batch", [64, 1024, 4096])
def test_float16_weights_updated_in_float16_keep_their_updates_at_any_batch_size(optimizer, batch):
    """The unscale folded into ``rescale_grad = 1 / (65536 * batch)``, which MXNet's float16
    kernels take as a float16 value: 0 from a batch of 256 on, so every step was lost, none
    skipped, nothing said. Such a step divides its gradients by the scale instead."""
    plain = _float16_weights_moved(batch, optimizer, scaled=False)
    assert plain > 0
    # the updates are a few float16 steps of the weights: as plain's, within one or two of them
    assert 0.5 * plain <= _float16_weights_moved(batch, optimizer, scaled=True) <= 2 * plain
    master = _float16_weights_moved(batch, optimizer, scaled=True, multi_precision=True)  # folded, as before
    assert 0.5 * plain <= master <= 2 * plain


def _lbsgd_weights(scaler):
    rng = np.random.RandomState(0)
    x, y = rng.randn(6, 16, 10), rng.randint(0, 3, (6, 16))
    net = nn.Dense(3, in_units=10)
    net.initialize()
    net.weight.set_data(mx.nd.array(rng.randn(3, 10) * 0.3))
    trainer = gluon.Trainer(net.collect_params(), "lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 2},
                            update_on_kvstore=False)
    if scaler is not None:
        gluon_amp.init_trainer(trainer, scaler)
    for k in range(6):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(mx.nd.array(x[k])), mx.nd.array(y[k])).mean()
            backward(loss, trainer if scaler is not None else None)
        trainer.step(1)
    return net.weight.data().asnumpy()


def test_lbsgd_summing_a_macro_batch_under_a_moving_scale_trains_as_fp32():
    """LBSGD (batch_scale 2) sums raw gradients over two steps and divides by the last step's
    rescale_grad: a scale that doubled in between weighed the steps unequally (3% off FP32 after
    6 steps; the peer too). Power-of-two scales, unscaled before it sums: FP32's bits."""
    want = _lbsgd_weights(None)
    assert np.array_equal(_lbsgd_weights(LossScaler(init_scale=1024.0, growth_interval=1)), want)


def test_lbsgd_summing_over_several_devices_is_refused_where_loss_scaling_would_break_it():
    """Updating on the worker, LBSGD's devices share one sum of gradients (keyed by parameter
    index): cpu(0)'s weights never moved while cpu(1)'s moved every step. Plain MXNet updates
    on its kvstore there; init_trainer, which needs the worker, says so before any step."""
    net = nn.Dense(3, in_units=10)
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = gluon.Trainer(net.collect_params(), "lbsgd", {"learning_rate": 0.1, "batch_scale": 2})
    with pytest.raises(ValueError, match=r"LBSGD with batch_scale=2 on 2 devices .*one device"):
        gluon_amp.init_trainer(trainer)
    one = nn.Dense(3, in_units=10)
    one.initialize()
    gluon_amp.init_trainer(gluon.Trainer(one.collect_params(), "lbsgd", {"learning_rate": 0.1, "batch_scale": 2}))
