"""gluon_amp's process state, in one place; :func:`reset` clears it (tests).

- The policy in force: ``init``'s for the process (:data:`process`), and each thread's
  ``autocast`` regions (:data:`thread`); :func:`current_policy` answers for the calling thread.
- The policy-change log: a trainer asks which dtypes ran since its last step
  (:func:`policy_serial`, :func:`dtypes_since`).
- The scaler registry: every trainer's step hook attached (loss-output ops read their scale).
- The once-only messages (:func:`say_once`) and the per-trainer records (:func:`trainer_record`).
- What other parts do when ``init`` turns AMP on or off (:func:`register_extension`).

Layers read and write it here instead of reaching into each other (training never imports
patching). Caches of what the machine measured (the probe's verdict, the emulation kernel's
build) stay with the code that measures them.

The patched op functions read :data:`thread`'s ``override`` on every call (one attribute read):

- ``None``: the thread follows the process, the policy ``init`` put in force (or none);
- :data:`OFF`: float32, the original MXNet functions (``autocast(enabled=False)``);
- another :class:`Region`: its policy, for this thread only.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, List, Optional, Set, Tuple


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
    regions it is in, innermost last (``None`` where a region follows the process)."""

    def __init__(self) -> None:
        self.override: Optional[Region] = None
        self.stack: List[Optional[Region]] = []


thread = _ThreadPolicy()


def override() -> Optional[Region]:
    """The calling thread's innermost region, or ``None`` when it follows the process."""
    return thread.override


def enter(region: Optional[Region]) -> None:
    """Make ``region`` the calling thread's innermost (``None``: follow the process)."""
    thread.stack.append(thread.override)
    thread.override = region


def leave() -> None:
    """Back to the region the last :func:`enter` of this thread left."""
    thread.override = thread.stack.pop()


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


def trainer_record(trainer: Any) -> TrainerRecord:
    """``trainer``'s record, made on first use (kept as long as the trainer lives)."""
    with lock:
        record = process.trainers.get(trainer)
        if record is None:
            record = process.trainers[trainer] = TrainerRecord()
        return record


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
    the change log, attached scalers, messages said, per-trainer records, and the calling
    thread's regions."""
    global process
    with lock:
        process = _Process()
    for extension in _extensions:
        extension.forget()
    thread.override = None
    thread.stack = []
