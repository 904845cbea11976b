"""A plan is a plain MXNet graph, and the converters read plans (issue 36: defects 1, 3, 4, 6, 7).

Checks that could crash the process (MXNet segfaults after a custom op's constructor raises)
run in a subprocess, so a crash fails the test instead of ending pytest.
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import mxnet as mx
import numpy as np
import pytest

import gluon_amp
from gluon_amp import runtime
from gluon_amp.type_inference import infer_dtypes
from helpers import make_net

from helpers import ROOT
DTYPES = ["float16", "bfloat16"]

_TWICE = '''
import mxnet as mx


class Twice(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0] * 2)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0] * 2)


@mx.operator.register("plan_seams_twice")
class TwiceProp(mx.operator.CustomOpProp):
    def __init__(self):  # a plain __init__: MXNet passes every node attribute as a keyword
        super().__init__(need_top_grad=True)

    def list_arguments(self): return ["x"]
    def list_outputs(self): return ["y"]
    def infer_shape(self, s): return s, [s[0]], []
    def infer_type(self, t): return t, [t[0]], []
    def create_operator(self, ctx, shapes, dtypes): return Twice()
'''


def _run(code, *args, launcher=None, timeout=300):
    """``code`` (after the custom op's definition) in a fresh ``python -c``, or, given
    ``launcher`` options, as a script under ``python -m gluon_amp.run``."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLUON_AMP_TUNE": "0"}
    script = "import gluon_amp\n" + _TWICE + textwrap.dedent(code)
    if launcher is None:
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=ROOT)
    with tempfile.TemporaryDirectory(prefix="plan-seams-") as folder:
        path = os.path.join(folder, "script.py")
        with open(path, "w") as f:
            f.write(script)
        cmd = [sys.executable, "-m", "gluon_amp.run", *launcher, path, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


_CONVERT_CUSTOM = '''
import sys, json
import numpy as np
import gluon_amp
from gluon_amp import runtime

x = mx.sym.var("data")
fc = mx.sym.FullyConnected(x, num_hidden=4, name="fc")
out = mx.sym.FullyConnected(mx.sym.Custom(fc, op_type="plan_seams_twice", name="c1"), num_hidden=2, name="head")
rng = np.random.RandomState(0)
args = {"fc_weight": mx.nd.array(rng.uniform(-1, 1, (4, 3))), "fc_bias": mx.nd.zeros(4),
        "head_weight": mx.nd.array(rng.uniform(-1, 1, (2, 4))), "head_bias": mx.nd.zeros(2)}
data = mx.nd.array(rng.uniform(-1, 1, (2, 3)))


def forward(sym, params):
    ex = sym.simple_bind(mx.cpu(), data=(2, 3), grad_req="null")
    for k, v in params.items():
        ex.arg_dict[k][:] = v.astype(ex.arg_dict[k].dtype)
    ex.arg_dict["data"][:] = data
    return ex.forward(is_train=False)[0].astype("float32").asnumpy()


ref = forward(out, args)
dtype, mode = sys.argv[1], sys.argv[2]
kw = {"target_dtype": dtype}
if mode == "emulated":  # the converters follow the emulated policy; the result runs emulated
    gluon_amp.init(target_dtype=dtype, emulate=True)
    kw = {}
conv = gluon_amp.convert_symbol(out, **kw)
csym, cargs, _ = gluon_amp.convert_model(out, args, {}, **kw)
for s in (conv, csym):
    nodes = json.loads(s.tojson(remove_amp_cast=False))["nodes"]
    assert "amp_cast" in {n["op"] for n in nodes}  # converted (in emulated mode: as the policy in force says)
    assert not [k for n in nodes for k in n.get("attrs", {}) if k.startswith("__amp_")], nodes
    assert s.infer_type(data="float32")[1] is not None  # type inference through the custom op
    s.simple_bind(mx.cpu(), data=(2, 3), grad_req="null")  # binding builds the custom op's prop
if mode == "emulated" or runtime.executable(dtype, "cpu"):
    got = forward(csym, cargs)
    assert np.abs(got - ref).max() < 5e-2 * (1 + np.abs(ref).max()), (got, ref)
print("ok", dtype, mode)
'''


@pytest.mark.parametrize("mode", ["plain", "emulated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_graph_with_a_plain_init_custom_op_converts_binds_and_runs(dtype, mode):
    """Defect 1: gluon_amp's attributes on the nodes reached the CustomOpProp's constructor:
    TypeError (``__amp_reason__``/``__amp_dtype__``), then a segfault."""
    assert f"ok {dtype} {mode}" in _ok(_run(_CONVERT_CUSTOM, dtype, mode))


_TRAIN_CUSTOM = '''
import sys
import numpy as np
from mxnet import autograd, gluon
import gluon_amp

gluon_amp.init(target_dtype=sys.argv[1], emulate=True)


class Net(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        self.fc = gluon.nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x):
        return F.Custom(self.fc(x), op_type="plan_seams_twice")


net = Net()
net.initialize()
net.hybridize()
tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
gluon_amp.init_trainer(tr)
for _ in range(2):
    with autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
        with gluon_amp.scale_loss(loss, tr) as scaled:
            autograd.backward(scaled)
    tr.step(2)
assert np.isfinite(loss.asscalar())
rep = gluon_amp.report(net)
assert sys.argv[1] in {r.dtype for r in rep.rows}, str(rep)
print("ok train", sys.argv[1])
'''


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_emulated_training_step_through_a_plain_init_custom_op(dtype):
    """Defect 1, emulation's side: the emulated graph's nodes carried ``__amp_dtype__``."""
    assert f"ok train {dtype}" in _ok(_run(_TRAIN_CUSTOM, dtype))


def _two_layer():
    data = mx.sym.var("data")
    conv = mx.sym.Convolution(data, num_filter=4, kernel=(3, 3), name="conv")
    return mx.sym.FullyConnected(conv, num_hidden=2, name="fc")


def _ops(sym):
    return {n["op"] for n in json.loads(sym.tojson(remove_amp_cast=False))["nodes"]}


@pytest.mark.parametrize("dtype", DTYPES)
def test_converters_without_target_dtype_follow_the_active_policy(dtype):
    """Defect 6: under init (or the launcher) converters used the machine's default."""
    policy = gluon_amp.init(target_dtype=dtype, emulate=True)
    sym = gluon_amp.convert_symbol(_two_layer())
    assert "amp_cast" in _ops(sym) and sym.amp_result.policy == policy
    assert sym.amp_result.reasons["conv"] == "low_precision"
    args = {"conv_weight": mx.nd.ones((4, 3, 3, 3)), "conv_bias": mx.nd.zeros(4),
            "fc_weight": mx.nd.ones((2, 64)), "fc_bias": mx.nd.zeros(2)}
    msym, _, _ = gluon_amp.convert_model(_two_layer(), args, {})
    assert "amp_cast" in _ops(msym) and msym.amp_result.policy.target_dtype == dtype
    net = make_net()
    net(mx.nd.ones((1, 3, 8, 8)))
    assert gluon_amp.convert_hybrid_block(net).amp_result.policy == policy
    gluon_amp.disable()
    off = gluon_amp.convert_symbol(_two_layer())  # no policy in force: the machine's default, as before
    assert off.amp_result.policy.target_dtype == gluon_amp.make_policy(None).target_dtype


def test_the_launchers_policy_reaches_a_converter_called_without_target_dtype():
    code = '''
import json
from mxnet.contrib import amp
data = mx.sym.var("data")
sym = mx.sym.FullyConnected(mx.sym.Convolution(data, num_filter=4, kernel=(3, 3), name="conv"), num_hidden=2)
out = amp.convert_symbol(sym)
print("amp_cast", "amp_cast" in {n["op"] for n in json.loads(out.tojson(remove_amp_cast=False))["nodes"]})
print("target", getattr(out, "amp_result", None) and out.amp_result.policy.target_dtype)
'''
    out = _ok(_run(code, launcher=("--emulate", "--target-dtype", "float16")))
    assert "amp_cast True" in out and "target float16" in out


_OWN_CAST = '''
import json
import numpy as np
import gluon_amp
from gluon_amp import runtime
from mxnet.gluon import nn

net = nn.HybridSequential()
net.add(nn.Conv2D(4, 3, in_channels=3), nn.Dense(2))
net.initialize()
net.hybridize()
x = mx.nd.ones((1, 3, 8, 8))
net(x)
out = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", cast_optional_params=True, ctx=mx.cpu())
print("converted", out.amp_result.param_dtypes)
'''


def test_the_converters_own_parameter_cast_is_never_refused_under_the_launcher():
    """Defect 7a: in the launcher's default mode a CPU without bfloat16 kernels refused the
    converter's own ``cast_optional_params`` cast as a script's GPU-only ``net.cast``."""
    out = _ok(_run(_OWN_CAST, launcher=("--no-tune",)))
    assert "'bfloat16'" in out.split("converted", 1)[1]


_RUN_F16 = '''
import gluon_amp
from mxnet.gluon import nn

net = nn.HybridSequential()
net.add(nn.Dense(4, in_units=3), nn.Dense(2, in_units=4))
net.initialize()
net.hybridize()
x = mx.nd.ones((2, 3))
net(x)
out = gluon_amp.convert_hybrid_block(net, target_dtype="float16", ctx=mx.cpu())
try:
    out(x).wait_to_read()
    print("ran")
except RuntimeError as e:
    print("gluon_amp error" if "emulate=True" in str(e) and "gluon_amp" in str(e) else "other error", str(e)[:300])
except mx.base.MXNetError as e:
    print("raw mxnet error", str(e)[:300])
'''


def test_a_float16_conversion_this_cpu_cannot_run_raises_gluon_amps_error():
    """Defect 7b: in the launcher's default mode, running an explicit float16 conversion failed
    with MXNet's ``FP16 gemm on cpu not implemented``, not gluon_amp's error naming emulate=True.
    (Execution checks attach where MXNet binds a graph: gluon_amp/execution.py.)"""
    out = _ok(_run(_RUN_F16, launcher=("--no-tune",)))
    if runtime.executable("float16", "cpu"):
        assert "ran" in out
    else:
        assert "gluon_amp error" in out, out


_LOAD_PLAIN = '''
import json, sys
import numpy as np
assert "gluon_amp" not in sys.modules
prefix, run = sys.argv[1], sys.argv[2] == "run"
text = open(prefix + "-symbol.json").read()
graph = json.loads(text)
assert not [n for n in graph["nodes"] if n["op"] == "_gluon_amp_round"]
assert not [k for n in graph["nodes"] for k in n.get("attrs", {}) if k.startswith("__amp_")]
sym = mx.sym.load(prefix + "-symbol.json")
assert sym.infer_type(data="float32")[1] is not None
if run:
    params = mx.nd.load(prefix + "-0000.params")
    x = mx.nd.array(np.load(prefix + "-x.npy"))
    ex = sym.simple_bind(mx.cpu(), data=x.shape, grad_req="null", type_dict={"data": "float32"})
    for k, v in params.items():
        ex.arg_dict.get(k[4:], ex.aux_dict.get(k[4:]))[:] = v
    ex.arg_dict["data"][:] = x
    np.save(prefix + "-out.npy", ex.forward(is_train=False)[0].astype("float32").asnumpy())
print("loaded", run)
'''


def _load_in_plain_mxnet(prefix, run):
    code = "import mxnet as mx\n" + _LOAD_PLAIN
    r = subprocess.run([sys.executable, "-c", code, prefix, "run" if run else "load"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(prefix + "-out.npy") if run else None


@pytest.mark.parametrize("target", ["same", "other", "policy", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_run_under_emulation_converts_exports_and_loads_without_gluon_amp(dtype, target, tmp_path):
    """Defects 3 and 4: converting a hybridized block after an emulated forward read the
    emulated graph (``_gluon_amp_round ... cannot be typed``), and its export needed gluon_amp.
    ``same``/``other``: an explicit target; ``policy``: none, under the emulated policy;
    ``none``: none, after ``disable`` (the machine's default: float32-only on a CPU without
    bfloat16 kernels, which then runs in plain MXNet)."""
    x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
    net = make_net(hybridize=False)
    ref = net(x).asnumpy()  # FP32
    net.hybridize()
    gluon_amp.init(target_dtype=dtype, emulate=True)
    net(x).wait_to_read()
    kw = {"same": {"target_dtype": dtype}, "other": {"target_dtype": {"float16": "bfloat16"}.get(dtype, "float16")},
          "policy": {}, "none": {}}[target]
    if target == "none":
        gluon_amp.disable()
    out = gluon_amp.convert_hybrid_block(net, ctx=mx.cpu(), fuse=False, **kw)
    want = kw.get("target_dtype") or (dtype if target == "policy" else gluon_amp.make_policy(None).target_dtype)
    assert out.amp_result.policy.target_dtype == want
    prefix = str(tmp_path / "net")
    out.export(prefix)
    np.save(prefix + "-x.npy", x.asnumpy())
    low = set(infer_dtypes(mx.sym.load(prefix + "-symbol.json"), {"data": "float32"}).values()) & set(DTYPES)
    if want == "float32":
        assert not low
    runs = all(runtime.executable(d, "cpu") for d in low)
    got = _load_in_plain_mxnet(prefix, runs)
    if runs:
        tol = 1e-4 if want == "float32" and not low else 5e-2
        assert np.abs(got - ref).max() <= tol * (1 + np.abs(ref).max()), np.abs(got - ref).max()
