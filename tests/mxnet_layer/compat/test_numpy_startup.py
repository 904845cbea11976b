"""The startup hook (``gluon_amp-numpy-aliases.pth`` + ``_gluon_amp_startup.py``): in every
process of an environment where gluon-amp is installed, ``import mxnet`` or ``import gluoncv``
works first, on numpy 1.23 to 1.26 (issue 31, defect 1).

On numpy >= 1.24 (``make test-numpy126``) the tests fail without the hook: MXNet 1.9.1 raises
``AttributeError: module 'numpy' has no attribute 'bool'`` on import. On numpy 1.23 they check
that the hook ran at the first import of mxnet and left numpy alone.
"""
import json
import os
import shutil
import subprocess
import sys
import venv

import numpy

from helpers import ROOT
NUMPY = tuple(int(x) for x in numpy.__version__.split(".")[:2])
EXPECTED = [] if NUMPY < (1, 24) else ["bool", "int", "float"]
PTH = "gluon_amp-numpy-aliases.pth"

# What a fresh process sees: nothing heavy at start, then `import <first>` works and the
# finder has run (and gone). Printed as one JSON line.
_PROBE = """
import builtins, json, sys
at_start = sorted(m for m in ("numpy", "mxnet", "gluon_amp") if m in sys.modules)
waiting = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "NumpyAliasesBeforeMXNet"]
import {first}
import numpy
out = {{"at_start": at_start, "waiting": waiting,
       "after": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "NumpyAliasesBeforeMXNet"],
       "aliases": [n for n in ("bool", "int", "float") if vars(numpy).get(n) is getattr(builtins, n)],
       "startup": getattr(sys.modules.get("_gluon_amp_startup"), "__file__", None),
       "gluon_amp": "gluon_amp" in sys.modules}}
print("@@" + json.dumps(out))
"""


def _fresh(python: str, first: str, **env: str) -> dict:
    """Run the probe in a new process of ``python``: no PYTHONPATH, so only what is installed counts."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLUON_AMP_NUMPY_SHIM")}
    r = subprocess.run([python, "-c", _PROBE.format(first=first)], capture_output=True, text=True,
                       timeout=300, env={**clean, **env}, cwd="/")
    lines = [line for line in r.stdout.splitlines() if line.startswith("@@")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][2:])


def _check(out: dict) -> None:
    assert out["at_start"] == []  # interpreter start imports neither numpy nor MXNet nor gluon_amp
    assert out["waiting"] == ["NumpyAliasesBeforeMXNet"], "the .pth did not install the finder"
    assert out["after"] == []  # it ran at the first import of mxnet/gluoncv and stepped aside
    assert out["aliases"] == EXPECTED
    assert out["gluon_amp"] is False  # the hook runs the shim by path, not the package


def test_import_mxnet_first_in_this_environment():
    """This interpreter's own environment (``make test``/``make test-numpy126``: ``pip install -e .``)."""
    site_dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isfile(os.path.join(p, PTH))]
    assert site_dirs, (f"{PTH} is not in this environment's site-packages: install gluon-amp into it "
                       "(make install, or pip install -e .)")
    _check(_fresh(sys.executable, "mxnet"))


def test_import_gluoncv_first_in_this_environment():
    _check(_fresh(sys.executable, "gluoncv"))


def test_off_switch_keeps_the_hook_out():
    out = _fresh(sys.executable, "sys", GLUON_AMP_NUMPY_SHIM="0")
    assert out["waiting"] == [] and out["startup"] is None


def test_a_wheel_install_has_the_hook(tmp_path):
    """The other install path: the built wheel, pip-installed into a venv of its own that sees
    this environment's packages (numpy, MXNet, GluonCV) but not its gluon-amp."""
    src = tmp_path / "gluon-amp"  # (a folder named src confuses setuptools 84 here)
    src.mkdir()
    for name in ("setup.py", "README.md", "_gluon_amp_startup.py"):
        shutil.copy(os.path.join(ROOT, name), src)
    for name in ("gluon_amp", "gluon_amp_core"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, timeout=300, cwd=str(tmp_path))
    wheel = next((tmp_path / "dist").glob("gluon_amp-*.whl"))
    env_dir = tmp_path / "v"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # a path line (not an import line): this environment's packages, without running its .pth files
    outer = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "00-outer.pth"), "w") as f:  # read first: the next .pth imports from there
        f.write("\n".join(outer) + "\n")
    # Python 3.12 has no distutils, which MXNet imports: setuptools, a dependency there, brings
    # it back through a .pth file of its own, as it does where pip installs both together
    for hack in (os.path.join(p, "distutils-precedence.pth") for p in outer):
        if os.path.isfile(hack):
            shutil.copy(hack, site)
    # --ignore-installed: without it, pip --prefix uninstalls this environment's gluon-amp first
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--ignore-installed", "--prefix", str(env_dir),
                          str(wheel)], check=True, timeout=300)
    assert os.path.isfile(os.path.join(site, PTH))
    out = _fresh(python, "mxnet")
    _check(out)
    assert out["startup"] == os.path.join(site, "_gluon_amp_startup.py")
