"""Read a block's graph and parameters, and every internal value of a graph, without
changing the block or the graph that runs."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.decide import CAST_OPS, users_casts
from gluon_amp_core.dtypes import DTYPE_CODE, FLOAT_DTYPES, dtype_name

from .. import mxnet_internals as mxi, plan_notes
from ..patching import is_enabled
from ..type_inference import entry_keys

Key = Tuple[str, int]


@dataclass
class Model:
    """An FP32 graph with its data inputs and parameters (copies: the block is not touched).
    ``data_dtypes``: what each data input holds in the FP32 run, float32 for float data and
    the caller's own dtype for integer data (token ids, lengths)."""

    sym: Symbol
    data_names: List[str]
    args: Dict[str, mx.nd.NDArray]
    aux: Dict[str, mx.nd.NDArray]
    ctx: mx.Context
    data_dtypes: Dict[str, str] = field(default_factory=dict)
    #: op nodes renamed because an earlier node had their name: new name -> the graph's own
    renamed: Dict[str, str] = field(default_factory=dict)

    @property
    def graph(self) -> dict:
        return json.loads(self.sym.tojson(remove_amp_cast=False))


def flat_inputs(inputs: Sequence[Any], caller: str) -> List[mx.nd.NDArray]:
    """A call's arrays in the order of the graph's inputs: nested lists (an RNN's state
    list) flattened and ``None`` dropped, as Gluon flattens a block call."""
    flat = mxi.call_arrays(list(inputs))
    bad = sorted({type(x).__name__ for x in flat if not isinstance(x, mx.nd.NDArray)})
    if bad or not flat:
        raise TypeError(f"{caller}: inputs must be mxnet NDArrays, or (nested) lists of them as the block "
                        f"takes them (e.g. block(x, [h, c])), got {bad or 'none'}")
    return flat


def _symbols(inputs: Any, names: Iterator[str]) -> Any:
    """``inputs`` with each array replaced by the next variable of ``names``, nested alike:
    numpy-frontend variables in numpy mode (``npx.set_np()``), whose layers call ``F.npx.*``
    and refuse legacy symbols (as MXNet's own ``_get_graph`` makes them)."""
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(_symbols(x, names) for x in inputs)
    if inputs is None:
        return None
    var = mx.sym.var(next(names))
    return var.as_np_ndarray() if mx.util.is_np_array() else var


def _check_fp32(block: HybridBlock, sym: Symbol, caller: str) -> None:
    """Refuse a graph that is not the user's FP32 graph: a converter's result, or a graph whose
    casts are gluon_amp's (a converted model's export; traced under ``init``, its trace lost)."""
    if getattr(block, "amp_result", None) is not None:
        raise TypeError(f"{caller} takes the FP32 block, got a converted mixed-precision block "
                        f"({type(block).__name__}, its graph is the plan): pass the block it was converted from")
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    users = users_casts(graph)
    planned = [n["name"] for n in graph["nodes"] if n["op"] in CAST_OPS and n["name"] not in users]
    if planned:
        raise RuntimeError(f"{caller}: the block's graph holds gluon_amp's casts ({', '.join(planned[:3])}"
                           f"{' ...' if len(planned) > 3 else ''}): it is a mixed-precision plan (a converted "
                           "model's export, or a graph traced under init whose trace is no longer known), not the "
                           "FP32 graph. Pass the FP32 block or its export; for a block traced under init, call "
                           "block.hybridize() again (it drops the cached graph) and compare with AMP off")


def _unique_names(sym: Symbol) -> Tuple[Symbol, Dict[str, str]]:
    """``sym`` with every op node named once, and the renamed nodes (new name -> old).

    A block called several times in one graph (an FPN's RPN head, run on each level) gives
    nodes of one name; values are read by name, so the second and later become ``NAME#2``..."""
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    taken = {n["name"] for n in graph["nodes"]}
    count: Dict[str, int] = {}
    renamed: Dict[str, str] = {}
    for node in graph["nodes"]:
        if node["op"] == "null":
            continue
        name = node["name"]
        count[name] = count.get(name, 0) + 1
        if count[name] > 1:
            k = count[name]
            while f"{name}#{k}" in taken:
                k += 1
            node["name"] = f"{name}#{k}"
            taken.add(node["name"])
            renamed[node["name"]] = name
    return (mx.sym.load_json(json.dumps(graph)) if renamed else sym), renamed


def model_of(block: HybridBlock, inputs: Sequence[Any], caller: str) -> Model:
    """The block's FP32 graph for a call ``block(*inputs)``: its cached graph (where traced
    under ``init``, the graph it was traced from without the plan's casts), or one built
    symbolically (nothing is cached). A converted block or a plan of unknown origin is refused."""
    if not isinstance(block, HybridBlock):
        raise TypeError(f"{caller} expects a gluon HybridBlock, got {type(block).__name__}")
    if is_enabled():
        raise RuntimeError(f"{caller} builds the FP32 and the low-precision graphs itself: call it with "
                           "AMP off (gluon_amp.disable() first).")
    flat = flat_inputs(inputs, caller)
    if mxi.has_cached_graph(block):
        graph_inputs, kept = mxi.cached_graph(block, caller)
        sym = plan_notes.fp32_graph(block, kept)  # traced under init: the plan's casts stripped
        names = [i.name for i in graph_inputs]
    else:  # the names Gluon gives a traced call's inputs
        names = ["data"] if len(flat) == 1 else [f"data{i}" for i in range(len(flat))]
        out = block(*_symbols(list(inputs), iter(names)))  # outputs nested alike: (out, [h, c])
        sym = mx.sym.Group(mxi.call_arrays(out)) if isinstance(out, (list, tuple)) else out
    if isinstance(sym, mxi.NP_SYMBOL):  # read and bound as a legacy graph (the same graph)
        sym = sym.as_nd_ndarray()
    sym = _float32_declared(sym)
    _check_fp32(block, sym, caller)
    if len(names) != len(flat):
        states = (" A recurrent layer called without its begin states makes them outside its graph: pass "
                  "them too, block(x, block.begin_state(batch_size)) as "
                  f"{caller.split('.')[-1]}(block, x, block.begin_state(batch_size))."
                  if mxi.is_rnn_layer(block) and len(flat) < len(names) else "")
        raise ValueError(f"{caller}: the block's graph takes {len(names)} inputs ({names}), got {len(flat)} "
                         "arrays (nested lists counted as Gluon flattens them); pass the arrays the block was "
                         f"called with, in the same nesting.{states}")
    params = {p.name: p for p in block.collect_params().values()}
    missing = [n for n in sym.list_inputs() if n not in params and n not in names]
    if missing:
        raise ValueError(f"{caller}: graph inputs {missing[:5]} are neither data nor parameters of the block")
    first = next(iter(params.values()), None)
    ctx = first.list_ctx()[0] if first is not None else mx.cpu()
    try:
        args = {n: _float32_copy(params[n].data(ctx)) for n in sym.list_arguments() if n in params}
        aux = {n: _float32_copy(params[n].data(ctx)) for n in sym.list_auxiliary_states()}
    except mx.gluon.parameter.DeferredInitializationError:
        raise RuntimeError(f"{caller}: the block's parameters are not initialized yet (their shapes are "
                           "deferred): run one forward pass, block(x), first.") from None
    dtypes = {n: "float32" if dtype_name(x.dtype) in FLOAT_DTYPES else dtype_name(x.dtype)
              for n, x in zip(names, flat)}
    sym, renamed = _unique_names(sym)
    return Model(sym, names, args, aux, ctx, dtypes, renamed)


def _float32_declared(sym: Symbol) -> Symbol:
    """``sym`` with each variable it declares float16 or bfloat16 (a block the user cast, traced
    symbolically) declared float32: the FP32 graph (see :func:`_float32_copy`)."""
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    low = {str(DTYPE_CODE[d]) for d in FLOAT_DTYPES if d != "float32"}
    changed = False
    for node in graph["nodes"]:
        attrs = node.get("attrs") or {}
        if node["op"] == "null" and attrs.get("__dtype__") in low:
            attrs["__dtype__"] = str(DTYPE_CODE["float32"])
            changed = True
    return mx.sym.load_json(json.dumps(graph)) if changed else sym


def _float32_copy(x: mx.nd.NDArray) -> mx.nd.NDArray:
    """A copy of a parameter's array, float32 where it holds float16 or bfloat16 values (a
    block the user cast, GPU-style or O2): the FP32 graph reads its values in float32, and
    the plan casts them as it casts a float32 weight. Other dtypes are copied as they are."""
    if dtype_name(x.dtype) not in FLOAT_DTYPES or dtype_name(x.dtype) == "float32":
        return x.copy()
    return mxi.cast_array(x, "float32")


def as_float32(x: mx.nd.NDArray) -> np.ndarray:
    """``x`` as a float32 NumPy array (bfloat16 arrays included); integer arrays keep
    their dtype (an op reading them, such as softmax's ``length``, needs integers)."""
    name = dtype_name(x.dtype)
    if name not in FLOAT_DTYPES:
        return x.asnumpy()
    if name != "float32":
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


def feed(model: Model, inputs: Sequence[Any]) -> Dict[str, mx.nd.NDArray]:
    """A call's arrays (flattened, see :func:`flat_inputs`) by input name, on the model's
    context, in ``model.data_dtypes``: float data as float32, integer data unchanged."""
    return {n: x.as_in_context(model.ctx).astype(model.data_dtypes[n], copy=False)
            for n, x in zip(model.data_names, mxi.call_arrays(list(inputs)))}
