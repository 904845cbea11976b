"""Check and fix the numerics of mixed precision: :func:`compare` finds where a network
leaves FP32, op by op; :func:`bisect` finds the ops to keep in float32. Both emulate the
target dtype where this machine has no kernels for it (see :mod:`gluon_amp.emulation`)."""
from .bisect import BisectResult, bisect
from .compare import CompareReport, GradCompare, OpCompare, compare

__all__ = ["compare", "bisect", "CompareReport", "OpCompare", "GradCompare", "BisectResult"]
