"""The class wrappers: cast (or, emulated, round) an op's inputs as its decision says.

One wrapper per op function with a decision (low precision, fp32, conditional, widest);
see :mod:`gluon_amp.patching.wrappers` for how they compose with the others.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, Tuple

from mxnet import autograd
from mxnet.base import MXNetError
from mxnet.ndarray import NDArray
from mxnet.numpy import ndarray as _NP_ARRAY
from mxnet.symbol import Symbol

from gluon_amp_core.decide import Decision, Reason, decide
from gluon_amp_core.dtypes import FLOAT_DTYPES, LOW_PRECISION_DTYPES, dtype_name
from gluon_amp_core.emulate import DIRECT_INPUTS
from gluon_amp_core.table import OpClass, OpTable
from gluon_amp_core.verdicts import Verdict

from ... import mxnet_internals as mxi
from ...emulation import round_nd, unpatched
from ...execution import CannotRun, cannot_run
from ...type_inference import op_types
from ..low_cast import _caller_level
from .casts import CASTABLE, cast_into, cast_nd, cast_sym, either_frontend, multicast_sym


def nd_wrapper(fn: Callable, op: str, table: OpTable, sig: mxi.Signature,
                neutral: Optional[Callable] = None, emulate: bool = False,
                runs_on_cpu: bool = True) -> Callable:
    """Imperative wrapper: cast float NDArray inputs as ``decide`` says, then call ``fn``.

    The decision for fixed classes (low precision, fp32) does not depend on the call, so
    it is taken once here; conditional ops decide per call on their attributes, widest ops
    on their input dtypes, and low-precision ops with a shape rule on their data input's
    shape. ``sig`` says which arguments are inputs and which attributes, for every way
    of calling the op. Dispatch cost matters: this runs on every op call.
    ``neutral`` runs the op when a conditional op's rule does not apply (default ``fn``).
    ``emulate``: inputs and outputs are rounded to the target in float32 instead of cast
    (imperative emulation rounds at decided ops only; hybridized graphs are exact).
    ``runs_on_cpu=False``: a low-precision op with CPU inputs raises a RuntimeError.
    """
    neutral = neutral or fn
    op_class = table.classes.get(op, OpClass.NEUTRAL)
    by_shape = op_class is OpClass.LOW_PRECISION and table.canonical(op) in table.narrow_fp32
    fixed = (decide(op, {}, [], table) if op_class in (OpClass.LOW_PRECISION, OpClass.FP32)
             and not by_shape else None)
    input_names = sig.inputs
    data_name = input_names[0] if input_names else "data"
    n_pos = len(input_names)  # positional arguments past these are attributes or options
    variadic = sig.variadic
    to_name = mxi.FLOAT_NAMES
    low = table.target_dtype
    # a widest op whose kernel in the target dtype is slow: uniform target inputs go to decide too
    slow_low = op_class is OpClass.WIDEST and table.verdicts.get(table.canonical(op)) is Verdict.SLOW
    most_inputs = table.fp32_above_inputs.get(table.canonical(op)) if op_class is OpClass.WIDEST else None
    guard = not emulate and not runs_on_cpu and op_class is OpClass.LOW_PRECISION
    direct = DIRECT_INPUTS.get(table.canonical(op)) if emulate else None

    def emulated_inputs(args: tuple, kwargs: dict, want: str, keep: frozenset) -> Tuple[Optional[list], Any]:
        """Emulated: every float input in float32, rounded to ``want`` where it is the target;
        float16/bfloat16 inputs (GPU-only code's data) cast to float32 first, even kept ones.
        Returns the new positional arguments (None: unchanged) and the first low dtype fed."""
        new_args, fed = None, None
        for i, a in enumerate(args if variadic or len(args) <= n_pos else args[:n_pos]):
            if isinstance(a, NDArray):
                dt = CASTABLE.get(a.dtype)
                if dt is None:
                    continue
                kept = keep and i < len(input_names) and input_names[i] in keep
                if dt in LOW_PRECISION_DTYPES:
                    fed = fed or dt
                elif kept:
                    continue
                if new_args is None:
                    new_args = list(args)
                new_args[i] = _emulated(a, "float32" if kept else want, dt, low)
        if kwargs:
            for k, v in kwargs.items():
                if k != "out" and isinstance(v, NDArray):
                    dt = CASTABLE.get(v.dtype)
                    if dt is None or (k in keep and dt not in LOW_PRECISION_DTYPES):
                        continue
                    if dt in LOW_PRECISION_DTYPES:
                        fed = fed or dt
                    kwargs[k] = _emulated(v, "float32" if k in keep else want, dt, low)
        return new_args, fed

    def cast_all(args: tuple, kwargs: dict, d: Decision) -> Any:
        want, keep = d.dtype, d.keep_fp32
        if guard and want == low and any(isinstance(a, NDArray) and a.ctx.device_type == "cpu"
                         for a in [*args, *kwargs.values()]):
            if mxi.constructing_block() is None:
                raise CannotRun(cannot_run(f"{op} (imperative)", want, "cpu"))
            return _while_constructing(fn, op, want, args, kwargs)
        given = kwargs.get("out") if variadic or len(args) <= n_pos else sig.option(args, kwargs, "out")
        if given is not None and (any(a is given for a in args)
                                  or any(v is given for k, v in kwargs.items() if k != "out")):
            # in place (x[idx] = v, x += y; MXNet's _scatter_set_nd requires its input to be its
            # out=): the caller's array stays the one written, in its own dtype; the other inputs
            # come in that dtype
            return _in_place(fn, args, kwargs, given)
        fed = None
        if emulate:
            new_args, fed = emulated_inputs(args, kwargs, want, keep)
        else:
            new_args = None
            # a widest float64 (numpy mode promotes mixed dtypes): amp_cast makes no float64
            # (oneDNN: "unknown type for MKLDNN"), so the others come in float32, exactly, and
            # MXNet promotes them as it does in FP32
            to = "float32" if want == "float64" else want
            for i, a in enumerate(args if variadic or len(args) <= n_pos else args[:n_pos]):
                if isinstance(a, NDArray):
                    dt = CASTABLE.get(a.dtype)
                    if dt in LOW_PRECISION_DTYPES:
                        fed = fed or dt
                    if dt is not None and dt != to and not (
                            keep and i < len(input_names) and input_names[i] in keep):
                        if new_args is None:
                            new_args = list(args)
                        new_args[i] = cast_nd(a, to)
            if kwargs:
                for k, v in kwargs.items():
                    if k != "out" and k not in keep and isinstance(v, NDArray):
                        dt = CASTABLE.get(v.dtype)
                        if dt in LOW_PRECISION_DTYPES:
                            fed = fed or dt
                        if dt is not None and dt != to:
                            kwargs[k] = cast_nd(v, to)
        if given is not None:
            return _call_with_out(fn, sig, new_args or list(args), kwargs, given, want,
                                  low if emulate and want == low else None)
        if direct is not None and want == low and new_args is not None and direct < len(args) <= n_pos:
            out = _direct_emulated(fn, args, new_args, kwargs, direct, low)
        else:
            out = fn(*(args if new_args is None else new_args), **kwargs)
        if emulate and want == low:
            out = _round_outputs(out, low)
            return out if fed is None else _cast_outputs(out, fed)
        if want == low and fed is not None and fed != low:
            # GPU-style code fed float16 to a bfloat16 op: its outputs in the dtype the code works
            # in, as the op's emulated run and a hybridized graph give them (execution.outputs_as_fed)
            return _cast_outputs(out, fed, low)
        if want == low == "bfloat16" and fed is None and _numpy_frontend(out):
            # MXNet 1.9.1's mx.np holds no bfloat16 arrays: asnumpy() gives raw 16-bit words, and
            # its hand-written functions (np.tensordot, np.outer) have no bfloat16 kernels nor
            # gluon_amp's casts. Float32 code gets float32, as from a graph (outputs_as_fed).
            return _cast_outputs(out, "float32", low)
        return out

    if fixed is not None:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            return cast_all(args, kwargs, fixed)
    elif by_shape:  # low precision unless the data input's shape keeps it in float32
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            x = args[0] if args else kwargs.get(data_name)
            shape = x.shape if isinstance(x, NDArray) else None
            return cast_all(args, kwargs, decide(op, sig.rule_attributes(args, kwargs), (), table,
                                                 input_shapes=(shape,)))
    elif op_class is OpClass.WIDEST:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            dts = [to_name.get(a.dtype, "other") for a in
                   (args if variadic or len(args) <= n_pos else args[:n_pos]) if isinstance(a, NDArray)]
            if kwargs:
                dts += [to_name.get(v.dtype, "other") for k, v in kwargs.items()
                        if k != "out" and isinstance(v, NDArray)]
            if (len(dts) < 2 or all(d == dts[0] for d in dts)) and not (
                    (slow_low or most_inputs is not None and len(dts) > most_inputs) and dts and dts[0] == low):
                return fn(*args, **kwargs)
            d = decide(op, sig.rule_attributes(args, kwargs), dts, table)
            return fn(*args, **kwargs) if d.dtype is None else cast_all(args, kwargs, d)
    else:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            d = decide(op, sig.rule_attributes(args, kwargs), (), table)
            return neutral(*args, **kwargs) if d.dtype is None else cast_all(args, kwargs, d)

    return amp_op


def _direct_emulated(fn: Callable, args: tuple, new_args: list, kwargs: dict, k: int, low: str) -> Any:
    """An emulated op of :data:`gluon_amp_core.emulate.DIRECT_INPUTS` whose parameter (input
    ``k``, ``args[k]``) the plan rounds: ``op(x, w, b) + op(x, r - w)``, the second without bias
    and ``r - w`` outside autograd, so the op reads the parameter itself and its gradient is the
    parameter's only one (MXNet 1.9.1's oneDNN deconvolution backward crashes otherwise); the
    other inputs as ``new_args`` has them. As in graphs (:func:`gluon_amp_core.emulate._direct_split`)."""
    w = args[k]
    if isinstance(w, NDArray) and mxi.FLOAT_NAMES.get(w.dtype) in LOW_PRECISION_DTYPES:
        # fed low (GPU-style float16 code): read through an add of zero, as graphs do
        with autograd.pause():
            zeros = _ZEROS_LIKE(new_args[k])
        return fn(*[_ADD(a, zeros) if i == k else a for i, a in enumerate(new_args)], **kwargs)
    if not isinstance(w, NDArray) or mxi.FLOAT_NAMES.get(w.dtype) != "float32" or new_args[k] is w:
        return fn(*new_args, **kwargs)
    with autograd.pause():
        delta = _SUB(round_nd(w, low), w)
    main = fn(*[w if i == k else a for i, a in enumerate(new_args)], **kwargs)
    rest = {n: v for n, v in kwargs.items() if n not in ("bias", "no_bias", "name")}
    correction = fn(*new_args[:k], delta, no_bias=True, **rest)
    return _ADD(main, correction)


def _in_place(fn: Callable, args: tuple, kwargs: dict, out: NDArray) -> Any:
    """``fn`` writing into ``out``, one of its own inputs, with every other float input cast to
    ``out``'s dtype (exact for a float16 or bfloat16 value read into float32)."""
    dtype = CASTABLE.get(out.dtype)

    def fit(v: Any) -> Any:
        if v is out or not isinstance(v, NDArray) or dtype is None or CASTABLE.get(v.dtype) in (None, dtype):
            return v
        return cast_nd(v, dtype)

    return fn(*[fit(a) for a in args], **{k: (v if k == "out" else fit(v)) for k, v in kwargs.items()})


def _while_constructing(fn: Callable, op: str, dtype: str, args: tuple, kwargs: dict) -> Any:
    """``op`` run as the caller gave it (float32), by a forward inside a block's construction.

    A model's constructor that runs part of itself to read a shape (GluonCV's CenterNet runs
    its backbone on zeros for the channel count) builds the plan; it does not train or infer.
    Under a target this machine cannot run, its low-precision ops run in float32, said once;
    a forward outside construction is refused (:func:`gluon_amp.execution.cannot_run`).
    """
    name = getattr(mxi.constructing_block(), "name", "?")
    if (name, dtype) not in _said_constructing:
        _said_constructing.add((name, dtype))
        warnings.warn(f"gluon_amp: a forward run while block {name!r} was being constructed ran its "
                      f"{dtype} ops ({op}, ...) in float32, since this machine cannot execute {dtype}: such a "
                      "forward only reads shapes. A forward outside construction raises.",
                      RuntimeWarning, stacklevel=_caller_level())
    return fn(*args, **kwargs)


_said_constructing: set = set()


def _call_with_out(fn: Callable, sig: mxi.Signature, args: list, kwargs: dict, out: Any,
                   want: Optional[str], rounded: Optional[str]) -> Any:
    """``fn`` writing into the caller's ``out=`` arrays, in their dtypes; emulated, their
    values rounded to ``rounded``. Returns ``out``, as MXNet does.

    The op runs in a dtype the caller did not choose: where MXNet rejects their arrays for
    it, the outputs are made without them and written into them cast. (Ops whose point is
    writing into ``out``, such as ``_copyto``, accept any dtype and run as they are.)"""
    try:
        result = fn(*args, **kwargs)
    except MXNetError:
        if want is None or not _differs(out, want):
            raise
        if "out" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        else:
            args = [None if k == sig.params.index("out") else a for k, a in enumerate(args)]
        made = fn(*args, **kwargs)
        if not _differs(out, _dtype_of(made)):
            raise  # not the dtype: MXNet's own error stands
        return _into(out, made, rounded)
    return _into(out, out, rounded) if rounded is not None else result


def _dtype_of(result: Any) -> str:
    first = result[0] if isinstance(result, (list, tuple)) else result
    return mxi.FLOAT_NAMES.get(first.dtype) or dtype_name(first.dtype)


def _differs(out: Any, dtype: str) -> bool:
    """True when a float array of ``out`` (the caller's ``out=``) is not of ``dtype``."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return any(mxi.FLOAT_NAMES.get(getattr(o, "dtype", None), dtype) != dtype for o in outs)


def _into(out: Any, result: Any, rounded: Optional[str]) -> Any:
    """Write ``result`` into the caller's ``out`` arrays in their dtypes (rounded to
    ``rounded`` first, emulated); returns ``out``."""
    if rounded is not None:
        result = _round_outputs(result, rounded)
    outs = out if isinstance(out, (list, tuple)) else [out]
    results = result if isinstance(result, (list, tuple)) else [result]
    for o, r in zip(outs, results):
        if r is o:
            continue
        if r.dtype != o.dtype and r.dtype in CASTABLE and o.dtype in CASTABLE:
            cast_into(r, o)
        else:
            r.copyto(o)  # MXNet says so when these do not fit
    return out


# legacy ops: the emulated op's own arrays may be numpy-mode ones (npx.deconvolution's)
_SUB, _ADD, _ZEROS_LIKE = (either_frontend(unpatched(op)) for op in ("elemwise_sub", "elemwise_add", "zeros_like"))


def _emulated(x: NDArray, to: str, given: str, low: str) -> NDArray:
    """``x`` (of dtype ``given``) as an emulated op reads it: float32, holding ``low``'s
    values where ``to`` is the target."""
    if to == low:
        return round_nd(x, low)
    return cast_nd(x, "float32") if given in LOW_PRECISION_DTYPES else x


def _cast_outputs(out: Any, dtype: str, computed: str = "float32") -> Any:
    """A low-precision op's outputs computed in ``computed`` (float32 emulated, the target
    natively), for a caller that fed it ``dtype`` (GPU-only code working in float16): in that
    dtype, as a graph fed so gives them (:func:`gluon_amp_core.emulate.emulate_graph`)."""
    if isinstance(out, NDArray):
        return cast_nd(out, dtype) if mxi.FLOAT_NAMES.get(out.dtype) == computed else out
    if isinstance(out, (list, tuple)):
        return type(out)(_cast_outputs(o, dtype, computed) for o in out)
    return out


def _numpy_frontend(out: Any) -> bool:
    """Whether ``out`` (an op's result: an array or a list of them) is a numpy-mode array."""
    return isinstance(out[0] if isinstance(out, (list, tuple)) and out else out, _NP_ARRAY)


def _round_outputs(out: Any, dtype: str) -> Any:
    if isinstance(out, NDArray):
        return round_nd(out, dtype) if mxi.FLOAT_NAMES.get(out.dtype) == "float32" else out
    if isinstance(out, (list, tuple)):
        return type(out)(_round_outputs(o, dtype) for o in out)
    return out


def sym_wrapper(fn: Callable, op: str, table: OpTable, info: mxi.OpInfo, sig: mxi.Signature,
                 neutral: Optional[Callable] = None, excluded: frozenset = frozenset()) -> Callable:
    """Symbolic wrapper: insert ``amp_cast``/``amp_multicast`` nodes before the op.

    ``sig`` says which arguments are inputs and which attributes.
    ``neutral`` builds the op when the decision leaves its inputs alone (default ``fn``).
    An op built with a ``name=`` that resolves to a node name in ``excluded`` runs in float32."""
    declared = len(info.inputs)
    neutral = neutral or fn

    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        sym_kw = [k for k, v in kwargs.items() if isinstance(v, Symbol)]
        inputs = sig.input_args(args)
        n_given = sum(isinstance(a, Symbol) for a in inputs) + len(sym_kw)
        is_excluded = bool(excluded) and mxi.full_op_name(sig.option(args, kwargs, "name")) in excluded
        d = decide(op, sig.rule_attributes(args, kwargs), [None] * n_given, table, excluded=is_excluded)
        if d.dtype is None and d.reason not in (Reason.WIDEST, Reason.UNIFORM_INPUTS):
            return neutral(*args, **kwargs)
        if not info.variadic and n_given < declared:
            # MXNet creates the missing inputs (weights) itself: build, then re-wire casts.
            given = {a.name for a in [*args, *kwargs.values()] if isinstance(a, Symbol)}
            return _recompose(fn(*args, **kwargs), d, info, given)
        forced = () if info.variadic else _forced_input_types(
            info, sig.attributes(args, kwargs), declared)
        positions = [(None, i) for i, a in enumerate(inputs) if isinstance(a, Symbol) and i not in forced]
        positions += [(k, None) for k in sym_kw if k not in info.inputs or info.inputs.index(k) not in forced]

        def build(aux: frozenset) -> Any:
            """The op on its inputs cast, those that are its auxiliary states (``aux``) left as given."""
            new_args, new_kwargs = list(args), dict(kwargs)

            def get(p):
                return new_kwargs[p[0]] if p[0] is not None else new_args[p[1]]

            def put(p, v):
                if p[0] is not None:
                    new_kwargs[p[0]] = v
                else:
                    new_args[p[1]] = v

            cast_at = positions if not aux else [
                p for p in positions if get(p).name not in aux or get(p).get_children() is not None]
            if d.dtype is None:  # widest, dtypes unknown until run time
                if len(cast_at) > 1:
                    cast = multicast_sym([get(p) for p in cast_at])
                    for j, p in enumerate(cast_at):
                        put(p, cast[j])
                return fn(*new_args, **new_kwargs)
            for p in cast_at:
                name = p[0] if p[0] is not None else (info.inputs[p[1]] if p[1] < declared else "")
                if name not in d.keep_fp32:
                    put(p, cast_sym(get(p), d.dtype))
            return fn(*new_args, **new_kwargs)

        return built_leaving_aux(build, neutral, args, kwargs)

    return amp_op


def built_leaving_aux(build: Callable[[frozenset], Any], plain: Callable, args: tuple, kwargs: dict) -> Any:
    """``build(frozenset())`` (the op on its inputs cast), else, where MXNet refuses it,
    ``build(aux)`` leaving the op's auxiliary states as given.

    An auxiliary state given as a variable (a Custom op's, whose prop declares them;
    ``quantized_batch_norm``'s moving mean and variance) is mutated by the op, and MXNet
    refuses a cast there ("Mutation target can only be Variable"): the op's own list, built by
    ``plain``, says which. The names these attempts took are handed out again (the op's is
    plain MXNet's)."""
    names_back = mxi.auto_names_mark()
    try:
        return build(frozenset())
    except MXNetError:
        try:
            aux = frozenset(mxi.op_head(plain(*args, **kwargs)).list_auxiliary_states())
        except MXNetError:
            aux = frozenset()
        finally:
            names_back()
        if not aux:
            raise
        return build(aux)


def control_flow_sym_wrapper(fn: Callable, subgraphs: int) -> Callable:
    """A symbolic control-flow op (float32 in the op table): its data inputs cast to float32,
    its leading ``subgraphs`` arguments (the body's graphs) passed as they are."""
    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        cast = [cast_sym(a, "float32") if k >= subgraphs and isinstance(a, Symbol) else a
                for k, a in enumerate(args)]
        return fn(*cast, **kwargs)

    return amp_op


#: ops whose type rule is the user's Python (a CustomOpProp's infer_type): MXNet's inference
#: without the program's input types calls it with what it does not expect, and a failure
#: there aborts the process
PYTHON_TYPED = frozenset({"Custom", "_CustomFunction", "_NDArray", "_Native"})


def _forced_input_types(info: mxi.OpInfo, attrs: dict, n: int) -> frozenset:
    """The positions among the op's ``n`` inputs whose dtype MXNet's type rule fixes to a
    non-float one whatever the others are (``batch_take``'s int32 indices): never cast, as
    the imperative wrapper casts only float arrays."""
    if info.canonical in PYTHON_TYPED:
        return frozenset()
    typed = op_types(info.canonical, {k: v for k, v in attrs.items() if v is not None}, (None,) * n)
    return frozenset(i for i, t in enumerate(typed[0]) if t is not None and t not in FLOAT_DTYPES) \
        if typed is not None else frozenset()


def _recompose(built: Any, d: Decision, info: mxi.OpInfo, given: set) -> Any:
    """``built`` (an op function's result, a list of outputs in numpy mode) rebuilt with
    casts in front of its inputs; same API form (:func:`gluon_amp.mxnet_internals.rebuild_op`)."""
    sym = mxi.op_head(built)
    children = sym.get_children()
    if children is None:
        return built
    aux = set(sym.list_auxiliary_states())
    inputs = []
    forced = _forced_input_types(info, {k: v for k, v in sym.list_attr().items() if k in info.attrs},
                                 len(children))
    for i in range(len(children)):
        child = children[i]
        if i in forced:
            inputs.append(child)  # an input the op types itself (batch_take's int32 indices)
            continue
        if (child.name not in given and child.get_children() is None
                and "__dtype__" not in child.list_attr()):
            # A weight the op created itself: pin it to float32 (the master copy), since
            # the cast in front of the op stops infer_type from reaching it.
            mxi.pin_float32(child)
        name = info.inputs[i] if i < len(info.inputs) else ""
        keep = d.dtype is None or child.name in aux or name in d.keep_fp32
        inputs.append(child if keep else cast_sym(child, d.dtype))
    return mxi.rebuild_op(built, inputs)
