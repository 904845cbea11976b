"""The patching lifecycle: ``init`` / ``disable`` / ``autocast``, and the state while AMP is on.

What each op function is wrapped with lives in :mod:`.wrappers`; what the HybridBlock hooks do
with a fresh graph in :mod:`.hooks` (with the input-shape rules of :mod:`.shape_rules`); how a
function is swapped in place (and back) in :mod:`gluon_amp.mxnet_internals`.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mxnet.gluon import SymbolBlock

from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec

from .. import emulation_kernel, execution, mxnet_internals as mxi, plan_notes, runtime, state
from ..gc_pause import while_gc_paused
from ..policy_builder import as_policy, check_options
from ..tuning.schedule import Tuner
from . import low_cast, outputs
from .hooks import graph_rewriter, holds_amp_plan
from .wrappers import ScalerRegistry, wrapper_for

_log = logging.getLogger(__name__)


class _Site:
    """One redirected op function: its original implementation and its wrapper per region."""

    __slots__ = ("function", "impl", "op", "kind", "name", "routes", "saved")

    def __init__(self, function: Any, impl: Any, op: str, kind: str, name: str) -> None:
        self.function, self.impl, self.op, self.kind, self.name = function, impl, op, kind, name
        #: Region -> wrapper: the trampoline reads it (by reference) inside a region
        self.routes: dict = {}
        #: what redirecting it changes, taken before: whatever lands mid-way can be undone
        self.saved: mxi.SavedFunction = mxi.saved_state(function, self.routes, name)


@dataclass
class _Graphs:
    """What the HybridBlock hooks do under one policy (:func:`.hooks.graph_rewriter`, the tuner)."""

    rewrite: Callable
    reshaped: Optional[Callable]
    watch: Callable
    tuner: Optional[Tuner]


@dataclass
class _Patched:
    """The op functions redirected, process-wide, from the first ``init`` or ``autocast`` region
    on, until :func:`disable` finds no policy in force anywhere (or the process exits); which
    wrapper a call gets is the calling thread's region, else ``init``'s (:mod:`gluon_amp.state`)."""

    #: id(original function) -> its site, for every function some policy wraps; recorded
    #: before it is redirected, so an interrupted redirect is still known to be undone
    sites: dict
    #: the HybridBlock hooks, which dispatch on the calling thread's policy too
    hooks: mxi.BlockHooks
    #: loss scalers attached (init_trainer); loss-output ops read them
    scalers: ScalerRegistry
    #: shape and type inference of a block not built yet, with the hooks paused (builds no execution)
    infer_hook: mxi.MethodHook
    #: a parameter's copies on several contexts averaged by MXNet's own ops (saving keeps its dtype)
    reduce_hook: mxi.MethodHook
    #: ``autograd.grad(..., create_graph=True)``: the casts' second gradients loaded first
    grad_hook: mxi.SavedFunction
    #: policy -> its Region, for every policy whose wrappers were built (equal policies share one)
    regions: dict = field(default_factory=dict)
    #: Region -> what the block hooks do under it
    graphs: dict = field(default_factory=dict)
    #: Region -> when a thread last entered it (:func:`_forget_idle_regions` keeps the latest)
    entered: dict = field(default_factory=dict)
    #: disable() asked for the functions back while a region elsewhere held a policy: the
    #: last such region to end restores them
    release_when_idle: bool = False


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
    check_options("init", options)
    with state.lock:
        given = (target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, *options.values())
        if state.process.policy is not None and all(v is None for v in given):
            return state.process.policy  # asks for nothing in particular (a launcher's second init)
        policy = as_policy(target_dtype, target_precision_ops=target_precision_ops,
                           conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops, **options)
        if state.process.policy is not None:
            if state.process.policy == policy:
                return state.process.policy
            running = state.process.policy
            batch_norm = (f" The policy in force has keep_batchnorm_fp32={running.keep_batchnorm_fp32!r}"
                          f"{' (batch norm as the op table says)' * (running.keep_batchnorm_fp32 is None)}."
                          if running.keep_batchnorm_fp32 != policy.keep_batchnorm_fp32 else "")
            raise RuntimeError(
                f"gluon_amp is already on with policy {running.describe()}; asked for "
                f"{policy.describe()}.{batch_norm} Call gluon_amp.disable() first, or use "
                "`with gluon_amp.autocast(...)` for a scoped change.")
        if not policy.enabled:
            return policy
        with state.interrupts_deferred():  # a Ctrl-C waits for the end; other exceptions roll back
            try:
                region = _region_for(policy)
                patched = _patched
                patched.release_when_idle = False
                for site in patched.sites.values():
                    mxi.retarget(site.saved, site.routes.get(region, site.impl))
                _init_region = region
                state.set_process_policy(policy)
                for extension in state.extensions():
                    extension.on(policy)
            except BaseException:
                _turn_off(policy)
                raise
        _log.info("gluon_amp: mixed precision on, %s, %d functions patched",
                  policy.describe(), sum(region in site.routes for site in patched.sites.values()))
        return policy


def _turn_off(policy: Optional[Policy]) -> None:
    """``init``'s policy off (idempotent: run it again after anything lands in it): threads
    outside regions run the original functions, and the extensions are off where ``policy``
    (the one going, if any) turned them on. Under ``state.lock``."""
    global _init_region
    _init_region = None
    state.set_process_policy(None)
    if _patched is not None:
        for site in _patched.sites.values():
            mxi.retarget(site.saved, site.impl)
    if policy is not None:
        for extension in reversed(state.extensions()):
            extension.off()


_LOW = frozenset({"float16", "bfloat16"})


def _before_create_graph() -> None:
    """Before ``autograd.grad(..., create_graph=True)`` on a thread that ran under a low policy
    (now, or earlier: the graph may have been recorded in a region that has ended): the
    gradient's own graph may go through a plan's casts, whose backward MXNet 1.9.1 cannot
    differentiate; the emulation kernel's library gives them a gradient. Without it, say so
    now, not at the ``backward`` that would fail with MXNet's "non-differentiable"."""
    if not state.dtypes_since(0) & _LOW:
        return
    status = emulation_kernel.cast_gradients()
    if status.path == "kernel":
        return
    policy = state.current_policy()
    now = policy is not None and policy.enabled and policy.target_dtype in _LOW
    message = (
        "gluon_amp: autograd.grad(..., create_graph=True) "
        + (f"under the {policy.target_dtype} policy records" if now else
           "on a thread that ran under a low-precision policy may record")
        + " a gradient through a plan's casts, and MXNet 1.9.1 cannot differentiate a cast's "
        "backward (the backward would fail with '_backward_amp_cast is non-differentiable'). "
        "gluon_amp gives the casts that gradient from its compiled kernel library, which this "
        f"process cannot load: {status.why}. Make a C++ compiler available (or set $CXX) and leave "
        f"{emulation_kernel.ENV} unset, or run the forward pass and its gradient inside "
        "`with gluon_amp.autocast(enabled=False):` (float32).")
    if now:
        raise RuntimeError(message)
    state.say_once(message)  # a graph recorded in float32 differentiates: only a warning


def _patch() -> _Patched:
    """The process-wide patch, made now if there is none (under ``state.lock``, interrupts
    deferred). Each part is undone if a later one fails; the patch exists once it is whole."""
    global _patched
    if _patched is not None:
        return _patched
    undo: List[Callable[[], Any]] = []
    try:
        hooks = mxi.install_block_hooks(_rewrite, _warn_stale, _reshaped, _watch, _called, outputs.returned,
                                        _graphs_now)
        undo.append(lambda: mxi.remove_block_hooks(hooks))
        undo.append(lambda: execution.release("init"))  # releasing what is not held changes nothing
        execution.hold("init")  # where MXNet binds a graph: the plan runs native, emulated or refused
        undo.append(lambda: low_cast.release("init"))
        low_cast.acquire("init")  # a script's net.cast('float16') follows the plan (low_cast.py)
        infer = mxi.install_infer_hook()
        undo.append(lambda: mxi.remove_method_hook(infer))
        reduce = mxi.install_reduce_hook(lambda: autocast(enabled=False))
        undo.append(lambda: mxi.remove_method_hook(reduce))
        grad = mxi.install_grad_hook(_before_create_graph)
        undo.append(lambda: mxi.remove_function_hook(grad))
        patched = _Patched({}, hooks, ScalerRegistry(), infer, reduce, grad)
        atexit.register(_at_exit)
        undo.append(lambda: atexit.unregister(_at_exit))
        _patched = patched
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return patched


def _unpatch() -> None:
    """Every function back (checked by identity), the hooks removed, the patch forgotten
    (under ``state.lock``). Idempotent: after anything lands in it, calling it again finishes."""
    global _patched
    patched = _patched
    if patched is None:
        return
    _restore([site.saved for site in patched.sites.values()])
    mxi.remove_block_hooks(patched.hooks, _fp32_of)
    mxi.remove_method_hook(patched.infer_hook)
    mxi.remove_method_hook(patched.reduce_hook)
    mxi.remove_function_hook(patched.grad_hook)
    execution.release("init")
    low_cast.release("init")
    atexit.unregister(_at_exit)
    _patched = None


def _release_if_idle() -> None:
    """After ``disable``: put every function back unless ``init`` or a region in some thread still
    holds a policy (then the last such region to end does it). Under ``state.lock``."""
    patched = _patched
    if patched is None or not patched.release_when_idle:
        return
    if state.process.policy is not None or state.in_any_region():
        return
    with state.interrupts_deferred():
        try:
            _unpatch()
        finally:
            _unpatch()  # again, should anything land in the first (it finishes what that left)


def _at_exit() -> None:
    """At process exit, every function back, whatever threads are still in regions."""
    if state.lock.acquire(timeout=5):  # a daemon thread may hold it forever: restore anyway
        try:
            _unpatch()
        finally:
            state.lock.release()
    else:
        _unpatch()


def _region_for(policy: Policy) -> state.Region:
    """``policy``'s Region, patching first if nothing is patched yet (under ``state.lock``,
    interrupts deferred). A failure leaves what was patched before as it was; what a first
    patch made stays only if nothing held it before (then nothing does now: disable()'s rule)."""
    patched = _patched
    if patched is not None:
        region = patched.regions.get(policy)
        if region is not None:
            return region
    fresh = patched is None
    patched = _patch()
    try:
        return _prepare(patched, policy)
    except BaseException:
        if fresh:
            patched.release_when_idle = True
            _release_if_idle()
        raise


def _prepare(patched: _Patched, policy: Policy) -> state.Region:
    """``policy``'s Region, its wrappers built and its functions redirected (once per policy
    while patched; under ``state.lock``, interrupts deferred). Each new function is recorded
    before it is redirected; a failure puts back the ones it redirected, and leaves the other
    policies as they were. The Region exists once it is whole."""
    region = patched.regions.get(policy)
    if region is not None:
        return region
    region = state.Region(policy)
    built, new_sites = _wrappers(policy, patched.scalers, patched.sites)
    for site in new_sites:
        patched.sites[id(site.function)] = site
    try:
        _redirect_untouched(patched.sites.values())  # new, or one an interrupted redirect never reached
    except BaseException:
        _restore([site.saved for site in new_sites])
        for site in new_sites:
            patched.sites.pop(id(site.function), None)
        raise
    for key, wrapper in built.items():
        patched.sites[key].routes[region] = wrapper
    rewrite, reshaped, watch = graph_rewriter(policy)
    tuner = Tuner(policy, lambda: runtime.timing_cache()) if policy.tune else None
    if tuner is not None:  # after the rewrite: the plan's shape rules apply first, and tuning needs kernels
        rewrite = _after(rewrite, tuner.rewrite)
    patched.graphs[region] = _Graphs(_noting_traced(rewrite), reshaped, watch, tuner)
    patched.regions[policy] = region  # last: the Region is used only once it is whole
    patched.entered[region] = next(_ticks)
    _forget_idle_regions(patched)
    return region


#: the Regions of policies no thread is in that stay built: each holds a wrapper per patched
#: function (about 2 MB) and took 150-270 ms to build, so a region entered again is quick, but
#: autocast with ever new arguments (a layer excluded at a time, by hand) must not grow without end
IDLE_REGIONS_KEPT = 8
_ticks = itertools.count()


def _forget_idle_regions(patched: _Patched) -> None:
    """Drop the Regions beyond the :data:`IDLE_REGIONS_KEPT` entered latest among those no
    thread is in (its innermost frame or any outside it) and that are not ``init``'s (under
    ``state.lock``). A policy entered again is built again."""
    in_use = {_init_region}
    for f in list(state.regions.values()):
        while f is not None:
            in_use.add(f.region)
            f = f.parent
    idle = sorted((p for p, r in patched.regions.items() if r not in in_use),
                  key=lambda p: patched.entered.get(patched.regions[p], -1))
    for policy in idle[:max(0, len(idle) - IDLE_REGIONS_KEPT)]:
        region = patched.regions.pop(policy)
        patched.graphs.pop(region, None)
        patched.entered.pop(region, None)
        for site in patched.sites.values():
            site.routes.pop(region, None)


def _adopt_regenerated() -> None:
    """After ``mx.library.load``, which generated every ``mx.nd``/``mx.sym`` op function again:
    the new objects get each patched policy's wrappers and are redirected, as :func:`_prepare`
    did the ones they replace (those stay redirected: references taken before still call them).
    Without it, AMP went on reporting itself on while every op ran float32."""
    with state.lock, state.interrupts_deferred():
        patched = _patched
        if patched is None:
            return
        new_sites: List[_Site] = []
        for policy, region in list(patched.regions.items()):
            built, fresh = _wrappers(policy, patched.scalers, patched.sites)
            for site in fresh:
                patched.sites[id(site.function)] = site
            new_sites += fresh
            adopted = {id(site.function) for site in new_sites}
            for key, wrapper in built.items():
                if key in adopted:
                    patched.sites[key].routes[region] = wrapper
        _redirect_untouched(new_sites)


def _redirect_untouched(sites: Any) -> None:
    """Redirect each of ``sites`` not redirected yet to its routes (``init``'s wrapper outside
    regions, else MXNet's implementation)."""
    for site in sites:
        if mxi.is_untouched(site.saved):
            mxi.redirect(site.saved, site.routes.get(_init_region, site.impl), regions=state.regions,
                         ident=state.get_ident, original=site.impl)


def _after(first: Callable, second: Callable) -> Callable:
    """Two graph rewrites, one after the other."""
    def rewrite(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
        return second(block, args, inputs, first(block, args, inputs, out))
    return rewrite


def _fp32_of(block: Any, kept: Any) -> Optional[Any]:
    """The FP32 graph of ``block``, whose graph ``kept`` the hooks made under a policy: the
    graph it traced without the plan's casts; None where its trace is not known."""
    if plan_notes.traced_graph(block, kept) is None:
        return None
    return plan_notes.fp32_graph(block, kept)


def _noting_traced(rewrite: Callable) -> Callable:
    """``rewrite``, keeping beside each block the graph it traced (:func:`plan_notes.record_traced`)."""
    def noting(block: Any, args: tuple, inputs: Sequence[Any], out: Any) -> Any:
        # in the traced graph's frontend now, so the graph the block keeps is this very object:
        # a numpy-mode block's, converted after, was not found by identity and kept the plan's casts
        given = mxi.like_frontend(out, rewrite(block, args, inputs, out))
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


def _restore(patches: Sequence[mxi.SavedFunction]) -> None:
    """Put back each function that still calls its wrapper (or is half-way there); leave the
    untouched ones, and leave (and name) those someone else changed meanwhile."""
    changed = []
    for p in reversed(patches):
        if mxi.is_redirected_to(p.function, p.routes):
            mxi.restore(p)
        elif not mxi.is_untouched(p):
            changed.append(p.site)
    if changed:
        shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
        warnings.warn(
            f"gluon_amp: {len(changed)} op function(s) were changed by someone else while patched "
            f"and are left as they are now, not restored: {shown}",
            RuntimeWarning, stacklevel=3)


def disable() -> None:
    """Turn off the policy ``init`` put in force, and put every original MXNet function back
    (checked by identity), as it was before the first ``init`` or ``autocast`` region.

    A region open in another thread keeps its policy for its whole extent: threads outside
    regions run the originals at once, and the functions are put back when the last such region
    ends. A no-op when nothing is patched, but for the policies autocast made (:data:`_MADE`),
    which are forgotten."""
    _MADE.clear()
    with state.lock:
        policy = state.process.policy
        if policy is None and _patched is None:
            return
        with state.interrupts_deferred():
            try:
                _turn_off(policy)
            finally:
                try:
                    _turn_off(None)  # again, should anything land in the first (extensions are idempotent)
                finally:
                    if _patched is not None:
                        _patched.release_when_idle = True
                    _release_if_idle()


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
    if patched is None:
        return ()
    return tuple(site.saved for site in patched.sites.values() if mxi.is_redirected_to(site.function, site.routes))


def _outer_policy() -> Optional[Policy]:
    """The policy ``autocast(enabled=True)`` without a target means on this thread: its
    innermost region's with a policy, else ``init``'s; ``None`` when there is none."""
    frame = state.frame()
    outer = frame.outer if frame is not None else None
    return outer if outer is not None else state.process.policy


def _policy_key(target_dtype: Any, kwargs: dict) -> Optional[tuple]:
    """A key for autocast's arguments, or None when some argument is unhashable (a list of op
    names: then the policy is made afresh each time)."""
    key = (target_dtype, *sorted(kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


#: autocast's arguments (and whether the native host is simulated) -> the policy they made:
#: a region entered at every training step, as PyTorch users write it, gets it without
#: building its op table again (``autocast()`` took 4.4 ms a step on an AMX host, and
#: ``autocast('bfloat16')`` as much where it falls back to float32, unpatched). Policies are
#: frozen, so the same arguments find their Region again by the policy (:attr:`_Patched.regions`);
#: the environment they read (``$GLUON_AMP_TUNE``) is read at the first entry. Forgotten by
#: ``disable`` and ``state.reset``.
_MADE: Dict[tuple, Policy] = {}


def _made_policy(target_dtype: Any, kwargs: dict) -> Policy:
    """:func:`as_policy` of autocast's arguments, made once per arguments (:data:`_MADE`)."""
    key = _policy_key(target_dtype, kwargs)
    if key is None:
        return as_policy(target_dtype, **kwargs)
    key = (key, runtime.simulated())
    policy = _MADE.get(key)
    if policy is None:
        policy = as_policy(target_dtype, **kwargs)
        if len(_MADE) >= 64:  # ever new arguments: the oldest made is made again if asked
            _MADE.pop(next(iter(_MADE)), None)
        _MADE[key] = policy
    return policy


state.register_extension(state.Extension(lambda policy: None, lambda: None, _MADE.clear))


class autocast(contextlib.ContextDecorator):
    """A region of code, on this thread only, with its own policy; the outer one is back on exit.

    ``enabled=False`` runs the region in float32: every op called inside runs the original
    MXNet function, and a hybridized block whose graph is built inside gets a float32 graph.
    Otherwise the region runs ``target_dtype`` and ``kwargs`` (as :func:`init` takes them);
    with neither, the policy already in force (an outer region's, else ``init``'s), or
    :func:`init`'s default. Regions nest, and each thread has its own: other threads keep
    theirs, and ``init``'s where they have none. The region's policy holds for its whole
    extent, whatever ``init`` and ``disable`` do meanwhile in other threads.

    The first region (or ``init``) of the process patches MXNet's op functions; they stay
    patched, so a later region costs microseconds, until :func:`disable` (or process exit)
    puts them back. Entering and leaving are each one step: an exception or a Ctrl-C anywhere
    leaves the thread either inside or outside, never half-way.

    A hybridized block's graph takes the policy of the region where Gluon builds it and keeps
    it where it runs later (docs/training.md, "autocast regions").

    ``with`` gives the region's policy, or ``None`` where it runs float32. Usable as a
    decorator; one object is entered once at a time.
    """

    __slots__ = ("_target", "_enabled", "_kwargs", "_frame")

    def __init__(self, target_dtype: Any = None, enabled: bool = True, **kwargs: Any) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast(enabled=...) takes True or False, got {enabled!r}")
        check_options("autocast", kwargs)
        self._target, self._enabled, self._kwargs = target_dtype, enabled, kwargs
        self._frame: Optional[state.Frame] = None

    def _recreate_cm(self) -> "autocast":  # as a decorator: a fresh region per call
        return autocast(self._target, self._enabled, **self._kwargs)

    def __enter__(self) -> Optional[Policy]:
        if self._frame is not None:
            raise RuntimeError("this autocast object is already entered; use a new autocast(...) for a "
                               "nested region")
        policy: Optional[Policy] = None
        outer = None
        if self._enabled:
            if self._target is None and not self._kwargs:
                outer = _outer_policy()
            if outer is not None:
                policy = outer
            else:  # the arguments' policy, or (none given, none in force) init's default
                policy = _made_policy(self._target, self._kwargs)
            if not policy.enabled:  # the float32 fallback
                policy = None
        frame: Optional[state.Frame] = None
        try:
            with state.lock:  # not while disable() decides that no region holds a policy
                patched = _patched
                region = state.OFF if policy is None else patched.regions.get(policy) if patched else None
                if region is None:  # the policy's first region while patched
                    with state.interrupts_deferred():
                        region = _region_for(policy)
                elif region is not state.OFF:
                    patched.entered[region] = next(_ticks)  # one store
                frame = state.Frame(region, state.frame())
                state.enter(frame)  # one store: in, or (on any exception) not
            self._frame = frame
            return policy
        except BaseException:  # whatever landed (the lock's release included): out again
            if frame is not None:
                state.leave(frame)
            self._frame = None
            raise

    def __exit__(self, *exc: Any) -> None:
        # CPython may deliver a signal at a function's entry (its RESUME), before any try can
        # be set up: no Python code is safe there. From the first statement on, the region is
        # left whatever lands where: twice (idempotent), the second time in a finally.
        try:
            self._leave()
        finally:
            self._leave()
        patched = _patched
        if patched is not None and patched.release_when_idle:  # disable() was called meanwhile
            with state.lock:
                _release_if_idle()

    def _leave(self) -> None:
        frame = self._frame
        if frame is not None:
            state.leave(frame)  # one store or pop: out (a no-op the second time)
            self._frame = None


# -- the HybridBlock hooks: each does what the calling thread's policy says ------------------

def _graphs_now() -> Optional[_Graphs]:
    patched, frame = _patched, state.frame()
    if patched is None:
        return None
    region = _init_region if frame is None else frame.region
    return patched.graphs.get(region) if region is not None else None


@while_gc_paused
@mxi.shared_reads()
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
    """A hybridized block runs a graph it cached while AMP was off (before ``init``, or outside
    any ``autocast`` region): it runs without AMP."""
    if current_policy() is None:  # AMP is off for this thread: nothing is missed
        return
    if getattr(block, "amp_result", None) is not None:  # converted by gluon_amp already
        return
    recorded = mxi.recorded_graph(block)
    if recorded is not None and holds_amp_plan(recorded):  # built under AMP (a SymbolBlock's), whatever it runs
        return
    if isinstance(block, SymbolBlock):
        # its graph was given (SymbolBlock.imports, or symbols built where AMP was off): tracing
        # it again gives the same graph, so hybridize() changes nothing
        message = (f"SymbolBlock {block.name!r} runs the graph it was given (SymbolBlock.imports, or symbols "
                   "built where AMP was off) as it is, without mixed precision: gluon_amp.init converts what "
                   "runs traced under it, not a given graph. Convert it: "
                   "gluon_amp.convert_hybrid_block(block) after its first call, or "
                   "python -m gluon_amp.convert PREFIX EPOCH for the exported files.")
    else:
        message = (f"hybridized block {block.name!r} cached its graph before gluon_amp.init() (or where AMP "
                   "was off: outside any autocast region, or in autocast(enabled=False), on any thread) and "
                   "runs it without mixed precision. Call block.hybridize() again where AMP is on (it drops "
                   "the cached graph) or rebuild the block, then run it.")
    warnings.warn(message, RuntimeWarning, stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))


#: From import on, for the process: ``mx.library.load`` notes the op functions it supersedes (a
#: later ``init`` patches them too: references taken before the load call them) and, while
#: patched, redirects the ones MXNet generates again. Installed at import, not by ``init``: a
#: load before ``init`` or after ``disable()`` leaves no trace of the functions it replaced.
_LIBRARY_HOOK = mxi.install_library_hook(_adopt_regenerated)
