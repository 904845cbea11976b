"""MXNet's error messages: the line that says what failed.

1.9.1 raises an ``MXNetError`` whose message starts "Traceback (most recent call last):" and
the C++ frames, and ends with the check that failed ("MXNetError: Unknown type enum 12"). A
message's first line says nothing; the last line naming an error does.
"""
from __future__ import annotations


def error_line(error: BaseException, limit: int = 300) -> str:
    """The last line of ``error``'s message that names an error or a failed check (else its
    last line, else the exception's type name), at most ``limit`` characters."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Check failed" in ln:
            return ln[:limit]
    return (lines[-1] if lines else type(error).__name__)[:limit]
