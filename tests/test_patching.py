import warnings

import numpy as np
import mxnet as mx
import pytest

import gluon_amp
from gluon_amp_core.capability import resolve_target
from gluon_amp_core.dtypes import dtype_name
from gluon_amp.mxnet_internals import BFLOAT16
from gluon_amp import LossScaler
from nets import make_net


def test_disable_restores_every_original_object():
    gluon_amp.init("bfloat16")
    record = gluon_amp.patched_functions()
    assert len(record) > 1000
    assert all(getattr(p.module, p.name) is not p.original for p in record)
    gluon_amp.disable()
    bad = [(p.module.__name__, p.name) for p in record if getattr(p.module, p.name) is not p.original]
    assert not bad
    assert gluon_amp.patched_functions() == ()


def test_wrappers_keep_names_and_docs():
    gluon_amp.init("float16")
    assert mx.nd.Convolution.__name__ == "Convolution"
    assert mx.nd.Convolution.__wrapped__ is not None
    assert "Convolution" in (mx.sym.Convolution.__doc__ or "")


def test_init_twice_same_args_is_noop_and_different_args_raise():
    t1 = gluon_amp.init("bfloat16")
    n = len(gluon_amp.patched_functions())
    assert gluon_amp.init("bfloat16") is t1
    assert len(gluon_amp.patched_functions()) == n
    with pytest.raises(RuntimeError, match="disable"):
        gluon_amp.init("float16")
    with pytest.raises(RuntimeError):
        gluon_amp.init("bfloat16", fp32_ops=["softmax"])


def test_bad_arguments_raise_value_error_and_leave_amp_off():
    with pytest.raises(ValueError, match="'float16', 'bfloat16'"):
        gluon_amp.init("float32")
    with pytest.raises(ValueError, match="Did you mean 'softmax'"):
        gluon_amp.init("bfloat16", fp32_ops=["softmx"])
    with pytest.raises(ValueError, match="in both"):
        gluon_amp.init("bfloat16", fp32_ops=["softmax"], target_precision_ops=["softmax"])
    assert not gluon_amp.is_enabled()


def test_none_follows_what_this_machine_executes():
    cap = gluon_amp.runtime.capability()
    want = resolve_target(None, cap).dtype
    result = gluon_amp.init(None)
    if want == "float32":
        assert result.target_dtype == "float32" and not result.enabled and result.reason
        assert not gluon_amp.is_enabled()
    else:
        assert result.target_dtype == want and gluon_amp.is_enabled()


def test_autocast_scopes_patching():
    orig = mx.nd.Convolution
    with gluon_amp.autocast("bfloat16") as table:
        assert table.target_dtype == "bfloat16"
        assert mx.nd.Convolution is not orig
    assert mx.nd.Convolution is orig and not gluon_amp.is_enabled()


def test_autocast_restores_on_error():
    orig = mx.sym.FullyConnected
    with pytest.raises(KeyError):
        with gluon_amp.autocast("float16"):
            raise KeyError("boom")
    assert mx.sym.FullyConnected is orig


@pytest.mark.bf16_kernels
def test_imperative_casts():
    x = mx.nd.random.uniform(shape=(2, 3, 6, 6))
    w = mx.nd.random.uniform(shape=(4, 3, 3, 3))
    with gluon_amp.autocast("bfloat16"):
        y = mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=4, no_bias=True)
        assert y.dtype == BFLOAT16
        assert mx.nd.softmax(y).dtype == np.float32
        assert (y + mx.nd.ones(y.shape)).dtype == np.float32     # widest
        assert mx.nd.Activation(y, act_type="relu").dtype == BFLOAT16       # neutral
        assert mx.nd.Activation(y, act_type="softrelu").dtype == np.float32  # conditional
        idx = mx.nd.array([0, 1], dtype="int32")
        assert mx.nd.take(mx.nd.softmax(y), idx).dtype == np.float32
    assert mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=4, no_bias=True).dtype == np.float32


@pytest.mark.bf16_kernels
def test_numpy_front_end_casts():
    x = mx.np.random.uniform(size=(2, 8))
    w = mx.np.random.uniform(size=(4, 8))
    with gluon_amp.autocast("bfloat16"):
        y = mx.npx.fully_connected(x, w, num_hidden=4, no_bias=True)
        assert isinstance(y, mx.np.ndarray) and dtype_name(y.dtype) == "bfloat16"
        z = mx.npx.softmax(y)
        assert isinstance(z, mx.np.ndarray) and z.dtype == np.float32


def test_ops_without_inputs_work_in_graphs():
    with gluon_amp.autocast("bfloat16"):
        a = mx.sym.arange(0, 10)
        z = mx.sym.zeros((2, 3))
        r = mx.sym.random.uniform(shape=(2,))
        out = mx.sym.Group([a, z, r])
        assert out.infer_type()[1] == [np.float32] * 3
        assert mx.nd.arange(0, 3).dtype == np.float32


def test_symbol_api_with_auto_created_weights():
    with gluon_amp.autocast("float16"):
        data = mx.sym.var("data")
        fc = mx.sym.FullyConnected(data, num_hidden=4, name="fc")
        out = mx.sym.softmax(fc)
    assert set(fc.list_arguments()) == {"data", "fc_weight", "fc_bias"}
    # parameters stay float32 (master copies); the cast sits between them and the op
    types = dict(data=np.float32, fc_weight=np.float32, fc_bias=np.float32)
    internals = fc.get_internals()
    got = dict(zip(internals.list_outputs(), internals.infer_type(**types)[1]))
    assert got["fc_output"] == np.float16
    assert out.infer_type(**types)[1] == [np.float32]


def test_warns_about_graph_cached_before_init():
    net = make_net()
    net(mx.nd.ones((1, 3, 8, 8)))
    with pytest.warns(RuntimeWarning, match="hybridize"):
        gluon_amp.init("bfloat16")
    gluon_amp.disable()
    net.hybridize()  # drops the cache: no warning any more
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gluon_amp.init("bfloat16")
    assert not [w for w in caught if "cached their graph" in str(w.message)]


@pytest.mark.bf16_kernels
def test_keep_batchnorm_fp32_graph_runs():
    with gluon_amp.autocast("bfloat16", keep_batchnorm_fp32=True):
        net = make_net()
        out = net(mx.nd.ones((2, 3, 8, 8)))
        assert out.dtype == np.float32


def _conv_prelu_net():
    from mxnet.gluon import nn
    mx.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, in_channels=3), nn.PReLU(), nn.Dense(2, in_units=144))
    net.initialize(mx.init.Xavier())
    return net


def test_prelu_after_low_precision_conv_types_in_a_training_graph():
    """A neutral op whose parameter must match its data (PReLU's slope) follows the conv."""
    with gluon_amp.autocast("float16"):
        sym = _conv_prelu_net()(mx.sym.var("data"))
    internals = sym.get_internals()
    arg_types, out_types, _ = internals.infer_type(data=np.float32)
    types = dict(zip(internals.list_outputs(), out_types))
    prelu = next(n for n in types if n.endswith("leakyrelu0_fwd_output") or "prelu" in n and n.endswith("_output"))
    assert types[prelu] == np.float16
    assert all(t == np.float32 for t in arg_types)   # parameters stay float32 master copies
    assert "amp_multicast" in sym.tojson(remove_amp_cast=False)


@pytest.mark.bf16_kernels
def test_prelu_after_conv_runs_imperatively_in_bf16():
    x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
    ref = _conv_prelu_net()(x).asnumpy()
    with gluon_amp.autocast("bfloat16"):
        out = _conv_prelu_net()(x)
    # bfloat16 has no PReLU kernel in MXNet 1.9.1: the table runs it in float32 after the conv
    np.testing.assert_allclose(mx.nd.amp_cast(out, dtype="float32").asnumpy(), ref, rtol=5e-2, atol=5e-2)


def test_loss_output_op_gets_the_loss_scale_in_grad_scale():
    from mxnet import autograd, gluon
    w = gluon.Parameter("w_lo", shape=(2, 3))
    w.initialize(mx.init.Constant(0.1))
    x, y = mx.nd.array([[1.0, 2.0, 3.0]]), mx.nd.array([1.0])

    def grad(amp):
        trainer = gluon.Trainer([w], "sgd", {"learning_rate": 1.0}, update_on_kvstore=False)
        if amp:
            gluon_amp.init_trainer(trainer, LossScaler(init_scale=8.0))
        with autograd.record():
            out = mx.nd.SoftmaxOutput(mx.nd.dot(x, w.data(), transpose_b=True), y)
            out.backward()
        return w.grad().asnumpy()

    plain = grad(False)
    with gluon_amp.autocast("float16"):
        scaled = grad(True)
    np.testing.assert_allclose(scaled, 8.0 * plain, rtol=1e-6)


def test_neutral_normalisation_ops_are_not_wrapped():
    """Their parameters stay float32 by design, so there is nothing to make agree."""
    originals = (mx.sym.BatchNorm, mx.nd.BatchNorm, mx.sym.contrib.BatchNormWithReLU)
    with gluon_amp.autocast("float16"):
        assert (mx.sym.BatchNorm, mx.nd.BatchNorm, mx.sym.contrib.BatchNormWithReLU) == originals
