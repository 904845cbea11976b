"""gluon_amp's rounding operator for emulation: built on first use, or the fallback, and why.

Emulation rounds every value the AMP plan holds in float16 or bfloat16. With MXNet's own ops
that takes 2 (float16) to 19 (bfloat16) passes over each value and a float16 conversion MXNet
does one value at a time; ``rounding.cc`` does it in one pass, in place where MXNet allows.
It is compiled on the first use of emulation in a process (:func:`load`) against the MXNet
installed, into the user's cache (:mod:`.build`), and loaded from there afterwards.

Where it cannot be had, emulation runs on MXNet's ops with the same values (the fallback),
and :func:`status` (``runtime_info()["emulation_kernel"]``) says why:

- no C++ compiler (``$CXX``, default ``c++``), or the build or its check failed;
- ``GLUON_AMP_EMULATION_KERNEL=0`` (or ``off``/``false``/``no``) in the environment;
- a GPU is visible (the operator runs on CPUs only).

The same library gives MXNet's ``amp_cast`` and ``amp_multicast`` a gradient of their backward
(MXNet 1.9.1 has none), so a gradient of a gradient runs through a plan's casts
(:func:`cast_gradients`, loaded on the first ``autograd.grad(..., create_graph=True)`` on a
thread that has run under a low-precision policy, with or without emulation).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from gluon_amp_core.emulate import PAIR_SUFFIX
from gluon_amp_core.switches import switched_off

#: The operator's name in MXNet's registry (``rounding.cc``).
OP_NAME = "_gluon_amp_round"
#: Its pair, ``(data, weight) -> (data, weight rounded)`` (:data:`gluon_amp_core.emulate.PAIR_SUFFIX`).
PAIR_OP_NAME = OP_NAME + PAIR_SUFFIX
#: Environment variable that turns the kernel off (``0``, ``off``, ``false``, ``no``).
ENV = "GLUON_AMP_EMULATION_KERNEL"

logger = logging.getLogger("gluon_amp.emulation_kernel")
_lock = threading.Lock()


@dataclass(frozen=True)
class KernelStatus:
    """Which rounding emulation uses in this process, and why.

    Attributes
    ----------
    path : str
        ``'kernel'`` (the compiled operator), ``'fallback'`` (MXNet's ops) or ``'not used yet'``
        (no emulation has run in this process; the first one decides).
    why : str
    library : str or None
        The loaded library, on the kernel path.
    """

    path: str
    why: str
    library: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The fields, for ``runtime_info()`` and JSON."""
        return asdict(self)


_status = KernelStatus("not used yet", "built or loaded on the first use of emulation in this process")
_function: Optional[Callable[..., Any]] = None
_forced: Optional[bool] = None
_gradients: Optional[KernelStatus] = None


def status() -> KernelStatus:
    """What :func:`load` decided, without deciding (or building) anything."""
    return _status


def load() -> KernelStatus:
    """Decide, once per process, whether emulation rounds with the kernel: build it if need be
    (:mod:`.build`), load it and generate its function. Never raises: a failure is the
    fallback, with the reason."""
    global _status, _function
    with _lock:
        if _status.path != "not used yet":
            return _status
        _status, _function = _decide()
        if _status.path == "kernel":
            logger.info("gluon_amp: emulation rounds with its compiled kernel (%s)", _status.why)
        else:
            logger.info("gluon_amp: emulation rounds with MXNet's ops (the fallback): %s", _status.why)
        return _status


def cast_gradients() -> KernelStatus:
    """Decide, once per process, whether the casts' gradients of ``rounding.cc`` are in
    MXNet's registry: the library loaded (built if need be), whatever emulation decided, as
    they are needed on a GPU too. ``path`` is ``'kernel'`` when they are, else ``'fallback'``
    with the reason. Never raises."""
    global _gradients
    with _lock:
        if _gradients is None:
            _gradients = _status if _status.path == "kernel" else _load_library()[0]
            logger.info("gluon_amp: casts' second gradients: %s (%s)", _gradients.path, _gradients.why)
        return _gradients


def active() -> bool:
    """True when emulation in this process rounds with the kernel (decided on first call)."""
    if _forced is not None:
        return _forced and load().path == "kernel"
    return load().path == "kernel"


def round_function() -> Optional[Callable[..., Any]]:
    """The kernel's ``mx.nd``-style function ``f(x, dtype=...)``, or ``None`` on the fallback."""
    return _function if active() else None


@contextlib.contextmanager
def forced(use: bool) -> Iterator[None]:
    """Within the block, emulation rounds with the kernel only if ``use`` (and it is loaded):
    ``forced(False)`` runs the fallback on a machine that has the kernel (tests do)."""
    global _forced
    saved, _forced = _forced, use
    try:
        yield
    finally:
        _forced = saved


def _decide() -> Tuple[KernelStatus, Optional[Callable[..., Any]]]:
    """The status and the kernel's function (``None`` on the fallback), decided now. A value
    of the switch that is neither on nor off is the caller's ``ValueError``, not a fallback."""
    off = switched_off(os.environ, ENV)
    try:
        import mxnet as mx
        if not off and mx.context.num_gpus() > 0:
            return KernelStatus("fallback", "a GPU is visible: the kernel runs on CPUs only"), None
    except Exception as exc:  # noqa: BLE001  whatever went wrong, emulation still runs
        return KernelStatus("fallback", f"loading the kernel failed: {type(exc).__name__}: {exc}"), None
    return _load_library()


def _load_library() -> Tuple[KernelStatus, Optional[Callable[..., Any]]]:
    """The library built (if need be), loaded and checked, and its rounding function; or the
    fallback and why."""
    if switched_off(os.environ, ENV):
        return KernelStatus("fallback", f"{ENV}={os.environ[ENV]}"), None
    try:
        from .. import mxnet_internals as mxi
        from . import build
        made = build.ensure(mxi.mxnet_build_facts(), os.environ, log=logger.warning)
        if made.library is None:
            return KernelStatus("fallback", made.why), None
        lib = mxi.load_op_library(made.library)
        version = lib.gluon_amp_kernel_version()
        if version != build.source_version() or not (mxi.op_registered(OP_NAME) and mxi.op_registered(PAIR_OP_NAME)):
            return KernelStatus("fallback", f"{made.library} is not this gluon-amp's kernel "
                                            f"(version {version}, expected {build.source_version()})"), None
        return KernelStatus("kernel", made.why, made.library), mxi.ndarray_function(OP_NAME)
    except Exception as exc:  # noqa: BLE001  whatever went wrong, emulation still runs
        return KernelStatus("fallback", f"loading the kernel failed: {type(exc).__name__}: {exc}"), None
