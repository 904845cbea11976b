import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gluon_amp  # noqa: E402


@pytest.fixture(autouse=True)
def _amp_off():
    """Every test starts and ends with AMP off, whatever it did."""
    gluon_amp.disable()
    yield
    gluon_amp.disable()


def gluoncv_or_skip():
    """GluonCV is in the [bench] extra that `make test` installs; skip only outside it."""
    return pytest.importorskip("gluoncv")
