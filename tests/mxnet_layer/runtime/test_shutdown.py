"""gluon_amp.mxnet_internals.shutdown: a program that ends with Python custom-op work still queued
exits, as it would if MXNet did not stop its custom-op thread before its last wait (it hangs there
under plain MXNet 1.9.1). Each program runs in a subprocess: a hang fails the test by timeout."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from helpers import ROOT

_OPS = '''
import sys, time
import mxnet as mx


class Slow(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(0.3)  # the second op is handed to the custom-op thread after exit began
        print("ran", float(in_data[0].asnumpy()[0]), flush=True)
        if float(in_data[0].asnumpy()[0]) >= FAIL_AT:
            raise ValueError("planted failure")
        self.assign(out_data[0], req[0], in_data[0] + 1)


@mx.operator.register("shutdown_slow")
class SlowProp(mx.operator.CustomOpProp):
    def list_arguments(self): return ["x"]
    def list_outputs(self): return ["y"]
    def infer_shape(self, s): return s, [s[0]], []
    def create_operator(self, ctx, shapes, dtypes): return Slow()


y = mx.nd.Custom(mx.nd.Custom(mx.nd.ones((2,)), op_type="shutdown_slow"), op_type="shutdown_slow")
print("end", flush=True)
'''

# where gluon_amp is imported: before MXNet, after MXNet ran an op, or by the launcher
_STARTS = {
    "imported first": "import gluon_amp\n",
    "imported after MXNet ran": "import mxnet as mx\nmx.nd.ones((1,)).wait_to_read()\nimport gluon_amp\n",
    "launcher": "",
}


def _run(start: str, fail_at: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLUON_AMP_TUNE": "0"}
    code = _STARTS[start] + f"FAIL_AT = {fail_at}\n" + textwrap.dedent(_OPS)
    with tempfile.TemporaryDirectory(prefix="shutdown-") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w") as f:
            f.write(code)
        cmd = [sys.executable, *(["-m", "gluon_amp.run"] if start == "launcher" else []), path]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd=folder)


@pytest.mark.parametrize("start", sorted(_STARTS))
def test_queued_custom_ops_run_before_the_process_exits(start):
    r = _run(start, fail_at=99.0)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split()
    assert lines[0] == "end" and r.stdout.count("ran") == 2, r.stdout  # both ops ran, after the program ended
    assert "ran 2.0" in r.stdout, r.stdout


def test_an_error_a_queued_custom_op_leaves_is_reported_at_exit():
    r = _run("imported first", fail_at=2.0)  # the second op fails, after the program ended
    assert r.returncode == 0, r.stderr[-2000:]  # as python treats an error in an atexit handler
    assert "ran 2.0" in r.stdout and "planted failure" in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])
    assert "MXNetError" in r.stderr and "atexit" in r.stderr, r.stderr[-2000:]  # MXNet's wait raised it
