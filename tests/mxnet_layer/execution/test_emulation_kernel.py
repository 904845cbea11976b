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


def _compiler(tmp_path, name, version="1.0", sleep=0.0):
    """A stand-in C++ compiler: logs each call to ``<name>.log``, answers ``--version``, and
    fails every build with a planted error (after ``sleep`` seconds)."""
    log = tmp_path / f"{name}.log"
    script = tmp_path / name
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "{name} {version}"; exit 0; fi
echo build >> "{log}"
sleep {sleep}
echo "rounding.cc:1: error: planted failure" >&2
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
    with open(build.SOURCE, "rb") as f:
        assert outcome["key"]["source"] == hashlib.sha256(f.read()).hexdigest()
    assert mxi.load_op_library(status.library).gluon_amp_kernel_version() == build.source_version()


def test_the_setting_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(emulation_kernel.ENV, "0")
    monkeypatch.setattr(emulation_kernel, "_status", emulation_kernel.KernelStatus("not used yet", ""))
    monkeypatch.setattr(emulation_kernel, "_function", emulation_kernel._function)  # restored after
    status = emulation_kernel.load()
    assert status == emulation_kernel.KernelStatus("fallback", f"{emulation_kernel.ENV}=0")
    assert emulation_kernel.round_function() is None


@pytest.mark.parametrize("dtype", ["float64", "half"])
def test_the_kernel_names_a_bad_dtype(dtype):
    import mxnet as mx
    assert emulation_kernel.load().path == "kernel"
    with pytest.raises(mx.base.MXNetError, match=f"dtype must be float16 or bfloat16, got {dtype}"):
        emulation_kernel.round_function()(mx.nd.ones((2,)), dtype=dtype).asnumpy()
