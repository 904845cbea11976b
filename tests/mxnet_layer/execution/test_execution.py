"""Execution attaches where MXNet binds a graph (issue 36): Module, BucketingModule,
Symbol.bind/simple_bind and a block's CachedOp run the plan natively, emulated, or refuse it
with gluon_amp's error; the plan itself (a block's cached graph, the user's Symbol, an export)
never holds the emulation."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx

from gluon_amp import runtime
from gluon_amp_core.emulate import ROUND_SUFFIX
from helpers import make_net

DTYPES = ["float16", "bfloat16"]
#: Module training, 10 steps of SGD on a small MLP: each step's cross-entropy emulated is
#: within this (absolute) of FP32's. Measured on an AVX2 host: at most 8.2e-5 (float16) and
#: 4.9e-4 (bfloat16), so 0.05 is a loose bound (about 100x); both are 0 when nothing is
#: emulated, so the test also checks that they differ.
LOSS_TOLERANCE = 0.05


def _mlp():
    data, label = mx.sym.var("data"), mx.sym.var("softmax_label")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=16, name="fc1"), act_type="relu")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=2, name="fc2"), label, name="softmax")


def _batches(n=10, batch=16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n * batch, 8).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("float32")
    return [mx.io.DataBatch([mx.nd.array(x[i * batch:(i + 1) * batch])],
                            [mx.nd.array(y[i * batch:(i + 1) * batch])]) for i in range(n)]


def _module_losses(sym, batches, loss_scale=None):
    """Ten SGD steps of a Module; the cross-entropy of each step's forward pass. ``loss_scale``:
    the Module's loss scaler (under ``init`` a Module gets the dynamic one by default, whose
    first float16 steps overflow and are skipped; this test is about execution, not scaling)."""
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.bind(data_shapes=[("data", (16, 8))], label_shapes=[("softmax_label", (16,))])
    mx.random.seed(3)
    mod.init_params(mx.init.Xavier(magnitude=2.0))
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.5})
    if loss_scale is not None:
        gluon_amp.init_trainer(mod, loss_scale)
    losses = []
    for b in batches:
        mod.forward_backward(b)
        mod.update()
        prob = mod.get_outputs()[0].asnumpy()
        label = b.label[0].asnumpy().astype(int)
        losses.append(float(-np.log(prob[np.arange(len(label)), label] + 1e-12).mean()))
    return np.array(losses)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_trains_emulated_close_to_fp32(dtype):
    batches = _batches()
    fp32 = _module_losses(_mlp(), batches)
    gluon_amp.init(target_dtype=dtype, emulate=True)
    sym = _mlp()  # built under init: the plan's casts to the target
    before = sym.tojson(remove_amp_cast=False)
    emu = _module_losses(sym, batches, loss_scale=1.0)
    assert np.isfinite(emu).all()
    assert np.abs(emu - fp32).max() < LOSS_TOLERANCE, (emu, fp32)
    assert not np.array_equal(emu, fp32)  # rounded to the target: not FP32's run
    assert emu[-1] < emu[0]
    assert sym.tojson(remove_amp_cast=False) == before  # the user's Symbol is the plan still


def _conv_model():
    data = mx.sym.var("data")
    sym = mx.sym.Convolution(data, num_filter=4, kernel=(3, 3), name="conv")
    rng = np.random.RandomState(1)
    args = {"conv_weight": mx.nd.array(rng.randn(4, 4, 3, 3) * 0.3), "conv_bias": mx.nd.array(rng.randn(4) * 0.1)}
    return sym, args


def _fp32_conv(sym, args, x):
    ex = sym.bind(mx.cpu(), {"data": x, **args}, grad_req="null")
    return ex.forward()[0].asnumpy()


def _is_bf16(values):
    return not (np.asarray(values, dtype=np.float32).view(np.uint32) & 0xFFFF).any()


def test_simple_bind_of_a_convert_model_bfloat16_result_runs_emulated():
    """MXNet's imagenet_inference.py pattern under --emulate: convert_model to bfloat16 (its
    parameters stored in bfloat16), then an executor and a Module bound from the result."""
    sym, args = _conv_model()
    x = mx.nd.array(np.random.RandomState(2).randn(2, 4, 8, 8))
    ref = _fp32_conv(sym, args, x)
    gluon_amp.init(target_dtype="bfloat16", emulate=True)
    s, a, aux = gluon_amp.convert_model(sym, args, {}, target_dtype="bfloat16", cast_optional_params=True)
    assert gluon_amp.mxnet_internals.FLOAT_NAMES.get(a["conv_weight"].dtype) == "bfloat16"  # the plan's
    ex = s.simple_bind(mx.cpu(), data=x.shape, grad_req="null")
    ex.copy_params_from(a, aux)
    out = ex.forward(data=x)[0].asnumpy()
    assert np.isfinite(out).all() and _is_bf16(out) and not _is_bf16(ref)
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    mod = mx.mod.Module(s, data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", x.shape)], for_training=False)
    mod.set_params(a, aux)  # bfloat16 arrays copied into the executor's
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    assert np.array_equal(mod.get_outputs()[0].asnumpy(), out)


def test_a_convert_model_result_asked_emulated_runs_emulated_when_bound_without_init():
    sym, args = _conv_model()
    x = mx.nd.array(np.random.RandomState(2).randn(2, 4, 8, 8))
    ref = _fp32_conv(sym, args, x)
    s, a, aux = gluon_amp.convert_model(sym, args, {}, target_dtype="float16", emulate=True)
    assert not any(ROUND_SUFFIX in n["name"] for n in json.loads(s.tojson(remove_amp_cast=False))["nodes"])
    mod = mx.mod.Module(s, data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", x.shape)], for_training=False)
    mod.set_params(a, aux)
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    out = mod.get_outputs()[0].asnumpy()
    with np.errstate(over="ignore"):
        assert np.array_equal(out.astype(np.float16).astype(np.float32), out)
    assert np.abs(out - ref).max() < 5e-3 * np.abs(ref).max() and not np.array_equal(out, ref)


def _plain_mxnet(code):
    """Run ``code`` in a fresh process that imports MXNet and not gluon_amp."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_emulated_block_keeps_its_plan_and_exports_it(dtype, tmp_path):
    """The block's cached graph, what export and the converters read, is the plan: no
    rounding node; its export loads in plain MXNet (and runs there where its dtypes run)."""
    x = mx.nd.random.normal(shape=(2, 3, 8, 8))
    gluon_amp.init(target_dtype=dtype, emulate=True)
    net = make_net()
    y = net(x).asnumpy()
    assert np.isfinite(y).all()
    graph = json.loads(net._cached_graph[1].tojson(remove_amp_cast=False))
    assert not [n["name"] for n in graph["nodes"] if ROUND_SUFFIX in n["name"] or n["op"] == "_gluon_amp_round"]
    assert {n["op"] for n in graph["nodes"]} & {"amp_cast", "amp_multicast"}  # the plan's casts
    ran = json.loads(gluon_amp.execution.executed_graph(net).tojson(remove_amp_cast=False))
    assert any(ROUND_SUFFIX in n["name"] for n in ran["nodes"])  # what the CachedOp ran
    converted = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, fuse=False)  # issue 36, defect 3
    assert np.isfinite(converted(x).asnumpy()).all()
    net.export(str(tmp_path / "m"), 0)
    saved = json.load(open(tmp_path / "m-symbol.json"))
    assert not [n["name"] for n in saved["nodes"] if ROUND_SUFFIX in n["name"] or n["op"] == "_gluon_amp_round"]
    runs = runtime.executable(dtype, "cpu")
    out = _plain_mxnet(f"""if True:
        import mxnet as mx, numpy as np
        sym = mx.sym.load({str(tmp_path / 'm-symbol.json')!r})
        params = mx.nd.load({str(tmp_path / 'm-0000.params')!r})
        arg_types, _, _ = sym.infer_type(data="float32")
        assert arg_types is not None
        if {runs!r}:
            net = mx.gluon.SymbolBlock.imports({str(tmp_path / 'm-symbol.json')!r}, ["data"],
                                               {str(tmp_path / 'm-0000.params')!r})
            assert np.isfinite(net(mx.nd.ones((2, 3, 8, 8))).asnumpy()).all()
        print("loaded", len(params))
    """)
    assert "loaded" in out


def test_binding_leaves_the_users_symbol_unchanged_and_runs_emulated():
    gluon_amp.init(target_dtype="bfloat16", emulate=True)
    data = mx.sym.var("data")
    sym = mx.sym.FullyConnected(data, num_hidden=5, name="fc")
    before = sym.tojson(remove_amp_cast=False)
    rng = np.random.RandomState(4)
    arrays = {"data": mx.nd.array(rng.randn(3, 7)), "fc_weight": mx.nd.array(rng.randn(5, 7)),
              "fc_bias": mx.nd.array(rng.randn(5))}
    ex = sym.bind(mx.cpu(), [arrays[n] for n in sym.list_arguments()], grad_req="null")
    out = ex.forward()[0].asnumpy()
    ex2 = sym.simple_bind(mx.cpu(), data=(3, 7), grad_req="null")
    ex2.copy_params_from({k: v for k, v in arrays.items() if k != "data"})
    out2 = ex2.forward(data=arrays["data"])[0].asnumpy()
    assert sym.tojson(remove_amp_cast=False) == before
    assert _is_bf16(out) and np.array_equal(out, out2)
    gluon_amp.disable()
    assert mx.sym.Symbol.bind is gluon_amp.mxnet_internals.gluon._BIND or \
        gluon_amp.execution.hooks_held.holders == {"converted"}


def test_a_module_binding_a_plan_the_host_cannot_run_raises_gluon_amps_error():
    dtype = next(d for d in ("float16", "bfloat16") if not runtime.executable(d, "cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # init says the target cannot execute here
        gluon_amp.init(target_dtype=dtype)
    mod = mx.mod.Module(_mlp(), context=mx.cpu())
    with pytest.raises(RuntimeError, match="emulate=True") as err:
        mod.bind(data_shapes=[("data", (16, 8))], label_shapes=[("softmax_label", (16,))])
        mod.init_params()
        mod.forward(_batches(1)[0], is_train=False)
        mod.get_outputs()[0].asnumpy()
    assert "MXNetError" not in type(err.value).__name__


def test_a_converted_symbol_the_host_cannot_run_binds_and_its_forward_raises_gluon_amps_error():
    """Without ``init``: ``convert_model`` for a dtype this CPU cannot run (float16 on any CPU)
    binds in a Module (shapes and types read as MXNet gives them), and its first forward, after
    a reshape too, raises gluon_amp's error naming ``emulate=True``, not MXNet's."""
    dtype = next(d for d in ("float16", "bfloat16") if not runtime.executable(d, "cpu"))
    mod = mx.mod.Module(_mlp(), context=mx.cpu())
    mod.bind(data_shapes=[("data", (16, 8))], label_shapes=[("softmax_label", (16,))])
    mod.init_params(mx.init.Xavier())
    args, aux = mod.get_params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter warns that the dtype cannot execute here
        sym, args, aux = gluon_amp.convert_model(_mlp(), args, aux, target_dtype=dtype)
    ex = sym.simple_bind(mx.cpu(), data=(16, 8), grad_req="null")
    assert [o.shape for o in ex.outputs] == [(16, 2)]
    runs = [lambda: ex.forward(data=mx.nd.ones((16, 8)))[0].asnumpy()]
    conv = mx.mod.Module(sym, context=mx.cpu())
    conv.bind(data_shapes=[("data", (16, 8))], label_shapes=[("softmax_label", (16,))], for_training=False)
    conv.set_params(args, aux)
    batch = _batches(1)[0]
    runs.append(lambda: (conv.forward(batch, is_train=False), conv.get_outputs()[0].asnumpy()))
    runs.append(lambda: (conv.reshape(data_shapes=[("data", (8, 8))], label_shapes=[("softmax_label", (8,))]),
                         conv.forward(_batches(1, batch=8)[0], is_train=False), conv.get_outputs()[0].asnumpy()))
    for run in runs:
        with pytest.raises(RuntimeError, match="emulate=True") as err:
            run()
        assert not isinstance(err.value, mx.base.MXNetError) and str(err.value).startswith("gluon_amp")
        mx.nd.waitall()  # nothing of MXNet's is left deferred for the next test


def _bucket_sym(key):
    data, label = mx.sym.var("data"), mx.sym.var("softmax_label")
    h = mx.sym.FullyConnected(data, num_hidden=6, flatten=False, name="proj")  # (N, key, 6)
    pooled = mx.sym.mean(mx.sym.Activation(h, act_type="tanh"), axis=1)
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(pooled, num_hidden=2, name="head"), label, name="softmax")
    return out, ("data",), ("softmax_label",)


def _bucketing_run():
    mod = mx.mod.BucketingModule(_bucket_sym, default_bucket_key=5, context=mx.cpu())
    mod.bind(data_shapes=[("data", (4, 5, 3))], label_shapes=[("softmax_label", (4,))])
    mx.random.seed(5)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    if gluon_amp.is_enabled():  # a static scale of 1: this test is about execution, not loss scaling
        gluon_amp.init_trainer(mod, 1.0)
    rng = np.random.RandomState(6)
    outs = []
    for key in (5, 3, 5):
        batch = mx.io.DataBatch([mx.nd.array(rng.randn(4, key, 3))], [mx.nd.array(rng.randint(0, 2, 4))],
                                bucket_key=key, provide_data=[mx.io.DataDesc("data", (4, key, 3))],
                                provide_label=[mx.io.DataDesc("softmax_label", (4,))])
        mod.forward_backward(batch)
        mod.update()
        outs.append(mod.get_outputs()[0].asnumpy())
    grads = [g.asnumpy() for g in mod._curr_module._exec_group.grad_arrays[0]]
    return outs, grads


def test_bucketing_module_runs_emulated_float16_for_two_bucket_keys():
    ref, _ = _bucketing_run()
    gluon_amp.init(target_dtype="float16", emulate=True)
    outs, grads = _bucketing_run()
    assert all(np.isfinite(o).all() for o in outs) and all(np.isfinite(g).all() for g in grads)
    assert all(np.abs(o - r).max() < 1e-2 for o, r in zip(outs, ref))
    assert any(not np.array_equal(o, r) for o, r in zip(outs, ref))
