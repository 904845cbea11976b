"""MXNet's own warnings, placed where plain MXNet places them while gluon_amp's hooks run.

1.9.1's modules warn with a ``stacklevel`` counted over their own frames: mxnet/gluon/block.py's
"Parameter ... is not used by any computation" is raised in ``_build_cache`` with 4, to name the
caller of the block; mxnet/module/module.py's "rescale_grad is not normalized" with 2, to name
``fit``. The block hooks (:mod:`.gluon`) and the Module methods gluon_amp wraps add frames
between those, so under ``init`` such a warning named a line of gluon_amp, and Python's
once-per-location filter counted it there. While any hook is installed, the ``warnings`` of
the modules in :data:`MODULES` is one whose ``warn`` counts its ``stacklevel`` over frames
outside gluon_amp only; everything else is Python's ``warnings``.
"""
from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any, Optional, Set

from mxnet.gluon import block as _block, parameter as _parameter, utils as _gluon_utils
from mxnet.module import bucketing_module as _bucketing_module, module as _module
from mxnet.symbol import symbol as _symbol

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: MXNet's package folder: a warning from a hook its Module calls names the caller past it
MXNET_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(_block.__file__))) + os.sep


def warn(message: Any, category: Optional[type] = None, stacklevel: int = 1, source: Any = None) -> None:
    """``warnings.warn``, its ``stacklevel`` counted over frames outside gluon_amp."""
    frame, real, counted = sys._getframe(1), 1, 1
    while counted < stacklevel and frame.f_back is not None:
        frame, real = frame.f_back, real + 1
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            counted += 1
    warnings.warn(message, category, stacklevel=real + 1 + stacklevel - counted, source=source)


class _Warnings(types.ModuleType):
    """Python's ``warnings``, but for :func:`warn`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(warnings, name)


_PLAIN = _Warnings("warnings", warnings.__doc__)
_PLAIN.warn = warn  # type: ignore[attr-defined]
_holders: Set[int] = set()
#: MXNet's modules whose warnings name a caller (``stacklevel`` > 1) that gluon_amp's hooks or
#: wrapped methods can stand between (1.9.1: each does ``import warnings`` at its top)
MODULES = (_block, _module, _bucketing_module, _gluon_utils, _parameter, _symbol)


def hold(holder: object) -> None:
    """While ``holder`` (a set of hooks) is installed, MXNet's :data:`MODULES` warn through :func:`warn`."""
    _holders.add(id(holder))
    for module in MODULES:
        if module.warnings is warnings:
            module.warnings = _PLAIN


def release(holder: object) -> None:
    """``holder`` is removed: the last one out puts Python's ``warnings`` back (checked by identity)."""
    _holders.discard(id(holder))
    if not _holders:
        for module in MODULES:
            if module.warnings is _PLAIN:
                module.warnings = warnings
