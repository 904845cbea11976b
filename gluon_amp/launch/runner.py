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


def run_script(path: str, args: List[str]) -> None:
    """Run the file ``path`` (or a directory/zip with ``__main__.py``) as ``__main__``.

    Raises ``FileNotFoundError`` when there is nothing to run at ``path``.
    """
    if os.path.isdir(path) or (os.path.isfile(path) and zipfile.is_zipfile(path)):
        # python DIR: sys.path[0] is DIR (runpy inserts it), not the working directory
        if not sys.flags.safe_path:
            del sys.path[0]
        sys.argv[:] = [path, *args]
        runpy.run_path(path, run_name="__main__")
        return
    filename = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # as python: not normalised
    with io.open_code(filename) as f:  # FileNotFoundError as python's "can't open file"
        source = f.read()
    code = compile(source, filename, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    vars(main).update(__file__=filename, __cached__=None, __package__=None, __spec__=None,
                      __loader__=importlib.machinery.SourceFileLoader("__main__", filename),
                      __builtins__=builtins, __annotations__={})
    sys.argv[:] = [path, *args]
    if not sys.flags.safe_path:  # -P: python adds nothing; else the script's real directory
        sys.path[0] = os.path.dirname(os.path.realpath(filename))
    sys.modules["__main__"] = main
    exec(code, vars(main))


def run_module(name: str, args: List[str]) -> None:
    """Run module ``name`` (a package: its ``__main__``) as ``python -m`` does, through
    :func:`runpy.run_module`; ``sys.path[0]`` stays the working directory, as it is for the
    launcher itself."""
    sys.argv[:] = [name, *args]  # runpy puts the module's file in argv[0] once found, as python -m
    runpy.run_module(name, {"__builtins__": builtins}, run_name="__main__", alter_sys=True)


def _launcher_frame(tb: types.TracebackType) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return (os.path.dirname(filename) == _HERE or filename in _LAUNCHER_FILES
            or filename == runpy.__file__ or filename.startswith("<frozen runpy"))


def user_traceback(tb: Optional[types.TracebackType]) -> Optional[types.TracebackType]:
    """``tb`` without its leading launcher/runpy frames (all of it if nothing else is left)."""
    first = tb
    while first is not None and _launcher_frame(first):
        first = first.tb_next
    return first if first is not None else tb


def trimming_excepthook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook`` that shows the program's traceback as ``python`` would print it."""
    def excepthook(exc_type: type, exc: BaseException, tb: Optional[types.TracebackType]) -> Any:
        tb = user_traceback(tb)
        if isinstance(exc, BaseException):
            exc.__traceback__ = tb  # what python's own hook prints from
        return hook(exc_type, exc, tb)
    excepthook.__wrapped__ = hook  # type: ignore[attr-defined]
    return excepthook
