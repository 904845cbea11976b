import os
import subprocess
import sys

import numpy
import pytest

from gluon_amp import _compat

from helpers import ROOT


def test_numpy_2_names_the_fix(monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.0.2")
    with pytest.raises(ImportError, match=r'pip install "numpy<2"'):
        _compat.check_numpy()


@pytest.mark.parametrize("version", ["1.23.5", "1.26.4"])
def test_numpy_1_is_accepted(monkeypatch, version):
    monkeypatch.setattr(numpy, "__version__", version)
    _compat.check_numpy()


def test_missing_mxnet_names_the_fix():
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "try:\n    import gluon_amp\nexcept ImportError as e:\n    print('IMPORTERROR', e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert "IMPORTERROR" in r.stdout and 'pip install "numpy<2" "mxnet==1.9.1"' in r.stdout


def test_unsupported_mxnet_version(monkeypatch):
    import mxnet
    monkeypatch.setattr(mxnet, "__version__", "2.0.0")
    with pytest.raises(ImportError, match="1.9"):
        _compat.import_mxnet()
