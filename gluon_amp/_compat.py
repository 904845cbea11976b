"""Import-time checks: a clear ImportError with the pip command that fixes it."""
from __future__ import annotations

from . import _numpy_shim

SUPPORTED_MXNET = ("1.9",)
_FIX = 'pip install "numpy<2" "mxnet==1.9.1"   (or: pip install -e ".[cpu]")'


def check_numpy() -> None:
    """Refuse numpy 2, which MXNet 1.9.1 cannot run on (the shim restores 1.24-1.26's removals only)."""
    import numpy
    major = int(numpy.__version__.split(".")[0])
    if major >= 2:
        raise ImportError(
            f"gluon_amp needs numpy<2 (MXNet 1.9.1 is built against numpy 1.x); found numpy "
            f"{numpy.__version__}. Fix: {_FIX}")


def import_mxnet():
    check_numpy()
    _numpy_shim.restore_numpy_aliases()  # MXNet reads numpy.bool on import
    try:
        import mxnet
    except ImportError as exc:
        raise ImportError(f"gluon_amp needs MXNet 1.9 ({exc}). Fix: {_FIX}; "
                          'on a CUDA 11.2 GPU machine: pip install "mxnet-cu112==1.9.1"') from exc
    except AttributeError as exc:
        if _numpy_shim.status() != "off":
            raise
        import numpy
        raise ImportError(
            f"MXNet 1.9.1 does not import with numpy {numpy.__version__} while "
            f"{_numpy_shim.ENV}=0 ({str(exc).splitlines()[0]}): it uses numpy aliases that numpy 1.24 removed. "
            f"Fix: unset "
            f'{_numpy_shim.ENV}, or on Python 3.11: pip install "numpy<1.24"') from exc
    if not mxnet.__version__.startswith(SUPPORTED_MXNET):
        raise ImportError(f"gluon_amp supports MXNet 1.9.x; found mxnet {mxnet.__version__}. Fix: {_FIX}")
    return mxnet
