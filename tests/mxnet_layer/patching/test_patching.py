import inspect
import json
import sys
import warnings

import numpy as np
import mxnet as mx
import pytest

import gluon_amp
from gluon_amp_core.dtypes import dtype_name
from gluon_amp import mxnet_internals as mxi
from gluon_amp.mxnet_internals import BFLOAT16
from gluon_amp import LossScaler
from helpers import import_gluoncv
from helpers import make_net


def _op_functions():
    """{(module name, attribute): function} and {id(function): (code, defaults, kwdefaults,
    attributes)} as they are now."""
    sites = {(m.__name__, a): f for m, a, f, _, _ in mxi.op_function_sites()}
    return sites, _state(sites)


def _state(sites):
    return {id(f): (f.__code__, f.__defaults__, f.__kwdefaults__, dict(vars(f))) for f in sites.values()}


def _attributes(sites):
    """The objects the module attributes of ``sites`` name now."""
    return {(m, a): getattr(sys.modules[m], a) for m, a in sites}


def test_disable_restores_every_original_object():
    sites, before = _op_functions()
    gluon_amp.init("bfloat16")
    record = gluon_amp.patched_functions()
    assert len(record) > 1000
    assert len({id(p.function) for p in record}) == len(record)  # one record per function
    assert all(p.function.__code__ is not before[id(p.function)][0] for p in record)
    assert _attributes(sites) == sites  # patched in place: the attributes name MXNet's objects
    gluon_amp.disable()
    assert _attributes(sites) == sites
    after = _state(sites)
    bad = [p.site for p in record
           if after[id(p.function)][0] is not before[id(p.function)][0]
           or after[id(p.function)] != before[id(p.function)]]
    assert not bad
    assert gluon_amp.patched_functions() == ()


def test_a_second_init_finds_every_function_again():
    gluon_amp.init("float16")
    first = {id(p.function) for p in gluon_amp.patched_functions()}
    # op_of_function reads a patched function through its original code
    assert {id(f) for _, _, f, _, _ in mxi.op_function_sites()} >= first
    gluon_amp.disable()
    gluon_amp.init("float16")
    assert {id(p.function) for p in gluon_amp.patched_functions()} == first


def test_failed_init_rolls_back(monkeypatch):
    from gluon_amp import patching
    _, state = _op_functions()
    real, calls = patching.wrapper_for, []

    def fail_late(*args, **kwargs):
        calls.append(1)
        if len(calls) == 500:
            raise KeyError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(patching, "wrapper_for", fail_late)
    with pytest.raises(KeyError):
        gluon_amp.init("float16")
    assert not gluon_amp.is_enabled()
    _, after = _op_functions()
    assert [k for k in state if after[k][0] is not state[k][0]] == []


def test_disable_leaves_a_function_someone_else_changed_and_says_so():
    gluon_amp.init("float16")
    p = next(p for p in gluon_amp.patched_functions() if p.function is mx.sym.Convolution)
    theirs = {"_gluon_amp_impl": lambda *a, **k: "theirs"}
    p.function.__kwdefaults__ = theirs
    try:
        with pytest.warns(RuntimeWarning, match="Convolution"):
            gluon_amp.disable()
        assert mx.sym.Convolution.__kwdefaults__ is theirs  # not clobbered
    finally:
        mxi.restore(p)
    assert "amp_cast" not in mx.sym.Convolution(mx.sym.var("d"), kernel=(1, 1), num_filter=1).tojson()


def test_references_taken_before_init_get_amp_and_keep_identity():
    from mxnet.ndarray import softmax as cap_softmax
    from mxnet.symbol import Convolution as cap_conv
    from mxnet.symbol.contrib import SyncBatchNorm as cap_sbn
    sig = inspect.signature(mx.nd.Convolution)
    code = cap_conv.__code__
    x = mx.nd.ones((2, 3), dtype="float16")

    def conv_json():
        return cap_conv(mx.sym.var("d"), kernel=(1, 1), num_filter=2, name="c").tojson(remove_amp_cast=False)

    with gluon_amp.autocast("float16"):
        assert cap_sbn is mx.sym.contrib.SyncBatchNorm and cap_conv is mx.sym.Convolution
        assert "amp_cast" in conv_json()
        assert cap_softmax(x).dtype == np.float32  # fp32 op, through the captured reference
        assert inspect.signature(mx.nd.Convolution) == sig
    assert "amp_cast" not in conv_json()
    assert cap_softmax(x).dtype == np.float16
    assert inspect.signature(mx.nd.Convolution) == sig
    gluon_amp.disable()  # the functions stay patched after a region until disable()
    assert cap_conv.__code__ is code


def test_captured_imperative_reference_runs_in_bfloat16(native_host):
    from mxnet.ndarray import Convolution as cap_nd
    x = mx.nd.random.uniform(shape=(1, 2, 4, 4))
    w = mx.nd.random.uniform(shape=(2, 2, 1, 1))
    with gluon_amp.autocast("bfloat16"):
        assert cap_nd(x, w, kernel=(1, 1), num_filter=2, no_bias=True).dtype == BFLOAT16
    assert cap_nd(x, w, kernel=(1, 1), num_filter=2, no_bias=True).dtype == np.float32


def test_gluoncv_fpn_syncbn_builds_under_init_after_importing_gluoncv(offline):
    """GluonCV imports SyncBatchNorm at import time and compares it with ``is`` later."""
    import_gluoncv()
    import gluoncv.nn.feature
    from gluoncv.model_zoo import get_model
    with gluon_amp.autocast("float16"):
        assert gluoncv.nn.feature.SyncBatchNorm is mx.sym.contrib.SyncBatchNorm
        net = get_model("faster_rcnn_fpn_syncbn_resnet50_v1b_coco", pretrained=False, pretrained_base=False)
        out = net(mx.sym.var("data"))
    sym = mx.sym.Group(list(out)) if isinstance(out, (list, tuple)) else out
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    keys = [n["attrs"]["key"] for n in nodes if n["op"] == "_contrib_SyncBatchNorm"]
    assert keys and len(set(keys)) == len(keys)
    assert any(n["op"] == "amp_cast" for n in nodes)
    assert sym.infer_type(data=np.float32)[1] is not None


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
    want = gluon_amp.runtime.resolve(None, warn=False).dtype  # capability and measured speed
    result = gluon_amp.init(None)
    if want == "float32":
        assert result.target_dtype == "float32" and not result.enabled and result.reason
        assert not gluon_amp.is_enabled()
    else:
        assert result.target_dtype == want and gluon_amp.is_enabled()


def test_autocast_scopes_patching():
    orig, code = mx.nd.Convolution, mx.nd.Convolution.__code__
    with gluon_amp.autocast("bfloat16") as table:
        assert table.target_dtype == "bfloat16"
        assert mx.nd.Convolution is orig and orig.__code__ is not code
    assert mx.nd.Convolution is orig and not gluon_amp.is_enabled()
    gluon_amp.disable()  # patched once, kept for the next region, put back here
    assert orig.__code__ is code and "__wrapped__" not in vars(orig)


def test_autocast_restores_on_error():
    code = mx.sym.FullyConnected.__code__
    with pytest.raises(KeyError):
        with gluon_amp.autocast("float16"):
            assert mx.sym.FullyConnected.__code__ is not code
            raise KeyError("boom")
    assert not gluon_amp.is_enabled()
    assert "amp_cast" not in mx.sym.FullyConnected(mx.sym.var("d"), num_hidden=2).tojson(remove_amp_cast=False)
    gluon_amp.disable()
    assert mx.sym.FullyConnected.__code__ is code


def test_imperative_casts(native_host):
    x = mx.nd.random.uniform(shape=(2, 4, 6, 6))
    w = mx.nd.random.uniform(shape=(4, 4, 3, 3))
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


def test_numpy_front_end_casts(native_host):
    x = mx.np.random.uniform(size=(2, 8))
    w = mx.np.random.uniform(size=(4, 8))
    with gluon_amp.autocast("bfloat16"):
        y = mx.npx.fully_connected(x, w, num_hidden=4, no_bias=True)
        # run in bfloat16, given back in float32: mx.np holds no bfloat16 (test_outputs.py)
        assert isinstance(y, mx.np.ndarray) and dtype_name(y.dtype) == "float32"
        assert not (y.asnumpy().view(np.uint32) & 0xFFFF).any()  # bfloat16 values
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


def test_warns_once_when_a_graph_cached_before_init_runs():
    net = make_net()
    x = mx.nd.ones((1, 4, 8, 8))
    net(x)
    gluon_amp.init("bfloat16", emulate=True)
    with pytest.warns(RuntimeWarning, match=f"{net.name}.*hybridize"):
        net(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(x)  # said once
        net.hybridize()  # drops the cache: rebuilt under AMP, no warning
        net(x)
    assert not [w for w in caught if "cached its graph" in str(w.message)]
    assert gluon_amp.report(net).emulated


def test_the_stale_warning_names_the_user_s_line_and_a_given_graph_s_way_out(tmp_path):
    """It named MXNet's block.py; and for a SymbolBlock loaded under init (GluonNLP's
    ``--deploy``) it said "before gluon_amp.init()" and advised ``hybridize()``, which traces
    the same given graph again: the converter is the way."""
    net = make_net()
    x = mx.nd.ones((1, 4, 8, 8))
    net(x)
    net.export(str(tmp_path / "m"), 0)
    gluon_amp.init("float16", emulate=True)
    with pytest.warns(RuntimeWarning, match="hybridize") as caught:
        net(x)
    assert [w.filename for w in caught if "cached its graph" in str(w.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = mx.gluon.SymbolBlock.imports(str(tmp_path / "m-symbol.json"), ["data"],
                                              str(tmp_path / "m-0000.params"))
    loaded.hybridize()
    with pytest.warns(RuntimeWarning, match="runs the graph it was given.*convert_hybrid_block") as caught:
        plain = loaded(x)
    assert [w.filename for w in caught if "given" in str(w.message)] == [__file__]
    converted = gluon_amp.convert_hybrid_block(loaded)  # the policy's float16, emulated
    assert gluon_amp.report(converted).totals_by_dtype.get("float16")
    np.testing.assert_allclose(converted(x).asnumpy(), plain.asnumpy(), rtol=1e-2, atol=1e-2)


def test_keep_batchnorm_fp32_graph_runs(native_host):
    with gluon_amp.autocast("bfloat16", keep_batchnorm_fp32=True):
        net = make_net()
        out = net(mx.nd.ones((2, 4, 8, 8)))
        assert out.dtype == np.float32


def _conv_prelu_net():
    from mxnet.gluon import nn
    mx.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, in_channels=4), nn.PReLU(), nn.Dense(2, in_units=144))
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


def test_prelu_after_conv_runs_imperatively_in_bf16(native_host):
    x = mx.nd.random.uniform(shape=(2, 4, 8, 8))
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
    fns = (mx.sym.BatchNorm, mx.nd.BatchNorm, mx.sym.contrib.BatchNormWithReLU)
    codes = [f.__code__ for f in fns]
    with gluon_amp.autocast("float16"):
        assert [f.__code__ for f in fns] == codes
        assert not {id(f) for f in fns} & {id(p.function) for p in gluon_amp.patched_functions()}
