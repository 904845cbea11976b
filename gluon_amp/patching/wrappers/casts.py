"""Casts the wrappers insert: ``amp_cast``/``amp_multicast`` for NDArrays and Symbols,
legacy and numpy frontends alike."""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import mxnet as mx
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.decide import PLAN_CAST_HINTS

from ... import mxnet_internals as mxi

# Copies of MXNet's cast functions: the wrappers call these, never the patched names
# (a cast op is never wrapped, but these stay valid whatever is patched).
_nd_amp_cast = mxi.copy_function(mx.nd.amp_cast)
_nd_identity = mxi.copy_function(mx.nd.identity)
_sym_amp_cast = mxi.copy_function(mx.sym.amp_cast)
_sym_amp_multicast = mxi.copy_function(mx.sym.amp_multicast)
_np_ndarray = mx.np.ndarray
#: The dtypes amp_cast converts (MXNet's type rule): it passes any other (float64, integers)
#: through as it is, so AMP leaves those alone, in graphs and imperatively alike.
CASTABLE = {t: n for t, n in mxi.FLOAT_NAMES.items() if n != "float64"}
_np_symbol = mxi.NP_SYMBOL


def cast_nd(x: NDArray, dtype: str) -> NDArray:
    legacy = x.as_nd_ndarray() if isinstance(x, _np_ndarray) else x  # amp_cast is a legacy op: a zero-copy view
    if dtype == "bfloat16" and mxi.leaf_with_grad(legacy):
        # the cast's backward would drop a gradient added to the leaf's: an identity takes it
        # (gluon_amp_core.accumulating_casts, where graphs do the same)
        legacy = _nd_identity(legacy)
    out = _nd_amp_cast(legacy, dtype=mxi.to_mx_dtype(dtype))
    return out.as_np_ndarray() if isinstance(x, _np_ndarray) else out


def cast_into(x: NDArray, out: NDArray) -> NDArray:
    """``x`` cast to ``out``'s float dtype, written into ``out``."""
    if isinstance(out, _np_ndarray):
        _nd_amp_cast(x.as_nd_ndarray(), dtype=out.dtype, out=out.as_nd_ndarray())
        return out
    return _nd_amp_cast(x.as_nd_ndarray() if isinstance(x, _np_ndarray) else x, dtype=out.dtype, out=out)


def either_frontend(op: Callable[..., NDArray]) -> Callable[..., NDArray]:
    """``op``, a legacy imperative op, taking numpy-frontend arrays too: they go through
    zero-copy views, and the result is in the frontend of the first array given (numpy mode
    refuses ``mx.np`` arrays to legacy ops, 1.9.1 ``_verify_all_legacy_ndarrays``)."""
    def run(*args: Any, **kwargs: Any) -> NDArray:
        first = next((a for a in args if isinstance(a, NDArray)), None)
        out = op(*[a.as_nd_ndarray() if isinstance(a, _np_ndarray) else a for a in args], **kwargs)
        return out.as_np_ndarray() if isinstance(first, _np_ndarray) else out

    return run


# The plan's casts carry names of their own (PLAN_CAST_HINTS), told from a user's amp_cast.
def cast_sym(x: Symbol, dtype: str) -> Symbol:
    name = mxi.auto_name(PLAN_CAST_HINTS["amp_cast"])
    if isinstance(x, _np_symbol):
        return _sym_amp_cast(x.as_nd_ndarray(), dtype=mxi.to_mx_dtype(dtype), name=name).as_np_ndarray()
    return _sym_amp_cast(x, dtype=mxi.to_mx_dtype(dtype), name=name)


def multicast_sym(xs: Sequence[Symbol], narrow: bool = False) -> List[Symbol]:
    is_np = [isinstance(x, _np_symbol) for x in xs]
    legacy = [x.as_nd_ndarray() if n else x for x, n in zip(xs, is_np)]
    out = _sym_amp_multicast(*legacy, num_outputs=len(xs), cast_narrow=narrow,
                             name=mxi.auto_name(PLAN_CAST_HINTS["amp_multicast"]))
    return [out[i].as_np_ndarray() if n else out[i] for i, n in enumerate(is_np)]
