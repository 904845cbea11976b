"""A timing cache on disk, keyed by everything that changes a measured time. Pure Python.

One JSON file per machine key under ``$XDG_CACHE_HOME/gluon-amp`` (``~/.cache/gluon-amp``):
the probe's figures and the tuner's per-op times. The key holds the CPU model and flags,
whether AMX was granted, the MXNet version, the oneDNN ISA in effect, ``DNNL_MAX_CPU_ISA``
and the thread count; the file repeats its key and format, so a corrupt file, one written
for another key (copied from another machine, a hash collision) or by another format is
ignored and rewritten, never trusted. Writes go to a temporary file in the same folder and
replace the old one atomically, so a reader sees a whole file, the old or the new; two
processes writing at once each leave a whole file (the last one wins; a lost entry is
measured again next time). :meth:`TimingCache.lock` serialises measuring across processes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional

#: Bump when the meaning of stored figures changes: older files are then stale.
FORMAT = 2


def cache_dir(env: Mapping[str, str]) -> str:
    """``$XDG_CACHE_HOME/gluon-amp``, or ``~/.cache/gluon-amp`` (XDG's default). A relative
    ``$XDG_CACHE_HOME`` is ignored, as the XDG spec says; with no home to expand ``~`` to (no
    ``$HOME``, no passwd entry), a folder of this user's in the temporary directory, not a
    ``~`` folder in the working directory."""
    base = env.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        base = os.path.join(home, ".cache") if os.path.isabs(home) else os.path.join(
            tempfile.gettempdir(), f"gluon-amp-cache-{_user_id()}")
    return os.path.join(base, "gluon-amp")


def _user_id() -> str:
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else "user"


def key_digest(key: Mapping[str, Any]) -> str:
    """A short stable name for a key (its canonical JSON, hashed)."""
    text = json.dumps(dict(key), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Loaded:
    """What :meth:`TimingCache.load` found: the entries, and why a file was not used."""

    entries: Dict[str, Any]
    ignored: Optional[str] = None


class TimingCache:
    """The cache file of one machine key.

    Parameters
    ----------
    directory : str
    key : mapping
        JSON-able facts the stored times depend on.
    """

    def __init__(self, directory: str, key: Mapping[str, Any]) -> None:
        self.key = json.loads(json.dumps(dict(key), sort_keys=True))  # canonical, JSON-typed
        self.path = os.path.join(directory, f"timings-{key_digest(self.key)}.json")

    def load(self) -> Loaded:
        """The stored entries; none (with the reason) for a missing, corrupt, foreign or stale file."""
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            return Loaded({})
        except (OSError, ValueError) as exc:
            return Loaded({}, f"unreadable ({type(exc).__name__}: {exc})")
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
            return Loaded({}, "not a gluon-amp timing cache")
        if doc.get("format") != FORMAT:
            return Loaded({}, f"stale (format {doc.get('format')!r}, this gluon-amp writes {FORMAT})")
        if doc.get("key") != self.key:
            return Loaded({}, "written for another machine or setting (its key differs)")
        return Loaded(doc["entries"])

    @contextlib.contextmanager
    def lock(self, blocking: bool = True) -> Iterator[bool]:
        """Hold this machine's measuring lock (a lock file beside the cache, ``flock``), so
        processes started together measure one after the other: the later ones then read
        the first one's figures, and nobody times while another process is timing. Where
        there is no ``fcntl`` (not POSIX), or the folder cannot be written, it does nothing.

        Yields whether this process may measure: always True when ``blocking`` (it waits
        its turn); with ``blocking=False``, False at once while another process holds it
        (a training step must not wait for another process's measurements)."""
        try:
            import fcntl
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except (ImportError, OSError):
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def store(self, entries: Mapping[str, Any]) -> None:
        """Merge ``entries`` into the file, atomically. Raises ``OSError`` if it cannot write."""
        merged = {**self.load().entries, **entries}
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".timings-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, "key": self.key, "entries": merged}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
