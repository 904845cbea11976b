"""Conversion defaults fall back, never crash: an optional step on by default (oneDNN fusion,
batch-norm folding for it, tuning) that fails on a graph running unfused is left out, and
``report`` says why, once; asked for explicitly, it raises naming the fallback."""
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import mxnet as mx

import gluon_amp as amp
from gluon_amp.convert import api as convert_api
from helpers import cnn, import_gluoncv, no_bf16_env

# GluonCV's NASNet breaks MXNet 1.9.1's oneDNN conv fusion in float32 as in bfloat16
# ("Error in operator sg_mkldnn_conv_24: ... Shape inconsistent, Provided = [11], inferred
# shape=(11,96,1,1)"), while the same graph runs unfused.
_NASNET = """
import json, sys, warnings
import numpy as np, mxnet as mx, gluoncv, gluon_amp as amp
fuse = json.loads(sys.argv[1])
mx.random.seed(0)
net = gluoncv.model_zoo.get_model("nasnet_4_1056", pretrained=False)
net.initialize(mx.init.MSRAPrelu())
net.hybridize()
x = mx.nd.array(np.random.default_rng(0).normal(0, 1, size=(1, 3, 224, 224)))
first = lambda y: y[0] if isinstance(y, (list, tuple)) else y
ref = first(net(x)).asnumpy()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    low = amp.convert_hybrid_block(net, fuse=fuse)
    fused = low.fuse_backend
    try:
        out = low(x)
    except RuntimeError as e:
        print(json.dumps({"raised": str(e), "fused": fused}))
        sys.exit(0)
    out = first(out).astype("float32").asnumpy()
    first(low(x)).wait_to_read()
    low.hybridize()
    first(low(x)).wait_to_read()
print(json.dumps({"fused": fused, "now": low.fuse_backend, "rel": float(np.abs(out - ref).max() / np.abs(ref).max()),
                  "fallbacks": list(amp.report(low).fallbacks), "printed": str(amp.report(low)).count("fallback:"),
                  "warned": sum("fusion fails" in str(w.message) for w in seen)}))
"""


def _nasnet_without_bf16(fuse):
    """NASNet converted with the defaults in a process without bfloat16 kernels (an AVX2 host,
    on any CPU): the plan is float32, fused by default."""
    r = subprocess.run([sys.executable, "-c", _NASNET, json.dumps(fuse)], capture_output=True, text=True,
                       env=no_bf16_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_default_conversion_runs_nasnet_unfused_where_fusion_fails():
    got = _nasnet_without_bf16(None)
    assert got["fused"] == "MKLDNN"  # the default fuses on this CPU ...
    assert got["rel"] < 1e-5          # ... and the result is the FP32 model's, run unfused
    assert got["now"] is None         # a later hybridize() stays unfused
    assert len(got["fallbacks"]) == 1 and "fusion fails" in got["fallbacks"][0], got["fallbacks"]
    assert "Shape inconsistent" in got["fallbacks"][0] and "fuse=False" in got["fallbacks"][0]
    assert got["printed"] == 1 and got["warned"] == 1  # said once, over three calls


def test_explicit_fuse_raises_naming_the_fallback_where_fusion_fails():
    got = _nasnet_without_bf16(True)
    assert got["fused"] == "MKLDNN"
    assert "fuse=False" in got["raised"] and "fusion" in got["raised"], got["raised"]


@pytest.mark.bf16_kernels
def test_nasnet_converted_to_bfloat16_natively_with_the_defaults():
    """The reproduction of issue 47 (nasnet_fused_convert_crash.py), on bfloat16 kernels."""
    gluoncv = import_gluoncv()
    mx.random.seed(0)
    net = gluoncv.model_zoo.get_model("nasnet_4_1056", pretrained=False)
    net.initialize(mx.init.MSRAPrelu())
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.array(np.random.default_rng(0).normal(0, 1, size=(2, 3, 224, 224)))
    ref = net(x)[0].asnumpy()  # NASNet returns a list
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        low = amp.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu())
        out = low(x)[0]
    assert out.dtype == np.float32  # a float32 head, as FP32 gives
    rel = float(np.abs(out.asnumpy() - ref).max() / np.abs(ref).max())
    assert rel < 0.05, rel  # bfloat16's error, not a wrong graph
    rep = amp.report(low)
    assert rep.totals_by_dtype.get("bfloat16", 0) > 100  # converted, not FP32 run unfused
    assert len(rep.fallbacks) == 1 and "MKLDNN fusion fails" in rep.fallbacks[0]


def _small_net():
    net = cnn(seed=0)
    x = mx.nd.array(np.random.default_rng(0).normal(0, 1, size=(2, 1, 8, 8)))
    return net, x, net(x).asnumpy()


def test_an_error_unfused_too_is_raised_as_it_is_without_a_fallback():
    """A call that fails unfused as well (a wrong input shape) is not fusion's failure: MXNet's
    error comes out, and the block stays fused."""
    net, x, _ = _small_net()
    low = amp.convert_hybrid_block(net, fuse=True, emulate=False)
    assert low.fuse_backend == "MKLDNN"
    with pytest.raises(mx.base.MXNetError):
        low(mx.nd.ones((2, 5, 8, 8)))
    assert low.amp_fallbacks == () and low.fuse_backend == "MKLDNN"
    low(x).wait_to_read()
    assert amp.report(low).fallbacks == ()


def _failing(*_a, **_k):
    raise RuntimeError("planted failure")


@pytest.mark.bf16_kernels  # tuning times a native plan (never an emulated one)
def test_tuning_that_fails_leaves_the_plan_untuned_and_says_why(monkeypatch):
    net, x, _ = _small_net()
    sym = net._cached_graph[1]
    params = {p.name: p.data() for p in net.collect_params().values()}
    args = {k: v for k, v in params.items() if k in sym.list_arguments()}
    aux = {k: v for k, v in params.items() if k in sym.list_auxiliary_states()}
    monkeypatch.setattr(convert_api, "tune_graph", _failing)
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)  # the suite's default is off: here, the real default
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, *_ = amp.convert_model(sym, args, aux, "bfloat16", input_shapes={"data": (2, 1, 8, 8)})
    fallbacks = amp.report(out).fallbacks
    assert len(fallbacks) == 1 and "planted failure" in fallbacks[0] and "tune=False" in fallbacks[0]
    assert sum("planted failure" in str(w.message) for w in seen) == 1
    assert amp.report(out).totals_by_dtype.get("bfloat16", 0) > 0  # the plan, untuned
    with pytest.raises(RuntimeError, match="tune=False"):
        amp.convert_model(sym, args, aux, "bfloat16", tune=True, input_shapes={"data": (2, 1, 8, 8)})


@pytest.mark.bf16_kernels
def test_batch_norm_folding_that_fails_runs_unfused(monkeypatch):
    net, x, ref = _small_net()
    monkeypatch.setattr(convert_api, "fold_batch_norm", _failing)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        low = amp.convert_hybrid_block(net, "bfloat16")
    assert low.fuse_backend is None
    assert [f for f in amp.report(low).fallbacks if "planted failure" in f] == list(low.amp_fallbacks)
    assert len(low.amp_fallbacks) == 1 and sum("planted failure" in str(w.message) for w in seen) == 1
    out = low(x).asnumpy()
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
    with pytest.raises(RuntimeError, match="fuse=False"):
        amp.convert_hybrid_block(net, "bfloat16", fuse=True)
