"""Durable file replacement: what a crash or power loss may leave of a file being written."""
from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file, or a folder after a rename in it) to the disk.

    POSIX; where the system cannot open or flush it (a folder on Windows, some file systems),
    nothing: the write is then as durable as the system makes it.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_file_mode() -> int:
    """The mode ``open(path, 'w')`` would give a new file under this process's umask (read from
    ``/proc`` where it is there: setting and restoring the umask races other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def replacement_mode(path: str) -> int:
    """The mode a file written anew to replace ``path`` should have: that file's, where it
    exists (another user or a server may read it), else a new file's."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return new_file_mode()


def hold_exclusive(fd: int) -> bool:
    """Take an exclusive ``flock`` on the open file ``fd`` (released when it is closed);
    False where the system has no ``flock``."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return False
    return True


def held_by_another(path: str) -> bool:
    """Whether some open file holds a ``flock`` on ``path`` (a writer still writing it): asked
    without waiting, and answered False where the system has no ``flock``."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # its lock, if taken, goes with it
    return False
