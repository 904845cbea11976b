"""A skipped step spends its gradients as an applied one does, and ``ignore_stale_grad=True``
leaves the parameters MXNet will not update out of the overflow check.

Found by running a shared body with two heads: one batch through head A overflowed (rightly
skipped), then only head B trained with ``trainer.step(..., ignore_stale_grad=True)``. Head A's
inf gradient stayed marked fresh (MXNet marks a gradient used in its update loop, which a
skipped step never reaches) and was checked at every later step: every step was skipped until
the collapse guard stopped the run, though MXNet would never have applied that gradient.
"""
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import mxnet_internals as mxi
from gluon_amp.training import early_update

pytestmark = pytest.mark.filterwarnings("ignore:gluon_amp. a training step was skipped:RuntimeWarning")

#: a scaler that checks every step, float32 ones included (AMP stays off: no emulation needed)
CHECKED = 1.0


class _TwoHeads(nn.Block):
    def __init__(self):
        super().__init__()
        self.body = nn.Dense(6, in_units=4, activation="tanh", prefix="body_")
        self.a = nn.Dense(2, in_units=6, prefix="heada_")
        self.b = nn.Dense(2, in_units=6, prefix="headb_")

    def forward(self, x, head):
        h = self.body(x)
        return self.a(h) + self.b(h) if head == "ab" else (self.a if head == "a" else self.b)(h)


def _net_and_trainer(scaler, early, monkeypatch):
    if not early:
        monkeypatch.setattr(early_update, "MAX_BYTES", -1)  # every step waits for its verdict
    mx.random.seed(0)
    net = _TwoHeads()
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            update_on_kvstore=False)
    got = gluon_amp.init_trainer(trainer, scaler) if scaler is not None else None
    return net, trainer, got


def _batches(n, bad_first, seed=0):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        x = rng.randn(4, 4).astype("float32")
        if i == 0 and bad_first:
            x[0, 0] = np.inf
        out.append(mx.nd.array(x))
    return out


def _step(net, trainer, x, head, ignore_stale_grad):
    with autograd.record():
        loss = (net(x, head) ** 2).mean()
        if getattr(trainer, "_amp_loss_scaler", None) is not None:
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                scaled.backward()
        else:
            loss.backward()
    trainer.step(4, ignore_stale_grad=ignore_stale_grad)


def _weights(net):
    return {k.split("_", 1)[0] + "_" + k.rsplit("_", 1)[1]: p.data().asnumpy()
            for k, p in net.collect_params().items()}


@pytest.mark.parametrize("early", [True, False], ids=["early", "waiting"])
@pytest.mark.parametrize("steps", [2, 5])
def test_a_stale_inf_gradient_skips_its_own_step_only_under_ignore_stale_grad(early, steps, monkeypatch):
    """Head A's one overflowing step is skipped; the next ``steps`` through head B update the
    body and head B exactly as plain MXNet does when that step never happened."""
    net, trainer, scaler = _net_and_trainer(CHECKED, early, monkeypatch)
    xs = _batches(steps + 1, bad_first=True)
    start = _weights(net)
    for i, x in enumerate(xs):
        _step(net, trainer, x, "a" if i == 0 else "b", ignore_stale_grad=True)
    got = _weights(net)
    assert scaler.skipped_steps == 1 and scaler.total_steps == steps + 1, scaler.state_dict()

    monkeypatch.undo()
    ref, ref_trainer, _ = _net_and_trainer(None, True, monkeypatch)
    for x in xs[1:]:  # the skipped step left nothing behind: as if it never ran
        _step(ref, ref_trainer, x, "b", ignore_stale_grad=True)
    want = _weights(ref)
    assert sorted(got) == sorted(want)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in ("heada_weight", "heada_bias"):  # never updated: skipped once, stale after
        np.testing.assert_array_equal(got[k], start[k], err_msg=k)
    assert not np.array_equal(got["body_weight"], start["body_weight"])


@pytest.mark.parametrize("early", [True, False], ids=["early", "waiting"])
def test_a_skipped_step_with_a_gradient_no_backward_wrote_is_refused_as_mxnet_refuses_it(early, monkeypatch):
    """An overflowing step where a parameter got no gradient at all, without
    ``ignore_stale_grad``: MXNet's UserWarning names it, as without AMP (a skip would hide it)."""
    net, trainer, scaler = _net_and_trainer(CHECKED, early, monkeypatch)
    with pytest.raises(UserWarning, match="headb_.*has not been updated by backward"):
        _step(net, trainer, _batches(1, bad_first=True)[0], "a", ignore_stale_grad=False)
    assert scaler.total_steps == 0


@pytest.mark.parametrize("early", [True, False], ids=["early", "waiting"])
def test_a_fresh_inf_gradient_is_still_skipped_under_ignore_stale_grad(early, monkeypatch):
    """Leaving stale gradients out must not leave out fresh ones: head B's own inf skips."""
    net, trainer, scaler = _net_and_trainer(CHECKED, early, monkeypatch)
    good, bad = _batches(2, bad_first=False)[0], _batches(1, bad_first=True)[0]
    _step(net, trainer, good, "a", ignore_stale_grad=True)
    before = _weights(net)
    _step(net, trainer, bad, "b", ignore_stale_grad=True)
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped
    after = _weights(net)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("early", [True, False], ids=["early", "waiting"])
def test_after_a_skipped_step_an_unused_heads_gradient_is_refused_as_mxnet_refuses_it(early, monkeypatch):
    """Without ``ignore_stale_grad``, MXNet refuses a step where a parameter got no new
    gradient (its UserWarning). After a skipped step it does so as after an applied one, and
    the refused step changes no weight."""
    net, trainer, scaler = _net_and_trainer(CHECKED, early, monkeypatch)
    xs = _batches(2, bad_first=True)
    _step(net, trainer, xs[0], "ab", ignore_stale_grad=False)
    assert scaler.skipped_steps == 1
    assert all(not mxi.fresh_grad(p.data()) for p in net.collect_params().values())  # spent, as if applied
    before = _weights(net)
    with pytest.raises(UserWarning, match="heada_.*has not been updated by backward"):
        _step(net, trainer, xs[1], "b", ignore_stale_grad=False)
    assert scaler.skipped_steps == 1
    for k, w in _weights(net).items():
        np.testing.assert_array_equal(w, before[k], err_msg=k)

    monkeypatch.undo()
    ref, ref_trainer, _ = _net_and_trainer(None, True, monkeypatch)
    _step(ref, ref_trainer, _batches(1, bad_first=False)[0], "ab", ignore_stale_grad=False)
    with pytest.raises(UserWarning, match="heada_.*has not been updated by backward"):
        _step(ref, ref_trainer, xs[1], "b", ignore_stale_grad=False)


def test_emulated_float16_with_the_dynamic_scaler_trains_on_after_an_unused_heads_overflow(monkeypatch):
    """The program that found it: emulated float16, the default dynamic scaler, 30 steps.
    Before, every step after the first was skipped and step 25 raised the collapse guard."""
    gluon_amp.init(target_dtype="float16", emulate=True)
    try:
        net, trainer, scaler = _net_and_trainer("dynamic", True, monkeypatch)
        xs = _batches(30, bad_first=True, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, x in enumerate(xs):
                _step(net, trainer, x, "a" if i == 0 else "b", ignore_stale_grad=True)
        assert scaler.skipped_steps == 1 and scaler.total_steps == 30, scaler.state_dict()
        assert all(np.isfinite(w).all() for w in _weights(net).values())
    finally:
        gluon_amp.disable()


@pytest.mark.parametrize("early", [True, False], ids=["early", "waiting"])
def test_a_skipped_step_that_leaves_stale_parameters_out_leaves_every_optimizer_state(early, monkeypatch):
    """Found in a two-head multi-task loop: the skipped step's early update saved and put back
    the optimizer states by positions in the fresh parameters, not in the trainer's list, so
    head B's momentum kept the inf and its next good step made its weights NaN."""
    net, trainer, scaler = _net_and_trainer(CHECKED, early, monkeypatch)
    good, bad = _batches(2, bad_first=False)[0], _batches(1, bad_first=True)[0]
    _step(net, trainer, good, "ab", ignore_stale_grad=True)  # every parameter gets its state
    _step(net, trainer, good, "a", ignore_stale_grad=True)
    states = {i: [s.asnumpy().copy() for s in ([st] if not isinstance(st, (list, tuple)) else st)]
              for i, st in trainer._updaters[0].states.items()}
    weights = _weights(net)
    _step(net, trainer, bad, "b", ignore_stale_grad=True)
    assert scaler.last_step_skipped
    for i, st in trainer._updaters[0].states.items():
        now = [s.asnumpy() for s in ([st] if not isinstance(st, (list, tuple)) else st)]
        for a, b in zip(now, states[i]):
            np.testing.assert_array_equal(a, b, err_msg=trainer._params[i].name)
    for k, w in _weights(net).items():
        np.testing.assert_array_equal(w, weights[k], err_msg=k)
    _step(net, trainer, good, "b", ignore_stale_grad=True)
    assert all(np.isfinite(w).all() for w in _weights(net).values())
