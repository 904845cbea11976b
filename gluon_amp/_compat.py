"""Import-time checks: a clear ImportError with the pip command that fixes it."""
from __future__ import annotations

SUPPORTED_MXNET = ("1.9",)
_FIX = 'pip install "numpy<1.24" "mxnet==1.9.1"   (or: pip install -e ".[cpu]")'


def check_numpy() -> None:
    import numpy
    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    if (major, minor) >= (1, 24):
        raise ImportError(
            f"gluon_amp needs numpy<1.24 (MXNet 1.9 uses aliases removed in 1.24); found numpy "
            f"{numpy.__version__}. Fix: {_FIX}")


def import_mxnet():
    check_numpy()
    try:
        import mxnet
    except ImportError as exc:
        raise ImportError(f"gluon_amp needs MXNet 1.9 ({exc}). Fix: {_FIX}; "
                          'on a CUDA 11.2 GPU machine: pip install "mxnet-cu112==1.9.1"') from exc
    if not mxnet.__version__.startswith(SUPPORTED_MXNET):
        raise ImportError(f"gluon_amp supports MXNet 1.9.x; found mxnet {mxnet.__version__}. Fix: {_FIX}")
    return mxnet
