"""Issue 42 item 16: a program that fails before its first line runs ends under
``python -m gluon_amp.run`` exactly as under ``python``: the same stderr (less the launcher's own
``gluon_amp.run:`` lines) and the same exit code.

Generated: every start-up failure kind (a module that is missing, under a missing parent, a
package without ``__main__``, a relative name, a SyntaxError in a module, in a package's
``__init__``; a file that is missing, with a SyntaxError/IndentationError/TabError; a directory or
zip without ``__main__``, a directory whose ``__main__`` does not compile) x each way to name it.
Costs (2 shared cores): each case runs ``python`` (0.1 s) and the launcher (3-4 s, it imports
MXNet), four cases at a time; the issue's four cases run in ``make test-quick``, the rest are ``slow``.
"""
import concurrent.futures
import os
import subprocess
import sys
import zipfile

import pytest

from helpers import ROOT

BAD_SOURCES = {"syntax": "def f(:\n", "indent": "if True:\nx = 1\n", "tab": "if 1:\n\tx = 1\n        y = 2\n"}


def _tree(tmp) -> None:
    (tmp / "emptydir").mkdir()
    (tmp / "nspkg").mkdir()  # a namespace package: no __main__
    (tmp / "pkgerr").mkdir()
    (tmp / "pkgerr" / "__init__.py").write_text("import no_such_module_42\n")
    for kind, src in BAD_SOURCES.items():
        (tmp / f"bad_{kind}.py").write_text(src)
        (tmp / f"dir_{kind}").mkdir()
        (tmp / f"dir_{kind}" / "__main__.py").write_text(src)
    with zipfile.ZipFile(tmp / "nomain.zip", "w") as z:
        z.writestr("other.py", "")
    (tmp / "fails_late.py").write_text("import json\njson.loads('{')\n")  # a failure after start


def _cases():
    quick = [("module", "no_such_pkg_42.sub"), ("module", "json"), ("script", "emptydir"), ("script", "bad_syntax.py")]
    rest = [("module", "no_such_module_42"), ("module", "json.no_such_42"), ("module", ".relative"),
            ("module", "nspkg"), ("module", "pkgerr"), ("module", "pkgerr.sub"), ("module", "bad_syntax.py"),
            ("script", "missing_42.py"), ("script", "nomain.zip"), ("script", "fails_late.py"),
            ("module", "fails_late")]
    for kind in BAD_SOURCES:
        rest += [("module", f"bad_{kind}"), ("script", f"dir_{kind}")]
        if kind != "syntax":
            rest.append(("script", f"bad_{kind}.py"))
    for how, name in quick:
        yield pytest.param(how, name, False, id=f"{how}-{name}")
    for how, name in quick + rest:
        if how == "script":  # the same, named by absolute path
            yield pytest.param(how, name, True, id=f"{how}-abs-{name}", marks=pytest.mark.slow)
    for how, name in rest:
        yield pytest.param(how, name, False, id=f"{how}-{name}", marks=pytest.mark.slow)


def _argv(how: str, name: str, absolute: bool, tmp) -> list:
    if how == "module":
        return ["-m", name]
    return [str(tmp / name) if absolute else name]


def _run_case(tmp, how: str, name: str, absolute: bool):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    args = _argv(how, name, absolute, tmp)
    plain = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp, env=env,
                           timeout=60)
    launched = subprocess.run([sys.executable, "-m", "gluon_amp.run", "--emulate", "--no-tune", *args],
                              capture_output=True, text=True, cwd=tmp, env=env, timeout=300)
    return plain, launched


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every selected case's (python, launcher) runs, four at a time: each launcher spends its
    seconds importing MXNet, so running them side by side halves this file's time on 2 cores.
    The cases share one tree (nothing writes to it: no bytecode)."""
    tmp = tmp_path_factory.mktemp("startup")
    _tree(tmp)
    selected = [tuple(item.callspec.params[k] for k in ("how", "name", "absolute"))
                for item in request.session.items
                if getattr(item, "originalname", None) == "test_a_program_that_cannot_start_ends_as_under_python"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = dict(zip(selected, pool.map(lambda case: _run_case(tmp, *case), selected)))
    return runs


@pytest.mark.parametrize("how, name, absolute", list(_cases()))
def test_a_program_that_cannot_start_ends_as_under_python(outcomes, how, name, absolute):
    plain, launched = outcomes[(how, name, absolute)]
    err = [line for line in launched.stderr.splitlines() if not line.startswith("gluon_amp.run:")]
    assert plain.returncode != 0  # the case fails under python: that is the point
    assert (launched.returncode, err) == (plain.returncode, plain.stderr.splitlines()), launched.stderr[-3000:]
