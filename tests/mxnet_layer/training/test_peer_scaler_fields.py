"""The peer's scaler fields as clients use them (issue 37, part 2).

Sockeye 2.3.24 saves ``(trainer._amp_loss_scaler._loss_scale, ._next_loss_scale, ._unskipped)``
with pickle and restores a run by assigning that tuple back; GluonNLP reads ``loss_scale``.
Each field reads the trainer's LossScaler state and an assignment replaces it, from the next
step on.
"""
import pickle

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import LossScaler

_RNG = np.random.RandomState(1)
BATCHES = [(mx.nd.array(_RNG.normal(0, 1, (6, 8))), mx.nd.array(_RNG.randint(0, 3, 6))) for _ in range(4)]
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
MODES = {"off": None, "float16-emulated": {"target_dtype": "float16", "emulate": True},
         "bfloat16-emulated": {"target_dtype": "bfloat16", "emulate": True}}


def _net():
    mx.random.seed(3)
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation="relu", in_units=8), nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _trainer(net, loss_scale="dynamic"):
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, loss_scale)
    return trainer


def _step(net, trainer, batch, poison=False):
    """One step; returns the factor scale_loss multiplied the loss by."""
    x, y = batch
    with autograd.record():
        loss = LOSS(net(x), y).mean()
        if poison:
            loss = loss * float("inf")
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            factor = float((scaled / loss).asscalar()) if not poison else None
            autograd.backward(scaled)
    trainer.step(1)
    return factor


def _weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


@pytest.mark.parametrize("mode", list(MODES))
def test_sockeye_restores_the_pickled_fields_and_training_continues_as_if_never_stopped(mode):
    if MODES[mode] is not None:
        gluon_amp.init(**MODES[mode])
    net = _net()
    trainer = _trainer(net)
    fp16 = mode == "float16-emulated"  # elsewhere steps are not scaled: scale 1, the count stays
    # float16: an inf step is skipped, the scale backs off and the count restarts (elsewhere it
    # would not be checked, and would reach the weights as in FP32)
    _step(net, trainer, BATCHES[0], poison=fp16)
    _step(net, trainer, BATCHES[1])
    _step(net, trainer, BATCHES[2])
    s = trainer._amp_loss_scaler
    saved = pickle.dumps((s._loss_scale, s._next_loss_scale, s._unskipped))  # sockeye/training.py
    params = [v.data().copy() for v in net.collect_params().values()]

    resumed = _net()
    for v, data in zip(resumed.collect_params().values(), params):
        v.set_data(data)
    trainer2 = _trainer(resumed)
    r = trainer2._amp_loss_scaler
    (r._loss_scale, r._next_loss_scale, r._unskipped) = pickle.loads(saved)
    assert (r._loss_scale, r._next_loss_scale, r._unskipped) == pickle.loads(saved)
    want = gluon_amp.get_scaler(trainer).state
    got = gluon_amp.get_scaler(trainer2).state
    assert (got.scale, got.growth_tracker) == (want.scale, want.growth_tracker)
    expected_scale = 2.0 ** 15 if fp16 else 1.0
    assert r.loss_scale == expected_scale and r._unskipped == (2 if fp16 else 0)
    # the next step is the uninterrupted run's, bit for bit
    assert _step(resumed, trainer2, BATCHES[3]) == _step(net, trainer, BATCHES[3]) == expected_scale
    assert all(np.array_equal(a, b) for a, b in zip(_weights(resumed), _weights(net)))


def test_an_assigned_scale_takes_effect_on_the_next_step_and_not_on_the_current_one():
    gluon_amp.init("float16", emulate=True)
    net = _net()
    trainer = _trainer(net)
    ref = _net()
    ref_trainer = _trainer(ref, LossScaler.where_needed(init_scale=1024.0))
    trainer._amp_loss_scaler.loss_scale = 1024.0  # between steps: the next step uses it
    assert trainer._amp_loss_scaler._next_loss_scale == 1024.0
    assert _step(net, trainer, BATCHES[0]) == _step(ref, ref_trainer, BATCHES[0]) == 1024.0
    assert all(np.array_equal(a, b) for a, b in zip(_weights(net), _weights(ref)))

    x, y = BATCHES[1]
    with autograd.record():
        loss = LOSS(net(x), y).mean()
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer._amp_loss_scaler._loss_scale = 8.0  # mid-step: this step keeps the 1024 its loss used
    assert trainer._amp_loss_scaler.loss_scale == 1024.0
    assert trainer._amp_loss_scaler._next_loss_scale == 8.0
    trainer.step(1)
    _step(ref, ref_trainer, BATCHES[1])
    assert all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(_weights(net), _weights(ref)))
    assert _step(net, trainer, BATCHES[2]) == 8.0


def test_an_assigned_count_of_unskipped_steps_makes_the_scale_grow_on_schedule():
    gluon_amp.init("float16", emulate=True)
    net = _net()
    trainer = _trainer(net, LossScaler.where_needed(growth_interval=5))
    s = trainer._amp_loss_scaler
    s._unskipped = 4
    assert s._unskipped == 4 and gluon_amp.get_scaler(trainer).state.growth_tracker == 4
    _step(net, trainer, BATCHES[0])
    assert s._unskipped == 0 and s.loss_scale == 2.0 ** 17


def test_bad_assignments_name_the_value_and_change_nothing():
    gluon_amp.init("float16", emulate=True)
    trainer = _trainer(_net())
    s, state = trainer._amp_loss_scaler, gluon_amp.get_scaler(trainer).state
    with pytest.raises(TypeError, match="'big'"):
        s._loss_scale = "big"
    with pytest.raises(ValueError, match="-1.0"):
        s._next_loss_scale = -1.0
    with pytest.raises(ValueError, match="max_scale"):
        s.loss_scale = 2.0 ** 30
    with pytest.raises(ValueError, match="-3"):
        s._unskipped = -3
    assert gluon_amp.get_scaler(trainer).state == state
