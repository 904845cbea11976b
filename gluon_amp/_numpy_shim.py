"""The numpy aliases MXNet 1.9.1 and GluonCV 0.10 still use, restored before MXNet loads.

numpy 1.24 removed ``numpy.bool``, ``numpy.int`` and ``numpy.float`` (deprecated since 1.20,
where each was the builtin of that name). MXNet 1.9.1 reads ``numpy.bool`` on import and when
indexing or filling with booleans; GluonCV 0.10 reads ``numpy.float``/``numpy.int`` when it
builds R-CNN anchors, HRNet and in its COCO metric. Python 3.12 has no wheel of a numpy older
than 1.26, so there they are gone. :func:`restore_numpy_aliases` sets each missing one to the
builtin numpy 1.20-1.23 aliased, and nothing else; see docs/python.md.

This file imports only the standard library and numpy, never MXNet or the rest of gluon_amp,
so a process that must not import gluon_amp (the peer's, in tests and benchmarks) can run it
by path: ``runpy.run_path(<repo>/gluon_amp/_numpy_shim.py)["restore_numpy_aliases"]()``.
"""
from __future__ import annotations

import builtins
import os
import warnings
from typing import Dict, List, Optional, Union

ENV = "GLUON_AMP_NUMPY_SHIM"
ALIASES = ("bool", "int", "float")
_state: Dict[str, Optional[bool]] = {"off": None}  # as found by the last call in this process


def enabled() -> bool:
    """False when ``GLUON_AMP_NUMPY_SHIM=0``; unset or ``1`` is on. Other values raise ValueError."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: allowed values are 1 (restore the numpy aliases MXNet "
                         f"1.9.1 needs; the default) and 0 (leave numpy alone); set one of them or "
                         f"unset it")
    return value == "1"


def _numpy_major() -> int:
    import numpy
    return int(numpy.__version__.split(".")[0])


def _missing(numpy: object, name: str) -> bool:
    with warnings.catch_warnings():  # numpy 1.20-1.23 still serve them, with a DeprecationWarning
        warnings.simplefilter("ignore")
        return not hasattr(numpy, name)


def restore_numpy_aliases() -> List[str]:
    """Set each of ``numpy.bool``/``int``/``float`` that numpy lacks to the builtin of that name.

    Idempotent. Does nothing when turned off (``GLUON_AMP_NUMPY_SHIM=0``) or on numpy 2, which
    gluon_amp does not support. Returns the names this call set.
    """
    _state["off"] = not enabled()
    if _state["off"] or _numpy_major() >= 2:
        return []
    import numpy
    restored = [name for name in ALIASES if _missing(numpy, name)]
    for name in restored:
        setattr(numpy, name, getattr(builtins, name))
    return restored


def status() -> Union[str, List[str]]:
    """``'off'`` when the shim was turned off, else the aliases that hold the builtin in numpy's
    namespace.

    Read from numpy itself, so it is right however often the shim ran (numpy up to 1.23
    serves the aliases through its deprecation hook, not its namespace: ``[]`` there).
    """
    if _state["off"] if _state["off"] is not None else not enabled():
        return "off"
    import numpy
    return [name for name in ALIASES if vars(numpy).get(name) is getattr(builtins, name)]
