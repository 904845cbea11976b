"""gluon_amp/emulation_kernel: built once per machine into the user's cache, checked, or why not.

The kernel's values and training graphs are tested in test_emulation.py (on both paths). Here:
the cache and its key, the lock, the recorded outcome, with stand-in compilers (shell scripts
that log their calls), so nothing is compiled."""
import hashlib
import json
import os
import stat
import threading

import pytest

from gluon_amp import emulation_kernel, mxnet_internals as mxi
from gluon_amp.emulation_kernel import build


def _compiler(tmp_path, name, version="1.0", sleep=0.0, said="rounding.cc:1: error: planted failure"):
    """A stand-in C++ compiler: logs each call to ``<name>.log``, answers ``--version``, and
    fails every build with a planted error (after ``sleep`` seconds), saying ``said``."""
    log = tmp_path / f"{name}.log"
    script = tmp_path / name
    lines = "\n".join(f'echo "{line}" >&2' for line in said.splitlines())
    script.write_text(f"""#!/bin/sh
for a in "$@"; do if [ "$a" = "--version" ]; then echo "{name} {version}"; exit 0; fi; done
echo build >> "{log}"
sleep {sleep}
{lines}
exit 1
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), log


def _calls(log):
    return len(log.read_text().splitlines()) if log.exists() else 0


def _env(tmp_path, cxx):
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": cxx}


def test_a_failed_build_is_recorded_with_its_error_and_not_retried(tmp_path):
    cxx, log = _compiler(tmp_path, "fakecc")
    facts = mxi.mxnet_build_facts()
    first = build.ensure(facts, _env(tmp_path, cxx))
    again = build.ensure(facts, _env(tmp_path, cxx))
    assert first.library is None and "planted failure" in first.why and "exit status 1" in first.why
    assert again.library is None and "planted failure" in again.why and "recorded in" in again.why
    assert _calls(log) == 1
    recorded = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("failed.json")]
    assert len(recorded) == 1 and recorded[0]["key"]["compiler"] == "fakecc 1.0"
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written is left


def test_a_build_that_failed_on_a_full_disk_says_so_and_is_tried_again(tmp_path):
    """A full disk during the link was recorded as the compiler's failure for good ("collect2:
    error: ld returned 1"): the cause hidden, and a slower fallback from then on."""
    cxx, log = _compiler(tmp_path, "fullcc", said="/usr/bin/ld: final link failed: No space left on device\n"
                                                  "collect2: error: ld returned 1 exit status")
    facts = mxi.mxnet_build_facts()
    first = build.ensure(facts, _env(tmp_path, cxx))
    assert first.library is None and "No space left on device" in first.why and "not recorded" in first.why
    assert not list((tmp_path / "cache").rglob("failed.json"))
    build.ensure(facts, _env(tmp_path, cxx))
    assert _calls(log) == 2  # tried again


def test_a_compiler_killed_by_the_system_is_tried_again(tmp_path):
    """The OOM killer ending cc1plus was recorded as the compiler's failure for good."""
    cxx, log = _compiler(tmp_path, "oomcc", said="g++: fatal error: Killed signal terminated program cc1plus")
    facts = mxi.mxnet_build_facts()
    assert "not recorded" in build.ensure(facts, _env(tmp_path, cxx)).why
    build.ensure(facts, _env(tmp_path, cxx))
    assert _calls(log) == 2 and not list((tmp_path / "cache").rglob("failed.json"))


def test_a_switch_value_that_is_neither_on_nor_off_is_an_error_not_a_fallback(monkeypatch):
    """``GLUON_AMP_EMULATION_KERNEL=bogus`` fell back to MXNet's slower ops without a word."""
    monkeypatch.setenv(emulation_kernel.ENV, "bogus")
    with pytest.raises(ValueError, match="GLUON_AMP_EMULATION_KERNEL='bogus' is neither on nor off"):
        emulation_kernel._decide()


def test_processes_started_together_build_once(tmp_path):
    cxx, log = _compiler(tmp_path, "slowcc", sleep=1.0)
    facts, env, outcomes = mxi.mxnet_build_facts(), _env(tmp_path, cxx), []
    threads = [threading.Thread(target=lambda: outcomes.append(build.ensure(facts, env))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert _calls(log) == 1 and len(outcomes) == 3 and all(o.library is None for o in outcomes)


def test_another_compiler_builds_again(tmp_path):
    facts = mxi.mxnet_build_facts()
    for version in ("1.0", "2.0"):
        cxx, log = _compiler(tmp_path, f"cc{version[0]}", version=version)
        assert build.ensure(facts, _env(tmp_path, cxx)).library is None and _calls(log) == 1
    assert len(list((tmp_path / "cache").rglob("failed.json"))) == 2


def test_no_compiler_is_a_reason_and_writes_nothing(tmp_path):
    made = build.ensure(mxi.mxnet_build_facts(), _env(tmp_path, str(tmp_path / "missing-c++")))
    assert made.library is None and made.why == f"no C++ compiler: CXX={tmp_path / 'missing-c++'} was not found"
    assert not (tmp_path / "cache").exists()


def test_the_loaded_kernel_is_the_checked_build_of_this_source():
    """This process's kernel (built once per test session, in its cache folder)."""
    status = emulation_kernel.load()
    assert status.path == "kernel", status.why
    folder = os.path.dirname(status.library)
    outcome = json.load(open(os.path.join(folder, "ok.json")))
    assert outcome["error"] is None and outcome["key"]["mxnet"] == mxi.mxnet_build_facts()["mxnet"]
    for name, path in (("source", build.SOURCE), ("check", build.CHECK)):
        with open(path, "rb") as f:
            assert outcome["key"][name] == hashlib.sha256(f.read()).hexdigest()
    assert mxi.load_op_library(status.library).gluon_amp_kernel_version() == build.source_version()


def test_the_setting_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(emulation_kernel.ENV, "0")
    monkeypatch.setattr(emulation_kernel, "_status", emulation_kernel.KernelStatus("not used yet", ""))
    monkeypatch.setattr(emulation_kernel, "_function", emulation_kernel._function)  # restored after
    status = emulation_kernel.load()
    assert status == emulation_kernel.KernelStatus("fallback", f"{emulation_kernel.ENV}=0")
    assert emulation_kernel.round_function() is None


@pytest.mark.parametrize("dtype", ["float64", "half"])
def test_the_kernel_names_a_bad_dtype(dtype, capfd):
    """The kernel refuses without throwing (rounding.cc, rule 3): it says why on stderr, and
    libmxnet raises its own error, which quotes the node's attributes."""
    import mxnet as mx
    assert emulation_kernel.load().path == "kernel"
    with pytest.raises(mx.base.MXNetError, match=f"dtype : {dtype}"):
        emulation_kernel.round_function()(mx.nd.ones((2,)), dtype=dtype).asnumpy()
    assert f"_gluon_amp_round: dtype must be float16 or bfloat16, got {dtype}" in capfd.readouterr().err


@pytest.mark.parametrize("op", [emulation_kernel.OP_NAME, emulation_kernel.PAIR_OP_NAME])
def test_a_float64_input_is_refused_in_a_graph_and_imperatively(op, capfd):
    import mxnet as mx
    assert emulation_kernel.load().path == "kernel"
    fn = mxi.ndarray_function(op)
    inputs = [mx.nd.ones((2,), dtype="float64")] * (2 if op == emulation_kernel.PAIR_OP_NAME else 1)
    with pytest.raises(mx.base.MXNetError):
        fn(*inputs, dtype="float16").asnumpy()
    from gluon_amp.emulation_kernel import selftest
    names = ("x", "w")[:len(inputs)]
    sym = selftest._one_op_graph({"dtype": "float16"}, op, names)
    with pytest.raises(RuntimeError, match="simple_bind error"):
        sym.simple_bind(mx.cpu(), **{n: (2,) for n in names}, type_dict={n: "float64" for n in names})
    assert f"{op}: takes and gives float32, got a type flag 1" in capfd.readouterr().err


def test_the_check_finds_the_kernels_errors_reach_mxnet():
    """On a lent machine's image (Python 3.12.3 and g++ 13 there) a kernel that threw crashed
    its process at a bad dtype: the kernel no longer throws, and the check calls what must fail."""
    from gluon_amp.emulation_kernel import selftest
    assert emulation_kernel.load().path == "kernel"
    assert selftest.check_errors(mxi.ndarray_function(emulation_kernel.OP_NAME)) == []


def _passes_anything(x, dtype):
    return x


def _fails_saying_nothing_useful(x, dtype):
    import mxnet as mx
    raise mx.base.MXNetError("some other error")


@pytest.mark.parametrize("stand_in, finding", [(_passes_anything, "no error was raised"),
                                               (_fails_saying_nothing_useful, "the error does not say")])
def test_the_check_of_errors_can_fail(stand_in, finding):
    from gluon_amp.emulation_kernel import selftest
    assert emulation_kernel.load().path == "kernel"  # the graph calls below reach the real kernel
    found = selftest.check_errors(stand_in)
    # the imperative calls of each bad call fail; the graph's ones bind the real kernel and pass
    assert [f.split(":")[0] for f in found] == [f"{what} imperatively" for what, *_ in selftest.BAD_CALLS]
    assert all(finding in f for f in found)


def test_the_check_finds_a_graph_the_kernel_would_run():
    """The bound half of the check fails where the kernel accepts what it must refuse: here, a
    graph whose op is stood in for by one that takes any dtype."""
    import mxnet as mx
    from gluon_amp.emulation_kernel import selftest
    real = selftest._one_op_graph
    try:
        selftest._one_op_graph = lambda attrs: mx.sym.identity(mx.sym.var("x"))
        found = selftest.check_errors(mxi.ndarray_function(emulation_kernel.OP_NAME))
    finally:
        selftest._one_op_graph = real
    assert found == [f"{what} bound in a graph: no error was raised" for what, *_ in selftest.BAD_CALLS]


@pytest.mark.parametrize("signal_name, status, words", [
    ("SIGSEGV", "(exit status 255):", "Segmentation fault"),  # MXNet's own handler reports it
    ("SIGABRT", "(killed by SIGABRT):", ""),                   # std::terminate's way out
])
def test_a_check_that_crashes_refuses_the_build_and_says_how(tmp_path, signal_name, status, words):
    """A library that takes the checking process down (here: at load) is refused with how it
    died; the user's process never loads it."""
    import subprocess
    source = tmp_path / "crash.c"
    source.write_text("#include <signal.h>\n"
                      f"__attribute__((constructor)) static void boom(void) {{ raise({signal_name}); }}\n")
    library = tmp_path / "crash.so"
    subprocess.run(["c++", "-x", "c", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    why = build._check(str(library), dict(os.environ))
    # the environment may print before the crash (Python 3.12 warns about distutils there)
    assert why is not None and why.startswith(f"the built kernel failed its check {status}"), why
    assert words in why and "  " not in why, why


@pytest.mark.parametrize("op", [emulation_kernel.OP_NAME, emulation_kernel.PAIR_OP_NAME])
def test_a_shape_known_in_part_passes_both_ways(op):
    """An LSTM's zero begin state is ``(0, hidden)`` (batch unknown) and the FullyConnected after
    its rounding learns the batch only once it sees its data's rank: the rounding passes a shape
    known in part forward and what comes back (MXNet 1.9.1's example/rnn/bucketing could not be
    bound under emulation: 'InferShape pass cannot decide shapes')."""
    import mxnet as mx
    assert emulation_kernel.load().path == "kernel"
    state = mx.sym.zeros(shape=(0, 16), name="begin")
    inputs = [state] if op == emulation_kernel.OP_NAME else [state, mx.sym.Variable("w")]
    graph = json.loads(mx.sym.Group(inputs).tojson())
    graph["nodes"].append({"op": op, "name": "r", "attrs": {"dtype": "bfloat16"},
                           "inputs": [[i, 0, 0] for i, n in enumerate(graph["nodes"]) if n["name"] in ("begin", "w")]})
    graph["heads"] = [[len(graph["nodes"]) - 1, 0, 0]]
    graph["arg_nodes"] = [i for i, n in enumerate(graph["nodes"]) if n["op"] == "null"]
    rounded = mx.sym.load_json(json.dumps(graph))
    out = mx.sym.FullyConnected(rounded, num_hidden=8, name="h2h") + mx.sym.FullyConnected(
        mx.sym.Variable("x"), num_hidden=8, name="i2h")
    internals = out.get_internals()
    kw = {"x": (4, 3)} if op == emulation_kernel.OP_NAME else {"x": (4, 3), "w": (4, 16)}
    _, shapes, _ = internals.infer_shape_partial(**kw)
    got = dict(zip(internals.list_outputs(), shapes))
    rounded_name = "r_output" if op == emulation_kernel.OP_NAME else "r_output0"
    assert got["begin_output"] == (4, 16) and got[rounded_name] == (4, 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_unrolled_lstm_with_zero_begin_states_binds_and_runs_emulated(dtype):
    """example/rnn/bucketing's graph (mx.rnn.LSTMCell unrolled, begin states of unknown batch)
    in a Module under emulation: it binds, and its loss is FP32's within the dtype."""
    import mxnet as mx
    import numpy as np
    import gluon_amp

    def loss(emulate):
        if emulate:
            gluon_amp.init(target_dtype=dtype, emulate=True)
        try:
            cell = mx.rnn.LSTMCell(num_hidden=16, prefix="l0_")
            embed = mx.sym.Embedding(mx.sym.Variable("data"), input_dim=50, output_dim=8, name="embed")
            out = cell.unroll(5, inputs=embed, merge_outputs=True)[0]
            pred = mx.sym.FullyConnected(mx.sym.Reshape(out, shape=(-1, 16)), num_hidden=50, name="pred")
            sym = mx.sym.SoftmaxOutput(pred, mx.sym.Reshape(mx.sym.Variable("softmax_label"), shape=(-1,)),
                                       name="softmax")
            mod = mx.mod.Module(sym, context=mx.cpu())
            mod.bind([("data", (4, 5))], [("softmax_label", (4, 5))])
            mx.random.seed(0)
            mod.init_params(mx.init.Xavier())
            rng = np.random.RandomState(0)
            label = rng.randint(0, 50, (4, 5))
            mod.forward(mx.io.DataBatch([mx.nd.array(rng.randint(0, 50, (4, 5)))], [mx.nd.array(label)]),
                        is_train=False)
            p = mod.get_outputs()[0].asnumpy()
            return float(-np.log(p[np.arange(20), label.reshape(-1)]).mean())
        finally:
            gluon_amp.disable()

    assert abs(loss(True) - loss(False)) <= 0.02 * loss(False)


def test_a_compiler_named_with_its_arguments_is_run_with_them(tmp_path):
    """``CXX="ccache g++"`` or ``CXX="g++ -O2"`` (as make reads it) said "was not found" and
    fell back to MXNet's slower ops."""
    cxx, log = _compiler(tmp_path, "wordcc")
    outcome = build.ensure(mxi.mxnet_build_facts(), _env(tmp_path, f"{cxx} -DFROM_CXX=1"))
    assert outcome.library is None and "planted failure" in outcome.why and _calls(log) == 1
    assert "-DFROM_CXX=1" in outcome.why  # the command it ran, its words kept
