"""Under the launcher, a failure in any thread ends the process; it never hangs.

Plain ``python`` prints a worker thread's uncaught exception and lets the thread die; whoever
waits for its result waits forever (GluonCV's ``Parallel`` runs ``forward_backward`` in worker
threads, and its main thread then blocks on a queue). And when the main thread fails, python
waits for every other non-daemon thread before exiting (``Parallel``'s workers wait on their
queue forever). The launcher ends the process in both cases, after the traceback, with exit
code 1 (the one python gives an uncaught exception): no ``finally`` of other threads and no
``atexit`` handler runs then (``os._exit``). See docs/compatibility.md.

The standard library's own helper threads (``multiprocessing.pool``'s result handler, which
dies of a manager proxy's ``RemoteError`` in GluonNLP's pretraining) fail as under ``python``:
printed, and the program goes on. Their callers are the standard library's, which python
leaves as they are; ending the process there failed runs that python completes.
"""
from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
from typing import Any, Callable

#: where the standard library's modules live (not its site-packages)
_STDLIB = os.path.join(os.path.abspath(sysconfig.get_paths()["stdlib"]), "")

EXIT_CODE = 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def end_process(code: int) -> None:
    """Flush stdout/stderr and end the process now, whatever other threads do."""
    _flush()
    os._exit(code)


def end_process_on_thread_failure(say: Callable[[str], None]) -> None:
    """Set ``threading.excepthook``: print as python does, then ``say`` why and end the process."""
    previous = threading.excepthook

    def excepthook(args: Any) -> None:
        if args.exc_type is SystemExit:  # sys.exit() in a thread ends that thread only, as in python
            return
        previous(args)
        if _runs_standard_library(args.exc_traceback):
            return  # as python: printed, the thread ends
        name = args.thread.name if args.thread is not None else "?"
        say(f"thread {name!r} died of {args.exc_type.__name__}: ending the process (exit code {EXIT_CODE}) "
            "rather than leaving the threads that wait for it hanging")
        end_process(EXIT_CODE)

    threading.excepthook = excepthook


def _runs_standard_library(tb: Any) -> bool:
    """Whether the thread whose exception has traceback ``tb`` ran a function of the standard
    library: its first frame past ``threading``'s own (``Thread.run`` has dropped its target
    by the time ``threading.excepthook`` runs)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == threading.__file__:
        tb = tb.tb_next
    if tb is None:
        return False
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return path.startswith(_STDLIB) and not any(d in path for d in ("site-packages", "dist-packages"))


def others_alive() -> bool:
    """True while a thread other than this one, not a daemon, still runs (python would wait)."""
    me = threading.current_thread()
    return any(t is not me and t.is_alive() and not t.daemon for t in threading.enumerate())


def end_like_python(exc: BaseException, print_exc: Callable[[BaseException], None]) -> None:
    """End the process as python would after the main thread's uncaught ``exc``, without
    waiting for the other threads: traceback (or SystemExit's message), then the exit code."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or isinstance(code, int):
            end_process(code or 0)
        print(code, file=sys.stderr)
        end_process(EXIT_CODE)
    print_exc(exc)
    if isinstance(exc, KeyboardInterrupt):  # python exits through SIGINT itself
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    end_process(EXIT_CODE)
