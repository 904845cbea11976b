"""``init`` / ``disable`` / ``autocast``: reversible patching of MXNet's op functions."""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.decide import CAST_OPS, Decision, Reason, decide
from gluon_amp_core.lists.loss_outputs import LOSS_OUTPUT_FUNCTIONS
from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec, OpClass, OpTable

from . import follow, loss_output, runtime
from . import mxnet_internals as registry
from .emulation import cannot_run, graph_rewriter, round_nd
from .mxnet_internals import to_mx_dtype
from .policies import as_policy

_log = logging.getLogger(__name__)

_nd_amp_cast = mx.nd.amp_cast
_sym_amp_cast = mx.sym.amp_cast
_sym_amp_multicast = mx.sym.amp_multicast
_np_ndarray = mx.np.ndarray
_np_symbol = registry.NP_SYMBOL


@dataclass(frozen=True)
class Patch:
    """One op function ``init`` redirected in place.

    ``function`` stays MXNet's own object: every module attribute, and every reference
    taken before ``init`` (``from mxnet.symbol.contrib import SyncBatchNorm``), still
    names it, and calls through any of them reach ``wrapper``, which runs a copy of the
    function as MXNet made it. ``saved`` holds the code, defaults and ``__wrapped__``
    that :func:`disable` puts back. ``module.name`` is where the function was first found.
    """

    module: types.ModuleType
    name: str
    saved: registry.SavedFunction

    @property
    def function(self) -> types.FunctionType:
        return self.saved.function

    @property
    def wrapper(self) -> Callable:
        return self.saved.wrapper


@dataclass
class _Active:
    policy: Policy
    patches: List[Patch]
    #: the HybridBlock graph hook (emulation, or the cannot-run check)
    graph_hook: Callable
    #: loss scalers attached (init_trainer) while this init is on; loss-output ops read them
    scalers: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


_lock = threading.RLock()
_active: Optional[_Active] = None


def _cast_nd(x: NDArray, dtype: str) -> NDArray:
    if isinstance(x, _np_ndarray):  # amp_cast is a legacy op: go through a zero-copy view
        return _nd_amp_cast(x.as_nd_ndarray(), dtype=to_mx_dtype(dtype)).as_np_ndarray()
    return _nd_amp_cast(x, dtype=to_mx_dtype(dtype))


def _cast_sym(x: Symbol, dtype: str) -> Symbol:
    if isinstance(x, _np_symbol):
        return _sym_amp_cast(x.as_nd_ndarray(), dtype=to_mx_dtype(dtype)).as_np_ndarray()
    return _sym_amp_cast(x, dtype=to_mx_dtype(dtype))


def _multicast_sym(xs: Sequence[Symbol], narrow: bool = False) -> List[Symbol]:
    is_np = [isinstance(x, _np_symbol) for x in xs]
    legacy = [x.as_nd_ndarray() if n else x for x, n in zip(xs, is_np)]
    out = _sym_amp_multicast(*legacy, num_outputs=len(xs), cast_narrow=narrow)
    return [out[i].as_np_ndarray() if n else out[i] for i, n in enumerate(is_np)]


def _nd_wrapper(fn: Callable, op: str, table: OpTable, input_names: Sequence[str],
                neutral: Optional[Callable] = None, emulate: bool = False,
                runs_on_cpu: bool = True) -> Callable:
    """Imperative wrapper: cast float NDArray inputs as ``decide`` says, then call ``fn``.

    The decision for fixed classes (low precision, fp32) does not depend on the call, so
    it is taken once here; conditional ops decide per call on their attributes and
    widest ops on their input dtypes. Dispatch cost matters: this runs on every op call.
    ``neutral`` runs the op when a conditional op's rule does not apply (default ``fn``).
    ``emulate``: inputs and outputs are rounded to the target in float32 instead of cast
    (imperative emulation rounds at decided ops only; hybridized graphs are exact).
    ``runs_on_cpu=False``: a low-precision op with CPU inputs raises a RuntimeError.
    """
    neutral = neutral or fn
    op_class = table.classes.get(op, OpClass.NEUTRAL)
    fixed = decide(op, {}, [], table) if op_class in (OpClass.LOW_PRECISION, OpClass.FP32) else None
    to_name = registry.FLOAT_NAMES
    low = table.target_dtype
    cast = (lambda x, dt: round_nd(x, dt) if dt == low else x) if emulate else _cast_nd
    guard = not emulate and not runs_on_cpu and op_class is OpClass.LOW_PRECISION

    def cast_all(args: tuple, kwargs: dict, d: Decision) -> Any:
        want, keep = d.dtype, d.keep_fp32
        if guard and any(isinstance(a, NDArray) and a.context.device_type == "cpu"
                         for a in [*args, *kwargs.values()]):
            raise RuntimeError(cannot_run(f"{op} (imperative)", want, "cpu"))
        new_args = None
        for i, a in enumerate(args):
            if isinstance(a, NDArray):
                dt = to_name.get(a.dtype)
                if dt is not None and (dt != want or emulate) and not (
                        keep and i < len(input_names) and input_names[i] in keep):
                    if new_args is None:
                        new_args = list(args)
                    new_args[i] = cast(a, want)
        if kwargs:
            for k, v in kwargs.items():
                if k != "out" and k not in keep and isinstance(v, NDArray):
                    dt = to_name.get(v.dtype)
                    if dt is not None and (dt != want or emulate):
                        kwargs[k] = cast(v, want)
        out = fn(*(args if new_args is None else new_args), **kwargs)
        if emulate and want == low and "out" not in kwargs:
            return _round_outputs(out, low)
        return out

    if fixed is not None:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            return cast_all(args, kwargs, fixed)
    elif op_class is OpClass.WIDEST:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            dts = [to_name.get(a.dtype, "other") for a in args if isinstance(a, NDArray)]
            if kwargs:
                dts += [to_name.get(v.dtype, "other") for k, v in kwargs.items()
                        if k != "out" and isinstance(v, NDArray)]
            if len(dts) < 2 or all(d == dts[0] for d in dts):
                return fn(*args, **kwargs)
            d = decide(op, kwargs, dts, table)
            return fn(*args, **kwargs) if d.dtype is None else cast_all(args, kwargs, d)
    else:
        @functools.wraps(fn)
        def amp_op(*args: Any, **kwargs: Any) -> Any:
            d = decide(op, kwargs, (), table)
            return neutral(*args, **kwargs) if d.dtype is None else cast_all(args, kwargs, d)

    return amp_op


def _round_outputs(out: Any, dtype: str) -> Any:
    if isinstance(out, NDArray):
        return round_nd(out, dtype) if registry.FLOAT_NAMES.get(out.dtype) == "float32" else out
    if isinstance(out, (list, tuple)):
        return type(out)(_round_outputs(o, dtype) for o in out)
    return out


def _sym_wrapper(fn: Callable, op: str, table: OpTable, info: registry.OpInfo,
                 neutral: Optional[Callable] = None, excluded: frozenset = frozenset()) -> Callable:
    """Symbolic wrapper: insert ``amp_cast``/``amp_multicast`` nodes before the op.

    ``neutral`` builds the op when the decision leaves its inputs alone (default ``fn``).
    An op built with a ``name=`` that resolves to a node name in ``excluded`` runs in float32."""
    declared = len(info.inputs)
    neutral = neutral or fn

    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        sym_kw = [k for k, v in kwargs.items() if isinstance(v, Symbol)]
        attrs = {k: v for k, v in kwargs.items() if k not in sym_kw}
        n_given = sum(isinstance(a, Symbol) for a in args) + len(sym_kw)
        is_excluded = bool(excluded) and registry.full_op_name(kwargs.get("name")) in excluded
        d = decide(op, attrs, [None] * n_given, table, excluded=is_excluded)
        if d.dtype is None and d.reason is not Reason.WIDEST:
            return neutral(*args, **kwargs)
        if not info.variadic and n_given < declared:
            # MXNet creates the missing inputs (weights) itself: build, then re-wire casts.
            given = {a.name for a in [*args, *kwargs.values()] if isinstance(a, Symbol)}
            return _recompose(fn(*args, **kwargs), d, info, given)
        positions = [(None, i) for i, a in enumerate(args) if isinstance(a, Symbol)]
        positions += [(k, None) for k in sym_kw]
        new_args = list(args)

        def get(p):
            return kwargs[p[0]] if p[0] is not None else new_args[p[1]]

        def put(p, v):
            if p[0] is not None:
                kwargs[p[0]] = v
            else:
                new_args[p[1]] = v

        if d.dtype is None:  # widest, dtypes unknown until run time
            if len(positions) > 1:
                cast = _multicast_sym([get(p) for p in positions])
                for j, p in enumerate(positions):
                    put(p, cast[j])
            return fn(*new_args, **kwargs)
        for p in positions:
            name = p[0] if p[0] is not None else (info.inputs[p[1]] if p[1] < declared else "")
            if name not in d.keep_fp32:
                put(p, _cast_sym(get(p), d.dtype))
        return fn(*new_args, **kwargs)

    return amp_op


def _recompose(sym: Symbol, d: Decision, info: registry.OpInfo, given: set) -> Symbol:
    children = sym.get_children()
    if children is None:
        return sym
    aux = set(sym.list_auxiliary_states())
    inputs = []
    for i in range(len(children)):
        child = children[i]
        if (child.name not in given and child.get_children() is None
                and "__dtype__" not in child.list_attr()):
            # A weight the op created itself: pin it to float32 (the master copy), since
            # the cast in front of the op stops infer_type from reaching it.
            registry.pin_float32(child)
        name = info.inputs[i] if i < len(info.inputs) else ""
        keep = d.dtype is None or child.name in aux or name in d.keep_fp32
        inputs.append(child if keep else _cast_sym(child, d.dtype))
    return registry.rebuild_op(sym, inputs)


def init(target_dtype: Any = None,
         target_precision_ops: Optional[Sequence[str]] = None,
         conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
         fp32_ops: Optional[Sequence[str]] = None,
         *,
         widest_type_ops: Optional[Sequence[str]] = None,
         keep_batchnorm_fp32: Optional[bool] = None,
         emulate: Optional[bool] = None,
         excluded_sym_names: Optional[Sequence[str]] = None) -> Policy:
    """Turn on automatic mixed precision for ``mx.nd``, ``mx.sym``, ``mx.np`` and ``mx.npx``.

    Call it before building (or hybridizing) the network. Undo with :func:`disable`.
    AMP is process-wide, not nestable: one policy at a time, for every thread.

    How: every MXNet op function that needs it (over 1,000) is patched *in place*: its
    ``__code__`` becomes a small trampoline into gluon_amp's wrapper, so references taken
    before ``init`` get AMP too and identity checks still hold. Tracebacks and
    ``inspect.getsource`` show the trampoline while AMP is on; :func:`disable` puts every
    function back, checked by identity.

    Parameters
    ----------
    target_dtype : {'float16', 'bfloat16', None} or Policy
        ``None`` picks float16 with a GPU, bfloat16 on a CPU with native bfloat16, and
        otherwise stays in float32 (see Returns). A :class:`Policy` is used as it is.
    target_precision_ops, fp32_ops : list of str, optional
        Replace the default list of ops run in the target dtype / in float32.
    conditional_fp32_ops : list of (op, attr, [values]), optional
        Replace the default list of ops that run in float32 for some attribute values.
    widest_type_ops : list of str, optional
        Replace the default list of ops that run in their widest input type.
    keep_batchnorm_fp32 : bool, optional
        As in Apex: ``True`` forces batch norm to float32, ``False`` to the target dtype.
    emulate : bool, optional
        ``True`` runs the plan of ``target_dtype`` emulated on any CPU: every op in
        float32, every value real AMP holds in low precision rounded to it (hybridized
        blocks exactly; imperative calls round at the decided ops). Without it, a target
        this machine cannot execute builds graphs, and running one raises RuntimeError.
    excluded_sym_names : list of str, optional
        Op node names (as in a hybridized block's graph, e.g. ``'dense0_fwd'``, and as
        :func:`gluon_amp.debug.bisect` returns them) kept in float32.

    Returns
    -------
    Policy
        The policy in force. In the float32 fallback (``target_dtype=None`` on a machine
        without useful low precision) it has ``target_dtype == 'float32'`` and
        ``enabled == False``, nothing is patched and :func:`is_enabled` is False; loss
        scaling still works. Calling ``init()`` again without arguments, or with an equal
        policy, is a no-op returning the active policy; with another one while active it
        raises ``RuntimeError``.
    """
    global _active
    with _lock:
        given = (target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, widest_type_ops,
                 keep_batchnorm_fp32, emulate, excluded_sym_names)
        if _active is not None and all(v is None for v in given):
            return _active.policy  # asks for nothing in particular (a launcher's second init)
        policy = as_policy(target_dtype, target_precision_ops=target_precision_ops,
                           conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops,
                           widest_type_ops=widest_type_ops, keep_batchnorm_fp32=keep_batchnorm_fp32,
                           emulate=emulate, excluded_sym_names=excluded_sym_names)
        if _active is not None:
            if _active.policy == policy:
                return _active.policy
            raise RuntimeError(
                f"gluon_amp is already on with policy {_active.policy.describe()}; asked for "
                f"{policy.describe()}. Call gluon_amp.disable() first, or use "
                "`with gluon_amp.autocast(...)` for a scoped change.")
        if not policy.enabled:
            return policy
        _warn_cached_blocks()
        patches = _patch_all(policy)
        _active = _Active(policy, patches, registry.install_graph_hook(graph_rewriter(policy)))
        _log.info("gluon_amp: mixed precision on, %s, %d functions patched",
                  policy.describe(), len(_active.patches))
        return policy


def register_scaler(scaler: Any) -> None:
    """Make a trainer's loss scaler known to the loss-output ops while AMP is on."""
    if _active is not None:
        _active.scalers.add(scaler)


def _loss_output_scale(op: str) -> float:
    """The scale a loss-output op multiplies its ``grad_scale`` by: the attached scalers'."""
    scales = {s.loss_scale for s in list(_active.scalers)} if _active is not None else set()
    if len(scales) > 1:
        raise RuntimeError(
            f"{op} starts its backward from grad_scale, and {len(scales)} loss scalers with different "
            f"scales {sorted(scales)} are attached: gluon_amp cannot tell which one this loss belongs "
            "to. Share one LossScaler between the trainers, or compute this loss with a gluon.loss block.")
    return scales.pop() if scales else 1.0


def _wrapper_for(fn: Callable, op: str, kind: str, policy: Policy,
                 info: registry.OpInfo) -> Optional[Callable]:
    """The wrapper ``op`` needs under ``table``; None when it runs as it is.

    Where the op may run neutral (its class, or a conditional rule that does not apply)
    and has several inputs, the neutral path makes them agree (:mod:`gluon_amp.follow`).
    """
    table = policy.table
    if op in LOSS_OUTPUT_FUNCTIONS:
        fn = (loss_output.nd_wrapper(fn, op, _loss_output_scale) if kind == "ndarray"
              else loss_output.sym_wrapper(fn, op))
    op_class = table.classes.get(op, OpClass.NEUTRAL)
    neutral = None
    kept = table.keep_fp32_inputs.get(op, frozenset())
    if op_class in (OpClass.NEUTRAL, OpClass.CONDITIONAL_FP32) and not (
            op in CAST_OPS or info.variadic or len(info.inputs) < 2
            or set(info.inputs[1:]) <= kept):  # normalisation: its parameters stay float32
        neutral = (follow.nd_wrapper(fn, op, info.inputs, _cast_nd) if kind == "ndarray" else
                   follow.sym_wrapper(fn, op, info.inputs, table.target_dtype,
                                      lambda xs: _multicast_sym(xs, narrow=True)))
    if op_class is OpClass.NEUTRAL:
        return neutral or (fn if op in LOSS_OUTPUT_FUNCTIONS else None)
    if kind == "ndarray":
        return _nd_wrapper(fn, op, table, info.inputs, neutral, emulate=policy.emulate,
                           runs_on_cpu=runtime.executable(table.target_dtype, "cpu"))
    return _sym_wrapper(fn, op, table, info, neutral, policy.excluded)


def _patch_all(policy: Policy) -> List[Patch]:
    """Redirect each op function that needs a wrapper, once per function object (one
    object is often reachable as several module attributes: ``mx.nd.X``, ``mx.nd.op.X``)."""
    infos = registry.op_infos()
    seen = set()
    patches: List[Patch] = []
    try:
        for module, attr, fn, op, kind in list(registry.op_function_sites()):
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            impl = registry.copy_function(fn)  # the wrappers call this, never fn (fn calls them)
            wrapper = _wrapper_for(impl, op, kind, policy, infos[op])
            if wrapper is not None:
                patches.append(Patch(module, attr, registry.redirect(fn, wrapper)))
    except BaseException:
        _restore(patches)
        raise
    return patches


def _restore(patches: Sequence[Patch]) -> None:
    """Put back each function that still calls its wrapper; leave (and name) the others."""
    changed = []
    for p in reversed(patches):
        if registry.is_redirected_to(p.function, p.wrapper):
            registry.restore(p.saved)
        else:
            changed.append(f"{p.module.__name__}.{p.name}")
    if changed:
        shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
        warnings.warn(
            f"gluon_amp: {len(changed)} op function(s) were changed by someone else while patched "
            f"and are left as they are now, not restored: {shown}",
            RuntimeWarning, stacklevel=3)


def disable() -> None:
    """Put back every original MXNet function. A no-op when AMP is off."""
    global _active
    with _lock:
        if _active is None:
            return
        _restore(_active.patches)
        registry.remove_graph_hook(_active.graph_hook)
        _active = None


def is_enabled() -> bool:
    return _active is not None


def current_policy() -> Optional[Policy]:
    """The policy in force, or ``None`` when nothing is patched."""
    return _active.policy if _active is not None else None


def current_table() -> Optional[OpTable]:
    """The op table in force, or ``None`` when nothing is patched."""
    return _active.policy.table if _active is not None else None


def patched_functions() -> Tuple[Patch, ...]:
    """The record of the op functions ``init`` redirected, one per function (empty when off)."""
    return tuple(_active.patches) if _active is not None else ()


@contextlib.contextmanager
def autocast(target_dtype: Any = None, **kwargs: Any) -> Iterator[Policy]:
    """Scope :func:`init`: AMP is on inside the block and restored on exit.

    If AMP was already on with the same arguments, the block changes nothing; with other
    arguments it raises ``RuntimeError`` as ``init`` does.
    """
    was_on = is_enabled()
    policy = init(target_dtype, **kwargs)
    try:
        yield policy
    finally:
        if not was_on:
            disable()


def _warn_cached_blocks() -> None:
    stale = []
    for obj in gc.get_objects():
        try:
            if registry.has_cached_graph(obj):
                stale.append(obj.name)
        except ReferenceError:
            continue
    if stale:
        shown = ", ".join(stale[:5]) + (" ..." if len(stale) > 5 else "")
        warnings.warn(
            f"{len(stale)} hybridized block(s) cached their graph before gluon_amp.init() and will "
            f"run without mixed precision: {shown}. Call block.hybridize() again (it drops the "
            "cached graph) or rebuild the "
            "block, then run it once.", RuntimeWarning, stacklevel=3)
