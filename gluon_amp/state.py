"""gluon_amp's process state, in one place; :func:`reset` clears it (tests).

- The policy in force: ``init``'s for the process (:data:`process`), and each thread's
  ``autocast`` regions (:data:`thread`); :func:`current_policy` answers for the calling thread.
- The policy-change log: a trainer asks which dtypes ran since its last step
  (:func:`policy_serial`, :func:`dtypes_since`).
- The scaler registry: every trainer's step hook attached (loss-output ops read their scale).
- The once-only messages (:func:`say_once`) and the per-object records: a trainer's
  (:func:`trainer_record`), a Module's (:func:`module_record`), what is kept beside a block's
  plan (:func:`block_record`, read through :mod:`gluon_amp.plan_notes`), and the converters'
  results run as their policy says (:class:`Converted`, read through :mod:`gluon_amp.execution`).
- What other parts do when ``init`` turns AMP on or off (:func:`register_extension`).

Layers read and write it here instead of reaching into each other (training never imports
patching). Caches of what the machine measured (the probe's verdict, the emulation kernel's
build) stay with the code that measures them, and so does the bookkeeping of what is patched
(the saved originals, who holds a patch): it must follow what MXNet's classes hold, which a
:func:`reset` cannot change.

The patched op functions read :data:`thread`'s ``override`` on every call (one attribute read):

- ``None``: the thread follows the process, the policy ``init`` put in force (or none);
- :data:`OFF`: float32, the original MXNet functions (``autocast(enabled=False)``);
- another :class:`Region`: its policy, for this thread only.
"""
from __future__ import annotations

import collections
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple


class Region:
    """The policy an ``autocast`` region puts in force on its thread (``None``: float32).

    One object per policy while it is in force (equal policies share it), hashed by
    identity: the patched functions look their wrapper up by it on every call.
    """

    __slots__ = ("policy",)

    def __init__(self, policy: Optional[Any]) -> None:
        self.policy = policy

    def __repr__(self) -> str:
        return f"Region({self.policy.describe() if self.policy is not None else 'float32'})"


#: the region of ``autocast(enabled=False)``: the original functions, float32
OFF = Region(None)


class _ThreadPolicy(threading.local):
    """One thread's regions: ``override`` (read on every op call) and the stack of the
    regions it is in, innermost last (``None`` where a region follows the process); and the
    scaler hook of a ``BucketingModule.bind`` under way in it."""

    def __init__(self) -> None:
        self.override: Optional[Region] = None
        self.stack: List[Optional[Region]] = []
        #: the scaler hook a ``BucketingModule.bind`` under way gives its default bucket
        #: (``training.module``), else ``None``
        self.bucket_hook: Optional[Any] = None


thread = _ThreadPolicy()


class _Gate:
    """Whether any thread is inside an ``autocast`` region. The patched op functions read
    ``open`` (a plain attribute) on every call, and the thread-local ``scope.override`` only
    while it is True: outside regions, a call costs no thread-local read."""

    __slots__ = ("open", "scope", "entered", "guard")

    def __init__(self, scope: _ThreadPolicy) -> None:
        self.open = False
        self.scope = scope
        self.entered = 0  # regions entered and not left, over every thread
        self.guard = threading.Lock()


gate = _Gate(thread)


def override() -> Optional[Region]:
    """The calling thread's innermost region, or ``None`` when it follows the process."""
    return thread.override


def enter(region: Optional[Region]) -> None:
    """Make ``region`` the calling thread's innermost (``None``: follow the process)."""
    with gate.guard:  # open before the override is set: no call on this thread misses it
        gate.entered += 1
        gate.open = True
    thread.stack.append(thread.override)
    thread.override = region


def leave() -> None:
    """Back to the region the last :func:`enter` of this thread left."""
    thread.override = thread.stack.pop()
    with gate.guard:
        gate.entered -= 1
        gate.open = gate.entered > 0


def current_policy() -> Optional[Any]:
    """The policy in force for the calling thread (its innermost ``autocast`` region's, else
    ``init``'s), or ``None`` when AMP is off for it."""
    region = thread.override
    return process.policy if region is None else region.policy


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
    """

    hook: Optional[Any] = None
    bound_scaled: bool = False
    scale_arg: Optional[str] = None
    heads: List[str] = field(default_factory=list)
    dtype: str = "float32"


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
    """

    notes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    real_dtypes: Optional[Dict[str, str]] = None
    traced: Optional[Tuple[Any, Any]] = None


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


_KEEP_CHANGES = 4096


@dataclass
class _Process:
    """The process's part of the state (one object: :data:`process`)."""

    #: the policy ``init`` put in force (threads without a region follow it)
    policy: Optional[Any] = None
    #: (serial, target dtype or None) each time a policy came in force or went (init, disable,
    #: an autocast region in any thread)
    changes: List[Tuple[int, Optional[str]]] = field(default_factory=lambda: [(0, None)])
    #: every trainer step hook attached so far (weakly): loss-output ops read their scale
    scalers: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: messages said once per process
    said: Set[str] = field(default_factory=set)
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


def changed(dtype: Optional[str]) -> None:
    """Record that a policy with ``dtype`` came in force (``None``: one went)."""
    with lock:
        changes = process.changes
        changes.append((changes[-1][0] + 1, dtype))
        if len(changes) > _KEEP_CHANGES:
            del changes[: len(changes) - _KEEP_CHANGES]


def policy_serial() -> int:
    """A number that grows each time a policy comes in force or goes (``init``, ``disable``,
    an ``autocast`` region in any thread)."""
    return process.changes[-1][0]


def dtypes_since(serial: int) -> FrozenSet[str]:
    """The target dtypes of the calling thread's policy now and of every one turned on since
    :func:`policy_serial` gave ``serial``: a step's forward pass may run under ``autocast``
    and its ``scale_loss`` after the scope (PyTorch's pattern)."""
    with lock:
        now = current_policy()
        dtypes = {now.target_dtype if now is not None else None}
        for k, d in reversed(process.changes):  # per step: usually nothing changed since, one look
            if k <= serial:
                break
            dtypes.add(d)
        dtypes.discard(None)
        return frozenset(dtypes)


def register_scaler(hook: Any) -> None:
    """Make a trainer's loss scaler (its step hook) known to the loss-output ops, now and under
    every later policy."""
    process.scalers.add(hook)


def say_once(message: str, warn: bool = True, category: type = RuntimeWarning, stacklevel: int = 3) -> bool:
    """Warn ``message`` (when ``warn``) unless it was said before in this process; either way it
    counts as said from now on. True when it was new."""
    with lock:
        if message in process.said:
            return False
        process.said.add(message)
    if warn:
        warnings.warn(message, category, stacklevel=stacklevel)
    return True


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
        """``owner`` needs it: installed now if nobody held it."""
        with self._guard:
            if self.installed is None:
                self.installed = self._install()
            self._owners.add(owner)

    def release(self, owner: str) -> Any:
        """``owner`` no longer needs it: the last one out removes it (and gets what ``remove``
        returned; ``None`` otherwise)."""
        with self._guard:
            self._owners.discard(owner)
            if self._owners or self.installed is None:
                return None
            installed, self.installed = self.installed, None
            return self._remove(installed)


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
    thread.override = None
    thread.stack = []
    thread.bucket_hook = None
    with gate.guard:
        gate.entered, gate.open = 0, False
