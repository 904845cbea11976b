"""The tests are split by layer: tests/core needs neither MXNet nor NumPy."""
import os
import subprocess
import sys

from helpers import ROOT

CODE = """
import sys
sys.modules["mxnet"] = None   # any import of MXNet or NumPy now raises ImportError
sys.modules["numpy"] = None
import pytest
# hypothesis's pytest plugin (the test extra) reads numpy's attributes when numpy is in sys.modules
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "tests/core"]))
"""


def test_the_core_tests_pass_without_mxnet_or_numpy():
    # Hypothesis (the [test] extra), loaded by pytest as a plugin, runs its own third-party plugins:
    # pydantic 1's (GluonTS needs pydantic 1) reads sys.modules["numpy"].ndarray, None here.
    env = {**os.environ, "HYPOTHESIS_NO_PLUGINS": "1"}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
