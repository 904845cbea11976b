"""gluon_amp's process state, in one place; :func:`reset` clears it (tests).

- The policy in force: ``init``'s for the process (:data:`process`), and each thread's open
  ``autocast`` regions (:data:`regions`); :func:`current_policy` answers for the calling thread.
- Per-thread facts for loss scaling: which dtypes were in force on a thread since a trainer's
  last step (:func:`policy_serial`, :func:`dtypes_since`): one serial per dtype, no log.
- The scaler registry: every trainer's step hook attached (loss-output ops read their scale).
- The once-only messages (:func:`say_once`) and the per-object records: a trainer's
  (:func:`trainer_record`), a Module's (:func:`module_record`), what is kept beside a block's
  plan (:func:`block_record`, read through :mod:`gluon_amp.plan_notes`), and the converters'
  results run as their policy says (:class:`Converted`, read through :mod:`gluon_amp.execution`).
- What other parts do when ``init`` turns AMP on or off (:func:`register_extension`).
- :class:`interrupts_deferred`: a Ctrl-C that lands in a multi-step transition waits for its end.

Layers read and write it here instead of reaching into each other (training never imports
patching). Caches of what the machine measured (the probe's verdict, the emulation kernel's
build) stay with the code that measures them, and so does the bookkeeping of what is patched
(the saved originals, who holds a patch): it must follow what MXNet's classes hold, which a
:func:`reset` cannot change.

The patched op functions read :data:`regions` on every call: while it is empty (no thread in a
region) they run the process's choice at once; otherwise the calling thread's :class:`Frame`
(none: the process's choice) names its :class:`Region`: a policy's, or :data:`OFF` (float32, the
original MXNet functions, ``autocast(enabled=False)``). A region holds its own policy for its
whole extent, whatever ``init``/``disable`` do meanwhile in any thread.
"""
from __future__ import annotations

import collections
import itertools
import os
import signal
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple


class Region:
    """The policy an ``autocast`` region puts in force on its thread (``None``: float32).

    One object per policy while the op functions are patched (equal policies share it),
    hashed by identity: the patched functions look their wrapper up by it on every call.
    """

    __slots__ = ("policy",)

    def __init__(self, policy: Optional[Any]) -> None:
        self.policy = policy

    def __repr__(self) -> str:
        return f"Region({self.policy.describe() if self.policy is not None else 'float32'})"


#: the region of ``autocast(enabled=False)``: the original functions, float32
OFF = Region(None)


class Frame:
    """One open ``autocast`` region of one thread: its :class:`Region`, the policy an
    ``autocast()`` without a target means inside it (``outer``), and the frame it was entered
    from (``parent``, ``None`` when the thread followed the process). Immutable once made: a
    region left out of order is cut out of the chain by copies of the frames above it, each
    naming the frame it stands for (``origin``), which is what their ``autocast`` leaves."""

    __slots__ = ("region", "outer", "parent", "origin")

    def __init__(self, region: Region, parent: Optional["Frame"], origin: Optional["Frame"] = None) -> None:
        self.region, self.parent = region, parent
        # a float32 region passes on the policy outside it; recomputed for a cut's copies, so a
        # region left out of order is not what autocast() inside them means
        self.outer: Optional[Any] = region.policy if region.policy is not None else (
            parent.outer if parent is not None else None)
        self.origin = origin  # None: this frame is its own (no reference cycle per region)


#: thread ident -> its innermost open region; a thread outside every region has no entry, so
#: the dict is empty while no thread is in a region. The patched op functions read it on every
#: call (its truth, then the calling thread's entry); one item store enters or leaves a region,
#: so a region is either entered or not whatever exception lands where (no stack to unwind).
regions: Dict[int, Frame] = {}
get_ident = threading.get_ident


class _ThreadEnd:
    """Held by a thread's :class:`_ThreadState`, so dropped when the thread ends (before
    CPython can give its ident to a new thread): a region the thread left open (a generator
    suspended in ``with autocast(...)``, kept alive) is forgotten with it, and a later thread
    with the same ident starts outside every region."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __del__(self) -> None:
        try:
            regions.pop(self.ident, None)
        except Exception:  # interpreter shutdown: the module's globals may be gone
            pass


class _ThreadState(threading.local):
    """One thread's facts besides its region: when each dtype last came in force on it
    (:func:`dtypes_since`), and the scaler hook of a ``BucketingModule.bind`` under way in it."""

    def __init__(self) -> None:
        #: target dtype (None: float32) -> the serial at which it last came in force here or
        #: last stopped being in force here (entering or leaving a region)
        self.began: Dict[Optional[str], int] = {}
        #: the serial since which the thread is outside every region (it follows the process)
        self.follow_from: int = 0
        #: the scaler hook a ``BucketingModule.bind`` under way gives its default bucket
        #: (``training.module``), else ``None``
        self.bucket_hook: Optional[Any] = None
        #: the Module whose ``bind`` is under way here (a bucket's: the Module whose memory it
        #: shares), for what is said once per Module; else ``None``
        self.binding_module: Optional[Any] = None
        self.end = _ThreadEnd(get_ident())


thread = _ThreadState()
#: one clock for every transition (itertools.count's next() is atomic under the GIL): serials
#: order region entries and exits, init/disable and a trainer's marks, over all threads
_clock = itertools.count(1)


def frame() -> Optional[Frame]:
    """The calling thread's innermost open region, or ``None`` when it follows the process."""
    return regions.get(get_ident())


def _dtype(policy: Optional[Any]) -> Optional[str]:
    return policy.target_dtype if policy is not None else None


def _began(dtypes: Dict[Optional[str], int]) -> None:
    began = thread.began
    for d, k in dtypes.items():
        if began.get(d, 0) < k:
            began[d] = k


def _began_now(dtype: Optional[str], now: int) -> None:
    thread.began[dtype] = now  # the clock only grows: now is the latest


def _outer_policy(frame: Frame) -> Optional[Any]:
    """The policy in force on the thread outside ``frame``: its parent region's, else init's."""
    return process.policy if frame.parent is None else frame.parent.region.policy


def enter(new: Frame) -> None:
    """Make ``new`` (whose ``parent`` is the calling thread's frame now) its innermost region.

    Idempotent, and the region is entered by the last item store: an exception before it
    leaves the thread where it was. When it comes in force is noted first (a fact either way,
    for :func:`dtypes_since`: noted early, a step counts it a little early)."""
    ident = get_ident()
    if regions.get(ident) is new:
        return
    now = next(_clock)
    if new.parent is None and process.began:  # init's policies turned on (or off) while the thread followed it
        since = thread.follow_from
        _began({d: k for d, k in list(process.began.items()) if k > since})
    _began_now(_dtype(_outer_policy(new)), now)  # in force here until now
    _began_now(_dtype(new.region.policy), now)
    regions[ident] = new


def leave(old: Frame) -> None:
    """Back to ``old.parent`` on the calling thread, if ``old`` is its innermost region;
    idempotent (call it again after any exception: a second call changes nothing). The region
    is left by one item store or pop.

    A region left while one entered inside it is still open (a generator suspended in
    ``with autocast(...)`` and closed inside a later region) is cut out of the chain: the
    regions inside it stay in force, and their exits lead to the regions outside it."""
    ident = get_ident()
    innermost = regions.get(ident)
    if innermost is None:
        return
    if (innermost.origin or innermost) is not old:
        _cut(ident, innermost, old)
        return
    old = innermost
    now = next(_clock)
    _began_now(_dtype(old.region.policy), now)  # in force here until now
    _began_now(_dtype(_outer_policy(old)), now)
    if old.parent is None:
        thread.follow_from = now
        regions.pop(ident, None)
    else:
        regions[ident] = old.parent


def _cut(ident: int, innermost: Frame, old: Frame) -> None:
    """``old``, open below ``innermost`` on thread ``ident``, is left: the frames above it are
    copied onto its parent (the policy in force does not change; one item store)."""
    above: List[Frame] = []
    f: Optional[Frame] = innermost
    while f is not None and (f.origin or f) is not old:
        above.append(f)
        f = f.parent
    if f is None:
        return  # not open on this thread (left already)
    parent = f.parent
    for g in reversed(above):
        parent = Frame(g.region, parent, g.origin or g)
    regions[ident] = parent


def current_policy() -> Optional[Any]:
    """The policy in force for the calling thread (its innermost ``autocast`` region's, else
    ``init``'s), or ``None`` when AMP is off for it."""
    f = regions.get(get_ident())
    return process.policy if f is None else f.region.policy


def in_any_region() -> bool:
    """True while some thread is inside a region that puts a policy in force (at any depth)."""
    for f in list(regions.values()):
        while f is not None:
            if f.region.policy is not None:
                return True
            f = f.parent
    return False


@dataclass
class TrainerRecord:
    """What gluon_amp knows of one trainer besides its step hook (the trainer's own attribute).

    Attributes
    ----------
    opt_level : str or None
        The Apex opt level ``initialize`` gave it.
    opt_level_done : bool
        ``initialize`` already set it up.
    kind : tuple or None
        ``(engine name, scaler)`` of its distributed set-up (``training.distributed``).
    kvstore_ready : bool
        Its kvstore was set up (and warned about) once.
    """

    opt_level: Optional[str] = None
    opt_level_done: bool = False
    kind: Optional[tuple] = None
    kvstore_ready: bool = False


@dataclass
class ModuleRecord:
    """What gluon_amp knows of one ``Module`` or ``BucketingModule`` (``training.module``),
    weakly keyed: nothing on the user's object. A BucketingModule's record holds its ``hook``
    only (its buckets, Modules, have their own records).

    Attributes
    ----------
    hook : ModuleHook or None
        Its member token in its loss scaler.
    bound_scaled : bool
        Its last bind went through gluon_amp (the scale argument added where there are heads).
    scale_arg : str or None
        The bound graph's loss-scale argument, where it has loss heads.
    heads : list of str
        The loss heads scaled.
    dtype : str
        The compute dtype of its bound graph.
    arg_value : float
        What the scale argument holds now.
    forward_scale : float or None
        What it held at the last training forward pass: what a step whose scaler came after
        that pass carries.
    mixed : bool
        Its gradients are mixed with another module's (an SVRGModule or its auxiliary module):
        never loss-scaled, since one scale cannot be divided out of the mix.
    input_grads : list of (NDArray, float)
        The input gradients its last backward pass wrote (and those ``get_input_grads``
        merged from them), with the scale they carry: given as another module's ``out_grads``
        (a SequentialModule's stages), they are not multiplied again.
    """

    hook: Optional[Any] = None
    bound_scaled: bool = False
    scale_arg: Optional[str] = None
    heads: List[str] = field(default_factory=list)
    dtype: str = "float32"
    arg_value: float = 1.0
    forward_scale: Optional[float] = None
    mixed: bool = False
    input_grads: List[Tuple[Any, float]] = field(default_factory=list)


@dataclass
class BlockRecord:
    """What gluon_amp keeps beside a hybridized block's plan (:mod:`gluon_amp.plan_notes`).

    Attributes
    ----------
    notes : dict
        Source (``'shape_rules'``, ``'tuner'``) -> node name -> note, what each source says of
        the block's current graph.
    real_dtypes : dict or None
        Node name -> the dtype real AMP gives it, where the block runs its plan emulated.
    traced : tuple or None
        ``(graph traced under init, graph the block was given to keep)``.
    fed : dict or None
        Graph input name -> the dtype the call that built the block's executor fed it.
    plan_heads : list or None
        The dtypes of the plan's outputs before the tuner retyped the block's graph, where it did.
    """

    notes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    real_dtypes: Optional[Dict[str, str]] = None
    traced: Optional[Tuple[Any, Any]] = None
    fed: Optional[Dict[str, str]] = None
    plan_heads: Optional[List[Optional[str]]] = None


@dataclass
class Converted:
    """The converters' results remembered to run as the policy they were asked for
    (:func:`gluon_amp.execution.remember`).

    Attributes
    ----------
    blocks : WeakKeyDictionary
        Converted block -> its policy.
    symbols : OrderedDict
        Converted Symbol's handle address -> ``(symbol, policy)``, oldest first. MXNet's
        Symbol takes no weak reference, so the newest few are held (a Symbol kept alive keeps
        its handle's address from being reused).
    """

    blocks: "weakref.WeakKeyDictionary[Any, Any]" = field(default_factory=weakref.WeakKeyDictionary)
    symbols: "collections.OrderedDict[int, Tuple[Any, Any]]" = field(default_factory=collections.OrderedDict)


@dataclass
class _Process:
    """The process's part of the state (one object: :data:`process`)."""

    #: the policy ``init`` put in force (threads without a region follow it)
    policy: Optional[Any] = None
    #: target dtype -> the serial at which an ``init`` policy of it last came in force or last
    #: stopped (``disable``): threads outside regions ran it then (one entry per dtype: nothing grows)
    began: Dict[Optional[str], int] = field(default_factory=dict)
    #: every trainer step hook attached so far (weakly): loss-output ops read their scale
    scalers: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: messages said once per process
    said: Set[str] = field(default_factory=set)
    #: Modules (a BucketingModule's default bucket for all its buckets) whose bind said its verdict
    said_for: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: per-trainer records
    trainers: "weakref.WeakKeyDictionary[Any, TrainerRecord]" = field(default_factory=weakref.WeakKeyDictionary)
    #: objects set up once (an Apex-initialized net, a kvstore's finite flag), weakly
    done: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: per-Module (and per-BucketingModule) records
    modules: "weakref.WeakKeyDictionary[Any, ModuleRecord]" = field(default_factory=weakref.WeakKeyDictionary)
    #: ``init`` gives its default scaler to every Module that initialises its optimizer
    modules_auto: bool = False
    #: per-block records: what is kept beside a block's plan
    blocks: "weakref.WeakKeyDictionary[Any, BlockRecord]" = field(default_factory=weakref.WeakKeyDictionary)
    #: the converters' results remembered with their policy
    converted: Converted = field(default_factory=Converted)


#: guards :data:`process` where a read-modify-write spans several fields
lock = threading.RLock()
process = _Process()


def set_process_policy(policy: Optional[Any]) -> None:
    """Put ``policy`` in force for the threads outside regions (``init``; ``None``: ``disable``).
    When it comes in force, and when the one it replaces stops, is noted before
    (:func:`dtypes_since` of a thread that reads in between sees it either way)."""
    if policy is not process.policy:
        now = next(_clock)
        if process.policy is not None:  # in force until now: a step since counts it
            process.began[_dtype(process.policy)] = now
        if policy is not None:
            process.began[_dtype(policy)] = now
    process.policy = policy


def policy_serial() -> int:
    """A mark on the clock of policy transitions (a trainer takes one after each step): what
    comes in force later has a greater serial."""
    return next(_clock)


def dtypes_since(serial: int) -> FrozenSet[str]:
    """The target dtypes of the calling thread's policy now and of every one that was in force
    on it at any time since :func:`policy_serial` gave ``serial`` (came in force then, or was in
    force then and ended later): its regions, and ``init``'s while it was outside regions.
    Another thread's regions never count: a step's forward pass runs on the thread that scales
    its loss, under ``autocast`` or after the scope (PyTorch's pattern). Nothing here grows: one
    serial per dtype."""
    f = regions.get(get_ident())
    dtypes = {_dtype(process.policy if f is None else f.region.policy)}
    dtypes.update(d for d, k in list(thread.began.items()) if k > serial)
    if f is None:
        since = max(serial, thread.follow_from)
        dtypes.update(d for d, k in list(process.began.items()) if k > since)
    dtypes.discard(None)
    return frozenset(dtypes)


def register_scaler(hook: Any) -> None:
    """Make a trainer's loss scaler (its step hook) known to the loss-output ops, now and under
    every later policy."""
    process.scalers.add(hook)


def say_once(message: str, warn: bool = True, category: type = RuntimeWarning,
             stacklevel: Optional[int] = None, past: Tuple[str, ...] = ()) -> bool:
    """Warn ``message`` (when ``warn``) unless it was said before in this process; either way it
    counts as said from now on. True when it was new. ``stacklevel`` (counted from the caller,
    as ``warnings.warn`` counts it): by default the first frame outside gluon_amp and
    gluon_amp_core (and the paths starting with one of ``past``: MXNet's package, for a hook
    its Module calls), the user's line, however deep the API call that warns."""
    with lock:
        if message in process.said:
            return False
        process.said.add(message)
    if warn:
        warnings.warn(message, category,
                      stacklevel=(stacklevel + 1) if stacklevel is not None else outside_level(past))
    return True


def first_for(owner: Any) -> bool:
    """True the first time ``owner`` (a Module) asks, False after (per process, weakly held)."""
    with lock:
        if owner in process.said_for:
            return False
        process.said_for.add(owner)
    return True


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = tuple(os.path.join(_ROOT, package) + os.sep for package in ("gluon_amp", "gluon_amp_core"))


def outside_level(past: Tuple[str, ...] = ()) -> int:
    """The ``warnings.warn`` stacklevel, for the function that calls this and then warns, of
    the first frame outside gluon_amp and gluon_amp_core (and the paths starting with one of
    ``past``): the user's line, however deep the call."""
    frame, level = sys._getframe(2), 2  # the warning function's caller
    inside = _OWN + tuple(past)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _record(table: str, key: Any, make: Callable[[], Any]) -> Any:
    """``process.<table>[key]``, made by ``make`` on first use (weakly keyed: kept as long as
    ``key`` lives)."""
    with lock:
        records = getattr(process, table)
        record = records.get(key)
        if record is None:
            record = records[key] = make()
        return record


def trainer_record(trainer: Any) -> TrainerRecord:
    """``trainer``'s record, made on first use."""
    return _record("trainers", trainer, TrainerRecord)


def module_record(module: Any) -> ModuleRecord:
    """``module``'s record, made on first use."""
    return _record("modules", module, ModuleRecord)


def block_record(block: Any) -> BlockRecord:
    """``block``'s record, made on first use."""
    return _record("blocks", block, BlockRecord)


class Held:
    """Something installed while any owner holds it (hooks, method patches): ``install()`` runs
    when the first owner comes and its result is kept; ``remove(installed)`` runs when the last
    owner leaves. Patching machinery, not a record: :func:`reset` leaves it (what is installed
    must stay known to be undone)."""

    def __init__(self, install: Callable[[], Any], remove: Callable[[Any], Any]) -> None:
        self._install, self._remove = install, remove
        self._owners: Set[str] = set()
        self.installed: Any = None
        self._guard = threading.Lock()

    @property
    def holders(self) -> FrozenSet[str]:
        """Who holds it now."""
        return frozenset(self._owners)

    def hold(self, owner: str) -> None:
        """``owner`` needs it: installed now if nobody held it. A removal an exception cut short
        (installed, no owner) is finished first, so nothing is ever installed over itself."""
        with self._guard:
            if self.installed is not None and not self._owners:
                self._remove(self.installed)
                self.installed = None
            if self.installed is None:
                self.installed = self._install()
            self._owners.add(owner)

    def release(self, owner: str) -> Any:
        """``owner`` no longer needs it: the last one out removes it (and gets what ``remove``
        returned; ``None`` otherwise). It is forgotten only once ``remove`` returned: if that
        raises, the next ``hold`` or ``release`` removes it again (``remove`` must allow that)."""
        with self._guard:
            self._owners.discard(owner)
            if self._owners or self.installed is None:
                return None
            result = self._remove(self.installed)
            self.installed = None
            return result


class interrupts_deferred:
    """A block that a Ctrl-C does not cut: a ``KeyboardInterrupt`` (SIGINT) arriving inside it
    is raised at its end, once what it does is whole (CPython's ``signal`` docs: a Python
    handler runs between bytecodes, anywhere). Only the main thread receives SIGINT; elsewhere,
    and where SIGINT's handler is not a Python function, it changes nothing. Nests.

    Other exceptions still propagate from inside: the block keeps its invariants with
    ``try``/``except`` itself."""

    __slots__ = ("_handler", "_pending")

    def __enter__(self) -> "interrupts_deferred":
        self._handler: Any = None
        self._pending: List[tuple] = []
        if threading.current_thread() is not threading.main_thread():
            return self
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIG_IGN, SIG_DFL, or a handler not installed from Python
            return self
        pending = self._pending
        self._handler = handler  # before the swap: __exit__ (or the except below) puts it back
        try:
            signal.signal(signal.SIGINT, lambda signum, frame: pending.append((signum, frame)))
        except BaseException:
            signal.signal(signal.SIGINT, handler)
            self._handler = None
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        handler = self._handler
        if handler is None:
            return
        try:
            signal.signal(signal.SIGINT, handler)
        finally:
            signal.signal(signal.SIGINT, handler)  # again, should anything land in the first
            self._handler = None
        if self._pending:
            handler(*self._pending[0])  # Python's default handler raises KeyboardInterrupt


@dataclass(frozen=True)
class Extension:
    """What another part of gluon_amp does when ``init`` turns AMP on (``on``, given the
    policy), when ``disable`` turns it off (``off``), and on :func:`reset` (``forget``).
    Registered here at import by that part (e.g. ``training.module``), so patching imports
    nothing of it."""

    on: Callable[[Any], None]
    off: Callable[[], None]
    forget: Callable[[], None]


_extensions: List[Extension] = []


def register_extension(extension: Extension) -> None:
    """Run ``extension`` with every later ``init``/``disable`` (and now, if ``init`` is on)."""
    with lock:
        _extensions.append(extension)
        if process.policy is not None:
            extension.on(process.policy)


def extensions() -> Tuple[Extension, ...]:
    """The registered extensions, in registration order."""
    return tuple(_extensions)


def reset() -> None:
    """Forget everything recorded (tests, after ``gluon_amp.disable()``): the process policy,
    the change log, attached scalers, messages said, the per-trainer, per-Module and per-block
    records, the converters' remembered results, and the calling thread's regions; then each
    extension's ``forget`` (which releases what those held, e.g. the execution hooks)."""
    global process
    with lock:
        process = _Process()
    for extension in _extensions:
        extension.forget()
    regions.clear()  # the same dict: the patched functions hold it
    thread.began, thread.follow_from = {}, 0
    thread.bucket_hook = thread.binding_module = None
