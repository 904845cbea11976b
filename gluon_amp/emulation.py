"""Emulated float16/bfloat16 on any CPU: MXNet's side of :mod:`gluon_amp_core.emulate`.

Graphs (converted ones, and under ``init(emulate=True)`` each block's graph, through the
block hooks' rule in :mod:`gluon_amp.patching.hooks`) are typed by MXNet as real AMP would
run them, then rewritten by the pure core (:func:`emulate_symbol`). Imperative calls round
at the low-precision ops' inputs and outputs (see :func:`round_nd`).

Both round with gluon_amp's compiled kernel where it could be built and loaded
(:mod:`gluon_amp.emulation_kernel`), else with MXNet's ops: the same values, bit for bit
(:func:`gluon_amp_core.emulate.round_bits`). Converted graphs always use MXNet's ops, so
that they load in a process without the kernel.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional, Tuple

import mxnet as mx
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.emulate import BF16_ROUNDING, PLAIN_LAYOUT, EmulatedGraph, emulate_graph

from . import emulation_kernel
from .mxnet_internals import FLOAT_NAMES, copy_function, internal_entries, symbol_graph, to_mx_dtype

Key = Tuple[str, int]


def unpatched(op: str) -> Any:
    """MXNet's own ``mx.nd`` function for ``op``, as a copy made before any patching (so
    rounding inside an AMP wrapper does not re-enter the wrappers)."""
    fn = getattr(mx.nd, op, None) or getattr(mx.nd._internal, op)
    return copy_function(fn)


# Imperatively, a value's layout is converted per call and freed: the first step (a
# graph's plain-layout step) is the value itself.
_BF16_STEPS = [(None if op == PLAIN_LAYOUT else unpatched(op), args, dict(attrs))
               for op, args, attrs in BF16_ROUNDING]
_AMP_CAST = unpatched("amp_cast")


def round_nd(x: NDArray, dtype: str) -> NDArray:
    """``x`` in float32 holding only values of ``dtype`` (:func:`gluon_amp_core.emulate.round_bits`).

    ``x`` is float32, or float16/bfloat16 (GPU-only code's data, a low-precision parameter):
    those are cast to float32 first, exactly."""
    if isinstance(x, mx.np.ndarray):
        return round_nd(x.as_nd_ndarray(), dtype).as_np_ndarray()
    given = FLOAT_NAMES.get(x.dtype)
    if given in LOW_PRECISION_DTYPES:
        x = _AMP_CAST(x, dtype="float32")
        if given == dtype:
            return x  # its values are dtype's already
        given = "float32"
    kernel = emulation_kernel.round_function()
    if kernel is not None and given == "float32" and x.stype == "default":
        return kernel(x, dtype=dtype)
    if dtype == "bfloat16":
        made: list = []
        for fn, args, attrs in _BF16_STEPS:
            made.append(x if fn is None else fn(*[x if a == "x" else made[a] for a in args], **attrs))
        return made[-1]
    return _AMP_CAST(_AMP_CAST(x, dtype=to_mx_dtype(dtype)), dtype="float32")


def emulate_symbol(sym: Symbol, dtypes: Mapping[Key, Optional[str]],
                   shapes: Optional[Mapping[str, tuple]] = None,
                   portable: bool = False, fed: Optional[Mapping[str, str]] = None) -> Tuple[Symbol, EmulatedGraph]:
    """``sym`` (typed by real AMP as ``dtypes``) rewritten for emulation. ``shapes`` (input
    name -> shape), when known, let the fallback's rewrite keep oneDNN's memory layouts (speed
    only). ``portable`` graphs round with MXNet's ops only (a converter's result may be saved
    and loaded where gluon_amp's kernel is not). ``fed`` (input name -> dtype of the array
    the executor feeds it): inputs fed float16/bfloat16 are read in that dtype, cast to
    float32, and the graph's low-precision outputs come back in it
    (:func:`gluon_amp_core.emulate.emulate_graph`)."""
    kernel = None if portable or not emulation_kernel.active() else emulation_kernel.OP_NAME
    ndims = _ndims(sym, shapes) if shapes and kernel is None else None
    emulated = emulate_graph(symbol_graph(sym), dtypes, ndims, kernel, fed)
    return mx.sym.load_json(json.dumps(emulated.graph)), emulated


def _ndims(sym: Symbol, shapes: Mapping[str, tuple]) -> Dict[Key, int]:
    """``{(node name, output): ndim}`` for the entries MXNet's shape inference reaches."""
    internals = sym.get_internals()
    known = {k: v for k, v in shapes.items() if k in set(sym.list_inputs())}
    try:
        _, out_shapes, _ = internals.infer_shape_partial(**known)
    except mx.base.MXNetError:
        return {}
    if out_shapes is None:
        return {}
    return {key: len(shape) for key, shape in zip(internal_entries(sym), out_shapes)
            if shape}
