"""gluon_amp.mxnet_internals.warning_sites: MXNet's own warnings name the line plain MXNet names."""
import warnings

import pytest
import mxnet as mx
from mxnet import gluon
from mxnet.gluon import block as mx_block

import gluon_amp


class _PartlyUsed(gluon.HybridBlock):
    """One Dense used, one not, and a second input not used: MXNet warns twice at the first call."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.used = gluon.nn.Dense(4, in_units=5)  # MXNet cannot defer shapes past an unused input
            self.unused = gluon.nn.Dense(3, in_units=5)

    def hybrid_forward(self, F, x, y):
        return self.used(x)


def _call_site_warnings():
    net = _PartlyUsed()
    net.initialize()
    net.hybridize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(mx.nd.ones((2, 5)), mx.nd.ones((2, 5)))
        mx.nd.waitall()
    return sorted((str(w.message).split(" ")[0], w.filename, w.lineno) for w in caught
                  if "not used by any computation" in str(w.message))


@pytest.fixture(params=["float16", "bfloat16"])
def emulated(request):
    gluon_amp.init(request.param, emulate=True)
    yield
    gluon_amp.disable()


def _plain():
    got = _call_site_warnings()
    assert [w[0] for w in got] == ["Parameter", "The"], got  # both warnings, to compare their sites
    return got


def test_unused_parameter_and_input_warnings_name_plain_mxnets_line_emulated(emulated):
    assert mx_block.warnings is not warnings  # the hooks are in
    under_init = _call_site_warnings()
    gluon_amp.disable()
    assert under_init == _plain()


def test_unused_parameter_and_input_warnings_name_plain_mxnets_line_natively(native_host):
    gluon_amp.init("bfloat16", tune=False)
    try:
        under_init = _call_site_warnings()
    finally:
        gluon_amp.disable()
    assert under_init == _plain()


def test_the_module_gets_pythons_warnings_back_when_the_last_hooks_go():
    assert mx_block.warnings is warnings
    gluon_amp.init("bfloat16", emulate=True)
    assert mx_block.warnings is not warnings and mx_block.warnings.catch_warnings is warnings.catch_warnings
    with gluon_amp.autocast("float16", emulate=True):  # a region inside: still held after it
        assert mx_block.warnings is not warnings
    assert mx_block.warnings is not warnings
    gluon_amp.disable()
    assert mx_block.warnings is warnings


def test_a_level_past_the_stack_lands_where_pythons_does():
    from gluon_amp.mxnet_internals import warning_sites
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("python", UserWarning, stacklevel=500)
        warning_sites.warn("ours", UserWarning, stacklevel=500)
        warning_sites.warn("here", UserWarning)
    assert caught[0].filename == caught[1].filename and caught[0].lineno == caught[1].lineno
    assert caught[2].filename == __file__


def _module_fit_warnings():
    """MXNet's init_optimizer warns (stacklevel 2, naming ``fit``) for an optimizer made outside
    the Module whose rescale_grad is not 1/batch; init_params after fit warns (naming the caller)."""
    import numpy as np
    sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2, name="fc"), name="softmax")
    it = mx.io.NDArrayIter(np.ones((8, 3), "float32"), np.zeros(8, "float32"), batch_size=4)
    mod = mx.mod.Module(sym)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.fit(it, num_epoch=1, optimizer=mx.optimizer.SGD(learning_rate=0.1, rescale_grad=1.0))
        mod.init_params()
    return sorted((str(w.message)[:40], w.filename, w.lineno) for w in caught
                  if "rescale_grad" in str(w.message) or "init_params call ignored" in str(w.message))


def test_a_modules_warnings_name_plain_mxnets_line(emulated):
    from mxnet.module import module as mx_module
    assert mx_module.warnings is not warnings  # Module's methods are wrapped
    under_init = _module_fit_warnings()
    gluon_amp.disable()
    assert mx_module.warnings is warnings
    plain = _module_fit_warnings()
    assert len(plain) == 2, plain
    assert under_init == plain
