"""Dtype objects and names, and host views of arrays (MXNet 1.9.1)."""
from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np
import mxnet as mx


#: MXNet 1.x spells bfloat16 as this structured NumPy dtype (1.9.1: mxnet/ndarray/ndarray.py
#: ``bfloat16``). If MXNet gains a real bfloat16 dtype, casts to bf16 need the new object.
BFLOAT16 = np.dtype([("bfloat16", np.uint16)])


#: MXNet's float dtype objects -> names: ``NDArray.dtype`` is a NumPy scalar type (or
#: BFLOAT16), ``mx.np`` arrays give ``np.dtype`` instances, which hash differently. A dict
#: lookup, because patched ops read it on every call.
FLOAT_NAMES = {np.float16: "float16", np.float32: "float32", np.float64: "float64",
               BFLOAT16: "bfloat16", np.dtype("float16"): "float16",
               np.dtype("float32"): "float32", np.dtype("float64"): "float64"}


def to_mx_dtype(name: str) -> Any:
    """The object MXNet accepts as ``dtype=`` for a canonical dtype name."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


# -- host views ----------------------------------------------------------------------
# MXNet 1.9.1: ``NDArray.wait_to_read()`` waits for pending writes and the C API's
# ``MXNDArrayGetData`` gives the address of the array's first value (its offset included).
# NumPy reads it through ``__array_interface__`` of a holder that keeps the NDArray alive.
# No DLPack: its capsule destructor is a ctypes callback, Python code that a Ctrl-C landing
# in it turns into "SystemError: error return without exception set". NumPy has no
# bfloat16, so those arrays have no host view.

class _Memory:
    """Owns a reference to ``array`` while a view of its memory lives (the view's base)."""

    def __init__(self, array: mx.nd.NDArray, address: int, typestr: str) -> None:
        self.array = array
        self.__array_interface__ = {"data": (address, True), "shape": tuple(array.shape),
                                    "typestr": typestr, "version": 3}


def host_view(array: mx.nd.NDArray) -> Optional[np.ndarray]:
    """A read-only NumPy view of a CPU float32/float16 array's memory (after its pending
    writes), or None where there is none (other devices, dtypes, storage types)."""
    name = FLOAT_NAMES.get(array.dtype)
    if array.ctx.device_type != "cpu" or array.stype != "default" or name not in ("float32", "float16"):
        return None
    array.wait_to_read()
    if array.size == 0:
        return np.empty(array.shape, dtype=name)
    address = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(array.handle, ctypes.byref(address)))
    return np.asarray(_Memory(array, address.value, "<f4" if name == "float32" else "<f2"))


def legacy(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """``array`` as a legacy ``mx.nd.NDArray``, for MXNet's legacy ops (``multi_sum_sq``,
    ``amp_cast``, ``all_finite``, ``amp_multicast``), which refuse ``mx.np`` arrays: a numpy
    array's zero-copy view (1.9.1: ``as_nd_ndarray``, a shallow copy of its handle, writes
    shared), a legacy array itself."""
    return array.as_nd_ndarray() if isinstance(array, mx.np.ndarray) else array


def cast_array(array: mx.nd.NDArray, dtype: str) -> mx.nd.NDArray:
    """``array`` cast to ``dtype`` by MXNet's ``amp_cast`` (exact between float32 and either
    low dtype's values), in ``array``'s frontend: a numpy array gives a numpy array."""
    out = mx.nd.amp_cast(legacy(array), dtype=to_mx_dtype(dtype))
    return out.as_np_ndarray() if isinstance(array, mx.np.ndarray) else out


# -- gradients a cast would drop -----------------------------------------------------------
# MXNet 1.9.1: the CPU ``amp_cast`` between float32 and bfloat16 (oneDNN's reorder,
# ``AMPCastExCPU``) never commits a result written with ``req=kAddTo``, so the gradient of a
# leaf whose ``grad_req`` is ``'add'`` stays zero when that cast's backward writes it.
# ``NDArray.grad`` is None for an array with no gradient attached; the C API does not say
# which ``grad_req`` it was attached with.

def leaf_with_grad(array: mx.nd.NDArray) -> bool:
    """True for a CPU float32 array with a gradient attached, while autograd records: a cast's
    backward would write its gradient directly (``'add'`` possibly)."""
    return (array.dtype == np.float32 and mx.autograd.is_recording() and array.ctx.device_type == "cpu"
            and array.grad is not None)
