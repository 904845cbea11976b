"""Operators gluon_amp compiles itself, in MXNet's process (MXNet 1.9.1).

A library built against the headers MXNet's wheel ships (``include/``) registers its ops into
libmxnet's registry when it is loaded (its static initialisers run). ``mx.library.load`` is
not used: it is for libraries of MXNet's ``lib_api.h`` and, after loading one, regenerates
every op function of ``mx.nd`` and ``mx.sym``, which would undo init's patches. The op
functions gluon_amp needs are generated here, from the op handle, with MXNet's own code
generator (1.9.1: ``mxnet.ndarray.register._make_ndarray_function``), and are not put in
``mx.nd``. If that generator changes, :func:`ndarray_function` fails and emulation falls back.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Dict

import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call

_loaded: Dict[str, ctypes.CDLL] = {}

__all__ = ["mxnet_build_facts", "load_op_library", "op_registered", "ndarray_function"]


def mxnet_build_facts() -> Dict[str, Any]:
    """What a library built against this MXNet must match: its version, ``libmxnet.so``
    (path, size, modification time), the headers' folder and whether oneDNN is built in."""
    lib = os.path.realpath(_LIB._name)
    st = os.stat(lib)
    return {"mxnet": mx.__version__, "libmxnet": lib, "libmxnet_size": st.st_size,
            "libmxnet_mtime": int(st.st_mtime), "include": mx.libinfo.find_include_path(),
            "mkldnn": mx.runtime.Features().is_enabled("MKLDNN")}


def load_op_library(path: str) -> ctypes.CDLL:
    """Load the shared library at ``path`` into this process (once): its ops register."""
    path = os.path.realpath(path)
    if path not in _loaded:
        _loaded[path] = ctypes.CDLL(path)
    return _loaded[path]


def op_registered(name: str) -> bool:
    """True when an op called ``name`` is in MXNet's registry."""
    handle = OpHandle()
    return _LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)) == 0 and bool(handle.value)


def ndarray_function(name: str) -> Callable[..., mx.nd.NDArray]:
    """An ``mx.nd``-style function for the registered op ``name`` (not added to ``mx.nd``)."""
    from mxnet.ndarray.register import _make_ndarray_function
    handle = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
    return _make_ndarray_function(handle, name, name)
