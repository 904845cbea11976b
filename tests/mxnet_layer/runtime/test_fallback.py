"""Hosts without bfloat16 kernels, simulated on any CPU with DNNL_MAX_CPU_ISA=AVX2 in a subprocess."""
import json
import subprocess
import sys

from helpers import no_bf16_env

TUTORIAL_LOOP = r'''
import json, warnings
import numpy as np
import gluon_amp as amp
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    policy = amp.init()
    mx.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, in_channels=1), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(2))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    scaler = amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = mx.nd.random.uniform(shape=(4, 1, 6, 6)), mx.nd.array([0, 1, 0, 1])
    losses, before_poison = [], None
    for i in range(4):
        if i == 3:
            before_poison = [p.data().asnumpy().copy() for p in net.collect_params().values()
                             if p.grad_req != "null"]
        with autograd.record():
            loss = loss_fn(net(x), y).mean() * (float("inf") if i == 3 else 1.0)
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(1)
        losses.append(float(loss.asscalar()))
    after = [p.data().asnumpy() for p in net.collect_params().values() if p.grad_req != "null"]
    info = amp.runtime_info()
print(json.dumps({
    "losses": losses, "skipped": scaler.skipped_steps, "scale": scaler.loss_scale,
    "step_scale": trainer._amp_loss_scaler.loss_scale,
    "unchanged_on_skip": all(np.array_equal(a, b) for a, b in zip(before_poison, after)),
    "enabled": amp.is_enabled(), "policy_dtype": getattr(policy, "target_dtype", None),
    "out_dtype": str(net(x).dtype), "info": {k: info[k] for k in ("bf16", "default_target_dtype", "bf16_why")},
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                 and "gluon_amp" in str(w.message)],
}))
'''

EXPLICIT_TARGET = r'''
import json, warnings
import numpy as np
import gluon_amp as amp
import mxnet as mx
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    amp.init("bfloat16")
    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=4, name="fc")
    types = dict(zip(sym.get_internals().list_outputs(),
                     sym.get_internals().infer_type(data=np.float32, fc_weight=np.float32, fc_bias=np.float32)[1]))
print(json.dumps({"enabled": amp.is_enabled(), "fc": str(types["fc_output"]),
                  "warnings": [str(w.message) for w in caught if "gluon_amp" in str(w.message)]}))
'''

CONVERT_DEFAULT = r'''
import json, warnings
import numpy as np
import gluon_amp as amp
import mxnet as mx
from mxnet.gluon import nn
warnings.simplefilter("ignore")
mx.random.seed(0)
net = nn.HybridSequential()
net.add(nn.Conv2D(8, 3, in_channels=3), nn.BatchNorm(), nn.Activation("relu"), nn.Dense(4))
net.initialize(mx.init.Xavier())
net.hybridize()
x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
ref = net(x).asnumpy()
block = amp.convert_hybrid_block(net)
out = block(x)
block.export("CONVERTED", 0)
ops = [n["op"] for n in json.load(open("CONVERTED-symbol.json"))["nodes"]]
print(json.dumps({"backend": block.fuse_backend, "dtype": str(out.dtype), "ops": ops,
                  "max_rel": float(np.abs(out.asnumpy() - ref).max() / np.abs(ref).max())}))
'''


def _run(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=no_bf16_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tutorial_loop_runs_in_float32_with_one_warning():
    out = _run(TUTORIAL_LOOP)
    assert out["info"]["bf16"] == "none" and out["info"]["default_target_dtype"] == "float32"
    assert not out["enabled"] and out["policy_dtype"] == "float32" and out["out_dtype"].endswith("float32'>")
    off = [w for w in out["warnings"] if "mixed precision is off" in w]
    assert len(off) == 1 and len(out["warnings"]) == 1, out["warnings"]
    assert out["info"]["bf16_why"] in out["warnings"][0] and "float32" in out["warnings"][0]
    assert all(v == v and abs(v) < 1e6 for v in out["losses"][:3])
    # AMP is off: the steps are FP32's, neither scaled nor checked, so the inf step reaches the
    # weights as it does without AMP, and the (float16) scale is left as it was
    assert out["skipped"] == 0 and not out["unchanged_on_skip"]
    assert out["step_scale"] == 1.0 and out["scale"] == 2.0 ** 16


def test_explicit_bfloat16_is_announced_and_graphs_still_build():
    out = _run(EXPLICIT_TARGET)
    assert out["enabled"] and "bfloat16" in out["fc"]
    assert len(out["warnings"]) == 1 and "cannot execute" in out["warnings"][0]
    assert "conversion still work" in out["warnings"][0]


def test_converter_default_is_fused_float32_without_bf16_kernels(tmp_path):
    """It runs fused here; its export is the plain graph, as the FP32 block's (ONNX's exporter
    reads no _sg_mkldnn_* node)."""
    out = _run(CONVERT_DEFAULT.replace("CONVERTED", str(tmp_path / "c")))
    assert out["backend"] == "MKLDNN" and out["dtype"].endswith("float32'>")
    assert "Convolution" in out["ops"] and not {"_sg_mkldnn_conv", "amp_cast"} & set(out["ops"])
    assert out["max_rel"] < 1e-5  # MXNet's float32 fold is exact to rounding
