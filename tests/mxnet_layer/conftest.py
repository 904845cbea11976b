import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# The speed probe's cache: one per test process, never the user's (the probe runs once here),
# gone when the process ends.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gluon-amp-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# init()'s default tunes each new graph by timing it (seconds to minutes): the many small
# init tests run the op table's plan; tests/mxnet_layer/tuning/test_tuning.py tunes on purpose.
os.environ["GLUON_AMP_TUNE"] = "0"

import gluon_amp  # noqa: E402  first: its numpy shim runs before MXNet loads (docs/python.md)
import mxnet as mx  # noqa: E402
from gluon_amp_core.capability import Bf16  # noqa: E402
import helpers  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "bf16_kernels: executes bfloat16 kernels; skipped, naming the missing CPU "
        "feature, where oneDNN has none (below AVX-512, or DNNL_MAX_CPU_ISA caps it there)")
    config.addinivalue_line(
        "markers", "simulated_native: runs on a simulated native-bfloat16 host, on every CPU (a "
        "parameter's twin of one marked bf16_kernels; tests/README.md)")
    config.addinivalue_line(
        "markers", "slow: runs a benchmark, the notebook or a real client, or takes over 20 s on 2 cores; "
        "`make test-quick` (pytest -m 'not slow') leaves it out, `make test` runs it")


def pytest_collection_modifyitems(config, items):
    cap = gluon_amp.runtime.capability()
    if cap.bf16 is not Bf16.NONE:
        return
    skip = pytest.mark.skip(reason=f"needs bfloat16 kernels: {cap.why}")
    for item in items:
        if "bf16_kernels" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated():
    """Every test starts and ends with AMP off and MXNet's engine drained.

    A deferred kernel error surfaces here, in the test that caused it, not in the next.
    """
    gluon_amp.disable()
    mx.nd.waitall()
    env = dict(os.environ)
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # left outside any test
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    held = _lock_left_held()  # before disable(), which would wait on it for good
    try:
        mx.nd.waitall()
    finally:
        gluon_amp.disable()
        gluon_amp.state.reset()  # also forgets converted results and releases their hooks
    changed = _restore_environ(env)
    if held:
        pytest.fail(f"gluon_amp.state.lock was left held by {held} (a `with state.lock:` whose exit "
                    "did not run): every later call from another thread would hang on it")
    if left is not signal.default_int_handler:
        pytest.fail(f"the test left SIGINT's handler as {left!r}; Python's put back. Every later Ctrl-C test would "
                    "see it (MXNet's DataLoader, for one, sets SIG_IGN while it forks its workers and "
                    "leaves it there if that fails)")
    if changed:
        pytest.fail(f"the test left os.environ changed ({changed}); restored. Every program a later "
                    "test starts would inherit it (a leaked DNNL_MAX_CPU_ISA=AVX512_CORE_AMX kills "
                    "them with SIGILL)")


def _restore_environ(before: dict) -> str:
    """Put ``os.environ`` back as it was; name what differed ('' if nothing). pytest's own
    ``PYTEST_CURRENT_TEST`` changes with every phase."""
    now = dict(os.environ)
    changed = sorted(k for k in before.keys() | now.keys()
                     if before.get(k) != now.get(k) and k != "PYTEST_CURRENT_TEST")
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    return ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)


def _lock_left_held() -> str:
    """Who still holds ``gluon_amp.state.lock`` after a test ('' if nobody); this thread's
    hold is released, so the next tests run."""
    lock = gluon_amp.state.lock
    if lock._is_owned():
        while lock._is_owned():
            lock.release()
        return "the test's own thread"
    if not lock.acquire(timeout=10):  # a thread the test started may still be finishing
        return f"another thread, for 10 s ({lock!r})"
    lock.release()
    return ""


@pytest.fixture(autouse=True)
def _simulated_native(request):
    """A test (parameter) marked ``simulated_native`` runs on a simulated native host."""
    if request.node.get_closest_marker("simulated_native") is None:
        yield None
        return
    with gluon_amp.runtime.simulate_native_bf16() as cap:
        yield cap


@pytest.fixture(params=["simulated", pytest.param("real", marks=pytest.mark.bf16_kernels)])
def native_host(request):
    """A host that runs bfloat16 natively, twice: ``simulated`` on every CPU (a planted native
    capability and probe figures, bfloat16 kernels run as float32 ones with rounded outputs:
    ``gluon_amp.runtime.simulate_native_bf16``, tests/README.md), and ``real`` where this
    CPU has bfloat16 kernels (the ``bf16_kernels`` marker skips it elsewhere, naming the
    missing feature). Gives the capability in force; ``native_host.why`` says which it is.
    Subprocesses the test starts inherit the simulation (its environment variable)."""
    if request.param == "simulated":
        with gluon_amp.runtime.simulate_native_bf16() as cap:
            yield cap
    else:
        yield gluon_amp.runtime.capability()


@pytest.fixture(scope="session")
def no_bf16_why() -> str:
    """Why a no-bf16 process (``no_bf16_env``) has no bfloat16, as gluon_amp says it there.

    Tests check that this reason reaches the user, never its wording: it names the cap
    under the simulation and the missing ``avx512f`` on a real AVX2 CPU.
    """
    import subprocess
    code = "import gluon_amp; print(gluon_amp.runtime.capability().why)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=helpers.no_bf16_env(), timeout=300, check=True)
    why = r.stdout.strip().splitlines()[-1]
    assert why, "the no-bf16 process gave no reason"
    return why


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No download can happen: sockets refuse to connect, MXNet's home is empty."""
    import socket

    def refuse(*_a, **_k):
        raise RuntimeError("download attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("MXNET_HOME", str(tmp_path))
