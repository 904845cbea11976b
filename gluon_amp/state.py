"""gluon_amp's process state, in one place (issue 38 starts it here; the rest moves in later).

For now: which policy each thread's ``autocast`` regions put in force. The patched op
functions read :data:`thread`'s ``override`` on every call (one attribute read):

- ``None``: the thread follows the process, the policy ``init`` put in force (or none);
- :data:`OFF`: float32, the original MXNet functions (``autocast(enabled=False)``);
- another :class:`Region`: its policy, for this thread only.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional


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
