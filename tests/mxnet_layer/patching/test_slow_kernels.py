"""Ops whose bfloat16 kernel is timed slow (gluon_amp_core.kernel_speed) under ``init``: run
float32 where they would run in bfloat16, imperatively and in a hybridized block's plan (the
hooks' rewrite, gluon_amp.patching.hooks), in legacy and numpy mode; in any other dtype as
before. On a native host, simulated everywhere and real where the CPU has the kernels."""
import numpy as np
import pytest
from mxnet import autograd, gluon, npx

import gluon_amp
import mxnet as mx
from gluon_amp.mxnet_internals import to_mx_dtype

BF16 = to_mx_dtype("bfloat16")


class Block(gluon.HybridBlock):
    """Two convolutions' bfloat16 outputs into loops timed slow: broadcast_add, relu, a comparison."""

    def __init__(self, numpy_mode):
        super().__init__()
        self.numpy_mode = numpy_mode
        with self.name_scope():
            self.c1 = gluon.nn.Conv2D(8, 3, padding=1, in_channels=4)
            self.c2 = gluon.nn.Conv2D(8, 3, padding=1, in_channels=4)

    def hybrid_forward(self, F, x):
        a, b = self.c1(x), self.c2(x)
        if self.numpy_mode:
            return F.npx.relu(a + b) * (a < b)
        return F.relu(F.broadcast_add(a, b)) * F.broadcast_lesser(a, b)


@pytest.mark.parametrize("numpy_mode", [False, True], ids=["legacy", "numpy"])
def test_a_traced_plan_runs_slow_loops_float32(native_host, numpy_mode):
    if numpy_mode:
        npx.set_np()
    try:
        gluon_amp.init(target_dtype="bfloat16", tune=False)
        net = Block(numpy_mode)
        net.initialize(mx.init.Xavier())
        net.hybridize()
        values = np.random.RandomState(0).uniform(-1, 1, (2, 4, 6, 6)).astype("float32")
        x = (mx.np if numpy_mode else mx.nd).array(values)
        x.attach_grad()
        with autograd.record():
            y = net(x)
        y.backward()
        rows = gluon_amp.report(net).rows
        assert {r.dtype for r in rows if r.op == "Convolution"} == {"bfloat16"}
        slow = [r for r in rows if r.op not in ("Convolution",)]
        assert len(slow) == 4, rows
        assert all(r.dtype in ("float32", "bool_") for r in slow), slow  # numpy's comparison gives bool
        assert sum(r.reason == "slow_kernel" for r in slow) >= 3, slow
        assert y.dtype == np.float32 and np.isfinite(x.grad.asnumpy()).all()
    finally:
        gluon_amp.disable()
        if numpy_mode:
            npx.reset_np()


def test_imperative_slow_loops_run_float32_and_other_dtypes_as_given(native_host):
    a = mx.nd.amp_cast(mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (3, 5))), dtype=BF16)
    h = a.astype("float32").astype("float16")
    gluon_amp.init(target_dtype="bfloat16", tune=False)
    try:
        for out in (mx.nd.broadcast_add(a, a), mx.nd.relu(a), mx.nd.broadcast_lesser(a, a), a + a):
            assert out.dtype == np.float32
        ref = mx.nd.amp_cast(a, dtype="float32")
        np.testing.assert_array_equal(mx.nd.broadcast_add(a, a).asnumpy(), (ref + ref).asnumpy())
        # not the target dtype: as plain MXNet runs it
        assert mx.nd.broadcast_add(h, h).dtype == np.float16 and mx.nd.relu(h).dtype == np.float16
        # oneDNN's kernels are fast in bfloat16: they keep it
        assert mx.nd.elemwise_add(a, a).dtype == mx.nd.Activation(a, act_type="relu").dtype == a.dtype
    finally:
        gluon_amp.disable()


def _bfloat16_exact(values):
    """Where each float32 value is one bfloat16 holds (its low 16 bits zero)."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) & 0xFFFF) == 0


@pytest.mark.parametrize("api", ["module", "simple_bind"])
def test_a_symbol_traced_under_init_runs_slow_loops_float32_where_it_is_bound(native_host, api):
    """A Symbol's wrappers trace before dtypes are known; the bind retypes what runs, as a
    block's first build does: the sum of two bfloat16 convolutions comes back unrounded."""
    rng = np.random.RandomState(2)
    shape = (2, 4, 6, 6)
    gluon_amp.init(target_dtype="bfloat16", tune=False)
    try:
        x = mx.sym.var("data")
        a = mx.sym.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="c1")
        b = mx.sym.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="c2")
        sym = mx.sym.relu(mx.sym.broadcast_add(a, b, name="add"), name="act")
        arg_shapes, _, _ = sym.infer_shape(data=shape)
        values = {n: mx.nd.array(rng.uniform(-1, 1, s)) for n, s in zip(sym.list_arguments(), arg_shapes)}
        if api == "module":
            mod = mx.mod.Module(sym, data_names=["data"], label_names=None, context=mx.cpu())
            mod.bind(data_shapes=[("data", shape)], for_training=True)
            mod.set_params({k: v for k, v in values.items() if k != "data"}, {})
            mod.forward(mx.io.DataBatch([values["data"]]), is_train=True)
            out = mod.get_outputs()[0].asnumpy()
        else:
            exe = sym.simple_bind(mx.cpu(), data=shape)
            for k, v in values.items():
                v.copyto(exe.arg_dict[k])
            out = exe.forward(is_train=True)[0].asnumpy()
    finally:
        gluon_amp.disable()
    positive = out[out > 0]
    assert positive.size > 50 and np.isfinite(out).all()
    assert not _bfloat16_exact(positive).all(), "the add ran in bfloat16: its sums were rounded"
    assert _bfloat16_exact(positive).mean() < 0.5


class ManySums(gluon.HybridBlock):
    """Nine convolutions' bfloat16 outputs summed by one ``add_n`` of all nine, and one of eight:
    oneDNN's bfloat16 sum takes at most 8 inputs (lists/bfloat16.py)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.convs = gluon.nn.HybridSequential()
            for _ in range(9):
                self.convs.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=4))

    def hybrid_forward(self, F, x):
        outs = [c(x) for c in self.convs]
        return F.add_n(*outs, name="nine"), F.add_n(*outs[:8], name="eight")



@pytest.mark.parametrize("how", ["init", "convert"])
def test_a_sum_of_more_than_eight_runs_float32_and_of_eight_the_target(native_host, how):
    net = ManySums()
    net.initialize(mx.init.Xavier())
    x = mx.nd.array(np.random.RandomState(3).uniform(-1, 1, (2, 4, 6, 6)))
    if how == "convert":
        net.hybridize()
        net(x)
        run = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu())
        nine, eight = run(x)
        rows = gluon_amp.report(run).rows
    else:
        gluon_amp.init(target_dtype="bfloat16", tune=False)
        try:
            net.hybridize()
            x.attach_grad()
            with autograd.record():
                nine, eight = net(x)
                total = nine + eight
            total.backward()
            rows = gluon_amp.report(net).rows
        finally:
            gluon_amp.disable()
        assert np.isfinite(x.grad.asnumpy()).all()
    sums = {r.dtype: r.reason for r in rows if r.op == "add_n"}
    assert sums == {"float32": "slow_kernel", "bfloat16": "widest"}, [r for r in rows if r.op == "add_n"]
    assert {r.dtype for r in rows if r.op in ("Convolution", "_sg_mkldnn_conv")} == {"bfloat16"}  # fused or not
    # the nine summed in float32: not rounded to bfloat16; the eight in it
    nine = mx.nd.amp_cast(nine, dtype="float32").asnumpy() if nine.dtype != np.float32 else nine.asnumpy()
    assert not _bfloat16_exact(nine).all()
    assert _bfloat16_exact(mx.nd.amp_cast(eight, dtype="float32").asnumpy()).all()


def test_imperative_add_n_of_more_than_eight_runs_float32(native_host):
    rng = np.random.RandomState(4)
    xs = [mx.nd.amp_cast(mx.nd.array(rng.uniform(-1, 1, (3, 5))), dtype=BF16) for _ in range(9)]
    gluon_amp.init(target_dtype="bfloat16", tune=False)
    try:
        nine, eight = mx.nd.add_n(*xs), mx.nd.add_n(*xs[:8])
        alias = mx.nd.ElementWiseSum(*xs)
    finally:
        gluon_amp.disable()
    assert nine.dtype == alias.dtype == np.float32 and eight.dtype == BF16
    want = sum(mx.nd.amp_cast(a, dtype="float32").asnumpy() for a in xs)
    np.testing.assert_allclose(nine.asnumpy(), want, rtol=1e-6, atol=1e-6)
