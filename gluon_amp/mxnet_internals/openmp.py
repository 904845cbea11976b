"""The OpenMP thread count libmxnet's operators and oneDNN run on, read from libgomp.

The 1.9.1 pip wheel links libgomp (``libgomp.so.1``), and MXNet sets its count when it starts
(``OpenMP::OpenMP``); reading it needs no MXNet API, only the runtime the wheel loaded.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import mxnet as mx  # noqa: F401  MXNet's start sets the count read below

__all__ = ["omp_threads"]


def omp_threads() -> Optional[int]:
    """libgomp's ``omp_get_max_threads()`` in this process, or None where libgomp is not loaded."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this OS
        return None
    n = lib.omp_get_max_threads()
    return n if n > 0 else None
