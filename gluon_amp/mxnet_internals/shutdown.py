"""MXNet's exit, made safe for Python custom operators (MXNet 1.9.1).

At exit, MXNet's ``atexit`` handler (``mxnet.base._notify_shutdown``, C: ``MXNotifyShutdown``)
stops the thread that runs Python ``CustomOp`` code, then waits for every queued operation.
An operation the engine hands to a custom op after that stop never runs, so the wait never
ends: a program that ends with custom-op work still queued hangs. A custom op fed by another
hangs every time; a training step whose backward runs a custom op hangs in about one run in
seven on a loaded 2-core host, with plain MXNet as with gluon_amp. Waiting for the queue first,
in a handler ``atexit`` runs before MXNet's (it runs the last registered first), lets the
custom ops finish. If MXNet renames that handler, :func:`drain_before_mxnet_shutdown` still
registers its own, which then runs first only if MXNet registered its handler before.
"""
from __future__ import annotations

import atexit

import mxnet as mx

__all__ = ["drain_before_mxnet_shutdown"]

_registered = False


def _drain() -> None:
    # An error an operation left behind is raised here, as MXNet's own wait would raise it.
    mx.nd.waitall()


def drain_before_mxnet_shutdown() -> None:
    """Make the process wait for MXNet's queued work before MXNet stops its custom-op thread
    at exit. Registers once; call it after ``mxnet`` is imported (its handler is registered at
    import), so that this one runs first."""
    global _registered
    if not _registered:
        atexit.register(_drain)
        _registered = True
