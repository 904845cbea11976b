"""Training in numpy mode (``npx.set_np()``) ends bit for bit where the same run in MXNet's
legacy mode ends, under every policy, optimizer and training feature.

Generated over: the policy (native bfloat16 on a simulated and a real host, emulated float16
and bfloat16), the optimizer (stateless, with states), the step (updating before its verdict,
:mod:`gluon_amp.training.early_update`, or waiting for it), what a step does besides (nothing,
``unscale`` then MXNet's clipping, ``clip_global_norm``, ``save_states``/``load_states``,
float16 weights with master copies) and batches with inf and NaN (skipped steps). A small
model's trainer updates early, and MXNet's legacy ops it runs there refused numpy-mode arrays:
every step of such a run raised ``TypeError`` (``multi_sum_sq``) in numpy mode.
"""
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon, npx

import gluon_amp
from gluon_amp.training import early_update

pytestmark = pytest.mark.filterwarnings("ignore:gluon_amp. a training step was skipped:RuntimeWarning")

#: the batches of each run: finite values, an inf, a NaN (the steps they meet are skipped)
BATCHES = ("finite", "inf", "finite", "nan", "finite")
OPTIMIZERS = {"sgd": {"learning_rate": 0.05}, "sgd-momentum": {"learning_rate": 0.05, "momentum": 0.9},
              "adam": {"learning_rate": 0.01}}
FEATURES = ("step", "unscale-then-clip", "clip_global_norm", "save-and-load-states", "float16-weights")
EMULATED = {"emulated-float16": {"target_dtype": "float16", "emulate": True},
            "emulated-bfloat16": {"target_dtype": "bfloat16", "emulate": True}}


def _run(numpy_mode, policy, optimizer, feature, tmp_path):
    """Weights, optimizer states and the scaler's state after the batches, in one mode."""
    if numpy_mode:
        npx.set_np()
    F = mx.np if numpy_mode else mx.nd
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gluon_amp.init(**policy)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(4))
        net.initialize()
        net(F.zeros((1, 12)))
        rng = np.random.RandomState(5)
        for p in net.collect_params().values():  # the same weights in both modes
            p.set_data(F.array(rng.standard_normal(p.shape) * 0.1, dtype="float32"))
        low = feature == "float16-weights"
        if low:
            net.cast("float16")
        net.hybridize()
        kwargs = dict(OPTIMIZERS[optimizer], multi_precision=low)
        trainer = gluon.Trainer(net.collect_params(), "sgd" if optimizer.startswith("sgd") else optimizer,
                                kwargs, update_on_kvstore=False)
        # bfloat16 steps: a scaler that checks them (the default checks float16 ones only), so
        # the planted inf and NaN steps are skipped in both modes
        gluon_amp.init_trainer(trainer, "dynamic" if policy["target_dtype"] == "float16" or low else 1.0)
        loss_fn = gluon.loss.L2Loss()
        data = np.random.RandomState(1)
        for i, kind in enumerate(BATCHES):
            x = data.rand(8, 12).astype("float32")
            x[0, 0] = {"finite": x[0, 0], "inf": np.inf, "nan": np.nan}[kind]
            x, y = F.array(x, dtype="float32"), F.array(data.rand(8, 4), dtype="float32")
            with autograd.record():
                out = net(x.astype("float16") if low else x)
                loss = loss_fn(out.astype("float32"), y)
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            if feature == "unscale-then-clip":
                gluon_amp.unscale(trainer)
                grads = [p.grad() for p in net.collect_params().values()]
                gluon.utils.clip_global_norm([g.as_nd_ndarray() if numpy_mode else g for g in grads], 0.5,
                                             check_isfinite=False)
            elif feature == "clip_global_norm":
                gluon_amp.clip_global_norm(trainer, 0.5)
            trainer.step(8)
            if feature == "save-and-load-states" and i == 2:
                path = str(tmp_path / f"states-{numpy_mode}")
                gluon_amp.save_states(trainer, path)
                gluon_amp.load_states(trainer, path)
        # each parameter's state, in the order of collect_params (as the weights): the Trainer
        # numbers parameters by their names sorted as strings, and Gluon's global block counter
        # gives the two runs different names (dense9/dense10 sort apart, dense11/dense12 do not),
        # so an index can stand for a different layer in each mode
        index = {id(p): i for i, p in enumerate(trainer._params)}
        states = [s for u in trainer._updaters for p in net.collect_params().values()
                  for st in [u.states.get(index[id(p)])]
                  for s in (st if isinstance(st, (list, tuple)) else [st]) if s is not None]
        return {"weights": [p.data().astype("float32").asnumpy() for p in net.collect_params().values()],
                "states": [getattr(s, "master", s).astype("float32").asnumpy()
                           for s in states if hasattr(getattr(s, "master", s), "asnumpy")],
                "scaler": gluon_amp.get_scaler(trainer).state_dict()}
    finally:
        gluon_amp.disable()
        if numpy_mode:
            npx.reset_np()


def _same_in_both_modes(policy, optimizer, feature, tmp_path):
    legacy = _run(False, policy, optimizer, feature, tmp_path)
    numpy = _run(True, policy, optimizer, feature, tmp_path)
    assert legacy["scaler"] == numpy["scaler"]
    assert legacy["weights"] and (legacy["states"] or optimizer == "sgd")
    for name in ("weights", "states"):
        assert len(legacy[name]) == len(numpy[name])
        for a, b in zip(legacy[name], numpy[name]):
            np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in numpy["weights"])  # the inf and NaN steps were skipped


@pytest.fixture(params=["early", "waiting"])
def step_kind(request, monkeypatch):
    """A step that updates before its verdict (this model is small enough) or waits for it."""
    if request.param == "waiting":
        monkeypatch.setattr(early_update, "MAX_BYTES", 0)
    return request.param


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("policy, feature", [(p, f) for p in EMULATED for f in FEATURES
                                             if f != "float16-weights" or p == "emulated-float16"])
def test_numpy_mode_trains_as_legacy_mode_does_emulated(policy, optimizer, feature, step_kind, tmp_path):
    _same_in_both_modes(EMULATED[policy], optimizer, feature, tmp_path)


@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "float16-weights"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_numpy_mode_trains_as_legacy_mode_does_native(native_host, optimizer, feature, step_kind, tmp_path):
    _same_in_both_modes({"target_dtype": "bfloat16", "tune": False}, optimizer, feature, tmp_path)
