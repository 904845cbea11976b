import subprocess
import sys

import warnings

import pytest

from gluon_amp_core.capability import Bf16, Capability

import gluon_amp
from gluon_amp import runtime

import helpers


def test_runtime_info_reports_choice():
    info = gluon_amp.runtime_info()
    for key in ("mxnet", "onednn", "default_target_dtype", "cpu_avx512_bf16", "cpu_amx_bf16",
                "amx_permission", "DNNL_MAX_CPU_ISA", "bf16_isa"):
        assert key in info
    assert info["default_target_dtype"] in ("float16", "bfloat16", "float32")
    assert info["bf16"] in ("native", "emulated", "none") and info["bf16_why"]
    if not info["cpu_amx_bf16"]:
        assert info["amx_permission"] is False and info["bf16_isa"] != "avx512_core_amx"


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(runtime, "_state", {"amx_permission": None, "isa_set_by": None, "error": None,
                                            "isa_cap": None, "mxnet_first": False, "onednn_first": False})
    # setenv first: monkeypatch restores only what it saw, and enable_amx() may set the cap
    for name in ("DNNL_MAX_CPU_ISA", "GLUON_AMP_DISABLE_AMX"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(runtime.platform, "system", lambda: "Linux")
    monkeypatch.setattr(runtime.platform, "machine", lambda: "x86_64")


def test_amx_needs_both_cpu_flag_and_kernel_permission(fresh_state, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: False)
    assert runtime.enable_amx() is False
    import os
    assert "DNNL_MAX_CPU_ISA" not in os.environ  # never widen the ISA without permission


def test_amx_granted_sets_isa(fresh_state, monkeypatch):
    import os
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    assert runtime.enable_amx() is True
    assert os.environ["DNNL_MAX_CPU_ISA"] == "AVX512_CORE_AMX"


def test_user_isa_choice_is_respected(fresh_state, monkeypatch):
    import os
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    runtime.enable_amx()
    assert os.environ["DNNL_MAX_CPU_ISA"] == "AVX2"


def test_an_empty_isa_choice_chooses_nothing_and_amx_is_enabled(fresh_state, monkeypatch):
    # oneDNN 2.4 reads DNNL_MAX_CPU_ISA= as no cap, whose default leaves AMX out (measured)
    import os
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    assert runtime.enable_amx() is True and runtime.amx_active()
    assert os.environ["DNNL_MAX_CPU_ISA"] == "AVX512_CORE_AMX" and runtime._state["isa_set_by"] == "gluon_amp"


def test_a_lowercase_amx_choice_is_not_amx(fresh_state, monkeypatch):
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core_amx")  # oneDNN 2.4 ignores it: case-sensitive
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    assert runtime.enable_amx() is True and not runtime.amx_active()


@pytest.mark.parametrize("runs_amx", [True, False])
def test_mxnet_imported_first_is_checked_by_the_speed_of_amx(fresh_state, monkeypatch, runs_amx):
    # MXNet is in sys.modules here, as when a program imports it before gluon_amp: whether oneDNN
    # read the cap gluon_amp set is measured (planted here); without AMX the cap is what it read
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    monkeypatch.setattr(runtime, "_amx_runs", lambda: runs_amx)
    assert runtime.enable_amx() and runtime._state["mxnet_first"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.settle_isa()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert "DNNL_MAX_CPU_ISA" not in runtime.os.environ
    assert runtime.amx_active() is runs_amx and runtime.user_isa_cap() is None
    assert runtime.isa_cap() == ("AVX512_CORE_AMX" if runs_amx else None)
    if runs_amx:
        assert said == []
    else:
        assert len(said) == 1 and "import gluon_amp before MXNet runs anything" in said[0]


def test_gluon_amp_imported_first_needs_no_check(fresh_state, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: True)
    monkeypatch.delitem(sys.modules, "mxnet")  # as at gluon_amp's own import of MXNet
    assert runtime.enable_amx() and not runtime._state["mxnet_first"]
    monkeypatch.setitem(sys.modules, "mxnet", __import__("mxnet"))
    monkeypatch.setattr(runtime, "_amx_runs", lambda: pytest.fail("checked although MXNet came after"))
    runtime.settle_isa()
    assert runtime.amx_active()


#: MXNet imported, and run or not, before gluon_amp; then a bfloat16 convolution
_ORDERS = {"gluon_amp first": "import gluon_amp, mxnet as mx",
           "mxnet imported first": "import mxnet as mx; import gluon_amp",
           "an operator first": ("import mxnet as mx; mx.nd.Activation(mx.nd.ones((1, 4)), act_type='relu')"
                                 ".wait_to_read(); import gluon_amp")}


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_amx_is_reported_as_onednn_runs_it_whatever_came_first(order):
    # DNNL_VERBOSE names the kernel oneDNN ran: runtime_info must agree, and say why where it lost AMX
    code = (f"import warnings; warnings.simplefilter('always'); {_ORDERS[order]}; "
            + _KERNEL.split("; ", 1)[1])
    env = {k: v for k, v in helpers.no_bf16_env().items() if k != "DNNL_MAX_CPU_ISA"}
    env["DNNL_VERBOSE"] = "1"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    ran = {line.split(",")[4].split(":")[1] for line in r.stdout.splitlines()
           if line.startswith("dnnl_verbose,exec,cpu,convolution") and "mb2_ic16oc16" in line}
    _, isa, amx = r.stdout.strip().splitlines()[-1].split()
    assert ran in ({isa}, {isa + "_bf16"}), (order, ran, isa)
    assert (amx == "True") == (isa == "avx512_core_amx")
    lost = "amx_bf16" in runtime.cpu_flags() and amx == "False"
    assert ("before gluon_amp was imported" in r.stderr) == lost, r.stderr[-2000:]
    assert lost == ("amx_bf16" in runtime.cpu_flags() and order == "an operator first")


_KERNEL = ("import gluon_amp, mxnet as mx; from gluon_amp.mxnet_internals import BFLOAT16; "
           "from gluon_amp import runtime; c = runtime.capability(); "
           "x = mx.nd.amp_cast(mx.nd.ones((2, 16, 8, 8)), dtype=BFLOAT16); "
           "w = mx.nd.amp_cast(mx.nd.ones((16, 16, 3, 3)), dtype=BFLOAT16); "
           "mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=16, no_bias=True).wait_to_read(); "
           "print('ISA', c.isa.lower(), runtime.amx_active())")


@pytest.mark.bf16_kernels
@pytest.mark.parametrize("value", [None, "", "ALL", "AVX512_CORE_AMX", "avx512_core_amx", "avx2"])
def test_the_isa_reported_is_the_kernel_onednn_runs(value):
    # runtime_info's ISA against DNNL_VERBOSE's kernel, in a fresh process per DNNL_MAX_CPU_ISA value
    env = {k: v for k, v in helpers.no_bf16_env().items() if k != "DNNL_MAX_CPU_ISA"}
    env.update({"DNNL_VERBOSE": "1", **({} if value is None else {"DNNL_MAX_CPU_ISA": value})})
    r = subprocess.run([sys.executable, "-c", _KERNEL], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    ran = {line.split(",")[4].split(":")[1] for line in r.stdout.splitlines()
           if line.startswith("dnnl_verbose,exec,cpu,convolution") and "mb2_ic16oc16" in line}
    _, isa, amx = r.stdout.strip().splitlines()[-1].split()
    assert ran in ({isa}, {isa + "_bf16"}), (value, ran, isa)  # oneDNN names AMX's kernel avx512_core_amx_bf16
    assert (amx == "True") == (isa == "avx512_core_amx")


_PARENT = ("import os, subprocess, sys, gluon_amp, mxnet as mx; from gluon_amp import runtime; "
           "from gluon_amp.mxnet_internals import BFLOAT16; "
           "x = mx.nd.amp_cast(mx.nd.ones((2, 16, 8, 8)), dtype=BFLOAT16); "
           "w = mx.nd.amp_cast(mx.nd.ones((16, 16, 3, 3)), dtype=BFLOAT16); "
           "mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=16, no_bias=True).wait_to_read(); "
           "print('PARENT', runtime.amx_active(), os.environ.get('DNNL_MAX_CPU_ISA')); sys.stdout.flush(); "
           "sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)")
#: a program without gluon_amp, started by one that has it: plain MXNet's bfloat16 convolution
_CHILD = ("import os, numpy as np, mxnet as mx; bf = np.dtype([('bfloat16', np.uint16)]); "
          "x, w = (mx.nd.amp_cast(mx.nd.ones(s), dtype=bf) for s in ((2, 16, 8, 8), (16, 16, 3, 3))); "
          "e = mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=16, no_bias=True); "
          "print('CHILD', mx.nd.amp_cast(e, dtype='float32').asnumpy().sum(), os.environ.get('DNNL_MAX_CPU_ISA'))")


@pytest.mark.bf16_kernels
def test_a_program_started_by_a_gluon_amp_process_runs_mxnet_alone():
    # oneDNN keeps the cap it read; the environment passed on is the user's, so a child that runs
    # MXNet without gluon_amp is not sent to AMX without the tile permission (SIGILL on an AMX host)
    env = {k: v for k, v in helpers.no_bf16_env().items() if k != "DNNL_MAX_CPU_ISA"}
    r = subprocess.run([sys.executable, "-c", _PARENT, _CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    parent = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("PARENT", "CHILD")))
    _, left = parent["PARENT"].split()
    assert left == "None"  # nothing inherited
    assert parent["CHILD"].split()[0] == str(float(2 * 16 * 6 * 6 * 16 * 9)) and parent["CHILD"].endswith("None")


def test_no_amx_cpu_is_a_quiet_no_op(fresh_state, monkeypatch):
    called = []
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(runtime, "_request_amx_permission", lambda: called.append(1) or True)
    assert runtime.enable_amx() is False and not called


def test_resolve_warns_once_per_message(monkeypatch):
    emulated = Capability(0, Bf16.EMULATED, "AVX512_CORE", "no avx512_bf16: slower than float32")
    monkeypatch.setattr(runtime, "capability", lambda: emulated)
    monkeypatch.setattr(gluon_amp.state.process, "said", set())
    with pytest.warns(RuntimeWarning, match="slower than float32"):
        assert runtime.resolve("bfloat16").dtype == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.resolve("bfloat16").dtype == "bfloat16"   # said once already
    with pytest.warns(RuntimeWarning, match="stay in float32"):
        assert runtime.resolve(None).dtype == "float32"


def test_probe_matches_the_classification_of_this_host():
    cap = runtime.capability()
    assert (runtime._probe_bf16() is None) == (cap.bf16 is not Bf16.NONE)


def test_real_syscall_never_crashes():
    # On a CPU without AMX the kernel refuses; either way the process survives.
    code = "from gluon_amp import runtime; print(runtime._request_amx_permission())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() in ("True", "False")


_INFO = ("import gluon_amp{init}; info = gluon_amp.runtime_info(); "
         "print(repr((info['bf16'], info['bf16_why'])))")


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_an_emulated_init_does_not_change_what_the_capability_probe_finds(target):
    # The probe is cached per process: each answer comes from a fresh one. It runs MXNet's
    # own op functions, so the wrappers an emulated init installed cannot make it pass.
    def info(init):
        r = subprocess.run([sys.executable, "-c", _INFO.format(init=init)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip().splitlines()[-1]

    plain = info("")
    emulated = info(f"; gluon_amp.init(target_dtype={target!r}, emulate=True)")
    assert emulated == plain


def test_the_probe_calls_mxnets_functions_while_init_has_patched_them():
    expected = runtime._probe_bf16()
    gluon_amp.init(target_dtype="float16", emulate=True)
    assert runtime._probe_bf16() == expected
    assert (expected is None) == (runtime.capability().bf16 is not Bf16.NONE)
