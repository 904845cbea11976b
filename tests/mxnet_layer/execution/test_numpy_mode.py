"""MXNet's numpy mode (``npx.set_np()``, which d2l and every ``mx.np`` program turn on) under
gluon_amp (issue 41, item 5): hybridized blocks give ``mx.np`` arrays under every mode, ``init``
before or after ``set_np``; the converted block too, and its export imports in numpy mode; the
speed probe's own timing blocks run in numpy mode; the launcher runs a numpy-mode program.
``test_matrix.py`` has numpy mode as an axis; the native-bfloat16 cases run where the hardware
has the kernels (the hardware marker)."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon, npx

from gluon_amp import mxnet_internals as mxi
from gluon_amp.speed import probe
from gluon_amp.speed.timing import time_graphs, time_op
from helpers import ROOT

EMULATED = [{"target_dtype": "float16", "emulate": True}, {"target_dtype": "bfloat16", "emulate": True}]
IDS = ["emulated-float16", "emulated-bfloat16"]
#: emulated against FP32 on this small net: float16 within 1e-2, bfloat16 within 5e-2 of the
#: largest output (measured: 1e-3 and 8e-3)
RTOL = {"float16": 1e-2, "bfloat16": 5e-2}


@pytest.fixture
def numpy_mode():
    """Numpy mode for the test; MXNet's legacy mode again afterwards."""
    yield npx.set_np
    npx.reset_np()


def _net(seed=0):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="sigmoid"), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _x():
    return mx.np.array(np.random.RandomState(0).randn(4, 5).astype("float32"))


def _init(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gluon_amp.init(**kwargs)


def _fp32():
    with autograd.record():
        y = _net()(_x())
    return y.asnumpy()


@pytest.mark.parametrize("kwargs", EMULATED, ids=IDS)
@pytest.mark.parametrize("init_first", [False, True], ids=["set_np-then-init", "init-then-set_np"])
def test_a_hybridized_block_gives_numpy_arrays_in_every_emulated_mode(numpy_mode, kwargs, init_first):
    if init_first:  # the launcher's order
        _init(kwargs)
        numpy_mode()
        ref = None
    else:
        numpy_mode()
        ref = _fp32()
        _init(kwargs)
    net = _net()
    with autograd.record():
        y = net(_x())
    y.backward()
    assert isinstance(y, mx.np.ndarray) and y.dtype == np.float32 and y.shape == (4, 3)
    grads = [p.grad() for p in net.collect_params().values()]
    assert all(isinstance(g, mx.np.ndarray) and np.isfinite(g.asnumpy()).all() for g in grads)
    if ref is None:
        gluon_amp.disable()
        ref = _fp32()
    got = y.asnumpy()
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= RTOL[kwargs["target_dtype"]] * scale and not np.array_equal(got, ref)


def test_a_graph_gluon_amp_rebuilds_runs_in_the_block_s_frontend(numpy_mode):
    """Whatever graph the hooks hand MXNet (a plan rebuilt from JSON, an emulated copy), a
    numpy-mode block's CachedOp returns mx.np arrays, as its own graph would."""
    numpy_mode()
    rebuilt = lambda block, args, inputs, out: mx.sym.load_json(out.tojson())  # noqa: E731  legacy
    hooks = mxi.install_block_hooks(rebuilt, lambda block: None)
    try:
        y = _net()(_x())
    finally:
        mxi.remove_block_hooks(hooks)
    assert isinstance(y, mx.np.ndarray) and y.shape == (4, 3)


@pytest.mark.parametrize("kwargs", EMULATED, ids=IDS)
def test_convert_hybrid_block_of_a_numpy_mode_block_runs_and_its_export_imports(numpy_mode, kwargs, tmp_path):
    numpy_mode()
    net = _net()
    ref = net(_x()).asnumpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = gluon_amp.convert_hybrid_block(net, **kwargs)
    y = conv(_x())
    assert isinstance(y, mx.np.ndarray) and y.dtype == np.float32
    assert np.abs(y.asnumpy() - ref).max() <= RTOL[kwargs["target_dtype"]] * np.abs(ref).max()
    prefix = str(tmp_path / "m")
    conv.export(prefix)
    block = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    assert [n for n in json.load(open(prefix + "-symbol.json"))["nodes"] if n["op"] == "amp_cast"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init(**kwargs)  # the imported plan runs emulated under init, in numpy mode too
    z = block(_x())
    assert isinstance(z, mx.np.ndarray) and np.abs(z.asnumpy() - y.asnumpy()).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.parametrize("frontend", ["numpy", "legacy"])
def test_a_block_that_ran_under_init_converts_as_a_fresh_one(numpy_mode, frontend, tmp_path):
    """The converter reads a block traced under ``init`` without that plan's casts, found by
    identity beside the graph the block keeps. A numpy-mode block keeps its graph in the numpy
    frontend, a copy of the one recorded: after a forward pass under init(float16), its bfloat16
    conversion kept five float16 casts (outputs off by up to 4096 of 6e5, and in its export)."""
    if frontend == "numpy":
        numpy_mode()
    F = mx.np if frontend == "numpy" else mx.nd
    rng = np.random.RandomState(0)
    weights = [rng.uniform(-0.5, 0.5, s) * 40 for s in [(16, 8), (16,), (4, 16), (4,)]]
    x = F.array(rng.randn(4, 8).astype("float32") * 400)

    def mlp():
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(16, activation="relu", in_units=8), gluon.nn.Dense(4, in_units=16))
        net.initialize()
        for p, w in zip(net.collect_params().values(), weights):
            p.set_data(F.array(w, dtype="float32"))
        net.hybridize()
        return net

    ran = mlp()
    _init({"target_dtype": "float16", "emulate": True})
    ran(x)
    gluon_amp.disable()
    fresh = mlp()
    fresh(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = (gluon_amp.convert_hybrid_block(n, target_dtype="bfloat16", emulate=True) for n in (ran, fresh))
    np.testing.assert_array_equal(got(x).asnumpy(), want(x).asnumpy())
    got.export(str(tmp_path / "m"))
    nodes = json.load(open(str(tmp_path / "m-symbol.json")))["nodes"]
    assert [n["name"] for n in nodes if n.get("attrs", {}).get("dtype") == "float16"] == []


def test_the_speed_probe_s_timing_blocks_run_in_numpy_mode(numpy_mode):
    """What ``init()``/``runtime_info()`` measure with an empty cache on a native-bfloat16 host,
    here in float32 (this host has no bfloat16 kernels): every probe item times in numpy mode."""
    numpy_mode()
    for label, kind, params in probe.PROBE:
        fp32, shapes = probe.probe_graph(kind, params)
        got = time_graphs([fp32, fp32], shapes, train=True, runs=1)
        assert got is not None and all(t > 0 for t in got), label
    assert time_op("FullyConnected", {"num_hidden": "4"}, [(2, 3), (4, 3), (4,)], ["float32"] * 3, train=True) > 0
    assert mx.util.is_np_array() and mx.util.is_np_shape()  # the user's mode, as it was


def test_the_launcher_runs_a_numpy_mode_training_program(tmp_path):
    """``python -m gluon_amp.run --emulate``: AMP is on before the program turns numpy mode on."""
    script = """
        import json
        from mxnet import autograd, gluon, np, npx
        npx.set_np()
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, activation='relu'), gluon.nn.Dense(2))
        net.initialize()
        net.hybridize()
        trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        x, y = np.ones((4, 3)), np.array([0, 1, 0, 1])
        for _ in range(3):
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(4)
        print('@@' + json.dumps([type(net(x)).__module__, float(loss.mean())]))
    """
    (tmp_path / "prog.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "gluon_amp.run", "--emulate", "--target-dtype", "bfloat16",
                        "--no-tune", "prog.py"], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    kind, loss = json.loads([line for line in r.stdout.splitlines() if line.startswith("@@")][0][2:])
    assert kind == "mxnet.numpy" and np.isfinite(loss)


_NATIVE = """
import json, sys
from mxnet import autograd, gluon, np, npx
import gluon_amp
first = sys.argv[1] == 'init-first'
if first:
    gluon_amp.init(target_dtype='bfloat16')
npx.set_np()
info = gluon_amp.runtime_info()
if not first:
    gluon_amp.init(target_dtype='bfloat16')
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(8, activation='sigmoid'), gluon.nn.Dense(2))
net.initialize()
net.hybridize()
with autograd.record():
    y = net(np.ones((2, 3)))
y.backward()
print('@@' + json.dumps([type(y).__module__, str(y.dtype), info['speed']['source']]))
"""


@pytest.mark.parametrize("order", ["init-first", "set_np-first"])
def test_native_bfloat16_in_numpy_mode_with_an_empty_probe_cache(native_host, order, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XDG_CACHE_HOME": str(tmp_path)}
    env.pop(probe.ENV, None)
    if gluon_amp.runtime.simulated():  # its empty cache would build the rounding kernel: seconds, same values
        env["GLUON_AMP_EMULATION_KERNEL"] = "0"
    r = subprocess.run([sys.executable, "-c", _NATIVE, order], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    kind, dtype, _ = json.loads([line for line in r.stdout.splitlines() if line.startswith("@@")][0][2:])
    assert kind == "mxnet.numpy" and dtype == "float32"  # bfloat16 outputs come back as fed


class _Elementwise(gluon.HybridBlock):
    """Element-wise math between two dense layers, written for either frontend: the numpy ops
    (``_npi_tanh``, ``_npi_multiply_scalar``, ...) in numpy mode, their legacy twins otherwise."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.a = gluon.nn.Dense(16, in_units=5)
            self.b = gluon.nn.Dense(3, in_units=16)

    def hybrid_forward(self, F, x):
        m = F.np if mx.util.is_np_array() else F
        h = m.tanh(self.a(x)) * 1.5 - 0.5
        h = m.sqrt(m.abs(h)) + m.square(h) - m.negative(h)
        h = m.floor(h) * 0.1 + m.sign(h) + (1.0 - h)
        return self.b(h)


@pytest.mark.simulated_native
def test_a_block_gets_one_bfloat16_plan_in_either_frontend(numpy_mode):
    """numpy_twins: each numpy op classed as its legacy twin (bfloat16: element-wise math outside
    oneDNN in float32, its bfloat16 loop being slower). Before, numpy mode ran tanh, the scalar
    arithmetic, abs, sqrt, square, negative, floor and sign in bfloat16, legacy mode in float32."""
    plans, outs = [], []
    for numpy in (False, True):
        if numpy:
            numpy_mode()
        net = _Elementwise()
        net.initialize()
        rng = np.random.RandomState(0)  # the same weights in either frontend
        for p in net.collect_params().values():
            w = rng.uniform(-0.5, 0.5, p.shape).astype("float32")
            p.set_data(mx.np.array(w) if numpy else mx.nd.array(w))
        net.hybridize()
        x = rng.randn(4, 5).astype("float32")
        _init({"target_dtype": "bfloat16", "tune": False})
        y = net(mx.np.array(x) if numpy else mx.nd.array(x))
        rows = gluon_amp.report(net).rows
        plans.append([(r.dtype, r.reason) for r in rows])
        outs.append(y.asnumpy())
        assert {r.dtype for r in rows} == {"bfloat16", "float32"}, [(r.op, r.dtype) for r in rows]
        gluon_amp.disable()
    assert plans[0] == plans[1]
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("kwargs", EMULATED, ids=IDS)
def test_numpy_take_keeps_float16_data_and_writes_out_in_place(numpy_mode, kwargs):
    """``np.take`` flattens with ``npx.reshape`` first, which the bfloat16 table ran in float32:
    float16 data came back float32, and ``out=`` the data raised MXNet's "Type inconsistent"."""
    gluon_amp.init(**kwargs)
    numpy_mode()
    x = mx.np.array([[0.5, 0.25, 0.75], [0.125, 1.0, 2.0]], dtype="float16")
    idx = mx.np.array([[1., 0., 2.], [0., 1., 1.]])
    want = np.take(x.asnumpy(), idx.asnumpy().astype(int))
    got = mx.np.take(x, idx)
    assert got.dtype == np.float16 and np.array_equal(got.asnumpy(), want)
    assert mx.np.take(x, idx, out=x) is x
    assert x.dtype == np.float16 and np.array_equal(x.asnumpy(), want)


class _After(gluon.HybridBlock):
    """A Dense output (low precision in every plan) into ``fn`` with a float32 array."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.fc = gluon.nn.Dense(4, in_units=3)

    def hybrid_forward(self, F, x, other):
        return self.fn(F, self.fc(x), other)


_AFTER = {  # functions a plan met with a low input they could not take (helper CC)
    "atleast_1d": lambda F, h, o: F.np.atleast_1d(h, o)[0] + F.np.atleast_1d(h, o)[1].sum(),
    "atleast_2d": lambda F, h, o: F.np.atleast_2d(h, o)[0] * 2,
    "atleast_3d": lambda F, h, o: F.np.atleast_3d(o, h)[1] - 1,
    "around": lambda F, h, o: F.np.around(h * 4) + o,
}


@pytest.mark.parametrize("fn", sorted(_AFTER))
@pytest.mark.parametrize("mode", EMULATED + ["native"], ids=IDS + ["native"])
def test_a_low_value_meets_functions_with_their_own_dtype_rules(numpy_mode, fn, mode):
    """Hybridized, ``np.atleast_1d(low, float32)`` failed in every mode ("Incompatible attr ...
    expected float16, got float32": its inputs must agree, and it was neutral), and
    ``np.around`` of a float16 value failed ("Do not support float16 as input"). The atleast
    functions now take the widest input type; ``around`` runs float32 under float16."""
    numpy_mode()
    rng = np.random.RandomState(0)
    x, other = (mx.np.array(rng.randn(*s).astype("float32")) for s in ((2, 3), (2, 4)))

    def run():
        mx.random.seed(0)
        net = _After(_AFTER[fn])
        net.initialize(mx.init.Xavier())
        net.hybridize()
        return net(x, other)

    want = run()
    with contextlib.ExitStack() as stack:
        if mode == "native":
            stack.enter_context(gluon_amp.runtime.simulate_native_bf16())
        gluon_amp.init(**({"target_dtype": "bfloat16"} if mode == "native" else mode), tune=False)
        stack.callback(gluon_amp.disable)
        got = run()
    assert isinstance(got, mx.np.ndarray) and got.dtype == want.dtype == np.float32
    scale = np.abs(want.asnumpy()).max()
    tol = 0.25 if fn == "around" else RTOL["float16" if mode == EMULATED[0] else "bfloat16"] * scale
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=0, atol=tol)
