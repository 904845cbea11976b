"""The simulated native-bfloat16 host itself (``runtime.simulate_native_bf16``, the
``native_host`` fixture): what it plants, that it runs on any CPU (AVX2 too), and that it
leaves nothing behind."""
import json
import os
import subprocess
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

import gluon_amp
from gluon_amp import execution, mxnet_internals as mxi, runtime
from gluon_amp.mxnet_internals import BFLOAT16, gluon as mxi_gluon
from gluon_amp_core.capability import Bf16
from helpers import ROOT, no_bf16_env


def _bf16(a):
    """float32 values of ``a`` rounded to bfloat16 (nearest even), with NumPy."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_the_simulation_plants_a_native_host_and_leaves_the_machine_as_it_was():
    before = runtime.capability()
    with runtime.simulate_native_bf16() as cap:
        assert cap.bf16 is Bf16.NATIVE and runtime.capability() is cap and "simulated" in cap.why
        assert runtime.simulated() and mxi.simulated_kernels_installed()
        assert "simulated" in execution.hooks_held.holders
        res = runtime.resolve(None, warn=False)
        assert res.dtype == "bfloat16" and res.speed.source == "cached"
        assert [t.fp32_ms for t in res.speed.timings] == [t.fp32_ms for t in runtime.SIMULATED_PROBE]
        sim_cache = runtime.timing_cache().path
    assert not runtime.simulated() and not mxi.simulated_kernels_installed()
    assert runtime.SIMULATE_ENV not in os.environ and "simulated" not in execution.hooks_held.holders
    assert runtime.capability() == before
    if before.bf16 is Bf16.NATIVE:  # planted figures never reach the machine's own cache
        assert runtime.timing_cache().path != sim_cache


def test_a_simulated_bfloat16_convolution_is_a_float32_one_rounded_with_native_dtypes_and_gradients():
    rng = np.random.RandomState(0)
    x32, w32 = rng.uniform(-1, 1, (2, 4, 6, 6)).astype("float32"), rng.uniform(-1, 1, (4, 4, 3, 3)).astype("float32")
    with runtime.simulate_native_bf16():
        x = mx.nd.amp_cast(mx.nd.array(x32), dtype=BFLOAT16)
        w = mx.nd.amp_cast(mx.nd.array(w32), dtype=BFLOAT16)
        x.attach_grad()
        with autograd.record():
            y = mx.nd.Activation(mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=4, no_bias=True), act_type="relu")
        y.backward()
        assert y.dtype == BFLOAT16 and x.grad.dtype == BFLOAT16
        got = mx.nd.amp_cast(y, dtype="float32").asnumpy()
        grad = mx.nd.amp_cast(x.grad, dtype="float32").asnumpy()
    ref = mx.nd.Convolution(mx.nd.array(_bf16(x32)), mx.nd.array(_bf16(w32)), kernel=(3, 3), num_filter=4,
                            no_bias=True).asnumpy()
    np.testing.assert_array_equal(got, np.maximum(_bf16(ref), 0))  # rounded once, at the kernel's output
    assert np.abs(grad).sum() > 0 and np.array_equal(grad, _bf16(grad))


def test_a_simulated_optimizer_update_writes_its_bfloat16_state_in_place():
    with runtime.simulate_native_bf16():
        w = mx.nd.amp_cast(mx.nd.ones((4,)), dtype=BFLOAT16)
        g = mx.nd.amp_cast(mx.nd.ones((4,)), dtype=BFLOAT16)
        mom = mx.nd.amp_cast(mx.nd.zeros((4,)), dtype=BFLOAT16)
        mx.nd.sgd_mom_update(w, g, mom, lr=0.5, momentum=0.9, out=w)
        assert w.dtype == BFLOAT16 and mom.dtype == BFLOAT16
        got = [mx.nd.amp_cast(a, dtype="float32").asnumpy().tolist() for a in (w, mom)]
    assert got == [[0.5] * 4, [-0.5] * 4]


def test_a_simulated_native_init_gives_native_dtypes_report_and_runs_the_graph_emulated():
    x = mx.nd.random.uniform(-1, 1, shape=(2, 4, 8, 8))
    with runtime.simulate_native_bf16():
        gluon_amp.init(target_dtype="bfloat16", tune=False)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(4, 3), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
                gluon.nn.MaxPool2D(), gluon.nn.Dense(3))
        net.initialize()
        imperative = net(x)
        with mxi_gluon._calls.inside():  # as a block inside another one gets it
            inner = net(x)
        assert inner.dtype == BFLOAT16  # as natively: the last op's bfloat16 output
        assert imperative.dtype == np.float32  # to the caller's float32 code (patching/outputs.py)
        net.hybridize()
        with autograd.record():
            out = net(x)
        out.backward()
        rows = {r.op: r.dtype for r in gluon_amp.report(net).rows}
        assert rows["Convolution"] == rows["FullyConnected"] == "bfloat16"
        assert out.dtype == np.float32 and not execution.runs_emulated(net)  # native, as reported
        assert execution.executed_graph(net) is not None  # what ran: the emulated copy
        assert np.isfinite(net[0].weight.grad().asnumpy()).all()
        gluon_amp.disable()
    with autograd.record():  # train mode, as above: batch statistics
        ref = net(x).asnumpy()
    assert np.abs(out.asnumpy() - ref).max() < 0.05


def test_a_subprocess_of_a_simulated_host_is_one_too_and_a_no_bf16_env_is_not(tmp_path):
    code = ("import json, gluon_amp; c = gluon_amp.runtime.capability(); print(json.dumps([c.bf16.value, "
            "gluon_amp.runtime.resolve(None, warn=False).dtype]))")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XDG_CACHE_HOME": str(tmp_path)}
    with runtime.simulate_native_bf16():
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**env, runtime.SIMULATE_ENV: os.environ[runtime.SIMULATE_ENV]})
        assert runtime.SIMULATE_ENV not in no_bf16_env()
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["native", "bfloat16"]
