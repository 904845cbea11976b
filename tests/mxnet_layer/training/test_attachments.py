"""Attachments do not outlive their owners (issue 42, item 5).

MXNet's parameters point back at their trainer (``Parameter._trainer``), so a dropped trainer
is freed only by the cyclic GC, and one that lived through training sits in its oldest
generation. It stops counting at once anyway: for the loss-output ops' scale and for a
shared scaler's rounds. The GC is off in these tests, as it effectively is for such a trainer.
"""
import gc
import weakref

import mxnet as mx
import pytest
from mxnet import autograd, gluon

import gluon_amp
from gluon_amp import LossScaler

x, y = mx.nd.ones((2, 8)), mx.nd.zeros((2,))


@pytest.fixture(autouse=True)
def _no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _train(scaler, steps=2, softmax=False):
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    gluon_amp.init_trainer(tr, scaler)
    for _ in range(steps):
        _step(net, tr, softmax)
    return net, tr


def _step(net, tr, softmax=False):
    with autograd.record():
        out = mx.nd.SoftmaxOutput(net(x), y) if softmax else net(x).mean()
        with gluon_amp.scale_loss(out, tr) as s:
            s.backward()
    tr.step(2)


def test_a_dropped_trainer_stops_counting_for_the_loss_output_ops_at_once():
    gluon_amp.init("float16", emulate=True)
    net1, tr1 = _train(LossScaler(init_scale=1024.0), softmax=True)
    old = weakref.ref(tr1)
    del net1, tr1
    assert old() is not None  # still there: only the cyclic GC would free it
    net2, tr2 = _train(LossScaler(init_scale=65536.0), softmax=True)  # no "2 loss scalers"
    assert gluon_amp.get_scaler(tr2).total_steps == 2


def test_a_trainer_held_only_by_its_parameters_does_not_count_but_a_held_one_does():
    gluon_amp.init("float16", emulate=True)
    net1, tr1 = _train(LossScaler(init_scale=1024.0), softmax=True)
    net2, tr2 = _train(LossScaler(init_scale=65536.0), steps=0)
    with pytest.raises(RuntimeError, match="2 loss scalers"):  # both held: ambiguous, as before
        _step(net2, tr2, softmax=True)
    del tr1  # the program keeps the net (its parameters point at the trainer), not the trainer
    _step(net2, tr2, softmax=True)


def test_a_shared_scaler_does_not_wait_for_a_dropped_trainer_or_module():
    scaler = LossScaler(init_scale=2.0 ** 10, growth_interval=1)
    net_a, tr_a = _train(scaler, steps=0)
    net_b, tr_b = _train(scaler, steps=0)
    _step(net_a, tr_a)
    _step(net_b, tr_b)  # a round of both
    assert scaler.total_steps == 1
    _step(net_a, tr_a)
    del net_b, tr_b  # dropped mid-round
    _step(net_a, tr_a)  # no "stepped twice": the round closes without the dropped trainer, a new one
    _step(net_a, tr_a)
    assert scaler.total_steps == 4

    data = mx.sym.Variable("data")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=4, name="fc"), name="softmax")
    mod = mx.mod.Module(out, data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (2, 8))], label_shapes=[("softmax_label", (2,))])
    mod.init_params()
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    gluon_amp.init_trainer(mod, scaler)
    _step(net_a, tr_a)  # waits for the Module
    assert scaler.total_steps == 4
    del mod
    _step(net_a, tr_a)
    assert scaler.total_steps == 6


def test_a_scaler_gives_the_stage_of_each_trainer_or_module_attached_to_it():
    """``scaler.stage(trainer)`` (docs/training.md) said the trainer was not attached and advised
    ``init_trainer(trainer, scaler)``, which then refused a second scaler: it took only the
    scaler's internal member token."""
    scaler = LossScaler()
    net, tr = _train(scaler, steps=0)
    assert scaler.stage(tr).value == "ready"
    with autograd.record():
        loss = net(x).sum()
        with gluon_amp.scale_loss(loss, tr) as scaled:
            autograd.backward(scaled)
    gluon_amp.unscale(tr)
    assert scaler.stage(tr).value == "unscaled"
    data = mx.sym.var("data")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=2), name="softmax")
    mod = mx.mod.Module(out)
    mod.bind([("data", (2, 8))], [("softmax_label", (2,))])
    mod.init_params()
    mod.init_optimizer()
    gluon_amp.init_trainer(mod, scaler)
    assert scaler.stage(mod).value == "ready"
    stranger = gluon.Trainer(net.collect_params(), "sgd", update_on_kvstore=False)
    with pytest.raises(RuntimeError, match="Trainer .* is not attached to this scaler.*get_scaler"):
        scaler.stage(stranger)


def test_a_bucketing_module_and_its_buckets_answer_for_their_scaler():
    """``scaler.stage(bucketing_module)`` and a bucket made later said "not attached", and the
    advice, ``init_trainer(module, scaler)``, said "already has a loss scaler"."""
    def sym_gen(key):
        out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2, name="fc"),
                                   mx.sym.var("softmax_label"), name="softmax")
        return out, ("data",), ("softmax_label",)
    mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=8)
    mod.bind([("data", (2, 8))], [("softmax_label", (2,))])
    mod.init_params()
    mod.init_optimizer()
    scaler = LossScaler()
    assert gluon_amp.init_trainer(mod, scaler) is scaler
    mod.switch_bucket(5, [mx.io.DataDesc("data", (2, 8))], [mx.io.DataDesc("softmax_label", (2,))])
    assert [scaler.stage(m).value for m in (mod, mod._buckets[8], mod._buckets[5])] == ["ready"] * 3
    assert gluon_amp.init_trainer(mod, scaler) is scaler  # asked again as before
    with pytest.raises(RuntimeError, match=r"already has a loss scaler \(from loss_scale=LossScaler"):
        gluon_amp.init_trainer(mod, 128.0)
