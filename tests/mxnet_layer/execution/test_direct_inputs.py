"""No node gluon_amp adds changes how MXNet runs an op it leaves in float32 (issue 41, item 4).

MXNet 1.9.1's oneDNN deconvolution backward crashes the process (SIGSEGV) when its weight's
gradient does not go straight into the parameter's: the weight is any op's output (even
``w * 1.0`` or an ``amp_cast`` to float32), or another reader of the parameter takes a gradient
too. :data:`gluon_amp_core.emulate.DIRECT_INPUTS` lists the op inputs so read; these tests check
that list against plain MXNet, and that a ``Conv2D -> Conv2DTranspose`` trains in every mode
and API where FP32 does. Each run is a fresh process: a crash fails the test, not pytest.

Run as a script, this file is the worker: ``plain OP SLOT VARIANT`` (plain MXNet, no gluon_amp)
or ``train MODE`` (gluon_amp's APIs on the network).
"""
import json
import math
import os
import subprocess
import sys

import pytest

#: op -> (attributes, input shapes, parameter inputs), for the ops with parameter inputs a
#: plan can hold in float32 (and Convolution/FullyConnected, which it holds low)
CASES = {
    "Convolution": (dict(kernel=(3, 3), pad=(1, 1), num_filter=8), dict(data=(4, 8, 10, 10)), ["weight", "bias"]),
    "Deconvolution": (dict(kernel=(2, 2), stride=(2, 2), num_filter=32, no_bias=False),
                      dict(data=(16, 8, 14, 14)), ["weight", "bias"]),
    "FullyConnected": (dict(num_hidden=16), dict(data=(4, 32)), ["weight", "bias"]),
    "BatchNorm": (dict(fix_gamma=False), dict(data=(4, 8, 6, 6)), ["gamma", "beta"]),
    "Embedding": (dict(input_dim=20, output_dim=8), dict(data=(4, 5)), ["weight"]),
    "LayerNorm": ({}, dict(data=(4, 8, 6)), ["gamma", "beta"]),
    "InstanceNorm": ({}, dict(data=(4, 8, 6, 6)), ["gamma", "beta"]),
    "GroupNorm": (dict(num_groups=2), dict(data=(4, 8, 6, 6)), ["gamma", "beta"]),
    "LeakyReLU": (dict(act_type="prelu"), dict(data=(4, 8, 6, 6)), ["gamma"]),
    "RNN": (dict(state_size=8, num_layers=1, mode="lstm"), dict(data=(5, 4, 8)), ["parameters"]),
}
QUICK = {("Deconvolution", "weight"), ("Deconvolution", "bias")}
MODES = ["emulate_float16", "emulate_bfloat16"]  # "off" is FP32 itself: the reference run


def _run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice"}
    return subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _declared(op, slot):
    """The index of ``slot`` among ``op``'s declared inputs (MXNet's registry)."""
    import mxnet as mx  # noqa: F401  (gluon_amp first: the NumPy shim)
    from gluon_amp import mxnet_internals as mxi
    return list(mxi.op_infos()[op].inputs).index(slot)


@pytest.mark.parametrize("variant", ["through_op", "tied"])
@pytest.mark.parametrize("op,slot", [
    pytest.param(op, slot, marks=() if (op, slot) in QUICK else pytest.mark.slow)
    for op, (_, _, slots) in CASES.items() for slot in slots])
def test_direct_inputs_are_the_ones_plain_mxnet_cannot_train_through_an_op(op, slot, variant):
    """Plain MXNet, float32: the parameter read through ``w * 1.0`` (or also by a second op that
    takes its gradient) crashes training exactly where DIRECT_INPUTS says."""
    from gluon_amp_core.emulate import DIRECT_INPUTS
    r = _run("plain", op, slot, variant)
    listed = DIRECT_INPUTS.get(op) == _declared(op, slot)
    assert (r.returncode != 0) == listed, (op, slot, variant, r.returncode, r.stderr[-1500:])
    if not listed:
        assert "OK" in r.stdout


def _fp32_losses():
    r = _run("train", "fp32")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fp32_losses():
    return _fp32_losses()


@pytest.mark.parametrize("mode", MODES)
def test_conv_then_transposed_conv_trains_in_every_mode_and_api(mode, fp32_losses):
    """Hybridized, unhybridized, converted (convert_hybrid_block) and as a bound Symbol built
    under init: a few SGD steps run (no crash) and land near FP32's losses."""
    r = _run("train", mode)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = json.loads(r.stdout.strip().splitlines()[-1])
    bound = {"emulate_float16": 2e-2, "emulate_bfloat16": 5e-2}[mode]
    assert set(losses) == set(fp32_losses)
    for api, got in losses.items():
        want = fp32_losses[api]
        assert all(math.isfinite(v) for v in got), (api, got)
        assert all(abs(g - w) <= bound * max(abs(w), 1e-3) for g, w in zip(got, want)), (api, got, want)


@pytest.mark.bf16_kernels
def test_conv_then_transposed_conv_trains_in_native_bfloat16(fp32_losses):
    r = _run("train", "native_bfloat16")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = json.loads(r.stdout.strip().splitlines()[-1])
    for api, got in losses.items():
        want = fp32_losses[api]
        assert all(abs(g - w) <= 5e-2 * max(abs(w), 1e-3) for g, w in zip(got, want)), (api, got, want)


# -- the worker ----------------------------------------------------------------------------

def _plain(op, slot, variant):
    import faulthandler
    faulthandler.enable()
    import mxnet as mx
    S = mx.sym
    attrs, shapes, slots = CASES[op]
    inputs = {s: S.var(s) for s in slots}
    if op == "RNN":
        inputs.update(state=S.var("state"), state_cell=S.var("state_cell"))
    param = inputs[slot]
    if variant == "through_op":
        inputs[slot] = param * 1.0
    out = getattr(S, op)(S.var("data"), **inputs, **attrs)
    if len(out.list_outputs()) > 1:
        out = out[0]
    out = S.mean(out)
    if variant == "tied":  # a second reader of the parameter that takes a gradient
        out = S.broadcast_add(out, S.sum(param) * 1e-3)
    loss = S.MakeLoss(out)
    req = {n: "null" if n == "data" and op == "Embedding" else "write" for n in loss.list_arguments()}
    ex = loss.simple_bind(mx.cpu(), grad_req=req, **shapes)
    for k, arr in ex.arg_dict.items():
        if k == "data" and op == "Embedding":
            arr[:] = mx.nd.random.randint(0, 20, shape=arr.shape).astype("float32")
        else:
            mx.nd.random.uniform(-0.1, 0.1, shape=arr.shape).copyto(arr)
    for _ in range(2):
        ex.forward(is_train=True)
        ex.backward()
    mx.nd.waitall()
    print("OK")


class _Net:
    """Conv2D -> Conv2DTranspose, a few SGD steps from a fixed start."""

    @staticmethod
    def build(seed=0):
        import mxnet as mx
        from mxnet import gluon
        mx.random.seed(seed)
        net = gluon.nn.HybridSequential(prefix="net_")
        with net.name_scope():
            net.add(gluon.nn.Conv2D(16, 3, padding=1), gluon.nn.Conv2DTranspose(8, 2, strides=2))
        net.initialize(mx.init.Xavier())
        return net


def _steps(net, x, y, n=3):
    import mxnet as mx
    from mxnet import autograd, gluon
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    losses = []
    for _ in range(n):
        with autograd.record():
            loss = ((net(x).astype("float32") - y) ** 2).mean()
        loss.backward()
        trainer.step(1)
        losses.append(float(loss.asscalar()))
    mx.nd.waitall()
    return losses


def _symbol_steps(x, y, n=3):
    """The same network as a Symbol (built under init when one is on), bound with simple_bind."""
    import mxnet as mx
    S = mx.sym
    net = _Net.build()
    net(x)  # the initial parameters, as the blocks' runs have them
    h = S.Convolution(S.var("data"), S.var("w1"), S.var("b1"), kernel=(3, 3), pad=(1, 1), num_filter=16)
    h = S.Deconvolution(h, S.var("w2"), S.var("b2"), kernel=(2, 2), stride=(2, 2), num_filter=8, no_bias=False)
    loss = S.MakeLoss(S.mean(S.square(h - S.var("label"))))
    params = [p.data() for p in net.collect_params().values()]
    ex = loss.simple_bind(mx.cpu(), data=x.shape, label=y.shape)
    for name, value in zip(["w1", "b1", "w2", "b2"], params):
        value.copyto(ex.arg_dict[name])
    x.copyto(ex.arg_dict["data"])
    y.copyto(ex.arg_dict["label"])
    losses = []
    for _ in range(n):
        ex.forward(is_train=True)
        ex.backward()
        losses.append(float(ex.outputs[0].asscalar()))
        for name in ["w1", "b1", "w2", "b2"]:
            ex.arg_dict[name][:] -= 0.05 * ex.grad_dict[name]
    mx.nd.waitall()
    return losses


def _train(mode):
    import faulthandler
    faulthandler.enable()
    import gluon_amp as amp
    import mxnet as mx
    if mode.startswith("emulate_"):
        amp.init(target_dtype=mode.split("_")[1], emulate=True)
    elif mode == "native_bfloat16":
        amp.init(target_dtype="bfloat16")
    mx.random.seed(1)
    x = mx.nd.random.uniform(shape=(4, 8, 6, 6))
    y = mx.nd.random.uniform(shape=(4, 8, 12, 12))
    out = {}
    for api in ("hybridized", "imperative", "converted"):
        net = _Net.build()
        if api != "imperative":
            net.hybridize()
        if api == "converted":
            net(x)
            if mode != "fp32" and mode != "off":
                net = amp.convert_hybrid_block(net, target_dtype=mode.split("_")[1],
                                               emulate=mode.startswith("emulate_"))
        out[api] = _steps(net, x, y)
    out["symbol"] = _symbol_steps(x, y)
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        _plain(*sys.argv[2:5])
    else:
        _train(sys.argv[2])
