"""Every entry point under every mode, with and without a Python custom op (issue 36's matrix).

Entry points: a hybridized block, an imperative block, a SymbolBlock, a Module, a
BucketingModule (two bucket keys), ``Symbol.simple_bind`` (hand-written SGD on the executor),
and the three converters, each followed by an export that a fresh process of plain MXNet (no
gluon_amp) loads. The Gluon entries (the blocks and ``convert_hybrid_block``) also run in MXNet's
numpy mode (``npx.set_np()`` before ``init``, as d2l programs do; without the custom op), where
every array a block returns must be an ``mx.np.ndarray``. The net: FullyConnected 8 -> 16, relu,
with ``custom`` a Python custom op (y = 2x; its ``CustomOpProp`` has a plain ``__init__``),
FullyConnected 16 -> 4; batch 4.

Modes: off (no ``init``), emulated float16, emulated bfloat16, native bfloat16, and float16
without emulation (MXNet has no float16 GEMM on CPU). Each cell's outcome follows from
``runtime.executable(dtype, "cpu")``, never from the CPU's name:

- a mode that runs here (off, emulated, native bfloat16 on a CPU with bfloat16 kernels): the
  training entries' ten SGD steps give losses, each within ``RTOL[dtype]`` of FP32's
  (``|loss - fp32| <= rtol * |fp32|``; the same weights and batches); a converter's result
  runs in this process and its logits are within ``RTOL[dtype] * max|fp32 logits|`` of FP32's;
- a mode that does not (float16 without emulation, native bfloat16 elsewhere): the entry
  raises gluon_amp's own ``RuntimeError`` naming ``emulate=True`` (never MXNet's error, which
  is a RuntimeError too), and the converters still convert and export, since building a plan
  executes nothing; binding their result here raises that error.

``RTOL``: float16 2e-2, bfloat16 8e-2, float32 (off; a plan with nothing low) 1e-6. Measured
on an AVX2 host (emulated): losses at most 2.9e-4 (float16) and 2.7e-3 (bfloat16) from FP32's,
a converter's logits 3.3e-4 and 3.6e-3 of their largest; the bounds leave room for native
kernels, and every low-precision cell must also differ from FP32 (its rounding took effect).
Under float16 a Module's dynamic loss scale skips the steps whose gradients overflow
(``MAX_SKIPPED``); FP32's reference then skips the same updates. Each export must hold no
``_gluon_amp_round`` node and no ``__amp_`` attribute, load and type in plain MXNet, and run
there (its logits within the same tolerance) where its dtypes run natively; the dtypes MXNet
infers in the loaded export are the plan's (a save that dropped the casts would run FP32). A converter given
no ``target_dtype`` must follow the mode's policy.

Cells with the custom op run in one worker process (a custom op whose constructor fails makes
MXNet end the process: issue 36, defect 1), one cell per request: a crash fails its cell, and
the next cell starts a new worker. Exports are loaded by one process of plain MXNet.
"""
import itertools
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon, npx
from mxnet.gluon import nn

from gluon_amp import runtime
from gluon_amp.training.trainer import attached_scaler
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES

# this file also runs as a worker script, where the tests' helpers module is not on the path
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
OP_TYPE = "matrix_twice"
# The custom op, as user code writes it; the plain-MXNet loader defines it from this text too.
_TWICE = f'''
class _Twice(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0] * 2)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0] * 2)


@mx.operator.register({OP_TYPE!r})
class _TwiceProp(mx.operator.CustomOpProp):
    def __init__(self):  # a plain __init__: MXNet passes every node attribute as a keyword
        super().__init__(need_top_grad=True)

    def list_arguments(self):
        return ["x"]

    def list_outputs(self):
        return ["y"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type):
        return in_type, [in_type[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _Twice()
'''
exec(_TWICE)  # registered once, for this process (and the worker, which runs this file)

BATCH, IN, HIDDEN, CLASSES, STEPS, LR = 4, 8, 16, 4, 10, 0.1
RTOL = {"float16": 2e-2, "bfloat16": 8e-2, None: 1e-6}
#: Under float16, init attaches a dynamic loss scale to a Module (real AMP does too): it starts
#: at 2**16 and skips each step whose gradients overflow float16 (here, SoftmaxOutput's
#: gradients summed over the batch overflow until the scale is 2**13: 3 or 4 of 10 steps).
#: FP32's reference skips the same updates; at most this many of STEPS may be skipped.
MAX_SKIPPED = STEPS // 2
MODES = {
    "off": None,
    "emulated-float16": {"target_dtype": "float16", "emulate": True},
    "emulated-bfloat16": {"target_dtype": "bfloat16", "emulate": True},
    "native-bfloat16": {"target_dtype": "bfloat16"},
    "float16-no-emulate": {"target_dtype": "float16"},
}
TRAINING = ["hybridized", "imperative", "symbolblock", "module", "bucketing", "simple_bind"]
CONVERTERS = ["convert_symbol", "convert_model", "convert_hybrid_block"]
#: the entries of numpy mode (Gluon's); without the custom op
NUMPY = ["hybridized", "imperative", "symbolblock", "convert_hybrid_block"]
CELLS = [(e, m, c, False) for e, m, c in itertools.product(TRAINING + CONVERTERS, MODES, [False, True])] + \
    [(e, m, False, True) for e, m in itertools.product(NUMPY, MODES)]
MARK = "@@matrix "


def _target(mode):
    return MODES[mode]["target_dtype"] if MODES[mode] else None


def _executes(mode, low=None):
    """Whether a cell of ``mode`` runs here, a plan holding ``low`` (its low dtypes) given."""
    if MODES[mode] and MODES[mode].get("emulate"):
        return True
    low = {_target(mode)} - {None} if low is None else low
    return all(runtime.executable(d, "cpu") for d in low)


# -- the model, its data, its weights ---------------------------------------------------------

def _batches():
    rng = np.random.RandomState(0)
    x = rng.randn(STEPS, BATCH, IN).astype("float32")
    return x, x[..., :CLASSES].argmax(-1).astype("float32")


def _weights():
    rng = np.random.RandomState(1)
    return {"fc1_weight": mx.nd.array(rng.randn(HIDDEN, IN) * 0.4), "fc1_bias": mx.nd.array(rng.randn(HIDDEN) * 0.1),
            "fc2_weight": mx.nd.array(rng.randn(CLASSES, HIDDEN) * 0.4), "fc2_bias": mx.nd.zeros(CLASSES)}


def _logits(custom, act="relu"):
    h = mx.sym.Activation(mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=HIDDEN, name="fc1"),
                          act_type=act, name="act")
    if custom:
        h = mx.sym.Custom(h, op_type=OP_TYPE, name="twice")
    return mx.sym.FullyConnected(h, num_hidden=CLASSES, name="fc2")


def _softmax(custom, act="relu"):
    return mx.sym.SoftmaxOutput(_logits(custom, act), mx.sym.var("softmax_label"), name="softmax")


class _Net(gluon.HybridBlock):
    def __init__(self, custom, numpy=False):
        super().__init__(prefix="")
        self.custom, self.numpy = custom, numpy
        with self.name_scope():
            self.fc1 = nn.Dense(HIDDEN, in_units=IN, prefix="fc1_")
            self.fc2 = nn.Dense(CLASSES, in_units=HIDDEN, prefix="fc2_")

    def hybrid_forward(self, F, x):
        h = (F.npx.activation if self.numpy else F.Activation)(self.fc1(x), act_type="relu")
        if self.custom:
            h = F.Custom(h, op_type=OP_TYPE)
        return self.fc2(h)


def _array(x, numpy=False):
    return mx.np.array(x) if numpy else mx.nd.array(x)


def _frontend(y, numpy):
    """``y``, a block's output: an ``mx.np.ndarray`` in numpy mode (Gluon requires it), else legacy."""
    if isinstance(y, mx.np.ndarray) != numpy:
        raise TypeError(f"a block gave a {type(y).__module__}.{type(y).__name__} in {'numpy' if numpy else 'legacy'} "
                        "mode")
    return y


def _set_weights(block, numpy=False):
    params = block.collect_params()
    params.initialize()
    for name, value in _weights().items():
        params[name].set_data(value.as_np_ndarray() if numpy else value)
    return block


def _net(custom, hybridize, numpy=False):
    net = _set_weights(_Net(custom, numpy), numpy)
    if hybridize:
        net.hybridize()
    return net


def _cross_entropy(prob, label):
    prob = prob.asnumpy().astype("float64")
    return float(-np.log(prob[np.arange(len(label)), label.astype(int)] + 1e-12).mean())


# -- the entry points: each gives ten losses ---------------------------------------------------

def _skipped(trainer_or_module):
    """Whether the last update was skipped by a loss scaler gluon_amp attached (float16's
    dynamic loss scale starts at 2**16 and skips the steps whose gradients overflow)."""
    scaler = attached_scaler(trainer_or_module)
    return scaler is not None and scaler.last_step_skipped


def _train_block(net, skip, numpy=False):
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": LR})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses, skipped = [], []
    for i, (x, y) in enumerate(zip(*_batches())):
        with autograd.record():
            loss = loss_fn(_frontend(net(_array(x, numpy)), numpy), _array(y, numpy))
        loss.backward()
        if i not in skip:
            trainer.step(BATCH)
        losses.append(float(loss.mean().asnumpy()))
        skipped += [i] * _skipped(trainer)
    return {"losses": losses, "skipped": skipped}


def _symbolblock(custom, numpy=False):
    if numpy:
        return _set_weights(gluon.SymbolBlock(_logits(custom).as_np_ndarray(), mx.sym.var("data").as_np_ndarray()),
                            numpy)
    return _set_weights(gluon.SymbolBlock(_logits(custom), mx.sym.var("data")))


def _train_module(mod, skip):
    mod.init_params(arg_params=_weights(), aux_params={})
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": LR})
    losses, skipped = [], []
    for i, (x, y) in enumerate(zip(*_batches())):
        key = (2, 1)[i % 2]
        batch = mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)], bucket_key=key,
                                provide_data=[mx.io.DataDesc("data", (BATCH, IN))],
                                provide_label=[mx.io.DataDesc("softmax_label", (BATCH,))])
        mod.forward_backward(batch)
        if i not in skip:
            mod.update()
        losses.append(_cross_entropy(mod.get_outputs()[0], y))
        skipped += [i] * _skipped(mod)
    return {"losses": losses, "skipped": skipped}


def _module(custom, skip, numpy=False):
    mod = mx.mod.Module(_softmax(custom), context=mx.cpu())
    mod.bind(data_shapes=[("data", (BATCH, IN))], label_shapes=[("softmax_label", (BATCH,))])
    return _train_module(mod, skip)


def _bucketing(custom, skip, numpy=False):
    def sym_gen(key):  # the two buckets share the weights; their graphs differ
        return _softmax(custom, "relu" if key == 2 else "tanh"), ("data",), ("softmax_label",)

    mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=2, context=mx.cpu())
    mod.bind(data_shapes=[("data", (BATCH, IN))], label_shapes=[("softmax_label", (BATCH,))])
    return _train_module(mod, skip)


def _simple_bind(custom, skip, numpy=False):
    weights = _weights()
    grad_req = {"data": "null", "softmax_label": "null", **dict.fromkeys(weights, "write")}
    ex = _softmax(custom).simple_bind(mx.cpu(), data=(BATCH, IN), softmax_label=(BATCH,), grad_req=grad_req)
    for name, value in weights.items():
        ex.arg_dict[name][:] = value
    losses = []
    for x, y in zip(*_batches()):
        ex.forward(is_train=True, data=mx.nd.array(x), softmax_label=mx.nd.array(y))
        ex.backward()
        for name in weights:
            ex.arg_dict[name][:] -= (LR / BATCH) * ex.grad_dict[name]
        losses.append(_cross_entropy(ex.outputs[0], y))
    return {"losses": losses, "skipped": []}  # no scaler: a bare executor's gradients are the user's


TRAIN = {
    "hybridized": lambda custom, skip, numpy: _train_block(_net(custom, True, numpy), skip, numpy),
    "imperative": lambda custom, skip, numpy: _train_block(_net(custom, False, numpy), skip, numpy),
    "symbolblock": lambda custom, skip, numpy: _train_block(_symbolblock(custom, numpy), skip, numpy),
    "module": _module,
    "bucketing": _bucketing,
    "simple_bind": _simple_bind,
}


# -- the converters ---------------------------------------------------------------------------

def _x0(numpy=False):
    return _array(_batches()[0][0], numpy)


def _run_symbol(sym, args, aux):
    ex = sym.simple_bind(mx.cpu(), data=(BATCH, IN), grad_req="null")
    ex.copy_params_from(args, aux, allow_extra_params=True)
    return ex.forward(data=_x0())[0].asnumpy().astype("float32").tolist()


def _save(sym, args, aux, prefix):
    sym.save(prefix + "-symbol.json")
    mx.nd.save(prefix + "-0000.params", {**{"arg:" + k: v for k, v in args.items()},
                                         **{"aux:" + k: v for k, v in aux.items()}})


def _attempt(run):
    """``run()``'s outputs, or what it raised (gluon_amp's or anyone's), as data."""
    try:
        return {"outputs": run()}
    except Exception as err:  # noqa: BLE001  the cell's checks judge it
        return {"raised": {"type": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err),
                           "runtime_error": isinstance(err, RuntimeError),
                           "mxnet": isinstance(err, mx.base.MXNetError), "trace": traceback.format_exc()}}


def _convert(entry, custom, prefix, numpy=False):
    """Convert the FP32 model with no ``target_dtype`` (the active policy's), export it, and run
    the result here. Conversion and export must not fail; running may refuse."""
    out = {}
    if entry == "convert_hybrid_block":
        net = _net(custom, True, numpy)
        # the block ran under this mode (its outputs as a float32 caller reads them: no raw bfloat16 words)
        out["before"] = _attempt(lambda: _frontend(net(_x0(numpy)), numpy).asnumpy().tolist())
        # tune=False: the plan as converted runs (the speed rule would run this small net in float32:
        # convert/test_conversion_speed_rule.py)
        conv = gluon_amp.convert_hybrid_block(net, tune=False)
        conv.export(prefix, 0)
        out["run"] = _attempt(lambda: _frontend(conv(_x0(numpy)), numpy).asnumpy().astype("float32").tolist())
        sym = mx.sym.load(prefix + "-symbol.json")
    else:
        fp32, args, aux = _logits(custom), _weights(), {}
        if entry == "convert_symbol":
            sym = gluon_amp.convert_symbol(fp32)
        else:
            sym, args, aux = gluon_amp.convert_model(fp32, args, aux)
        _save(sym, args, aux, prefix)
        out["run"] = _attempt(lambda: _run_symbol(sym, args, aux))
    out["low"] = sorted({t for t in (infer_dtypes(sym, {"data": "float32"}, partial=True) or {}).values()
                         if t in LOW_PRECISION_DTYPES})
    out["prefix"] = prefix
    return out


# -- one cell ---------------------------------------------------------------------------------

def _init(mode):
    if MODES[mode] is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # init warns where the target cannot execute here
            gluon_amp.init(**MODES[mode])


def run_cell(entry, mode, custom, workdir, numpy=False):
    """FP32's outputs, then this cell's (or what it raised), as data (JSON). ``numpy``: in
    MXNet's numpy mode, turned on before ``init`` and off again after."""
    if numpy:
        npx.set_np()
    try:
        return _run_cell(entry, mode, custom, workdir, numpy)
    finally:
        if numpy:
            npx.reset_np()


def _run_cell(entry, mode, custom, workdir, numpy):
    if entry in TRAIN:
        _init(mode)
        run = _attempt(lambda: TRAIN[entry](custom, (), numpy))
        gluon_amp.disable()
        # FP32's run, with the updates the loss scaler skipped skipped too
        ref = TRAIN[entry](custom, run.get("outputs", {}).get("skipped", ()), numpy)
        return {"ref": ref, "run": run}
    fp32 = _run_symbol(_logits(custom), _weights(), {})
    _init(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 fallback / kept-in-float32 notes
        prefix = os.path.join(workdir, f"{entry}-{mode}-{int(custom)}{'-numpy' * numpy}")
        return {"ref": fp32, **_convert(entry, custom, prefix, numpy)}


def _reset():
    """What tests/mxnet_layer/conftest.py's fixture does between tests."""
    try:
        mx.nd.waitall()
    finally:
        gluon_amp.disable()
        gluon_amp.state.reset()  # also forgets converted results and releases their hooks


# -- processes: the custom-op worker and plain MXNet ------------------------------------------

_LOADER = '''
import json, sys
import numpy as np
import mxnet as mx
''' + _TWICE + '''
for line in sys.stdin:
    req = json.loads(line)
    try:
        sym = mx.sym.load(req["prefix"] + "-symbol.json")
        with mx.util.np_shape(req["numpy"]):  # arrays saved in numpy mode load in its shape semantics
            params = mx.nd.load(req["prefix"] + "-0000.params")
        args = {k[4:]: v for k, v in params.items() if k.startswith("arg:")}
        aux = {k[4:]: v for k, v in params.items() if k.startswith("aux:")}
        arg_types, out_types, _ = sym.infer_type(data="float32")
        if arg_types is None or None in out_types:
            raise ValueError("infer_type left types unknown")
        codes = mx.ndarray.ndarray._DTYPE_NP_TO_MX
        internal = sym.get_internals().infer_type(data="float32")[1]
        low = sorted({{2: "float16", 12: "bfloat16"}.get(codes.get(t)) for t in internal} - {None})
        res = {"loaded": sorted(params), "outputs": None, "low": low}
        if req["runs"]:
            ex = sym.simple_bind(mx.cpu(), data=tuple(req["shape"]), grad_req="null")
            ex.copy_params_from(args, aux, allow_extra_params=True)
            res["outputs"] = ex.forward(data=mx.nd.array(req["x"]))[0].asnumpy().astype("float32").tolist()
        res["gluon_amp"] = "gluon_amp" in sys.modules
    except Exception:
        import traceback
        res = {"error": traceback.format_exc()}
    sys.stdout.write("''' + MARK + '''" + json.dumps(res) + "\\n")
    sys.stdout.flush()
'''


class _Process:
    """A child answering one JSON request per line; a crash or a hang fails the request that
    met it, and the next request starts a new child."""

    def __init__(self, cmd, env, cwd, timeout=240):
        self.cmd, self.env, self.cwd, self.timeout = cmd, env, cwd, timeout
        self.proc, self.buf, self.log = None, b"", None

    def ask(self, request):
        if self.proc is None:
            self.log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                         env=self.env, cwd=self.cwd, bufsize=0)
            self.buf = b""
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        deadline = time.monotonic() + self.timeout
        while True:
            line = self._line(deadline)
            if line is None:
                self.close()
                pytest.fail(f"{request}: the child process ended (exit {self.rc}) in this cell:\n{self.stderr}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def _line(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.proc.kill()
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def close(self):
        self.rc, self.stderr = None, ""
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.rc = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.rc = self.proc.wait()
            self.log.seek(0)
            self.stderr = self.log.read().decode(errors="replace")[-4000:]
            self.log.close()
        self.proc = None


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="gluon-amp-matrix-") as d:
        yield d


@pytest.fixture(scope="module")
def worker():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = _Process([sys.executable, os.path.abspath(__file__), "--worker"], env, ROOT)
    yield child
    child.close()


@pytest.fixture(scope="module")
def plain_mxnet(workdir):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = _Process([sys.executable, "-c", _LOADER], env, workdir)
    yield child
    child.close()


# -- the checks -------------------------------------------------------------------------------

def _check_ran(cell, outcome, ref, dtype, scale):
    assert "raised" not in outcome, f"{cell}: raised\n{outcome['raised']['trace']}"
    got, ref = np.asarray(outcome["outputs"], dtype="float64"), np.asarray(ref, dtype="float64")
    assert got.shape == ref.shape and np.isfinite(got).all(), (cell, got)
    bound = RTOL[dtype] * (np.abs(ref) if scale is None else scale)
    assert (np.abs(got - ref) <= bound).all(), f"{cell}: beyond rtol {RTOL[dtype]} of FP32's\n{got}\n{ref}"
    if dtype is not None:
        assert not np.array_equal(got, ref), f"{cell}: identical to FP32's: nothing ran in {dtype}"


def _check_refused(cell, outcome):
    assert "raised" in outcome, f"{cell}: ran although this host cannot run its dtype: expected gluon_amp's error"
    raised = outcome["raised"]
    # gluon_amp's refusal (execution.CannotRun, a RuntimeError), never MXNet's (also a RuntimeError)
    assert raised["type"] in ("builtins.RuntimeError", "gluon_amp.execution.CannotRun"), raised["trace"]
    assert raised["runtime_error"] and not raised["mxnet"], f"{cell}: {raised['trace']}"
    assert raised["message"].startswith("gluon_amp") and "emulate=True" in raised["message"], raised["message"]


def _check(cell, outcome, ref, dtype, executes, scale=None):
    if executes:
        _check_ran(cell, outcome, ref, dtype, scale)
    else:
        _check_refused(cell, outcome)


def _lowest(low):
    return "float16" if "float16" in low else ("bfloat16" if "bfloat16" in low else None)


@pytest.mark.parametrize("entry,mode,custom,numpy", CELLS,
                         ids=[f"{e}-{m}-{'custom' if c else 'plain'}{'-numpy' * n}" for e, m, c, n in CELLS])
def test_cell(entry, mode, custom, numpy, worker, plain_mxnet, workdir):
    cell = f"{entry} / {mode} / {'with' if custom else 'without'} the custom op{' / numpy mode' * numpy}"
    request = {"entry": entry, "mode": mode, "custom": custom, "workdir": workdir, "numpy": numpy}
    if custom:
        result = worker.ask(request)
        assert "error" not in result, f"{cell}:\n{result['error']}"
    else:
        result = run_cell(**request)
    if entry in TRAIN:
        run, target = result["run"], _target(mode)
        if "outputs" in run:  # float16's loss scale may skip steps
            skipped = run["outputs"]["skipped"]
            assert len(skipped) <= MAX_SKIPPED if target == "float16" else not skipped, f"{cell}: skipped {skipped}"
            run = {"outputs": run["outputs"]["losses"]}
        assert not result["ref"]["skipped"]
        _check(cell, run, result["ref"]["losses"], target, _executes(mode))
        return
    low, target = set(result["low"]), _target(mode)
    if target is not None:  # without target_dtype, a converter follows the policy in force
        assert low == {target}, f"{cell}: the plan holds {low}, the policy {target}"
    scale = np.abs(np.asarray(result["ref"])).max()
    if "before" in result:
        _check(cell + " (its first forward)", result["before"], result["ref"], target, _executes(mode), scale)
    _check(cell, result["run"], result["ref"], _lowest(low), _executes(mode, low), scale)
    text = open(result["prefix"] + "-symbol.json").read()
    assert "_gluon_amp_round" not in text and "__amp_" not in text, f"{cell}: gluon_amp's nodes in the export"
    runs = all(runtime.executable(d, "cpu") for d in low)  # plain MXNet runs it natively, or not at all
    loaded = plain_mxnet.ask({"prefix": result["prefix"], "runs": runs, "shape": [BATCH, IN], "numpy": numpy,
                              "x": _x0().asnumpy().tolist()})
    assert "error" not in loaded, f"{cell}: plain MXNet failed on the export\n{loaded['error']}"
    assert not loaded["gluon_amp"] and loaded["loaded"], loaded
    assert loaded["low"] == sorted(low), f"{cell}: the export holds {loaded['low']}, the plan {sorted(low)}"
    if runs:
        _check_ran(cell + " (plain MXNet)", {"outputs": loaded["outputs"]}, result["ref"], _lowest(low), scale)


def _worker():
    """Run cells asked on stdin, one JSON line each; answer on stdout after MARK."""
    for line in sys.stdin:
        try:
            result = run_cell(**json.loads(line))
        except BaseException:  # noqa: BLE001  reported to the test, which fails its cell
            result = {"error": traceback.format_exc()}
        finally:
            _reset()
        sys.stdout.write(MARK + json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
