"""Read a block's graph and parameters, and every internal value of a graph, without
changing the block or the graph that runs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import dtype_name

from .. import mxnet_internals as mxi
from ..patching import is_enabled
from ..type_inference import entry_keys

Key = Tuple[str, int]


@dataclass
class Model:
    """An FP32 graph with its data inputs and parameters (copies: the block is not touched)."""

    sym: Symbol
    data_names: List[str]
    args: Dict[str, mx.nd.NDArray]
    aux: Dict[str, mx.nd.NDArray]
    ctx: mx.Context

    @property
    def graph(self) -> dict:
        return json.loads(self.sym.tojson(remove_amp_cast=False))


def model_of(block: HybridBlock, n_inputs: int, caller: str) -> Model:
    """The block's FP32 graph: its cached graph, or one built symbolically (nothing is cached)."""
    if not isinstance(block, HybridBlock):
        raise TypeError(f"{caller} expects a gluon HybridBlock, got {type(block).__name__}")
    if is_enabled():
        raise RuntimeError(f"{caller} builds the FP32 and the low-precision graphs itself: call it with "
                           "AMP off (gluon_amp.disable() first).")
    if mxi.has_cached_graph(block):
        inputs, sym = mxi.cached_graph(block, caller)
        names = [i.name for i in inputs]
    else:
        names = ["data"] if n_inputs == 1 else [f"data{i}" for i in range(n_inputs)]
        out = block(*[mx.sym.var(n) for n in names])
        sym = mx.sym.Group(list(out)) if isinstance(out, (list, tuple)) else out
    if len(names) != n_inputs:
        raise ValueError(f"{caller}: the block's graph takes {len(names)} inputs ({names}), got {n_inputs}")
    params = {p.name: p for p in block.collect_params().values()}
    missing = [n for n in sym.list_inputs() if n not in params and n not in names]
    if missing:
        raise ValueError(f"{caller}: graph inputs {missing[:5]} are neither data nor parameters of the block")
    first = next(iter(params.values()), None)
    ctx = first.list_ctx()[0] if first is not None else mx.cpu()
    try:
        args = {n: params[n].data(ctx).copy() for n in sym.list_arguments() if n in params}
        aux = {n: params[n].data(ctx).copy() for n in sym.list_auxiliary_states()}
    except mx.gluon.parameter.DeferredInitializationError:
        raise RuntimeError(f"{caller}: the block's parameters are not initialized yet (their shapes are "
                           "deferred): run one forward pass, block(x), first.") from None
    return Model(sym, names, args, aux, ctx)


def as_float32(x: mx.nd.NDArray) -> np.ndarray:
    """``x`` as a float32 NumPy array (bfloat16 arrays included)."""
    if dtype_name(x.dtype) != "float32":
        x = mx.nd.amp_cast(x, dtype="float32")
    return x.asnumpy()


def run_internals(sym: Symbol, data: Dict[str, mx.nd.NDArray], args: Dict[str, mx.nd.NDArray],
                  aux: Dict[str, mx.nd.NDArray], ctx: mx.Context, outputs_only: bool = False,
                  keys: Optional[Collection[Key]] = None) -> Dict[Key, np.ndarray]:
    """Every output of every node of ``sym`` (only those in ``keys``, or only the graph's
    outputs, keyed ``("", k)``), inference mode.

    One executor bound over the chosen ``get_internals()`` entries: the same ops as the
    graph that runs, with those outputs kept (memory planning differs; values do not)."""
    if outputs_only:
        target = sym
    else:
        internals = sym.get_internals()
        entries = entry_keys(internals)
        chosen = [i for i, e in enumerate(entries) if keys is None or e in keys]
        target = internals if keys is None else mx.sym.Group([internals[i] for i in chosen])
    given = {**args, **data}
    with mxi.unfused_binds():
        ex = target.bind(ctx, {n: given[n] for n in target.list_arguments()},
                         aux_states={n: aux[n] for n in target.list_auxiliary_states()}, grad_req="null")
    values = [as_float32(o) for o in ex.forward(is_train=False)]
    if outputs_only:
        return {("", k): v for k, v in enumerate(values)}
    return {entries[i]: v for i, v in zip(chosen, values)}


def relative_error(low: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 error of ``low`` against ``ref``: inf where ``low`` is not finite and
    ``ref`` is, or differs from it there; entries both hold as the same inf or NaN are equal
    (a value FP32 itself makes non-finite is not the low precision's error)."""
    low64, ref64 = low.astype(np.float64), ref.astype(np.float64)
    low_ok, ref_ok = np.isfinite(low64), np.isfinite(ref64)
    if not low_ok.all() or not ref_ok.all():
        same = (low64 == ref64) | (np.isnan(low64) & np.isnan(ref64))
        if not (low_ok | same).all() or not (ref_ok | same).all():
            return float("inf")
        both = low_ok & ref_ok
        low64, ref64 = low64[both], ref64[both]
    norm = float(np.linalg.norm(ref64))
    diff = float(np.linalg.norm(low64 - ref64))
    return diff / norm if norm > 0 else diff


def outputs_error(low: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> float:
    """The largest relative error over a graph's outputs."""
    return max(relative_error(a, b) for a, b in zip(low, ref))


def feed(model: Model, inputs: Sequence[mx.nd.NDArray]) -> Dict[str, mx.nd.NDArray]:
    """The data inputs by name, on the model's context, float32."""
    bad = [type(x).__name__ for x in inputs if not isinstance(x, mx.nd.NDArray)]
    if bad:
        raise TypeError(f"inputs must be mxnet NDArrays, got {bad}")
    return {n: x.as_in_context(model.ctx).astype("float32", copy=False) for n, x in zip(model.data_names, inputs)}

