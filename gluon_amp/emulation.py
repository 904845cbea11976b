"""Emulated float16/bfloat16 on any CPU: MXNet's side of :mod:`gluon_amp_core.emulate`.

Graphs (converted ones, and a hybridized block's graph under ``init(emulate=True)``, also
the graph a SymbolBlock was given) are typed by MXNet as real AMP would run them, then
rewritten by the pure core. Imperative calls round at the low-precision ops' inputs and
outputs (see :func:`round_nd`).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES, dtype_name
from gluon_amp_core.emulate import BF16_ROUNDING, PLAIN_LAYOUT, REAL_DTYPE_ATTR, EmulatedGraph, emulate_graph
from gluon_amp_core.policy import Policy

from . import runtime
from .mxnet_internals import FLOAT_NAMES, copy_function, to_mx_dtype
from .shape_rules import ShapeRules
from .type_inference import entry_keys, infer_dtypes

Key = Tuple[str, int]


def _unpatched(op: str) -> Any:
    """MXNet's own ``mx.nd`` function for ``op``, as a copy made before any patching (so
    rounding inside an AMP wrapper does not re-enter the wrappers)."""
    fn = getattr(mx.nd, op, None) or getattr(mx.nd._internal, op)
    return copy_function(fn)


# Imperatively, a value's layout is converted per call and freed: the first step (a
# graph's plain-layout step) is the value itself.
_BF16_STEPS = [(None if op == PLAIN_LAYOUT else _unpatched(op), args, dict(attrs))
               for op, args, attrs in BF16_ROUNDING]
_AMP_CAST = _unpatched("amp_cast")


def round_nd(x: NDArray, dtype: str) -> NDArray:
    """``x`` (float32) holding only values of ``dtype`` (:mod:`gluon_amp_core.emulate`)."""
    if isinstance(x, mx.np.ndarray):
        return round_nd(x.as_nd_ndarray(), dtype).as_np_ndarray()
    if dtype == "bfloat16":
        made: list = []
        for fn, args, attrs in _BF16_STEPS:
            made.append(x if fn is None else fn(*[x if a == "x" else made[a] for a in args], **attrs))
        return made[-1]
    return _AMP_CAST(_AMP_CAST(x, dtype=to_mx_dtype(dtype)), dtype="float32")


def emulate_symbol(sym: Symbol, dtypes: Mapping[Key, Optional[str]],
                   shapes: Optional[Mapping[str, tuple]] = None) -> Tuple[Symbol, EmulatedGraph]:
    """``sym`` (typed by real AMP as ``dtypes``) rewritten for emulation. ``shapes`` (input
    name -> shape), when known, let the rewrite keep oneDNN's memory layouts (speed only)."""
    ndims = _ndims(sym, shapes) if shapes else None
    emulated = emulate_graph(json.loads(sym.tojson(remove_amp_cast=False)), dtypes, ndims)
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
    return {key: len(shape) for key, shape in zip(entry_keys(internals.list_outputs()), out_shapes)
            if shape}


def _input_dtypes(block: HybridBlock, args: tuple, inputs: Sequence[Symbol]) -> Dict[str, str]:
    """Dtypes of the graph's inputs: data from the call's arrays, parameters as stored."""
    known: Dict[str, str] = {}
    for var, a in zip(inputs, _data(args)):
        if isinstance(a, NDArray):
            known[var.name] = FLOAT_NAMES.get(a.dtype) or dtype_name(a.dtype)
    for p in block.collect_params().values():
        if p.dtype is not None:
            known[p.name] = dtype_name(p.dtype)
    return known


def input_shapes(args: tuple, inputs: Sequence[Symbol]) -> Dict[str, Tuple[int, ...]]:
    """Shapes of the graph's data inputs, from the call's arrays."""
    return {var.name: a.shape for var, a in zip(inputs, _data(args)) if isinstance(a, NDArray)}


def _data(args: Any) -> list:
    """The call's inputs, flattened as Gluon flattens them for the graph (``None`` dropped)."""
    if isinstance(args, (list, tuple)):
        return [x for a in args for x in _data(a)]
    return [] if args is None else [args]


def _devices(args: tuple) -> set:
    return {a.context.device_type for a in _data(args) if isinstance(a, NDArray)}


def graph_rewriter(policy: Policy) -> Tuple[Callable, Optional[Callable], Callable]:
    """What :func:`gluon_amp.init` hooks into every HybridBlock: ``(rewrite, reshaped, watch)``.

    ``rewrite(block, args, inputs, out)`` runs on each fresh graph build. First the ops that
    the input shapes keep in float32 are fed float32 (:class:`gluon_amp.shape_rules.ShapeRules`),
    emulated or not, so both run one plan. Emulated policies get the emulated graph.
    Otherwise, a graph holding a dtype the call's device cannot execute raises a
    ``RuntimeError`` before MXNet fails on it.

    ``reshaped(block, args, inputs, out)`` runs when a block is called with other input
    shapes than before: True when its graph must be rebuilt (more ops kept in float32).
    It is None when the policy has no shape rules (nothing to check); ``watch(block)`` says
    whether a block's graph has an op whose rule other shapes could change.
    """
    rules = ShapeRules(policy)

    def rewrite(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> Symbol:
        if getattr(block, "amp_result", None) is not None:
            return out  # converted by gluon_amp: its plan was fixed then
        out = rules.apply(block, out, input_shapes(args, inputs))
        dtypes = infer_dtypes(out, _input_dtypes(block, args, inputs), partial=True) or {}
        low = {t for t in dtypes.values() if t in LOW_PRECISION_DTYPES}
        if not low:
            return out
        if policy.emulate:
            return emulate_symbol(out, dtypes, input_shapes(args, inputs))[0]
        for device in _devices(args):
            for dtype in sorted(low):
                if not runtime.executable(dtype, device):
                    raise RuntimeError(cannot_run(f"block {block.name!r}", dtype, device))
        return out

    def reshaped(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> bool:
        return rules.keeps_more(block, out, input_shapes(args, inputs))

    return rewrite, (reshaped if rules.active else None), rules.watches


def holds_amp_plan(sym: Symbol) -> bool:
    """True when ``sym`` carries an AMP plan: casts the symbolic wrappers or a converter
    inserted, or an emulated graph's typed nodes."""
    return any(n["op"] in ("amp_cast", "amp_multicast") or REAL_DTYPE_ATTR in n.get("attrs", {})
               for n in json.loads(sym.tojson(remove_amp_cast=False))["nodes"])


def cannot_run(what: str, dtype: str, device: str) -> str:
    """The message for a low-precision op this machine cannot execute."""
    why = ("MXNet's CPU build has no float16 convolution or GEMM" if dtype == "float16"
           else runtime.capability().why)
    return (f"gluon_amp: {what} would run {dtype} kernels on the {device}, which this machine cannot "
            f"execute ({why}). Call gluon_amp.init(target_dtype={dtype!r}, emulate=True) to run the "
            "same plan emulated in float32 on this CPU (for numerics), or run on hardware with "
            f"{dtype} kernels.")
