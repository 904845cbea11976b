"""convert_symbol / convert_model / convert_hybrid_block: FP32 networks to mixed precision."""
from __future__ import annotations

import difflib
import json
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import HybridBlock, SymbolBlock
from mxnet.symbol import Symbol

from gluon_amp_core.decide import CAST_OPS, MeasuredChoice
from gluon_amp_core.dtypes import CODE_DTYPE, dtype_name
from gluon_amp_core.lists.common import CONTROL_FLOW
from gluon_amp_core.graph_pass import (PassResult, convert_graph, is_kept, parameter_only_inputs,
                                      params_read_through_casts, users_casts, without_amp_casts)
from gluon_amp_core.policy import Policy
from gluon_amp_core.shape_limits import channels_from_weights
from gluon_amp_core.table import ConditionalSpec, check_name_list

from .. import execution, mxnet_internals as mxi, plan_notes, runtime
from ..state import current_policy
from ..policy_builder import as_policy, following
from ..same_shape_run import call_shapes, outgrown, twins_of
from ..tuning.casts import pass_result_with_fewer_casts
from ..tuning.schedule import tune_graph
from ..type_inference import infer_dtypes, infer_shapes, op_types
from .fold import fold_batch_norm

def _fp32_types(sym: Symbol, data_names: Sequence[str], param_types: Dict[str, Any],
                data_dtypes: Optional[Mapping[str, str]] = None) -> Dict[Tuple[str, int], Optional[str]]:
    """Dtype of every output of the FP32 graph (variables included), as far as MXNet infers."""
    known = {**{n: "float32" for n in data_names}, **(data_dtypes or {}), **param_types}
    return infer_dtypes(sym, known, partial=True) or {}


def _var_dtypes(sym: Symbol, fp32_types: Dict[Tuple[str, int], Optional[str]]) -> Dict[str, str]:
    inputs = set(sym.list_inputs())
    return {name: t for (name, k), t in fp32_types.items() if k == 0 and t is not None and name in inputs}


def _names(arg: str, value: Any, kind: str) -> List[str]:
    return [] if value is None else list(check_name_list(arg, value, kind))


def _warn_kept(graph: dict, policy: Policy) -> None:
    # control flow keeps its dtypes by the op table (float32), as planned: nothing to say
    kept = [n["name"] for n in graph["nodes"]
            if n["op"] != "null" and is_kept(n) and n["op"] not in CONTROL_FLOW]
    if kept and policy.enabled:
        warnings.warn(
            f"{len(kept)} fused or quantized op(s) ({kept[:3]}{' ...' if len(kept) > 3 else ''}) keep "
            f"the dtypes they have in this graph; only the other ops are converted to "
            f"{policy.target_dtype}. To run the fused ops in {policy.target_dtype}, convert the FP32 "
            "graph before fusion or quantization (convert_hybrid_block fuses after converting)."
            + _AMX_INT8_NOTE * (runtime.amx_active() and any("quantize" in n["op"] for n in graph["nodes"])),
            UserWarning, stacklevel=3)


_AMX_INT8_NOTE = (" AMX is on in this process (gluon_amp enables it at import), and MXNet 1.9.1's oneDNN "
                  "2.4.4 crashes on some int8 networks with AMX (GluonCV's simple_pose_*_int8); if this "
                  "one does, set GLUON_AMP_DISABLE_AMX=1 before importing gluon_amp.")


def _check_excluded(graph: dict, excluded: List[str]) -> None:
    op_names = {n["name"] for n in graph["nodes"] if n["op"] != "null"}
    missing = [n for n in excluded if n not in op_names]
    if missing:
        near = difflib.get_close_matches(missing[0], sorted(op_names), n=3, cutoff=0.6)
        raise ValueError(f"excluded_sym_names {missing} are not op nodes of this graph"
                         + (f"; did you mean {near}?" if near else ".")
                         + " Use gluon_amp.report(sym) to list the node names.")


def _data_names(clean: Symbol, data_names: Any, graph: dict,
                op_inputs: Dict[str, Sequence[str]]) -> List[str]:
    if data_names is None:
        attrs = clean.attr_dict()
        params = parameter_only_inputs(graph, op_inputs)
        return [n for n in clean.list_inputs() if "__dtype__" not in attrs.get(n, {}) and n not in params]
    data_names = _names("data_names", data_names, "input names")
    unknown = [n for n in data_names if n not in clean.list_inputs()]
    if unknown:
        raise ValueError(f"data_names {unknown} are not inputs of the symbol; its inputs are "
                         f"{clean.list_inputs()[:10]}...")
    return data_names


def convert_with_policy(sym: Symbol, policy: Policy, excluded_sym_names: Any = None,
                        data_names: Any = None, cast_optional_params: bool = False,
                        param_dtypes: Optional[Dict[str, str]] = None,
                        measured: Optional[Mapping[str, MeasuredChoice]] = None,
                        data_dtypes: Optional[Mapping[str, str]] = None,
                        input_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None,
                        param_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Tuple[Symbol, PassResult]:
    """Convert ``sym`` as ``policy`` says; also return what the pass did (casts, decisions).

    The returned graph is the plan, also with ``policy.emulate``: the caller remembers it
    (:func:`gluon_amp.execution.remember`) so that it runs emulated where it is bound. ``measured``
    holds the tuner's choices (:func:`~gluon_amp.tuning.schedule.tune_graph`); ``data_dtypes`` the dtypes of data inputs
    that are not float32 (integer token ids and lengths); ``input_shapes`` the shapes the model
    will run with, where known, for the table's input-shape rules (a kernel's limits); without
    them, ``param_shapes`` (the parameters' shapes) give the rules that ask only a convolution's
    input channels what they need (:func:`gluon_amp_core.shape_limits.channels_from_weights`)."""
    if not isinstance(sym, Symbol):
        raise TypeError(f"convert_symbol expects an mxnet Symbol, got {type(sym).__name__}")
    if not isinstance(cast_optional_params, bool) and type(cast_optional_params).__name__ != "bool_":
        raise TypeError(f"cast_optional_params takes True or False, got {cast_optional_params!r}")
    excluded = sorted(set(_names("excluded_sym_names", excluded_sym_names, "op node names")) | policy.excluded)
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    if users_casts(graph) != {n["name"] for n in graph["nodes"] if n["op"] in CAST_OPS}:
        # built under init or in a region: that policy's casts go, or a bfloat16 conversion of a
        # float16 plan would still round every value through float16 (the user's casts stay)
        graph = without_amp_casts(graph, keep=users_casts(graph))
        sym = mx.sym.load_json(json.dumps(graph))
    _check_excluded(graph, excluded)
    _warn_kept(graph, policy)
    if not policy.enabled:  # no useful low precision here: the FP32 graph, unchanged
        return mx.sym.load_json(json.dumps(graph)), PassResult(graph, {}, dict(param_dtypes or {}), policy)
    op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
    data_names = _data_names(sym, data_names, graph, op_inputs)
    fp32_types = _fp32_types(sym, data_names, param_dtypes or {}, data_dtypes)
    result = convert_graph(graph, policy, data_names, _var_dtypes(sym, fp32_types), op_types, op_inputs,
                           excluded, cast_optional_params, fp32_types=fp32_types, measured=measured or {},
                           entry_shapes=infer_shapes(sym, input_shapes) if input_shapes
                           else channels_from_weights(graph["nodes"], param_shapes or {}) or None)
    converted = mx.sym.load_json(json.dumps(result.graph))
    _verify(converted, result, {n: "float32" for n in data_names} | dict(data_dtypes or {}))
    # no value cast back and forth between neighbours that can share a dtype
    fewer = pass_result_with_fewer_casts(result, policy.table, {n: "float32" for n in data_names}
                                         | dict(data_dtypes or {}), keep=users_casts(graph))
    return (converted if fewer is None else fewer), result


def _verify(sym: Symbol, result: PassResult, data_dtypes: Mapping[str, str]) -> None:
    """MXNet's own type inference must agree with the pass on every output."""
    # parameters carry their stored dtype as __dtype__ in the converted graph already
    inferred = infer_dtypes(sym, data_dtypes)
    if inferred is None:
        raise RuntimeError("the converted graph does not type-check; please report this with the model")
    wrong = [f"{name}[{k}]: pass {want}, MXNet {inferred[(name, k)]}"
             for (name, k), want in result.dtypes.items()
             if (name, k) in inferred and inferred[(name, k)] != want]
    if wrong:
        raise RuntimeError("gluon_amp's conversion disagrees with MXNet's type inference at "
                           f"{len(wrong)} outputs, e.g. {wrong[:3]}; please report this with the model")


def _policy(target_dtype: Any, target_dtype_ops: Any, fp32_ops: Any, conditional_fp32_ops: Any,
            widest_type_ops: Any, keep_batchnorm_fp32: Any, emulate: Any = None, tune: Any = None) -> Policy:
    """The converter's policy. Without ``target_dtype`` it follows the one in force (``init``,
    or ``python -m gluon_amp.run``), as ``init``'s own callers do, with the arguments given
    replacing its settings; with none in force, the machine's default."""
    lists = dict(target_precision_ops=target_dtype_ops, fp32_ops=fp32_ops, conditional_fp32_ops=conditional_fp32_ops,
                 widest_type_ops=widest_type_ops, keep_batchnorm_fp32=keep_batchnorm_fp32)
    active = current_policy() if target_dtype is None else None
    if active is None:
        return as_policy(target_dtype, **lists, emulate=emulate, tune=tune)
    return following(active, **lists, emulate=emulate, tune=tune)


def convert_symbol(sym: Symbol, target_dtype: Any = None, target_dtype_ops: Optional[Sequence[str]] = None,
                   fp32_ops: Optional[Sequence[str]] = None,
                   conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
                   excluded_sym_names: Optional[Sequence[str]] = None,
                   data_names: Optional[Sequence[str]] = None,
                   cast_optional_params: bool = False, *,
                   widest_type_ops: Optional[Sequence[str]] = None,
                   keep_batchnorm_fp32: Optional[bool] = None,
                   emulate: Optional[bool] = None) -> Symbol:
    """Return a new Symbol running ``sym`` (an FP32 graph) in mixed precision.

    Parameters
    ----------
    sym : Symbol
    target_dtype : {'float16', 'bfloat16', None} or Policy
        As for :func:`gluon_amp.init`; ``None`` on a machine without useful low precision
        returns the graph unchanged (with a warning).
    target_dtype_ops, fp32_ops, conditional_fp32_ops, widest_type_ops, keep_batchnorm_fp32 :
        Override the op lists, as for :func:`gluon_amp.init`.
    excluded_sym_names : list of str
        Op node names forced to float32. A name not in the graph raises ``ValueError``.
    data_names : list of str
        The data inputs; by default the inputs without a ``__dtype__`` attribute, except
        those every consumer reads as a parameter (``weight``, ``bias``, ``gamma``, ...).
    cast_optional_params : bool
        Store parameters read only by low-precision ops in the target dtype.
    emulate : bool, optional
        Run the returned plan emulated in float32 wherever it is bound (``bind``,
        ``simple_bind``, a Module; on any CPU, values rounded to the target wherever the plan
        holds it): see :func:`gluon_amp.init`. The Symbol itself is the plan: saved, it loads
        and runs natively where its dtypes run.
    """
    policy = _policy(target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops,
                     widest_type_ops, keep_batchnorm_fp32, emulate)
    return _run_as_planned(_with_result(*convert_with_policy(sym, policy, excluded_sym_names, data_names,
                                                                  cast_optional_params)), policy)


class MixedPrecisionSymbol(Symbol):
    """The Symbol :func:`convert_symbol` and :func:`convert_model` return: a plain MXNet graph
    (its nodes carry no attribute of gluon_amp's), and ``amp_result``, the pass's per-node
    decisions, kept beside it (read by :func:`gluon_amp.report`). Symbols MXNet derives from
    it (``get_internals``, a saved and loaded copy) are plain Symbols.

    :meth:`save` and :meth:`tojson` keep the casts by default (``remove_amp_cast=False``), as
    the converted block's ``export`` does: MXNet's default removes the ``amp_cast`` nodes a plan
    reads through, and the file would hold the FP32 graph (plain MXNet on a bfloat16 host ran it
    bit for bit as FP32). ``remove_amp_cast=True`` still does what MXNet does."""

    amp_result: Optional[PassResult] = None
    #: what the converter did not do, and why (an optional step that failed on this graph)
    amp_fallbacks: Tuple[str, ...] = ()

    def save(self, fname: str, remove_amp_cast: bool = False) -> None:
        super().save(fname, remove_amp_cast=remove_amp_cast)

    def tojson(self, remove_amp_cast: bool = False) -> str:
        return super().tojson(remove_amp_cast=remove_amp_cast)


def _with_result(sym: Symbol, result: PassResult) -> MixedPrecisionSymbol:
    out = mxi.symbol_of_class(MixedPrecisionSymbol, sym)
    out.amp_result = result
    return out


def _run_as_planned(result: Any, policy: Policy) -> Any:
    """A converter's result, remembered to run as ``policy`` says where it is bound
    (:func:`execution.remember`), with or without ``init``: natively, emulated, or refused with
    gluon_amp's error, a block when its CachedOp is built (its first call), a Symbol at its
    executor's first ``forward`` (it binds wherever MXNet binds it: binding is also how users
    infer its shapes and types)."""
    if policy.enabled:
        execution.remember(result, policy)
    return result


def _cast_array(arr: mx.nd.NDArray, dtype: str) -> mx.nd.NDArray:
    """A copy of ``arr`` stored in ``dtype`` (the plan's; emulated runs read it widened)."""
    if dtype_name(arr.dtype) == dtype:
        return arr.copy()
    return mx.nd.amp_cast(arr, dtype=mxi.to_mx_dtype(dtype))


def _check_params(name: str, params: Any) -> Dict[str, mx.nd.NDArray]:
    if not isinstance(params, dict):
        raise TypeError(f"{name} must be a dict of name -> NDArray, got {type(params).__name__}")
    bad = [k for k, v in params.items() if not isinstance(v, mx.nd.NDArray)]
    if bad:
        raise TypeError(f"{name} values must be NDArrays; not for {bad[:5]}")
    return params


def convert_model(sym: Symbol, arg_params: Dict[str, mx.nd.NDArray], aux_params: Dict[str, mx.nd.NDArray],
                  target_dtype: Any = None, target_dtype_ops=None, fp32_ops=None,
                  conditional_fp32_ops=None, excluded_sym_names=None,
                  cast_optional_params: bool = False, *, widest_type_ops=None,
                  keep_batchnorm_fp32: Optional[bool] = None, emulate: Optional[bool] = None,
                  tune: Optional[bool] = None, input_shapes: Optional[Mapping[str, Sequence[int]]] = None):
    """Convert an FP32 model; return new ``(sym, arg_params, aux_params)``.

    Arguments as for :func:`convert_symbol`. The caller's dicts and arrays are not
    modified: the returned dicts hold copies, cast where the converted graph stores a
    parameter in another dtype (also with ``emulate=True``: the plan's parameters, read
    emulated where the graph is bound).
    ``input_shapes`` (data input name -> shape the model will run with) lets the converter
    time the model's low-precision ops on this machine and keep in float32 those that do not
    make the whole model faster in the target dtype (see :func:`gluon_amp.init`): with
    ``tune=None`` (the default) it does whenever ``input_shapes`` is given; ``tune=False``
    opts out; ``tune=True`` requires ``input_shapes``.
    """
    policy = _policy(target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops,
                     widest_type_ops, keep_batchnorm_fp32, emulate, tune)
    fallbacks: List[str] = []
    new_sym, new_args, new_aux, result = _convert_model(sym, arg_params, aux_params, policy, excluded_sym_names,
                                                        cast_optional_params, input_shapes, require_shapes=tune is True,
                                                        fallbacks=fallbacks)
    out = _with_result(new_sym, result)
    out.amp_fallbacks = tuple(fallbacks)
    for why in fallbacks:
        warnings.warn(f"convert_model: {why}", UserWarning, stacklevel=2)
    return _run_as_planned(out, policy), new_args, new_aux


def _convert_model(sym: Symbol, arg_params: Dict[str, mx.nd.NDArray], aux_params: Dict[str, mx.nd.NDArray],
                   policy: Policy, excluded_sym_names: Any, cast_optional_params: bool,
                   input_shapes: Optional[Mapping[str, Sequence[int]]] = None, fused: bool = False,
                   require_shapes: bool = False, data_dtypes: Optional[Mapping[str, str]] = None,
                   fallbacks: Optional[List[str]] = None):
    _check_params("arg_params", arg_params)
    _check_params("aux_params", aux_params)
    names = set(arg_params) | set(aux_params)
    data_names = [n for n in sym.list_inputs() if n not in names]
    types = {k: dtype_name(v.dtype) for k, v in {**arg_params, **aux_params}.items()}
    param_shapes = {k: tuple(v.shape) for k, v in {**arg_params, **aux_params}.items()}
    shapes = _check_input_shapes(input_shapes, data_names, require_shapes and policy.enabled)
    measured = None
    if policy.tune and policy.enabled and shapes:  # tuning times the model at the shapes it runs with
        def convert(choices: Optional[Mapping[str, MeasuredChoice]] = None) -> Symbol:
            return convert_with_policy(sym, policy, excluded_sym_names, data_names, cast_optional_params,
                                       param_dtypes=types, measured=choices, data_dtypes=data_dtypes,
                                       input_shapes=shapes)[0]

        plan = convert()
        known = {**{n: "float32" for n in data_names}, **(data_dtypes or {}), **_stored_dtypes(plan)}
        try:
            measured = tune_graph(plan, known, shapes, policy, False, convert, runtime.timing_cache(),
                                  fused)[0].choices
        except Exception as error:  # noqa: BLE001  tuning is optional: the plan stands untuned
            if require_shapes:  # tune=True: asked for, so its failure is the caller's to see
                raise RuntimeError(f"tune=True: timing this model's ops fails ({mxi.error_line(error)}); "
                                   "convert with tune=False (or leave tune unset) to keep the plan "
                                   "untuned") from error
            why = (f"untuned: timing this model's ops fails ({mxi.error_line(error)}); "
                   "the plan is not tuned (tune=False)")
            if fallbacks is None:
                warnings.warn(f"convert_model: {why}", UserWarning, stacklevel=3)
            else:
                fallbacks.append(why)
    new_sym, result = convert_with_policy(sym, policy, excluded_sym_names, data_names, cast_optional_params,
                                          param_dtypes=types, measured=measured, data_dtypes=data_dtypes,
                                          input_shapes=shapes, param_shapes=param_shapes)
    new_args = {k: _cast_array(v, result.param_dtypes.get(k, types[k])) for k, v in arg_params.items()}
    new_aux = {k: _cast_array(v, result.param_dtypes.get(k, types[k])) for k, v in aux_params.items()}
    return new_sym, new_args, new_aux, result


def _check_input_shapes(input_shapes: Any, data_names: Sequence[str], required: bool) -> Dict[str, Tuple[int, ...]]:
    """``input_shapes`` as ``{name: tuple of int}`` for every data input; ``required`` with ``tune=True``."""
    if input_shapes is None:
        if required:
            raise ValueError(f"tune=True times the model at the shapes it will run with: pass input_shapes="
                             f"{{{', '.join(repr(n) + ': (batch, ...)' for n in data_names)}}}")
        return {}
    if not isinstance(input_shapes, Mapping):
        raise TypeError(f"input_shapes must be a dict of input name -> shape, got {type(input_shapes).__name__}")
    unknown = sorted(set(input_shapes) - set(data_names))
    missing = sorted(set(data_names) - set(input_shapes))
    if unknown or missing:
        raise ValueError(f"input_shapes must name exactly the data inputs {list(data_names)}; "
                         + "; ".join(f"{what}: {names}" for what, names in (("unknown", unknown), ("missing", missing))
                                     if names))
    out = {}
    for name, shape in input_shapes.items():
        if (not isinstance(shape, (tuple, list)) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise ValueError(f"input_shapes[{name!r}] must be a tuple of positive ints, got {shape!r}")
        out[name] = tuple(shape)
    return out


def _stored_dtypes(sym: Symbol) -> Dict[str, str]:
    """The dtypes a converted graph declares for its parameters (``__dtype__``)."""
    attrs = sym.attr_dict()
    return {n: CODE_DTYPE[int(a["__dtype__"])] for n, a in attrs.items()
            if "__dtype__" in a and int(a["__dtype__"]) in CODE_DTYPE and n in sym.list_inputs()}


#: ``hybridize()`` given no ``backend``: the block's own ``fuse_backend``
_DEFAULT_BACKEND: Any = object()
#: 1.9.1 ``HybridBlock.hybridize``'s parameters after ``active, backend``, in order
_HYBRIDIZE_FLAGS = ("clear", "static_alloc", "static_shape", "inline_limit", "forward_bulk_size",
                    "backward_bulk_size")


class MixedPrecisionBlock(SymbolBlock):
    """The :class:`SymbolBlock` :func:`convert_hybrid_block` returns.

    Differences from a plain SymbolBlock: :meth:`export` writes the whole model without a
    forward pass (MXNet 1.9.1's writes only the parameters a forward pass collected: none
    where the target cannot run here) and keeps the cast nodes by default (MXNet's own
    default, ``remove_amp_cast=True``, writes a graph that no longer type-checks); when
    ``fuse_backend`` is set (``'MKLDNN'`` on CPU), every :meth:`hybridize` without an
    explicit ``backend`` uses MXNet's oneDNN subgraph fusion, and a fused ``hybridize``
    defaults to ``static_alloc=True, static_shape=True`` (pass ``False`` to opt out): the
    fused ops' state is then built once, not on every call. ``amp_result`` holds the
    pass's per-node decisions.
    """

    fuse_backend: Optional[str] = None
    #: the fusion was asked for (``fuse=True``), not the default
    fuse_asked: bool = False
    amp_result: Optional[PassResult] = None
    #: converted without ``input_shapes`` (nothing measured): where it is bound, the speed rule
    #: decides whether its plan or the same graph in float32 runs (gluon_amp.execution)
    amp_speed_rule: bool = False
    #: parameters stored low only by ``cast_optional_params``' default: float32 again for training
    stored_low_by_default: Tuple[str, ...] = ()
    #: the speed rule ran the float32 graph at the last binding (gluon_amp.execution)
    runs_float32_stand_in: bool = False
    #: parameters the plan stores low, held in float32 for that graph (the plan unchanged)
    float32_stand_in_params: Tuple[str, ...] = ()
    #: what the converter did not do, and why (an optional step that failed on this graph)
    amp_fallbacks: Tuple[str, ...] = ()

    def __call__(self, *args: Any) -> Any:
        if self._settled:
            return self._call(*args)
        # Until its graph is bound and stays so, calls wait for each other: the first one's
        # binding decides what runs (fused, unfused, the float32 stand-in) and may bind again,
        # and a concurrent call met a half-changed block (MXNet's "Gluon failed to build the cache")
        with self._binding:
            out = self._call(*args)
            self._settled = self._cached_op is not None
            return out

    def _clear_cached_op(self) -> None:
        self._settled = False
        super()._clear_cached_op()

    def _call(self, *args: Any) -> Any:
        if autograd.is_recording():
            if mxi.block_backend(self)[0] is not None:
                self._unfuse_to_train()
            if autograd.is_training():  # record(train_mode=False): input gradients, nothing to train
                self._refuse_training_bfloat16()
        # Called as the block it converts is (its inputs nested: an RNN's state list), or
        # with its inputs flat, as a SymbolBlock of the graph's inputs is.
        try:
            grouped = mxi.regroup(mxi.call_arrays(args), mxi.call_formats(self)[0])
        except ValueError:
            return super().__call__(*args)  # SymbolBlock says what is wrong
        flat = grouped if isinstance(grouped, list) else [grouped]
        if twins_of(self) and outgrown(self, call_shapes(self, tuple(flat))):
            self._clear_cached_op()  # its twins' inputs differ in shape now: bound again at these
        backend = mxi.block_backend(self)[0]
        if not backend or backend != self.fuse_backend:
            out = super().__call__(*flat)
        else:
            try:
                out = super().__call__(*flat)
            except mx.base.MXNetError as error:
                out = self._unfused_after(error, backend, flat)
        if self.runs_float32_stand_in and self.stored_low_by_default and not self.float32_stand_in_params:
            self._store_float32_for_stand_in()
        return out

    def _store_float32_for_stand_in(self) -> None:
        """Store the parameters the default stored low in float32 (the same values: rounded when
        stored), where the speed rule runs the float32 graph instead of the plan: that graph
        would cast every weight on every call (at batch 1, MobileNetV3-small ran at 0.90x FP32
        so, 1.31x reading them in float32). The plan stays as converted: bound, it reads them
        through casts (gluon_amp.execution), and :meth:`export` writes them as it stores them."""
        names = set(self.stored_low_by_default)
        with mxi.own_casts():
            for p in self.collect_params().values():
                if p.name in names:
                    p.cast("float32")
        self.float32_stand_in_params = tuple(sorted(names))
        mxi.run_unpartitioned(self, self._converted, mxi.block_backend(self)[0])  # rebuilt at the next call

    def _unfused_after(self, error: Exception, backend: str, args: List[Any]) -> Any:
        """The call run unfused, where MXNet's ``backend`` fusion failed on this graph (it
        breaks on some graphs in float32 too: GluonCV's NASNet). Unfused failing as well,
        the error is not fusion's: raise that one. With ``fuse=True``, raise saying so."""
        first = mxi.error_line(error)
        mxi.run_unpartitioned(self, self._converted)
        try:
            out = super().__call__(*args)
        except Exception:
            mxi.run_unpartitioned(self, self._converted, backend)
            raise
        if self.fuse_asked:
            mxi.run_unpartitioned(self, self._converted, backend)
            raise RuntimeError(f"MXNet's {backend} fusion (fuse=True) fails on this graph, which runs "
                               f"unfused: {first}. Convert with fuse=False, or leave fuse unset: the "
                               "default then runs the unfused graph.") from error
        self.fuse_backend = None  # a later hybridize() stays unfused too
        self.amp_fallbacks += (f"unfused: MXNet's {backend} fusion fails on this graph ({first}); "
                               "it runs unfused (fuse=False)",)
        warnings.warn(f"convert_hybrid_block: {self.amp_fallbacks[-1]}", UserWarning, stacklevel=3)
        return out

    def _unfuse_to_train(self) -> None:
        """Run unfused from now on: MXNet's fused ops (``_sg_mkldnn_conv``, ...) are inference
        kernels with no gradient, so a fused block trains with zero gradients for every
        parameter they read, silently (float32 as well). A fusion asked for raises instead."""
        backend = mxi.block_backend(self)[0]
        if self.fuse_asked or backend != self.fuse_backend:
            raise RuntimeError(
                f"gluon_amp: this converted block runs MXNet's {backend!r} subgraph fusion, whose fused ops "
                "have no gradient: trained so, every parameter they read gets a zero gradient. To train it, "
                "convert with fuse=False (or leave fuse unset: the default fusion is dropped when training starts).")
        warnings.warn(f"gluon_amp: converted block {self.name!r} is being trained (called under autograd.record), "
                      f"so it runs unfused from now on: MXNet's {backend} fused ops have no gradient. Convert "
                      "with fuse=False to train it from the start.", RuntimeWarning, stacklevel=3)
        self.fuse_backend = None
        if self.stored_low_by_default:
            self._train_float32_params()
        mxi.run_unpartitioned(self, self._converted)  # also where an inference call built the fused graph

    def _refuse_training_bfloat16(self) -> None:
        """A RuntimeError where parameters to train are stored in bfloat16 (``cast_optional_params=True``)
        and the block is called to train (``autograd.record()`` in train mode):
        MXNet 1.9.1's optimizers have no bfloat16 kernels, and ``trainer.step`` failed with its
        "Unknown type enum 12" or "ndim_is_known", or at the next read of a weight."""
        low = [p.name for p in self.collect_params().values()
               if p.grad_req != "null" and mxi.FLOAT_NAMES.get(p.dtype) == "bfloat16"]
        if low:
            raise RuntimeError(
                f"gluon_amp: converted block {self.name!r} is being trained (called under autograd.record() in train "
                "mode), and "
                f"{len(low)} of its parameters to train ({', '.join(low[:3])}{', ...' if len(low) > 3 else ''}) are "
                "stored in bfloat16 (cast_optional_params=True), which MXNet's optimizers cannot update. Convert "
                "with cast_optional_params left unset to train it (the parameters go back to float32 when training "
                "starts), set grad_req='null' on those parameters to keep them fixed, or record with "
                "train_mode=False for gradients of the inputs only.")

    def _train_float32_params(self) -> None:
        """Store the parameters the default stored low in float32 again, read through casts:
        an optimizer updating bfloat16 weights loses every update below their rounding (the
        stored values, already rounded, are what training starts from)."""
        names = set(self.stored_low_by_default)
        graph = params_read_through_casts(json.loads(self._converted.tojson(remove_amp_cast=False)), names)
        self._converted = mx.sym.load_json(json.dumps(graph))
        self.float32_stand_in_params = ()  # the plan itself reads them through casts now
        with mxi.own_casts():
            for p in self.collect_params().values():
                if p.name in names:
                    p.cast("float32")
        self.stored_low_by_default = ()

    def hybridize(self, active: bool = True, backend: Any = _DEFAULT_BACKEND, *args: Any, **kwargs: Any) -> None:
        """As ``HybridBlock.hybridize`` (its arguments by position too: ``optimize_for`` passes
        them so); without a ``backend``, the block's ``fuse_backend``; ``backend=None`` unfused."""
        if len(args) > len(_HYBRIDIZE_FLAGS):
            raise TypeError(f"hybridize() takes at most {2 + len(_HYBRIDIZE_FLAGS)} positional arguments "
                            f"(active, backend, {', '.join(_HYBRIDIZE_FLAGS)}), got {2 + len(args)}")
        for name, value in zip(_HYBRIDIZE_FLAGS, args):
            if name in kwargs:
                raise TypeError(f"hybridize() got multiple values for argument {name!r}")
            kwargs[name] = value
        if backend is _DEFAULT_BACKEND:
            backend = self.fuse_backend if active else None
        if active and backend is not None:
            # A fused op builds its state once (batch norm folded in, weights reordered to
            # oneDNN's blocked layout), but without static_alloc and static_shape MXNet's
            # CachedOp builds every op state again on each call: ResNet-50 bfloat16 ran at
            # FP32's speed instead of 2x it (docs/speed.md). A new input shape still works.
            kwargs.setdefault("static_alloc", True)
            kwargs.setdefault("static_shape", True)
        super().hybridize(active, backend=backend, **kwargs)

    def __init__(self, outputs: Any, inputs: Any, params: Any = None) -> None:
        self._binding = threading.RLock()
        self._settled = False
        super().__init__(outputs, inputs, params)
        data, self._converted = mxi.cached_graph(self, "MixedPrecisionBlock")
        self._data_names = [d.name for d in data]

    def deployed_symbol(self) -> Symbol:
        """The graph :meth:`export` writes: the converted graph, partitioned by the subgraph
        backend its last ``hybridize`` chose (as MXNet does on the first forward pass;
        partitioning reads the graph only, nothing runs). Not where the converter chose that
        backend for a graph it left float32 throughout: that one is written unfused."""
        backend, options = mxi.block_backend(self)
        if not backend or not (self.fuse_asked or backend != self.fuse_backend or self._plans_low()):
            # the default fusion of a plan that converted nothing (float32 throughout: the default
            # where the target does not run) is how it runs here, not the model: ONNX's exporter
            # and GPU builds of MXNet read no _sg_mkldnn_* node
            return self._converted
        return self._converted.optimize_for(backend, **options)

    def _plans_low(self) -> bool:
        """Whether the converted graph computes anything in a low-precision dtype."""
        result = self.amp_result
        return result is None or any(t in ("float16", "bfloat16") for t in result.dtypes.values())

    def export(self, path: str, epoch: int = 0, remove_amp_cast: bool = False) -> None:  # type: ignore[override]
        """Write ``PATH-symbol.json`` (:meth:`deployed_symbol`) and ``PATH-EPOCH.params``
        (every parameter the graph reads, ``arg:``/``aux:`` names, in the dtype the block
        stores it), as ``HybridBlock.export`` does after a forward pass; no forward pass is
        needed, so a model for a target this machine cannot run is written whole."""
        sym = self.deployed_symbol()
        params = {p.name: p for p in self.collect_params().values()}
        names = [n for n in sym.list_inputs() if n not in self._data_names]
        missing = [n for n in names if n not in params]
        if missing:
            raise RuntimeError(f"export: graph inputs {missing[:5]} are neither data inputs {self._data_names} "
                               f"nor parameters of this block (the {mxi.block_backend(self)[0]} backend "
                               "added them?); export an unfused block: hybridize(backend=None) first "
                               "(hybridize() fuses again)")
        aux = set(sym.list_auxiliary_states())
        arrays = {f"{'aux' if n in aux else 'arg'}:{n}": params[n].list_data()[0].copyto(mx.cpu()) for n in names}
        if self.float32_stand_in_params:  # as the plan stores them
            declared = _stored_dtypes(sym)
            for n in self.float32_stand_in_params:
                key = f"{'aux' if n in aux else 'arg'}:{n}"
                if key in arrays and n in declared:
                    arrays[key] = mx.nd.amp_cast(arrays[key], dtype=mxi.to_mx_dtype(declared[n]))
        if remove_amp_cast:
            _check_uncast(sym, arrays, self._data_names)
        sym.save(f"{path}-symbol.json", remove_amp_cast=remove_amp_cast)
        (mx.npx.save if mx.util.is_np_array() else mx.nd.save)(f"{path}-{epoch:04d}.params", arrays)


def _check_uncast(sym: Symbol, arrays: Mapping[str, Any], data_names: Sequence[str]) -> None:
    """``ValueError`` where ``sym`` without its casts does not type-check with the parameters
    as stored (``arrays``, ``arg:``/``aux:`` keys) and float32 data: MXNet would write it
    silently, and every reader (``SymbolBlock.imports``, ONNX) would refuse it later."""
    low = sorted(k.split(":", 1)[1] for k, a in arrays.items() if dtype_name(a.dtype) in ("float16", "bfloat16"))
    if not low:
        return
    stripped = mx.sym.load_json(sym.tojson(remove_amp_cast=True))
    given = {**{n: "float32" for n in data_names}, **{k.split(":", 1)[1]: a.dtype for k, a in arrays.items()}}
    try:
        with mxi.quiet_stdout():  # 1.9.1's infer_type prints the arguments it rejects
            typed = infer_dtypes(stripped, given) is not None
    except mx.base.MXNetError:
        typed = False
    if not typed:
        shown = ", ".join(low[:5]) + (f" and {len(low) - 5} more" if len(low) > 5 else "")
        raise ValueError(
            f"export(remove_amp_cast=True): this block stores parameters in low precision ({shown}), and "
            "its graph without the casts does not type-check with them: MXNet would write files that "
            "SymbolBlock.imports and ONNX refuse. Export with remove_amp_cast=False (the default), or "
            "convert with cast_optional_params=False to store every parameter in float32.")


def _as_called(block: HybridBlock, sym: Symbol, inputs: List[Symbol]) -> Tuple[Any, Any]:
    """``sym``'s outputs and ``inputs`` nested as ``block`` takes and returns them (an RNN's
    state lists), so that the converted block is called as the block is."""
    in_fmt, out_fmt = mxi.call_formats(block)
    heads = [sym[k] for k in range(len(sym.list_outputs()))]
    try:
        outputs = sym if out_fmt is None else mxi.regroup(heads, out_fmt)
        grouped = inputs if in_fmt is None else mxi.regroup(inputs, in_fmt)
    except ValueError:  # the graph's inputs are not the call's arrays (a None argument)
        return sym, inputs
    if any(x is None for x in _leaves([outputs, grouped])):
        return sym, inputs
    return outputs, grouped


def _like_frontend(like: Symbol, outputs: Any) -> Any:
    """``outputs`` (a Symbol, or nested lists of them) in the frontend of ``like``."""
    if isinstance(outputs, list):
        return [_like_frontend(like, o) for o in outputs]
    return mxi.like_frontend(like, outputs)


def _leaves(x: Any) -> list:
    return [z for y in x for z in _leaves(y)] if isinstance(x, list) else [x]


@dataclass(frozen=True)
class FusionPlan:
    """How a converted model is fused: MXNet's subgraph ``backend`` (``'MKLDNN'``) or None,
    and whether batch norm is ``fold``-ed into the convolutions in float32 first."""

    backend: Optional[str]
    fold: bool


def fusion_plan(fuse: Optional[bool], device_type: str, policy: Policy) -> FusionPlan:
    """The one fuse/fold rule, for :func:`convert_hybrid_block` and the CLI.

    ``None`` (the default) fuses on a CPU with oneDNN unless the target is float16, which has
    no CPU kernels to fuse, or the policy emulates (emulation checks the unfused plan). Fusion
    is faster there in bfloat16 and in float32 alike. Fusing bfloat16 folds batch norm in
    float32 first, because MXNet's own fold rounds bfloat16 weights towards zero.
    """
    if fuse is not None and not isinstance(fuse, bool):
        raise TypeError(f"fuse must be None, True or False, got {fuse!r}")
    if policy.emulate and fuse:
        raise ValueError("fuse=True with emulate=True: emulation checks the plan's numerics "
                         "unfused; leave fuse unset (or False) when emulating.")
    possible = device_type == "cpu" and runtime.has_onednn()
    if fuse and not possible:
        raise ValueError(f"fuse=True needs a CPU context and MXNet built with oneDNN (MKLDNN); "
                         f"got a {device_type} context. Use fuse=False (or None) there.")
    if fuse is None:
        fuse = possible and policy.target_dtype != "float16" and not policy.emulate
    backend = "MKLDNN" if fuse else None
    return FusionPlan(backend, bool(backend) and policy.enabled and policy.target_dtype == "bfloat16")


def _contexts(ctx: Any) -> List[mx.Context]:
    """``ctx`` (a Context, or a list/tuple of them, as MXNet's own APIs take it) as a non-empty
    list of Contexts of one device type; ``TypeError``/``ValueError`` naming it otherwise."""
    many = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx]
    bad = [c for c in many if not isinstance(c, mx.Context)]
    if bad or not many:
        raise (ValueError if not many else TypeError)(
            f"ctx must be an mx.Context or a non-empty list of them (e.g. mx.cpu() or [mx.gpu(0), mx.gpu(1)]), "
            f"got {ctx!r}")
    kinds = sorted({c.device_type for c in many})
    if len(kinds) > 1:
        raise ValueError(f"ctx mixes device types {kinds} ({ctx!r}): the converted block is planned for one "
                         "device type; give contexts of one type.")
    return many


def convert_hybrid_block(block: HybridBlock, target_dtype: Any = None, target_dtype_ops=None,
                         fp32_ops=None, conditional_fp32_ops=None, excluded_sym_names=None,
                         ctx: Union[None, mx.Context, Sequence[mx.Context]] = None,
                         cast_optional_params: Optional[bool] = None, *, widest_type_ops=None,
                         keep_batchnorm_fp32: Optional[bool] = None,
                         fuse: Optional[bool] = None, emulate: Optional[bool] = None,
                         tune: Optional[bool] = None,
                         input_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> SymbolBlock:
    """Convert a hybridized FP32 block into a mixed-precision :class:`MixedPrecisionBlock`.

    The block must have been hybridized and run once (its graph is read from the cache).
    ``ctx`` (a Context or a list of Contexts of one device type, as MXNet's APIs take it) defaults to
    where the block's parameters live. The block is not modified.
    ``fuse`` (default: on for a CPU context with oneDNN, unless the target is float16)
    makes the result use MXNet's oneDNN subgraph fusion (conv+BN+ReLU+sum), as
    ``hybridize(backend='MKLDNN')`` does, also after a later ``hybridize``; ``fuse=False``
    opts out. Fusing for bfloat16 first folds each convolution's batch norm into its
    weights in float32 (the result's parameters hold the folded values and an identity
    batch norm), because MXNet's own fold rounds bfloat16 weights towards zero.
    ``cast_optional_params`` (default: on where the block is fused, as the deployment CLI's
    default, except for a numpy-mode block: MXNet 1.9.1's ``mx.np`` has no bfloat16) stores
    the parameters that only low-precision ops read in the target dtype: a fused op caches
    its weights only when they are stored so. Where they stay float32, the calls that record
    nothing run on their casts made once (again once a weight is written), and a call that
    records casts them in its graph (docs/speed.md). Other arguments as for :func:`convert_symbol`.
    The result's ``export`` keeps the cast nodes, and its ``amp_result`` holds the pass's
    per-node decisions (read by ``report``).
    ``emulate=True`` runs the plan emulated in float32 (never fused) when the block runs: on
    any CPU; its graph and parameters (what ``export`` writes) are the plan's.
    With ``input_shapes`` (e.g. ``{'data': (16, 3, 224, 224)}``) it also keeps in float32 the
    ops that do not make the model faster in the target dtype on this machine, measured
    (``tune``, on by default then: see :func:`convert_model`); ``report(result)`` names them
    with their figures. Without them (unless tuning is off, or emulated), where the result is
    bound, at its first call's shapes, the rule ``init`` applies to a graph not measured yet
    decides: a plan it finds slower than float32 (MobileNetV3's hard-swish casts) runs as the
    same graph in float32, still fused, and ``report(result).fallbacks`` says so; the plan
    (what ``export`` writes) stays as converted, and from the next call the result holds the
    weights it stored in the target dtype in float32 (the same values; ``export`` still writes
    them as the plan stores them), so that graph does not cast them on every call. A
    convolution whose low kernel fails at the shapes it meets runs float32 whatever the plan
    (:mod:`gluon_amp_core.shape_limits`); with ``input_shapes`` the plan itself says so.
    """
    if not isinstance(block, HybridBlock):
        raise TypeError(f"convert_hybrid_block expects a gluon HybridBlock, got {type(block).__name__}")
    inputs, sym = mxi.cached_graph(block, "convert_hybrid_block")
    frontend = sym  # a numpy-mode block's graph: the result returns mx.np arrays too
    sym = plan_notes.fp32_graph(block, sym)  # traced under init: without the plan's casts (any policy's)
    policy = _policy(target_dtype, target_dtype_ops, fp32_ops, conditional_fp32_ops,
                     widest_type_ops, keep_batchnorm_fp32, emulate, tune)
    params = {p.name: p for p in block.collect_params().values()}
    if ctx is None:
        ctx = next(iter(params.values())).list_ctx()[0] if params else mx.current_context()
    ctx = _contexts(ctx)
    plan = fusion_plan(fuse, ctx[0].device_type, policy)
    backend = plan.backend
    if backend is not None and any(n["op"] in CONTROL_FLOW for n in mxi.symbol_graph(sym)["nodes"]):
        if fuse:
            raise ValueError("fuse=True: this graph holds control flow (foreach, while_loop or cond), and "
                             f"MXNet's {backend} fusion of such a graph with {policy.target_dtype} ops gave "
                             "wrong values (NaN, 1e30) on a simulated native host. Convert with fuse=False, "
                             "or leave fuse unset (such a graph then runs unfused).")
        backend = None  # the default: unfused, as the emulated plan it matches
    defaulted = cast_optional_params is None
    if defaulted:  # not a numpy-mode block's: 1.9.1's mx.np holds no bfloat16 arrays
        cast_optional_params = backend is not None and not isinstance(frontend, mxi.NP_SYMBOL)
    arg_names, aux_names = set(sym.list_arguments()), set(sym.list_auxiliary_states())
    arg_params = {n: params[n].data(params[n].list_ctx()[0]) for n in arg_names if n in params}
    aux_params = {n: params[n].data(params[n].list_ctx()[0]) for n in aux_names if n in params}
    fallbacks: List[str] = []
    if plan.fold:
        try:
            arg_params, aux_params, _ = fold_batch_norm(sym, arg_params, aux_params)
        except Exception as error:  # noqa: BLE001  an optional step: the plan runs without it
            if fuse:
                raise RuntimeError("fuse=True folds batch norm first, which fails on this graph: "
                                   f"{mxi.error_line(error)}. Convert with fuse=False, or leave fuse unset "
                                   "to run unfused.") from error
            backend = None
            fallbacks.append(f"unfused: folding batch norm for the fusion fails on this graph "
                             f"({mxi.error_line(error)}); it runs unfused (fuse=False)")
    new_sym, new_args, new_aux, result = _convert_model(sym, arg_params, aux_params, policy, excluded_sym_names,
                                                        cast_optional_params, input_shapes, backend is not None,
                                                        require_shapes=tune is True, fallbacks=fallbacks)
    data_vars = [mx.sym.var(i.name, dtype="float32") for i in inputs]
    outputs, grouped = _as_called(block, new_sym, data_vars)
    out = MixedPrecisionBlock(_like_frontend(frontend, outputs), grouped)
    out.amp_result, out.fuse_backend, out.fuse_asked = result, backend, fuse is True
    out.amp_fallbacks = tuple(fallbacks)
    out.amp_speed_rule = policy.tune and input_shapes is None and not policy.emulate  # tune=None: $GLUON_AMP_TUNE
    if defaulted and cast_optional_params:
        out.stored_low_by_default = tuple(sorted(n for n, t in result.param_dtypes.items() if t != "float32"))
    for why in fallbacks:
        warnings.warn(f"convert_hybrid_block: {why}", UserWarning, stacklevel=2)
    loaded = {**{f"arg:{k}": v for k, v in new_args.items()}, **{f"aux:{k}": v for k, v in new_aux.items()}}
    with mxi.own_casts():  # the plan's parameter dtypes: never a script's GPU-only cast (patching/low_cast.py)
        out.collect_params().load_dict(loaded, ctx=ctx, cast_dtype=True, dtype_source="saved")
    if backend:
        out.hybridize()
    return _run_as_planned(out, policy)
