"""bfloat16 AMP training executes on this CPU: quality and bitwise-exact resume."""
import numpy as np
from mxnet import autograd, gluon

import gluon_amp
from helpers import blobs as _data, cnn


def _train(net, x, y, steps, amp, trainer=None, start=0, bs=32):
    trainer = trainer or gluon.Trainer(net.collect_params(), "sgd",
                                       {"learning_rate": 0.05, "momentum": 0.9}, update_on_kvstore=False)
    if amp and start == 0:
        gluon_amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for i in range(start, start + steps):
        j = (i * bs) % x.shape[0]
        xb, yb = x[j:j + bs], y[j:j + bs]
        with autograd.record():
            loss = loss_fn(net(xb), yb)
            if amp:
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        trainer.step(bs)
    return trainer


def _accuracy(net, x, y):
    return float((net(x).argmax(axis=1) == y).mean().asscalar())


def test_bf16_training_reaches_fp32_accuracy(native_host):
    x, y = _data()
    xt, yt = _data(seed=1)
    ref = cnn(0)
    _train(ref, x, y, 60, amp=False)
    with gluon_amp.autocast("bfloat16"):
        net = cnn(0)
        _train(net, x, y, 60, amp=True)
        acc = _accuracy(net, xt, yt)
    ref_acc = _accuracy(ref, xt, yt)
    assert ref_acc > 0.9
    assert acc >= ref_acc - 0.01, (acc, ref_acc)


def test_resume_is_bitwise_exact(native_host, tmp_path):
    x, y = _data(n=256)
    n = 8
    with gluon_amp.autocast("bfloat16"):
        straight = cnn(3)
        tr = _train(straight, x, y, n, amp=True)
        want_scale = gluon_amp.get_scaler(tr).state_dict()

        first = cnn(3)
        tr1 = _train(first, x, y, n // 2, amp=True)
        first.save_parameters(str(tmp_path / "p.params"))
        gluon_amp.save_states(tr1, str(tmp_path / "t.states"))

        resumed = cnn(11)  # different init: everything must come from the checkpoint
        resumed(x[:1])
        resumed.load_parameters(str(tmp_path / "p.params"))
        tr2 = gluon.Trainer(resumed.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                            update_on_kvstore=False)
        gluon_amp.init_trainer(tr2)
        gluon_amp.load_states(tr2, str(tmp_path / "t.states"))
        _train(resumed, x, y, n // 2, amp=True, trainer=tr2, start=n // 2)
    for (name, a), b in zip(straight.collect_params().items(), resumed.collect_params().values()):
        assert np.array_equal(a.data().asnumpy(), b.data().asnumpy()), name
    assert gluon_amp.get_scaler(tr2).state_dict() == want_scale
