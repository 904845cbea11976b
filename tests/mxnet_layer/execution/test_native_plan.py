"""Which graph runs where bfloat16 runs natively (issue 41, items 6 and 7), decided in-process:
``runtime.capability`` is replaced by a native-bfloat16 one (the seam ``speed/test_probe.py``
uses), so :func:`gluon_amp.execution.graph_to_run` decides as on a bfloat16 host; nothing runs
a bfloat16 kernel. The runs themselves are checked on a native host (``native_host``: the
simulated one on every CPU, and the real one where the CPU has bfloat16 kernels).

- GPU-style float16 code (``net.cast('float16')``, ``net(x.astype('float16'))``) under native
  bfloat16: the float16 data is only cast to bfloat16, so the plan runs, hybridized as it does
  op by op (the README's promise); a plan that computes in float16 is still refused.
- A plan's bfloat16 outputs come back in the dtype the caller feeds, as emulation gives them:
  never bfloat16 arrays to float32 code, whose ``asnumpy()`` reads raw 16-bit words.
"""
import json
import contextlib
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon

from gluon_amp import execution, runtime
from gluon_amp.speed import probe
from gluon_amp.type_inference import infer_dtypes
from gluon_amp_core import table as gluon_amp_core_table
from gluon_amp_core.capability import Bf16, Capability
from gluon_amp_core.verdicts import Verdict

NATIVE = Capability(0, Bf16.NATIVE, "AVX512_CORE_BF16", "oneDNN runs bfloat16 natively (in-process stand-in)",
                    amx_hint="")


@pytest.fixture
def decides_as_native(monkeypatch):
    """This process decides as a CPU with native bfloat16 does (the speed probe off); nothing
    runs (the ``native_host`` fixture's simulated host would run the emulated copy)."""
    monkeypatch.setattr(runtime, "capability", lambda: NATIVE)
    monkeypatch.setattr(gluon_amp.state.process, "said", set())
    monkeypatch.setenv(probe.ENV, "0")
    probe.forget()
    yield
    probe.forget()


def _init(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gluon_amp.init(**kwargs)


def _cnn():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
            gluon.nn.Dense(10))
    net.initialize()
    return net


def _plan(net):
    """The plan ``net`` builds under the policy in force (its symbolic trace, as the block
    hooks receive it), its parameters' dtypes as stored."""
    plan = net(mx.sym.var("data"))
    return plan, {p.name: str(np.dtype(p.dtype)) for p in net.collect_params().values()}


def _head_dtype(sym, fed):
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    j, k, _ = graph["heads"][0]
    return infer_dtypes(sym, fed, partial=True)[(graph["nodes"][j]["name"], k)]


SHAPES = {"data": (2, 4, 8, 8)}


def test_gpu_style_float16_code_runs_the_bfloat16_plan_natively(decides_as_native):
    policy = _init(target_dtype="bfloat16")
    assert not policy.emulate and runtime.executable("bfloat16", "cpu")
    net = _cnn()
    net.cast("float16")  # left to AMP: float32 master weights
    plan, params = _plan(net)
    assert set(params.values()) == {"float32"}
    fed = {"data": "float16", **params}
    run = execution.graph_to_run(plan, fed, SHAPES, {"cpu"}, policy, "the block")
    assert execution.kernel_dtypes(run, infer_dtypes(run, fed, partial=True)) == {"bfloat16"}
    # its output in the dtype the code works in, as the emulated copy gives it (gluon_amp_core.emulate)
    assert _head_dtype(plan, fed) == "bfloat16" and _head_dtype(run, fed) == "float16"


def test_a_plan_computing_in_float16_is_still_refused_on_a_cpu(decides_as_native):
    policy = _init(target_dtype="float16")
    plan, params = _plan(_cnn())
    with pytest.raises(execution.CannotRun, match="float16 kernels.*emulate=True"):
        execution.graph_to_run(plan, {"data": "float32", **params}, SHAPES, {"cpu"}, policy, "the block")


#: ops a script may compute in float16 itself, each built on float16 inputs (a mask, a sum,
#: a GEMM); whether each is refused comes from the recorded facts, not from this list
SCRIPT_FLOAT16_OPS = {
    "broadcast_lesser": lambda a, b: mx.sym.broadcast_lesser(a, b),
    "elemwise_add": lambda a, b: mx.sym.elemwise_add(a, b),
    "Activation:act_type=relu": lambda a, b: mx.sym.Activation(a, act_type="relu"),
    "SequenceMask": lambda a, b: mx.sym.SequenceMask(a),
    "FullyConnected": lambda a, b: mx.sym.FullyConnected(a, num_hidden=3, no_bias=True, name="fc16"),
    "dot": lambda a, b: mx.sym.dot(a, b, transpose_b=True),
    "batch_dot": lambda a, b: mx.sym.batch_dot(mx.sym.expand_dims(a, 0), mx.sym.expand_dims(b, 0),
                                               transpose_b=True),
}


@pytest.mark.parametrize("op", sorted(SCRIPT_FLOAT16_OPS))
def test_a_bfloat16_plan_refuses_a_scripts_own_float16_op_only_where_the_cpu_has_no_kernel(decides_as_native, op):
    """GluonNLP's run_pretraining.py --dtype float16 feeds ``valid_length.astype('float16')``
    into a mask: elementwise float16 ops, which MXNet's CPU build runs. Refused before, as if
    every float16 op were a GEMM; now only what the facts say has no float16 kernel here."""
    a16, b16 = mx.sym.cast(mx.sym.var("a"), "float16"), mx.sym.cast(mx.sym.var("b"), "float16")
    # built before init: under it, the patched GEMMs would cast the float16 inputs to bfloat16
    plan = mx.sym.cast(SCRIPT_FLOAT16_OPS[op](a16, b16), "float32")
    policy = _init(target_dtype="bfloat16")
    fed, shapes = {"a": "float32", "b": "float32"}, {"a": (4, 3), "b": (4, 3)}
    no_kernel = gluon_amp_core_table.kernel_verdicts("float16", "cpu").get(op) is Verdict.NO_KERNEL
    if no_kernel:
        name = op.split(":")[0]
        with pytest.raises(execution.CannotRun, match=f"{name} in float16.*--emulate --target-dtype float16"):
            execution.graph_to_run(plan, fed, shapes, {"cpu"}, policy, "the block")
    else:
        assert execution.graph_to_run(plan, fed, shapes, {"cpu"}, policy, "the block") is plan


class _Masked(gluon.HybridBlock):
    """A float16 ``valid_length`` feeding a mask, as GluonNLP's scripts under ``--dtype
    float16`` build it: beside a dense layer (``dense``), or filling masked attention scores
    with ``where`` before a softmax (``where``: GluonNLP's ``_apply_mask``)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.dense = gluon.nn.Dense(4, flatten=False)

    def hybrid_forward(self, F, x, valid_length):
        steps = F.cast(F.contrib.arange_like(x, axis=1), "float16")
        mask = F.broadcast_lesser(steps.reshape((1, -1)), valid_length.reshape((-1, 1)))
        if self.kind == "dense":
            return F.broadcast_mul(self.dense(x), F.expand_dims(mask.astype("float32"), axis=2)), mask
        scores = F.broadcast_axis(F.expand_dims(mask, axis=1), axis=1, size=5)  # (batch, 5, 5)
        att = F.slice_axis(x, axis=2, begin=0, end=5)
        filled = F.where(scores, att, -1e4 * F.ones_like(att))
        return F.softmax(filled, axis=-1), mask


@pytest.mark.parametrize("kind", ["dense", "where"])
def test_a_scripts_float16_mask_runs_natively_as_plain_mxnet_computes_it(native_host, kind):
    """The pretraining script's patterns end to end: a hybridized block, float32 data, a float16
    ``valid_length`` that only feeds a mask. ``where`` met the plan's ``amp_multicast`` of the
    float16 mask and the float32 scores, which a CPU runs in oneDNN: "unknown type for MKLDNN
    :2" where plain MXNet runs the op; its inputs are now cast one by one on a CPU."""
    x = mx.nd.random.normal(shape=(2, 5, 8))
    valid = mx.nd.array([3, 5]).astype("float16")
    mx.random.seed(0)
    plain = _Masked(kind)
    plain.initialize()
    plain.hybridize()
    want = [a.asnumpy() for a in plain(x, valid)]
    _init(target_dtype="bfloat16", tune=False)
    mx.random.seed(0)
    net = _Masked(kind)
    net.initialize()
    net.hybridize()
    x.attach_grad()
    with autograd.record():
        out, mask = net(x, valid)
        loss = (out * out).sum()
    loss.backward()
    assert np.isfinite(x.grad.asnumpy()).all() and np.abs(x.grad.asnumpy()).sum() > 0
    assert mask.dtype == np.float16
    np.testing.assert_array_equal(mask.asnumpy(), want[1])
    if kind == "where":  # no low-precision op decided: the values are plain MXNet's
        np.testing.assert_array_equal(out.asnumpy(), want[0])
    else:
        assert np.isfinite(net.dense.weight.grad().asnumpy()).all()


@pytest.mark.parametrize("entry", ["block", "symbol"])
def test_bfloat16_outputs_come_back_float32_to_float32_code_and_the_plan_keeps_them(decides_as_native, entry):
    policy = _init(target_dtype="bfloat16")
    net = gluon.nn.Dense(4, in_units=3)
    net.initialize()
    plan, params = _plan(net)
    fed = {"data": "float32", **params}
    if entry == "block":
        run = execution.graph_to_run(plan, fed, {"data": (2, 3)}, {"cpu"}, policy, "the block")
    else:  # where Symbol.simple_bind / Module bind it
        run = execution._for_symbol(plan, mx.cpu(), {}, {"data": (2, 3)}, None)
    assert _head_dtype(plan, fed) == "bfloat16"  # the plan (what export writes) is left as it is
    assert _head_dtype(run, fed) == "float32"
    assert not execution.runs_emulated(plan)


# -- run on a native host (simulated everywhere, real with bfloat16 kernels) ---------------

@pytest.mark.parametrize("channels", [4, 3])
def test_gpu_style_float16_training_step_runs_hybridized_as_unhybridized(native_host, channels):
    """3 channels: the image's convolution runs float32 by the odd-channels rule, so the layers
    after it are fed float32; unhybridized, the output came back float32 (a graph gives the
    dtype the caller fed: float16)."""
    _init(target_dtype="bfloat16")
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, channels, 8, 8)))
    outs = []
    for hybridize in (False, True):
        mx.random.seed(0)
        net = _cnn()
        net.cast("float16")
        if hybridize:
            net.hybridize()
        with autograd.record():
            y = net(x.astype("float16"))
        y.backward()
        assert y.dtype == np.float16, hybridize
        outs.append(y.asnumpy().astype("float32"))
    assert np.abs(outs[0] - outs[1]).max() <= 2e-2 * np.abs(outs[0]).max()


def test_a_hybridized_block_s_output_is_float32_not_raw_bfloat16_words(native_host):
    _init(target_dtype="bfloat16")
    net = gluon.nn.Dense(4, in_units=3)
    net.initialize()
    net.hybridize()
    y = net(mx.nd.ones((2, 3)))
    assert y.dtype == np.float32 and y.asnumpy().shape == (2, 4)


def test_gpu_style_float16_code_gets_float16_outputs_when_tuning_runs_the_graph_float32(native_host):
    """The tuner's whole-graph rule runs a graph this small float32 until measured: the output
    dtype must not follow timings. GPU-style code fed float16 gets float16, as the untuned plan
    and its emulated copy give it (only float32 kernels run here: any CPU)."""
    _init(target_dtype="bfloat16", tune=True)
    net = _cnn()
    net.cast("float16")
    net.hybridize()
    y = net(mx.nd.ones((2, 4, 8, 8), dtype="float16"))
    assert set(gluon_amp.report(net, data="float16").totals_by_dtype) == {"float32"}  # the tuner's verdict
    assert y.dtype == np.float16


class _ScoresStep(gluon.HybridBlock):
    """Sockeye 2.3's beam search update, trimmed: a sum and a concat of what the caller passes."""

    def hybrid_forward(self, F, dists, scores, pad):
        summed = F.broadcast_add(dists, scores)
        return F.where(summed > 1e9, F.concat(scores, pad), summed)


@pytest.mark.parametrize("mode", ["native", "emulated-float16", "emulated-bfloat16"])
def test_a_block_called_with_other_input_dtypes_than_its_plan_was_typed_for_plans_again(mode):
    """Sockeye's ``translate --dtype float16``: a beam-search block first fed float16 only got
    float32 scores from ``topk`` (float32 in the table) at its next call. Its plan, typed for
    float16 inputs, had no cast before the concat: MXNet's "Non-uniform data type in Concat" on
    a native host; emulated, the float32 input was read as float16, silently."""
    with contextlib.ExitStack() as stack:
        if mode == "native":  # simulated: the plan's graphs are what a bfloat16 host binds
            stack.enter_context(gluon_amp.runtime.simulate_native_bf16())
            _init(target_dtype="bfloat16")
        else:
            _init(target_dtype=mode.split("-")[1], emulate=True)
        _called_with_changing_dtypes()


def _called_with_changing_dtypes():
    dists = mx.nd.array(np.random.RandomState(0).rand(2, 5), dtype="float16")
    pad = mx.nd.full((2, 4), np.inf, dtype="float16")
    fine = 1 + 2.0 ** -20  # not a float16 value
    calls = [(dists, mx.nd.zeros((2, 1), dtype="float16"), pad),
             (dists * 0, mx.nd.full((2, 1), fine, dtype="float32"), pad),
             (dists, mx.nd.zeros((2, 1), dtype="float16"), pad)]

    def fresh(args):
        block = _ScoresStep()
        block.hybridize()
        return block(*args)

    step = _ScoresStep()
    step.hybridize()
    for args in calls:  # the same block as a fresh one, whatever it was called with before
        out, want = step(*args), fresh(args)
        assert out.dtype == want.dtype and np.array_equal(out.asnumpy(), want.asnumpy())
    assert step(*calls[1]).dtype == np.float32 and np.all(step(*calls[1]).asnumpy() == np.float32(fine))


class _CountedStep(_ScoresStep):
    """Counts its traces: ``hybrid_forward`` runs with symbols only when the block is traced."""

    def __init__(self):
        super().__init__()
        self.traces = 0

    def hybrid_forward(self, F, *args):
        self.traces += F is mx.sym
        return super().hybrid_forward(F, *args)


def test_a_block_fed_alternating_dtypes_keeps_a_plan_for_each():
    """A decoder fed float16, then float32, then float16 again: each call traced its block again
    (about 40x the call), where one plan per set of input dtypes serves. A plan kept aside is
    not one for another policy, nor one from before the block's graph was dropped."""
    _init(target_dtype="float16", emulate=True)
    dists = mx.nd.array(np.random.RandomState(0).rand(2, 5), dtype="float16")
    pad = mx.nd.full((2, 4), np.inf, dtype="float16")
    low, wide = (dists, dists[:, :1], pad), (dists, dists[:, :1].astype("float32"), pad)
    step = _CountedStep()
    step.hybridize()
    for args in [low, wide] * 3:
        out, want = step(*args), _ScoresStep()
        want.hybridize()
        want = want(*args)
        assert out.dtype == want.dtype and np.array_equal(out.asnumpy(), want.asnumpy())
    assert step.traces == 2
    with gluon_amp.autocast(target_dtype="bfloat16", emulate=True):  # another policy: its own plans
        step(*low), step(*wide), step(*low)
    assert step.traces == 4
    step.hybridize()  # the graph dropped: the plans aside too
    step(*wide), step(*low)
    assert step.traces == 6


class _AnyInput(gluon.HybridBlock):
    """Two dense layers after a cast of the input to float32: any input dtype runs, FP32 too."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense0, self.dense1 = gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(4)

    def hybrid_forward(self, F, x):
        return self.dense1(self.dense0(F.cast(x, "float32")))


def _mlp():
    mx.random.seed(0)
    net = _AnyInput()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _as_traced_fresh(x, region=contextlib.nullcontext):
    with region():
        return _mlp()(x).asnumpy()


def test_a_plan_kept_aside_comes_back_only_under_its_own_policy_and_never_after_disable():
    """Plans kept aside crossed with regions and ``disable()``: a plan put back kept the label of
    the one it replaced, so a later region ran init's float16 plan where its own bfloat16 one was
    asked; a graph traced with AMP off, then a plan put back, ran that plan after ``disable()``
    with a false "runs without mixed precision" warning."""
    _init(target_dtype="float16", emulate=True)
    x32 = mx.nd.array(np.random.RandomState(0).randn(2, 8) * 3.3)
    x16 = x32.astype("float16")

    def region():
        return gluon_amp.autocast(target_dtype="bfloat16", emulate=True)

    net = _mlp()
    net(x32)
    with region():
        net(x16)
    net(x32), net(x16)
    with region():
        assert np.array_equal(net(x32).asnumpy(), _as_traced_fresh(x32, region))
    with gluon_amp.autocast(enabled=False):
        net(x32.astype("float64"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert np.array_equal(net(x16).asnumpy(), _as_traced_fresh(x16))  # its plan, put back
    assert not [w for w in caught if "without mixed precision" in str(w.message)]
    gluon_amp.disable()
    assert np.array_equal(net(x32).asnumpy(), _mlp()(x32).asnumpy())  # FP32's


def test_a_block_the_shape_rules_watch_is_traced_again_for_other_input_dtypes():
    """A plan kept aside from before the rules kept a convolution in float32 (its input
    narrower than its stride) came back at those shapes, its convolution in bfloat16."""
    _init(target_dtype="bfloat16", emulate=True)

    def conv():
        mx.random.seed(0)
        net = gluon.nn.Conv2D(8, 1, strides=4, in_channels=4)
        net.initialize(mx.init.Xavier())
        net.hybridize()
        return net

    rng = np.random.RandomState(0)
    big, small = mx.nd.array(rng.randn(1, 4, 8, 8) * 3.3), mx.nd.array(rng.randn(1, 4, 3, 3) * 3.3)
    net, ref = conv(), conv()
    net(big), net(small.astype("float16"))
    ref(big)
    assert np.array_equal(net(small).asnumpy(), ref(small).asnumpy())
    with gluon_amp.autocast(enabled=False):
        assert np.array_equal(ref(small).asnumpy(), conv()(small).asnumpy())  # float32 there: FP32's bits
