"""The numpy alias shim (gluon_amp/_numpy_shim.py), in whichever venv runs it.

With numpy 1.23 (``make test`` on Python 3.11) it must leave numpy alone; with numpy 1.26
(``make test-numpy126``, what Python 3.12 installs) it must restore exactly ``bool``, ``int``
and ``float``, and what MXNet 1.9.1 and GluonCV 0.10 do with them must work.
"""
import builtins
import json
import os
import subprocess
import sys
import types

import numpy
import pytest

import gluon_amp
from gluon_amp import _numpy_shim

from helpers import ROOT
SHIM = os.path.join(ROOT, "gluon_amp", "_numpy_shim.py")
NUMPY = tuple(int(x) for x in numpy.__version__.split(".")[:2])
# numpy 1.24 removed these three aliases of builtins; 1.20-1.23 still serve them (deprecated)
EXPECTED = [] if NUMPY < (1, 24) else ["bool", "int", "float"]

# Prints which non-module names of numpy's namespace changed while the code in {body} ran.
_PROBE = """
import builtins, json, sys, types, warnings
import numpy
def names():
    return {{k: v for k, v in vars(numpy).items() if not isinstance(v, types.ModuleType)}}
before = names()
out = {{}}
{body}
after = names()
out["changed"] = sorted(k for k in after if k not in before or after[k] is not before[k])
out["builtins"] = sorted(k for k in out["changed"] if after[k] is getattr(builtins, k, None))
print("@@" + json.dumps(out))
"""


def _probe(body: str, **env: str) -> dict:
    code = _PROBE.format(body=body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                            **env})
    lines = [line for line in r.stdout.splitlines() if line.startswith("@@")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][2:])


def test_importing_gluon_amp_then_mxnet_and_gluoncv_changes_exactly_the_missing_aliases():
    out = _probe("import gluon_amp\nimport mxnet\nimport gluoncv\n"
                 "out['info'] = gluon_amp.runtime_info()['numpy_shim']")
    assert out["changed"] == sorted(EXPECTED)
    assert out["builtins"] == sorted(EXPECTED)  # each set to the builtin numpy 1.23 aliased
    assert out["info"] == EXPECTED


def test_off_switch_leaves_numpy_alone():
    out = _probe("try:\n    import gluon_amp\n    out['info'] = gluon_amp.runtime_info()['numpy_shim']\n"
                 "except ImportError:\n    out['info'] = 'ImportError'",
                 GLUON_AMP_NUMPY_SHIM="0")
    assert out["changed"] == []
    # numpy 1.23 still has the aliases: gluon_amp runs; with 1.26, MXNet cannot import
    assert out["info"] == ("off" if not EXPECTED else "ImportError")


def test_run_by_path_for_a_process_without_gluon_amp():
    """How the peer's processes (tests, benchmarks) get the shim without importing gluon_amp."""
    out = _probe(f"import runpy\nout['restored'] = runpy.run_path({SHIM!r})['restore_numpy_aliases']()\n"
                 "import mxnet\nfrom mxnet.contrib import amp\n"
                 "out['gluon_amp'] = sorted(m for m in sys.modules if m.startswith('gluon_amp'))")
    assert out["restored"] == EXPECTED and out["changed"] == sorted(EXPECTED)
    assert out["gluon_amp"] == []


def test_runtime_info_names_the_restored_aliases():
    assert gluon_amp.runtime_info()["numpy_shim"] == EXPECTED
    for name in EXPECTED:
        assert getattr(numpy, name) is getattr(builtins, name)


# ---------------------------------------------------------------- the shim on a stand-in numpy

@pytest.fixture
def fake_numpy(monkeypatch):
    fake = types.ModuleType("numpy")
    fake.__version__ = "1.26.4"
    monkeypatch.setitem(sys.modules, "numpy", fake)
    monkeypatch.setattr(_numpy_shim, "_state", {"off": None})
    monkeypatch.delenv(_numpy_shim.ENV, raising=False)
    return fake


def test_sets_only_what_numpy_lacks_once(fake_numpy):
    mine = object()
    fake_numpy.bool = mine
    assert _numpy_shim.restore_numpy_aliases() == ["int", "float"]
    assert fake_numpy.bool is mine and fake_numpy.int is int and fake_numpy.float is float
    assert _numpy_shim.restore_numpy_aliases() == []
    assert _numpy_shim.status() == ["int", "float"]


def test_leaves_numpy_2_alone(fake_numpy):
    fake_numpy.__version__ = "2.1.0"
    assert _numpy_shim.restore_numpy_aliases() == []
    assert not hasattr(fake_numpy, "int") and not hasattr(fake_numpy, "float")


def test_env_switch(fake_numpy, monkeypatch):
    monkeypatch.setenv(_numpy_shim.ENV, "0")
    assert _numpy_shim.restore_numpy_aliases() == [] and not hasattr(fake_numpy, "bool")
    assert _numpy_shim.status() == "off"
    monkeypatch.setenv(_numpy_shim.ENV, "off")
    with pytest.raises(ValueError, match=_numpy_shim.ENV):
        _numpy_shim.restore_numpy_aliases()


# ---------------------------------------------------------------- what MXNet and GluonCV do with them

def test_mx_np_assignment_and_indexing():
    import mxnet as mx
    a = mx.np.zeros((5,))
    a[mx.np.array([0, 3], dtype="int32")] = 2.0  # every assignment indexed by an array checks the key's dtype
    a[a > 1] = 7.0                                # boolean mask
    a[mx.np.array([False, True, False, False, True], dtype=numpy.bool_)] = 1.0
    assert a.asnumpy().tolist() == [7.0, 1.0, 0.0, 7.0, 1.0]
    assert a[True].shape == (1, 5)


def test_np_full_with_a_bool():
    import mxnet as mx
    x = mx.np.full((2, 3), True)
    assert x.dtype == numpy.bool_ and x.asnumpy().all()
    sym = mx.sym.np.full((2, 3), False)
    assert sym.infer_type()[1] == [numpy.bool_]
    assert mx.test_utils.default_rtols()[numpy.dtype(numpy.bool_)] == 0


def test_gluoncv_rcnn_anchors_and_hrnet_build():
    import mxnet as mx
    from gluoncv.model_zoo import get_model
    from gluoncv.model_zoo.rcnn.rpn.anchor import RPNAnchorGenerator
    gen = RPNAnchorGenerator(stride=16, base_size=16, ratios=(0.5, 1, 2), scales=(8, 16, 32),
                             alloc_size=(8, 8))
    gen.initialize()
    anchors = gen(mx.nd.zeros((1, 3, 5, 6))).asnumpy()
    assert anchors.shape == (1, 5 * 6 * 9, 4)
    # Faster R-CNN's nine base anchors (stride 16, ratios 0.5/1/2, scales 8/16/32), then shifted by the stride
    assert anchors[0, :9].tolist() == [
        [-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 199],
        [-56, -56, 71, 71], [-120, -120, 135, 135], [-248, -248, 263, 263],
        [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359]]
    assert (anchors[0, 9:18] - anchors[0, :9]).tolist() == [[16, 0, 16, 0]] * 9
    get_model("hrnet_w18_small_v1_c", pretrained=False)  # numpy.int in its constructor
