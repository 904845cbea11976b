"""The patching lifecycle: ``init`` / ``disable`` / ``autocast``, and the state while AMP is on.

What each op function is wrapped with lives in :mod:`.wrappers`; what the HybridBlock hooks do
with a fresh graph in :mod:`.hooks` (with the input-shape rules of :mod:`.shape_rules`); how a
function is swapped in place (and back) in :mod:`gluon_amp.mxnet_internals`.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec

from .. import execution, mxnet_internals as mxi, plan_notes, runtime, state
from ..policy_builder import as_policy
from ..tuning.schedule import Tuner
from . import low_cast
from .hooks import graph_rewriter, holds_amp_plan
from .wrappers import ScalerRegistry, wrapper_for

_log = logging.getLogger(__name__)


class _Site:
    """One redirected op function: its original implementation and its wrapper per region."""

    __slots__ = ("function", "impl", "op", "kind", "name", "routes", "saved")

    def __init__(self, function: Any, impl: Any, op: str, kind: str, name: str) -> None:
        self.function, self.impl, self.op, self.kind, self.name = function, impl, op, kind, name
        #: Region -> wrapper: the trampoline reads it (by reference) under an override
        self.routes: dict = {}
        self.saved: Optional[mxi.SavedFunction] = None


@dataclass
class _Graphs:
    """What the HybridBlock hooks do under one policy (:func:`.hooks.graph_rewriter`, the tuner)."""

    rewrite: Callable
    reshaped: Optional[Callable]
    watch: Callable
    tuner: Optional[Tuner]


@dataclass
class _Patched:
    """The op functions redirected, process-wide, while any policy is in force (``init``, or
    an ``autocast`` region in any thread); which wrapper a call gets is the calling thread's
    policy (:mod:`gluon_amp.state`)."""

    #: id(original function) -> its site, for every function some policy in force wraps
    sites: dict
    #: the HybridBlock hooks, which dispatch on the calling thread's policy too
    hooks: mxi.BlockHooks
    #: loss scalers attached (init_trainer); loss-output ops read them
    scalers: ScalerRegistry
    #: shape and type inference of a block not built yet, with the hooks paused (builds no execution)
    infer_hook: mxi.InferHook
    #: policy -> its Region, for every policy whose wrappers were built (equal policies share one)
    regions: dict = field(default_factory=dict)
    #: Region -> what the block hooks do under it
    graphs: dict = field(default_factory=dict)
    #: autocast regions in force with a policy, in every thread
    regions_open: int = 0


#: the Region of ``state.process.policy``, init's (its wrappers and graph rules in ``_patched``)
_init_region: Optional[state.Region] = None
_patched: Optional[_Patched] = None


def init(target_dtype: Any = None, target_precision_ops: Optional[Sequence[str]] = None,
         conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
         fp32_ops: Optional[Sequence[str]] = None, **options: Any) -> Policy:
    """Turn on automatic mixed precision for ``mx.nd``, ``mx.sym``, ``mx.np`` and ``mx.npx``.

    Call it before building (or hybridizing) the network. Undo with :func:`disable`.
    The policy is the process's: every thread runs it, except inside an :func:`autocast`
    region of its own. One ``init`` policy at a time.

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
    global _init_region
    with state.lock:
        given = (target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, *options.values())
        if state.process.policy is not None and all(v is None for v in given):
            return state.process.policy  # asks for nothing in particular (a launcher's second init)
        policy = as_policy(target_dtype, target_precision_ops=target_precision_ops,
                           conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops, **options)
        if state.process.policy is not None:
            if state.process.policy == policy:
                return state.process.policy
            raise RuntimeError(
                f"gluon_amp is already on with policy {state.process.policy.describe()}; asked for "
                f"{policy.describe()}. Call gluon_amp.disable() first, or use "
                "`with gluon_amp.autocast(...)` for a scoped change.")
        if not policy.enabled:
            return policy
        region = _region_for(policy)
        for site in _patched.sites.values():
            mxi.retarget(site.saved, site.routes.get(region, site.impl))
        state.process.policy, _init_region = policy, region
        state.changed(policy.target_dtype)
        for extension in state.extensions():
            extension.on(policy)
        _log.info("gluon_amp: mixed precision on, %s, %d functions patched",
                  policy.describe(), sum(region in site.routes for site in _patched.sites.values()))
        return policy


def _patch() -> _Patched:
    """The process-wide patch, made now if no policy is in force (under ``state.lock``)."""
    global _patched
    if _patched is None:
        scalers = ScalerRegistry()
        hooks = mxi.install_block_hooks(_rewrite, _warn_stale, _reshaped, _watch, _called)
        execution.hold("init")  # where MXNet binds a graph: the plan runs native, emulated or refused
        low_cast.acquire("init")  # a script's net.cast('float16') follows the plan (low_cast.py)
        _patched = _Patched({}, hooks, scalers, mxi.install_infer_hook())
    return _patched


def _unpatch_if_unused() -> None:
    """Put every function back once neither ``init`` nor any region holds a policy (under ``state.lock``)."""
    global _patched
    if _patched is None or state.process.policy is not None or _patched.regions_open:
        return
    _restore([site.saved for site in _patched.sites.values()])
    mxi.remove_block_hooks(_patched.hooks)
    mxi.remove_infer_hook(_patched.infer_hook)
    execution.release("init")
    low_cast.release("init")
    _patched = None


def _region_for(policy: Policy) -> state.Region:
    """``policy``'s Region, patching first if nothing is patched yet (under ``state.lock``); a
    failure takes back what it patched."""
    patched = _patch()
    try:
        return _prepare(patched, policy)
    except BaseException:
        _unpatch_if_unused()
        raise


def _prepare(patched: _Patched, policy: Policy) -> state.Region:
    """``policy``'s Region, its wrappers built and its functions redirected (once per policy
    while patched; under ``state.lock``). A failure leaves the other policies as they were."""
    region = patched.regions.get(policy)
    if region is not None:
        return region
    region = state.Region(policy)
    built, new_sites = _wrappers(policy, patched.scalers, patched.sites)
    redirected: List[_Site] = []
    try:
        for site in new_sites:
            site.saved = mxi.redirect(site.function, site.impl, site.name, scope=state.gate,
                                      routes=site.routes, original=site.impl)
            redirected.append(site)
    except BaseException:
        _restore([s.saved for s in redirected])
        raise
    for site in new_sites:
        patched.sites[id(site.function)] = site
    for key, wrapper in built.items():
        patched.sites[key].routes[region] = wrapper
    rewrite, reshaped, watch = graph_rewriter(policy)
    tuner = Tuner(policy, lambda: runtime.timing_cache()) if policy.tune else None
    if tuner is not None:  # after the rewrite: the plan's shape rules apply first, and tuning needs kernels
        rewrite = _after(rewrite, tuner.rewrite)
    patched.graphs[region] = _Graphs(_noting_traced(rewrite), reshaped, watch, tuner)
    patched.regions[policy] = region
    return region


def _after(first: Callable, second: Callable) -> Callable:
    """Two graph rewrites, one after the other."""
    def rewrite(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
        return second(block, args, inputs, first(block, args, inputs, out))
    return rewrite


def _noting_traced(rewrite: Callable) -> Callable:
    """``rewrite``, keeping beside each block the graph it traced (:func:`plan_notes.record_traced`)."""
    def noting(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
        given = rewrite(block, args, inputs, out)
        if getattr(block, "amp_result", None) is None:  # a converter's result keeps its own plan
            plan_notes.record_traced(block, out, given)
        return given
    return noting


def _wrappers(policy: Policy, scalers: ScalerRegistry, sites: dict) -> Tuple[dict, List[_Site]]:
    """The wrapper ``policy`` needs for each op function (by id), and the sites of those not
    redirected yet; once per function object (one object is often reachable as several
    module attributes: ``mx.nd.X``, ``mx.nd.op.X``)."""
    infos = mxi.op_infos()
    built: dict = {}
    new: List[_Site] = []
    seen = set()
    for module, attr, fn, op, kind in list(mxi.op_function_sites()):
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        site = sites.get(id(fn))
        fresh = site is None
        if fresh:  # the wrappers call impl, never fn (fn calls them)
            site = _Site(fn, mxi.copy_function(fn), op, kind, f"{module.__name__}.{attr}")
        wrapper = wrapper_for(site.impl, op, kind, policy, infos[op], scalers)
        if wrapper is not None:
            built[id(fn)] = wrapper
            if fresh:
                new.append(site)
    return built, new


def _restore(patches: Sequence[Optional[mxi.SavedFunction]]) -> None:
    """Put back each function that still calls its wrapper; leave (and name) the others."""
    changed = []
    for p in reversed(patches):
        if p is None:
            continue
        if mxi.is_redirected_to(p.function, p.routes):
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
    """Turn off the policy ``init`` put in force. Every original MXNet function is back unless
    an ``autocast`` region (in any thread) still holds a policy; then threads without a region
    run the originals. A no-op when ``init`` is off."""
    global _init_region
    with state.lock:
        if state.process.policy is None:
            return
        state.process.policy, _init_region = None, None
        for site in _patched.sites.values():
            mxi.retarget(site.saved, site.impl)
        _unpatch_if_unused()
        for extension in reversed(state.extensions()):
            extension.off()
        state.changed(None)


def _policy_of(region: Optional[state.Region]) -> Optional[Policy]:
    return state.process.policy if region is None else region.policy


def is_enabled() -> bool:
    """True when AMP is on for the calling thread (``init``, or the ``autocast`` region it is in)."""
    return current_policy() is not None


current_policy = state.current_policy


def tuning_info() -> Optional[dict]:
    """What tuning has spent and where each graph stands (``None`` when AMP is off or does
    not tune): :meth:`gluon_amp.tuning.schedule.Tuner.info`."""
    graphs = _graphs_now()
    return graphs.tuner.info() if graphs is not None and graphs.tuner is not None else None


def patched_functions() -> Tuple[mxi.SavedFunction, ...]:
    """The record of the op functions redirected, one per function (empty when no policy is in
    force in any thread)."""
    patched = _patched
    return tuple(site.saved for site in patched.sites.values()) if patched is not None else ()


def _outer_policy() -> Optional[Policy]:
    """The policy ``autocast(enabled=True)`` without a target means on this thread: its
    innermost region's with a policy, else ``init``'s; ``None`` when there is none."""
    for region in (state.thread.override, *reversed(state.thread.stack)):
        policy = _policy_of(region)
        if policy is not None:
            return policy
    return None


@contextlib.contextmanager
def autocast(target_dtype: Any = None, enabled: bool = True, **kwargs: Any) -> Iterator[Optional[Policy]]:
    """A region of code, on this thread only, with its own policy; the outer one is back on exit.

    ``enabled=False`` runs the region in float32: every op called inside runs the original
    MXNet function, and a hybridized block whose graph is built inside gets a float32 graph.
    Otherwise the region runs ``target_dtype`` and ``kwargs`` (as :func:`init` takes them);
    with neither, the policy already in force (an outer region's, else ``init``'s), or
    :func:`init`'s default. Regions nest, and each thread has its own: other threads keep
    theirs, and ``init``'s where they have none.

    A hybridized block's graph takes the policy of the region where Gluon builds it and keeps
    it where it runs later (docs/training.md, "autocast regions").

    Yields the region's policy, or ``None`` where it runs float32.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) takes True or False, got {enabled!r}")
    policy: Optional[Policy] = None
    if enabled:
        if target_dtype is None and not kwargs:
            policy = _outer_policy() or as_policy(None)
        else:
            policy = as_policy(target_dtype, **kwargs)
        if not policy.enabled:  # the float32 fallback of target_dtype=None
            policy = None
    with state.lock:
        region: Optional[state.Region] = state.OFF
        if policy is not None:
            if policy == state.process.policy:
                region = None  # init's own: the fast path
            else:
                region = _region_for(policy)
            if _patched is not None:
                _patched.regions_open += 1
        state.enter(region)
        state.changed(policy.target_dtype if policy is not None else None)
    try:
        yield policy
    finally:
        with state.lock:
            state.leave()
            if policy is not None and _patched is not None:
                _patched.regions_open -= 1
                _unpatch_if_unused()
            now = current_policy()
            state.changed(now.target_dtype if now is not None else None)


# -- the HybridBlock hooks: each does what the calling thread's policy says ------------------

def _graphs_now() -> Optional[_Graphs]:
    patched, region = _patched, state.thread.override
    if patched is None:
        return None
    region = _init_region if region is None else region
    return patched.graphs.get(region) if region is not None else None


def _rewrite(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
    graphs = _graphs_now()
    return graphs.rewrite(block, args, inputs, out) if graphs is not None else out


def _reshaped(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> bool:
    graphs = _graphs_now()
    return graphs is not None and graphs.reshaped is not None and graphs.reshaped(block, args, inputs, out)


def _watch(block: Any) -> bool:
    graphs = _graphs_now()
    return graphs is not None and graphs.reshaped is not None and graphs.watch(block)


def _called(block: Any, args: tuple) -> bool:
    graphs = _graphs_now()
    return graphs is not None and graphs.tuner is not None and graphs.tuner.called(block, args)


def _warn_stale(block: Any) -> None:
    """A hybridized block runs a graph it cached before ``init``: it runs without AMP."""
    if current_policy() is None:  # AMP is off for this thread: nothing is missed
        return
    if getattr(block, "amp_result", None) is not None:  # converted by gluon_amp already
        return
    if holds_amp_plan(mxi.cached_graph(block, "gluon_amp")[1]):  # built under AMP (a SymbolBlock's)
        return
    warnings.warn(
        f"hybridized block {block.name!r} cached its graph before gluon_amp.init() and runs without "
        "mixed precision. Call block.hybridize() again (it drops the cached graph) or rebuild the "
        "block, then run it.", RuntimeWarning, stacklevel=4)
