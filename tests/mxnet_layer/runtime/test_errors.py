"""gluon_amp.mxnet_internals.errors: the line of an MXNet error that says what failed."""
import json
import os
import subprocess
import sys

import pytest
import mxnet as mx

from gluon_amp.mxnet_internals import error_line
from helpers import ROOT


def test_an_mxnet_error_gives_its_failed_check_not_its_traceback_header():
    with pytest.raises(mx.base.MXNetError) as caught:
        half = [mx.nd.ones(s, dtype="float16") for s in ((2, 3), (4, 3))]  # no float16 GEMM on a CPU
        mx.nd.FullyConnected(*half, num_hidden=4, no_bias=True).asnumpy()
    message = str(caught.value)
    assert message.strip().splitlines()[0].startswith("Traceback")  # what the first line says
    line = error_line(caught.value)
    assert line in message and "Traceback" not in line and ("Error" in line or "Check failed" in line)


@pytest.mark.parametrize("error, expected", [(ValueError("one line"), "one line"),
                                             (RuntimeError("first\nsecond"), "second"),
                                             (KeyError(), "KeyError"),
                                             (RuntimeError("x" * 500), "x" * 300)])
def test_other_errors(error, expected):
    assert error_line(error) == expected


def test_a_host_without_bfloat16_kernels_says_which_check_failed():
    """MXNet without oneDNN has no bfloat16 convolution on any CPU; the capability's reason
    quoted the first line of MXNet's message, "Traceback (most recent call last):"."""
    code = ("import json, warnings; warnings.simplefilter('ignore'); import gluon_amp; "
            "i = gluon_amp.runtime_info(); print(json.dumps([i['bf16'], i['bf16_why']]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "MXNET_MKLDNN_ENABLED": "0", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    bf16, why = json.loads(r.stdout.strip().splitlines()[-1])
    assert bf16 == "none" and "Traceback" not in why and "Unknown type enum 12" in why, why
