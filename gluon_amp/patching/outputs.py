"""What a block called from outside any block returns, in the dtype its caller works in.

A hybridized block's graph already gives float32 code float32 (:mod:`gluon_amp.execution`).
An un-hybridized one runs op by op, and its last low-precision op's output would reach the
caller as it is: a bfloat16 array, whose ``asnumpy()`` gives raw 16-bit words (NumPy has no
bfloat16), so ``mx.metric.Accuracy`` read 0 and printed predictions were garbage. Here its
outputs of the policy's low dtype come back in the dtype the caller works in, as a graph's do
(:func:`gluon_amp.execution.outputs_as_fed`): float32, or the one low dtype the caller fed
(GPU-style code, ``net.cast('float16')``, gets float16 under a bfloat16 policy too). Only the
outermost call: the blocks inside it pass low-precision values to each other as before.
"""
from __future__ import annotations

from typing import Any

from mxnet.ndarray import NDArray  # mx.np.ndarray is a subclass

from .. import mxnet_internals as mxi, state

_LOW = ("bfloat16", "float16")


def returned(block: Any, args: tuple, out: Any) -> Any:
    """``out`` of ``block(*args)`` as its caller gets it (the block hooks' ``returned``)."""
    policy = state.current_policy()
    if policy is None or not policy.enabled or policy.emulate or policy.target_dtype not in _LOW:
        return out  # emulation computes in float32 already
    if not _holds(out, policy.target_dtype) or _holds(args, policy.target_dtype):
        return out  # the output first: a graph gives its float32 code float32 already
    fed = {d for d in _LOW if _holds(args, d)}
    return _cast(out, policy.target_dtype, fed.pop() if len(fed) == 1 else "float32")


def _holds(args: Any, dtype: str) -> bool:
    """Whether an array of ``dtype`` is among ``args`` (nested lists and tuples)."""
    if isinstance(args, (list, tuple)):
        return any(_holds(a, dtype) for a in args)
    return _dtype_name(args) == dtype


def _cast(out: Any, dtype: str, want: str) -> Any:
    """``out`` with its arrays of ``dtype`` cast to ``want`` (nested lists and tuples kept)."""
    if isinstance(out, (list, tuple)):
        items = [_cast(o, dtype, want) for o in out]
        if all(a is b for a, b in zip(items, out)):
            return out
        if isinstance(out, list):
            return items
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out.astype(want) if _dtype_name(out) == dtype else out


def _dtype_name(value: Any) -> Any:
    return mxi.FLOAT_NAMES.get(value.dtype) if isinstance(value, NDArray) else None
