"""The kernel timing scan (gluon_amp.conformance.speed) and what its recorded facts do to a plan.

MXNet's element-wise loops outside oneDNN run in bfloat16 on every CPU (they need no bfloat16
instructions), so the scan's machinery runs on any host. What the timings say is the hardware's:
where oneDNN has no bfloat16 kernels, its casts between float32 and bfloat16 are slow loops too,
and the float32 side of a timing is no longer what a native host runs; those checks carry the
hardware marker."""
import numpy as np
import pytest
from mxnet import gluon, npx

import gluon_amp
import mxnet as mx
from gluon_amp.conformance import speed
from gluon_amp_core.kernel_speed import timing_from_row
from gluon_amp_core.lists import kernel_speed as data
from gluon_amp_core.table import split_key

ONEDNN = ("Activation", "Pooling", "BatchNorm", "Concat", "elemwise_add", "add_n", "LeakyReLU", "softmax")


def _recorded():
    return [timing_from_row(r) for r in data.TIMINGS]


def _retime(t):
    op, _ = split_key(t.key)
    case = next(c for c in speed.cases_of(op)[0] if speed._key(op, c) == t.key)
    fp32_ms, low_ms = speed.time_case(op, case, gluon_amp.conformance.runner.apis_of(op)[0])
    return low_ms / fp32_ms


@pytest.mark.bf16_kernels
def test_the_slowest_recorded_loops_are_slow_here():
    """The three keys recorded slowest (3x and more) outside oneDNN are slow on this CPU too."""
    loops = sorted((t for t in _recorded() if t.ratio >= 3 and split_key(t.key)[0] not in ONEDNN),
                   key=lambda t: -t.ratio)[:3]
    assert len(loops) == 3
    for t in loops:
        assert _retime(t) > 1.5, t


@pytest.mark.bf16_kernels
def test_onednn_kernels_recorded_fast_are_fast_here():
    """What this CPU's bfloat16 kernels give: oneDNN's ReLU and sum faster than float32 with casts."""
    fast = [t for t in _recorded() if t.key in ("Activation:act_type=relu", "elemwise_add")]
    assert {t.key for t in fast} == {"Activation:act_type=relu", "elemwise_add"}
    for t in fast:
        assert _retime(t) < 1.0, t


def test_the_scan_times_each_case_and_writes_rows_a_module_reads_back():
    timings, untimed = speed.run_all(["relu", "broadcast_add", "where", "LRN"])
    assert [t.key for t in timings] == ["relu", "broadcast_add", "where"]  # one case each, in order
    assert "spec" in untimed["LRN"] and "relu" not in untimed
    sigmoid = speed.SPECS["Activation"][1]
    assert speed._key("Activation", sigmoid) == "Activation:act_type=sigmoid"  # one key per attribute value
    assert all(t.dtype == "bfloat16" and t.fp32_ms > 0 and t.low_ms > 0 for t in timings)
    text = speed.data_module(timings, untimed, ("host-x", "cpu", "flags", "1.9.1", "cmd"))
    space = {}
    exec(compile(text, "kernel_speed_measured_x.py", "exec"), space)  # noqa: S102  our own generated module
    assert [timing_from_row(r) for r in space["TIMINGS"]] == timings
    assert space["MEASURED_HOST"][0] == "host-x" and space["UNTIMED"] == untimed


def test_only_ops_a_plan_may_run_low_are_timed():
    ops = speed.candidates()
    assert "broadcast_add" in ops and "_npi_add" in ops and "relu" in ops
    assert "Convolution" not in ops and "transpose" not in ops  # the probe's; float32 already


class Residual(gluon.HybridBlock):
    """d2l's residual block in numpy mode after a stem convolution: conv, conv, ``y + h``
    (``_npi_add`` of two bfloat16 values), ``npx.relu``."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.c0 = gluon.nn.Conv2D(8, 3, padding=1, in_channels=8)
            self.c1 = gluon.nn.Conv2D(8, 3, padding=1, in_channels=8)
            self.c2 = gluon.nn.Conv2D(8, 3, padding=1, in_channels=8)

    def hybrid_forward(self, F, x):
        h = self.c0(x)
        return F.npx.relu(self.c2(F.npx.relu(self.c1(h))) + h)


@pytest.mark.parametrize("emulate", [False, True])
def test_a_numpy_mode_residual_add_runs_float32_where_its_loop_is_slow(emulate):
    npx.set_np()
    try:
        net = Residual()
        net.initialize(mx.init.Xavier())
        net.hybridize()
        x = mx.np.array(np.random.RandomState(0).uniform(-1, 1, (2, 8, 8, 8)).astype("float32"))
        ref = net(x).asnumpy()
        cb = gluon_amp.convert_hybrid_block(net, "bfloat16", emulate=emulate, fuse=False)
        rows = gluon_amp.report(cb).rows
        assert {r.dtype for r in rows if r.op == "Convolution"} == {"bfloat16"}
        slow = [r for r in rows if r.op in ("_npi_add", "_npx_relu")]
        assert len(slow) == 3 and {r.dtype for r in slow} == {"float32"}, slow
        # the relu after a convolution and the add of two convolutions' outputs would run in
        # bfloat16; the last relu reads the add's float32 (widest)
        assert [r.reason for r in slow] == ["slow_kernel", "slow_kernel", "widest"], slow
        if emulate:
            out = cb(x).asnumpy()
            assert np.abs(out - ref).max() <= 0.03 * np.abs(ref).max()
    finally:
        npx.reset_np()


def test_the_command_names_what_it_refuses():
    import subprocess
    import sys
    for args, words in ((["--speed", "Convolution"], "outside the low-precision class: ['Convolution']"),
                        (["--speed", "--write", "relu"], "give no op names")):
        p = subprocess.run([sys.executable, "-m", "gluon_amp.conformance", *args], capture_output=True, text=True)
        assert p.returncode == 2 and words in p.stderr, (args, p.stderr[-500:])
