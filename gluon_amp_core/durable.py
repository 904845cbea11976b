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
