"""Run a script or a module as ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would.

``sys.argv``, ``sys.path[0]`` and the ``__main__`` module (``__file__``, ``__loader__``,
``__spec__``, pickling of classes defined in it) are what the plain interpreter gives. The
launcher's own frames are left out of tracebacks (:func:`user_traceback`).
"""
from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import sys
import types
import zipfile
from typing import Any, Callable, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER_FILES = {os.path.join(os.path.dirname(_HERE), "run.py")}


def _fresh_main() -> types.ModuleType:
    """An empty ``__main__`` module, as the interpreter makes one, put in ``sys.modules``."""
    main = types.ModuleType("__main__")
    vars(main).update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    if "__mp_main__" in sys.modules:
        # multiprocessing, imported by the launcher (through mxnet), took the launcher's module as
        # the main one: a spawn worker's result of a class defined in the script could not be
        # unpickled, and Pool.map hung
        sys.modules["__mp_main__"] = main
    return main


def _as_python_m(name: str, set_argv0: bool) -> None:
    # runpy._run_module_as_main is the function python's own C main calls for ``-m MODULE`` and for
    # a directory or zip (there as "__main__"): running through it gives python's start-up failures
    # word for word (``python: No module named X``, exit code 1) and python's frames in tracebacks.
    # It runs the code in sys.modules["__main__"]'s namespace, so that is a fresh module first.
    _fresh_main()
    runpy._run_module_as_main(name, set_argv0)  # type: ignore[attr-defined]


def run_script(path: str, args: List[str]) -> None:
    """Run the file ``path`` (or a directory/zip with ``__main__.py``) as ``__main__``.

    Raises ``FileNotFoundError`` when there is nothing to run at ``path``.
    """
    if os.path.isdir(path) or (os.path.isfile(path) and zipfile.is_zipfile(path)):
        sys.argv[:] = [path, *args]
        # python DIR: sys.path[0] is DIR joined to the working directory (not normalised)
        where = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        if sys.flags.safe_path:
            sys.path.insert(0, where)
        else:
            sys.path[0] = where
        _as_python_m("__main__", False)
        return
    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # as python: not normalised
    with io.open_code(filename) as f:  # FileNotFoundError as python's "can't open file"
        source = f.read()
    code = compile(source, filename, "exec", dont_inherit=True)
    main = _fresh_main()
    vars(main).update(__file__=filename, __cached__=None,
                      __loader__=importlib.machinery.SourceFileLoader("__main__", filename))
    sys.argv[:] = [path, *args]
    if not sys.flags.safe_path:  # -P: python adds nothing; else the script's real directory
        sys.path[0] = os.path.dirname(os.path.realpath(filename))
    exec(code, vars(main))


def run_module(name: str, args: List[str]) -> None:
    """Run module ``name`` (a package: its ``__main__``) as ``python -m`` does; ``sys.path[0]``
    stays the working directory, as it is for the launcher itself. A module that cannot be run
    ends the process as python's would (``SystemExit`` with python's message)."""
    sys.argv[:] = ["-m", *args]  # as python -m while it looks for the module; then the module's file
    _as_python_m(name, True)


def _launcher_frame(tb: types.TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return (os.path.dirname(filename) == _HERE or filename in _LAUNCHER_FILES
            or filename == runpy.__file__ or filename.startswith("<frozen runpy"))


def user_traceback(tb: Optional[types.TracebackType]) -> Optional[types.TracebackType]:
    """``tb`` as ``python`` would show it: from the frame the launcher's runner called on (for
    ``-m`` and directories, python's own runpy frames; ``None`` when the failure came before the
    program's first line, e.g. a script's ``SyntaxError``). Without a runner frame, ``tb`` less its
    leading launcher/runpy frames (all of it if nothing else is left)."""
    found, after = False, None
    first = tb
    while first is not None and _launcher_frame(first):
        if first.tb_frame.f_code in _RUNNERS:
            found, after = True, first.tb_next
        first = first.tb_next
    if found:
        return after
    return first if first is not None else tb


_RUNNERS = {run_script.__code__, run_module.__code__, _as_python_m.__code__}


def trimming_excepthook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook`` that shows the program's traceback as ``python`` would print it."""
    def excepthook(exc_type: type, exc: BaseException, tb: Optional[types.TracebackType]) -> Any:
        tb = user_traceback(tb)
        if isinstance(exc, BaseException):
            exc.__traceback__ = tb  # what python's own hook prints from
        return hook(exc_type, exc, tb)
    excepthook.__wrapped__ = hook  # type: ignore[attr-defined]
    return excepthook
