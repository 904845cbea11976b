"""How many writes an array's memory has taken: its engine variable's version (MXNet 1.9.1).

MXNet counts every completed write to an array (``Engine::Var::version_``; its oneDNN layers
cache reordered weights by it). The C API does not expose it, so it is read from memory, at
the offsets of the 1.9.1 pip wheel's layout, and only after a check at first use that writes
to a fresh array move it as they must: where the check fails, :func:`write_count` gives None,
and callers do without the count.

Layout (``include/mxnet/ndarray.h``, ``engine.h``): an ``NDArrayHandle`` points at an
``NDArray`` whose first member is ``std::shared_ptr<Chunk> ptr_`` (its first word the
``Chunk*``); the ``Chunk`` holds ``Storage::Handle shandle`` (32 bytes),
``std::vector<Storage::Handle> aux_handles`` (24), ``std::shared_ptr<MKLDNNMemory> mkl_mem_``
(16: the wheel is built with oneDNN), then ``Engine::VarHandle var``; a ``Var`` is a vtable
pointer followed by ``size_t version_``.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import mxnet as mx

__all__ = ["write_count"]

_VAR_IN_CHUNK = 72
_VERSION_IN_VAR = 8


def _read(array: mx.nd.NDArray) -> Optional[int]:
    handle = array.handle.value
    if not handle:
        return None
    chunk = ctypes.c_void_p.from_address(handle).value
    if not chunk:
        return None
    var = ctypes.c_void_p.from_address(chunk + _VAR_IN_CHUNK).value
    if not var:
        return None
    return ctypes.c_size_t.from_address(var + _VERSION_IN_VAR).value


@functools.lru_cache(maxsize=None)
def readable() -> bool:
    """Whether versions read as MXNet keeps them: each write to one array moves its count by
    one and leaves another array's alone (checked once per process)."""
    try:
        a, b = mx.nd.zeros((4,)), mx.nd.zeros((4,))
        a.wait_to_read(), b.wait_to_read()
        before_a, before_b = _read(a), _read(b)
        if before_a is None or before_b is None:
            return False
        a[:] = 1
        a += 1
        a.wait_to_read()
        view = a.reshape((2, 2))
        view[:] = 3
        a.wait_to_read()
        return _read(a) == before_a + 3 and _read(b) == before_b
    except (ValueError, OSError, mx.base.MXNetError):  # an address ctypes cannot read
        return False


def write_count(array: mx.nd.NDArray) -> Optional[int]:
    """The number of writes ``array``'s memory has taken (views of it share the count), once
    the writes already pushed to it have completed (this waits for them); None where the
    count cannot be read (:func:`readable`)."""
    if not readable():
        return None
    array.wait_to_read()
    return _read(array)
