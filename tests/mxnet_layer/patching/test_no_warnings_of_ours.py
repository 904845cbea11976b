"""A wrapper is invisible: a training step under AMP shows the user no warning that the same
step without AMP does not (MXNet's deprecated ``NameManager.current`` and ``ndarray.context``,
read by gluon_amp on every op of a trace, did)."""
import warnings

import mxnet as mx
import pytest
from mxnet import autograd, gluon

import gluon_amp


def _steps(frontend, amp):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, in_channels=2), gluon.nn.Dense(3))
    net.initialize()
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    if amp:
        gluon_amp.init(target_dtype="float16", emulate=True)
        gluon_amp.init_trainer(trainer)
    x = frontend.ones((2, 2, 6, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with autograd.record():
                loss = net(x).sum()
                if amp:
                    with gluon_amp.scale_loss(loss, trainer) as scaled:
                        autograd.backward(scaled)
                else:
                    loss.backward()
            trainer.step(2)
    return {(w.category.__name__, str(w.message)) for w in caught if issubclass(w.category, DeprecationWarning)}


@pytest.mark.parametrize("mode", ["legacy", "numpy"])
def test_a_training_step_under_amp_shows_no_deprecation_warning_the_plain_step_does_not(mode):
    if mode == "numpy":
        mx.npx.set_np()
    try:
        frontend = mx.np if mode == "numpy" else mx.nd
        plain = _steps(frontend, amp=False)
        under = _steps(frontend, amp=True)
    finally:
        gluon_amp.disable()
        if mode == "numpy":
            mx.npx.reset_np()
    assert under <= plain, under - plain


class _Norm(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        self.feat = gluon.nn.Dense(6, in_units=3, flatten=False)

    def hybrid_forward(self, F, x):
        return F.np.linalg.norm(self.feat(x), axis=1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_type_rule_probed_with_free_inputs_logs_nothing(dtype, capfd):
    """The op wrapper probes an op's type rule with inputs of no dtype; MXNet's rule for
    ``np.linalg.norm`` then logs "Integer input to norm ... breaks gradient compute in backward"
    (helper Z), false: values and gradients are FP32's. MXNet's log lines of the probe are dropped."""
    mx.npx.set_np()
    try:
        gluon_amp.init(target_dtype=dtype, emulate=True)
        net = _Norm()
        net.initialize(mx.init.One())
        net.hybridize()
        x = mx.np.ones((2, 3))
        with autograd.record():
            y = net(x)
        y.backward()
        assert float(y[0]) == pytest.approx(3 * 6 ** 0.5, rel=0.01)  # Dense of ones: 3 per unit, 6 units
    finally:
        gluon_amp.disable()
        mx.npx.reset_np()
    assert "Integer input to norm" not in capfd.readouterr().err
