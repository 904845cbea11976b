"""The patching lifecycle: ``init`` / ``disable`` / ``autocast``, and the state while AMP is on.

What each op function is wrapped with lives in :mod:`.wrappers`; what the HybridBlock hooks do
with a fresh graph in :mod:`.hooks` (with the input-shape rules of :mod:`.shape_rules`); how a
function is swapped in place (and back) in :mod:`gluon_amp.mxnet_internals`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec

from .. import mxnet_internals as mxi, runtime
from ..policy_builder import as_policy
from ..speed.schedule import Tuner
from . import low_cast
from .hooks import graph_rewriter, holds_amp_plan
from .wrappers import ScalerRegistry, wrapper_for

_log = logging.getLogger(__name__)


@dataclass
class _Active:
    policy: Policy
    patches: List[mxi.SavedFunction]
    #: the HybridBlock hooks (emulation or the cannot-run check; stale cached graphs)
    hooks: mxi.BlockHooks
    #: loss scalers attached (init_trainer) while this init is on; loss-output ops read them
    scalers: ScalerRegistry = field(default_factory=ScalerRegistry)
    #: tunes the blocks' graphs as they train (``tune``), within the process's budget
    tuner: Optional[Tuner] = None
    #: shape and type inference of a block not built yet, with the hooks paused (builds no execution)
    infer_hook: Optional[mxi.InferHook] = None


_lock = threading.RLock()
_active: Optional[_Active] = None
#: (serial, target dtype or None) each time the policy in force changed (init, disable):
#: a trainer asks which dtypes ran since its last step (:func:`dtypes_since`)
_changes: List[Tuple[int, Optional[str]]] = [(0, None)]
_KEEP_CHANGES = 4096
#: every trainer hook attached so far (weakly): an ``init`` after ``init_trainer`` starts
#: its loss-output ops with them, so their first step is scaled as ``scale_loss`` scales it
_hooks: "weakref.WeakSet[Any]" = weakref.WeakSet()


def init(target_dtype: Any = None, target_precision_ops: Optional[Sequence[str]] = None,
         conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
         fp32_ops: Optional[Sequence[str]] = None, **options: Any) -> Policy:
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
    **options : keyword-only, as :func:`gluon_amp.make_policy` takes them:
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
    tune : bool, optional
        Choose per op, by timing on this machine, which ops the plan runs low stay in
        float32: each op timed alone in both dtypes with the casts it needs, then the
        proposals kept only where the whole graph gets faster. A hybridized block's first
        call runs the plan (or what the timing cache holds for its graph structure);
        tuning starts once an input shape repeats, runs between calls as far as
        ``tune_budget`` has paid for, and the block's graph is built again when its
        choices change. One tuning per graph structure serves every shape; another shape
        re-times only the choices that could flip there (docs/speed.md). All of it is
        cached per machine. :func:`gluon_amp.report` names the choices with their figures,
        ``runtime_info()['tune']`` shows what was spent and what waits. ``None`` (the
        default): on, except with ``emulate=True`` or where ``GLUON_AMP_TUNE=0``;
        ``False``: the op table's plan as it is.
    tune_budget : float, str or TuneBudget, optional
        What tuning may spend per process: a number of seconds (spent as soon as shapes
        repeat), ``'2%'`` (a share of the wall time since training began, tuning
        included), or both (``'2%,600'``); ``0`` only reads the cache. ``None`` (the
        default): ``$GLUON_AMP_TUNE_BUDGET``, else 1% of the training time so far, at
        most 600 s. Whatever is not tuned by then runs the plan.
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
        given = (target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, *options.values())
        if _active is not None and all(v is None for v in given):
            return _active.policy  # asks for nothing in particular (a launcher's second init)
        policy = as_policy(target_dtype, target_precision_ops=target_precision_ops,
                           conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops, **options)
        if _active is not None:
            if _active.policy == policy:
                return _active.policy
            raise RuntimeError(
                f"gluon_amp is already on with policy {_active.policy.describe()}; asked for "
                f"{policy.describe()}. Call gluon_amp.disable() first, or use "
                "`with gluon_amp.autocast(...)` for a scoped change.")
        if not policy.enabled:
            return policy
        scalers = ScalerRegistry()
        for hook in list(_hooks):
            scalers.add(hook)
        patches = _patch_all(policy, scalers)
        rewrite, reshaped, watch = graph_rewriter(policy)
        tuner = Tuner(policy, lambda: runtime.timing_cache()) if policy.tune else None
        if tuner is not None:  # after the rewrite: the plan's shape rules apply first, and tuning needs kernels
            rewrite = _after(rewrite, tuner.rewrite)
        hooks = mxi.install_block_hooks(rewrite, _warn_stale, reshaped, watch, tuner.called if tuner else None)
        low_cast.acquire("init")  # a script's net.cast('float16') follows the plan (low_cast.py)
        _active = _Active(policy, patches, hooks, scalers, tuner, mxi.install_infer_hook())
        _changed(policy.target_dtype)
        _log.info("gluon_amp: mixed precision on, %s, %d functions patched",
                  policy.describe(), len(_active.patches))
        return policy


def _after(first: Callable, second: Callable) -> Callable:
    """Two graph rewrites, one after the other."""
    def rewrite(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
        return second(block, args, inputs, first(block, args, inputs, out))
    return rewrite


def register_scaler(scaler: Any) -> None:
    """Make a trainer's loss scaler (its step hook) known to the loss-output ops, now if AMP
    is on and to every later ``init``."""
    _hooks.add(scaler)
    if _active is not None:
        _active.scalers.add(scaler)


def _changed(dtype: Optional[str]) -> None:
    _changes.append((_changes[-1][0] + 1, dtype))
    if len(_changes) > _KEEP_CHANGES:
        del _changes[: len(_changes) - _KEEP_CHANGES]


def policy_serial() -> int:
    """A number that grows each time the policy in force changes (``init``, ``disable``)."""
    return _changes[-1][0]


def dtypes_since(serial: int) -> FrozenSet[str]:
    """The target dtypes of the policy in force now and of every one turned on since
    :func:`policy_serial` gave ``serial``: a step's forward pass may run under ``autocast``
    and its ``scale_loss`` after the scope (PyTorch's pattern)."""
    with _lock:
        dtypes = {_changes[-1][1]}
        for k, d in reversed(_changes):  # per step: usually nothing changed since, one look
            if k <= serial:
                break
            dtypes.add(d)
        dtypes.discard(None)
        return frozenset(dtypes)


def forget_scalers() -> None:
    """Forget every trainer hook attached so far (a test's trainers, kept alive by reference
    cycles until the collector runs, must not reach the next test's ``init``)."""
    _hooks.clear()


def _patch_all(policy: Policy, scalers: ScalerRegistry) -> List[mxi.SavedFunction]:
    """Redirect each op function that needs a wrapper, once per function object (one
    object is often reachable as several module attributes: ``mx.nd.X``, ``mx.nd.op.X``)."""
    infos = mxi.op_infos()
    seen = set()
    patches: List[mxi.SavedFunction] = []
    try:
        for module, attr, fn, op, kind in list(mxi.op_function_sites()):
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            impl = mxi.copy_function(fn)  # the wrappers call this, never fn (fn calls them)
            wrapper = wrapper_for(impl, op, kind, policy, infos[op], scalers)
            if wrapper is not None:
                patches.append(mxi.redirect(fn, wrapper, f"{module.__name__}.{attr}"))
    except BaseException:
        _restore(patches)
        raise
    return patches


def _restore(patches: Sequence[mxi.SavedFunction]) -> None:
    """Put back each function that still calls its wrapper; leave (and name) the others."""
    changed = []
    for p in reversed(patches):
        if mxi.is_redirected_to(p.function, p.wrapper):
            mxi.restore(p)
        else:
            changed.append(p.site)
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
        mxi.remove_block_hooks(_active.hooks)
        if _active.infer_hook is not None:
            mxi.remove_infer_hook(_active.infer_hook)
        low_cast.release("init")
        _active = None
        _changed(None)


def is_enabled() -> bool:
    return _active is not None


def current_policy() -> Optional[Policy]:
    """The policy in force, or ``None`` when nothing is patched."""
    return _active.policy if _active is not None else None


def tuning_info() -> Optional[dict]:
    """What tuning has spent and where each graph stands (``None`` when AMP is off or does
    not tune): :meth:`gluon_amp.speed.schedule.Tuner.info`."""
    active = _active
    return active.tuner.info() if active is not None and active.tuner is not None else None


def patched_functions() -> Tuple[mxi.SavedFunction, ...]:
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


def _warn_stale(block: Any) -> None:
    """A hybridized block runs a graph it cached before ``init``: it runs without AMP."""
    if getattr(block, "amp_result", None) is not None:  # converted by gluon_amp already
        return
    if holds_amp_plan(mxi.cached_graph(block, "gluon_amp")[1]):  # built under AMP (a SymbolBlock's)
        return
    warnings.warn(
        f"hybridized block {block.name!r} cached its graph before gluon_amp.init() and runs without "
        "mixed precision. Call block.hybridize() again (it drops the cached graph) or rebuild the "
        "block, then run it.", RuntimeWarning, stacklevel=4)
