"""``python -m gluon_amp.run [options] SCRIPT [ARGS...]`` / ``... -m MODULE [ARGS...]``.

Turns AMP on with the policy its options give, makes gluon_amp answer imports of the peer (MXNet's own AMP module)
for the process (:func:`gluon_amp.install_as_contrib_amp`), then runs the program as
``python`` would (:mod:`.runner`); a thread that dies of an exception ends the process
(:mod:`.threads`). Options stop at the first argument that is not one of them: everything
after SCRIPT (or -m MODULE) is the program's.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.resolve import EMULATE_HINT

from . import facade, runner, threads
from .install import install_as_contrib_amp

PROG = "python -m gluon_amp.run"


def _say(message: str) -> None:
    print(f"gluon_amp.run: {message}", file=sys.stderr, flush=True)


def _names(text: str) -> List[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _conditional(text: str) -> Tuple[str, str, List[str]]:
    op, sep1, rest = text.partition(":")
    attr, sep2, values = rest.partition(":")
    if not (op and sep1 and attr and sep2 and _names(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: give OP:ATTR:V1,V2,... e.g. Activation:act_type:softrelu")
    return op, attr, _names(values)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} [options] SCRIPT [ARGS...]  |  {PROG} [options] -m MODULE [ARGS...]",
        description="Run a Python program (code you do not own, e.g. GluonCV's and GluonNLP's training "
                    "scripts) under gluon_amp: mixed precision is on before it starts, its `from "
                    f"{facade.PEER_PACKAGE} import amp` gets gluon_amp, and its own amp.init() keeps the policy "
                    "given here. sys.argv, "
                    "sys.path[0], __main__ and the exit code are what `python SCRIPT` gives; unlike python, a "
                    "thread that dies of an exception ends the process (exit code 1).")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run library module MODULE as a script (as python -m)")
    p.add_argument("--target-dtype", choices=LOW_PRECISION_DTYPES, default=None,
                   help="low-precision dtype (default: float16 with a GPU, bfloat16 on a CPU that runs it "
                        "natively and fast, else float32: AMP off)")
    p.add_argument("--emulate", action="store_true", default=None,
                   help="run the plan emulated on any CPU: float32 kernels, values rounded to the target dtype "
                        "(default target there: bfloat16)")
    p.add_argument("--no-tune", dest="tune", action="store_false", default=None,
                   help="use the op table's plan as it is, without timing ops on this machine")
    p.add_argument("--tune-budget", default=None, metavar="BUDGET",
                   help="what timing ops may spend in this process: seconds (600), a share of the run's "
                        "time (2%%), or both (2%%,600); 0 only reads the timing cache (default: "
                        "$GLUON_AMP_TUNE_BUDGET, else 1%%, at most 600 s)")
    p.add_argument("--keep-batchnorm-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="force batch norm to float32 (or, with --no-..., to the target dtype)")
    for flag, what in (("--target-precision-ops", "run in the target dtype"), ("--fp32-ops", "run in float32"),
                       ("--widest-type-ops", "run in their widest input type")):
        p.add_argument(flag, action="append", type=_names, default=None, metavar="OP,OP",
                       help=f"replace the default list of ops that {what} (comma-separated, repeatable; "
                            "an empty string gives an empty list)")
    p.add_argument("--conditional-fp32-ops", action="append", type=_conditional, default=None,
                   metavar="OP:ATTR:V1,V2", help="replace the default conditional float32 list (repeatable: "
                                                 "one op per option)")
    p.add_argument("--excluded-sym-names", action="append", type=_names, default=None, metavar="NAME,NAME",
                   help="op nodes kept in float32 (as named in a hybridized block's graph)")
    return p


#: Options that take a value, to find where the launcher's options end.
_VALUED = {"-m", "--target-dtype", "--target-precision-ops", "--fp32-ops", "--widest-type-ops",
           "--conditional-fp32-ops", "--excluded-sym-names", "--tune-budget"}


def split(argv: List[str]) -> Tuple[List[str], Optional[Tuple[str, str, List[str]]]]:
    """``(launcher options, (kind, SCRIPT or MODULE, program args) or None)``."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], (("script", argv[i + 1], argv[i + 2:]) if i + 1 < len(argv) else None)
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--")):
            name, rest = (argv[i + 1], argv[i + 2:]) if tok == "-m" and i + 1 < len(argv) else (tok[2:], argv[i + 1:])
            return argv[:i], (("module", name, rest) if name else None)
        if not tok.startswith("-") or tok == "-":
            return argv[:i], ("script", tok, argv[i + 1:])
        i += 2 if tok in _VALUED else 1
    return argv, None


_LISTS = ("target_precision_ops", "fp32_ops", "widest_type_ops", "excluded_sym_names")


def policy_options(opts: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of :func:`gluon_amp.install_as_contrib_amp` the options give."""
    given = {k: v for k, v in vars(opts).items() if k != "module" and v is not None}
    return {k: ([n for part in v for n in part] if k in _LISTS else v) for k, v in given.items()}


def main(argv: Optional[List[str]] = None) -> None:
    """Parse, install, run the program; its exit is the process's (see the module doc)."""
    own, target = split(list(sys.argv[1:] if argv is None else argv))
    p = parser()
    opts = p.parse_args(own)
    if target is None:
        p.error("give the program to run: SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    kind, name, args = target
    if kind == "script" and not os.path.exists(name):  # python's line, before anything starts
        where = name if os.path.isabs(name) else os.path.join(os.getcwd(), name)
        p.exit(2, f"{sys.orig_argv[0]}: can't open file {where!r}: [Errno 2] No such file or directory\n")
    # a module python -m cannot run (missing, a package without __main__) ends in runner.run_module
    # with python's own line: looking for it here would import its parents before AMP is on
    try:
        # what installing warns (e.g. AMP off on this CPU) is said as the launcher's own lines:
        # a warning's usual source line would show gluon_amp's frames above the program's output
        with warnings.catch_warnings(record=True) as said:
            policy = install_as_contrib_amp(**policy_options(opts))
    except (ValueError, TypeError, RuntimeError) as exc:
        p.exit(2, f"{PROG}: error: {str(exc).replace('tune_budget=', '--tune-budget ')}\n")
    for w in said:  # the launcher's user turns emulation on with its option, not an argument
        _say(f"{w.category.__name__}: {w.message}".replace(
            EMULATE_HINT, EMULATE_HINT.replace("Pass emulate=True", "Add --emulate (before the program)")))
    sys.excepthook = runner.trimming_excepthook(sys.excepthook)
    threads.end_process_on_thread_failure(_say)
    described = policy.describe()
    if not policy.enabled and policy.reason and any(policy.reason in str(w.message) for w in said):
        described = "float32 (mixed precision off: why is said above)"  # its reason once, not twice
    _say(f"{described}; gluon_amp answers {facade.PEER}; running {name}")
    try:
        (runner.run_module if kind == "module" else runner.run_script)(name, args)
    except SystemExit as exc:
        if exc.code not in (None, 0) and threads.others_alive():
            threads.end_like_python(exc, _print)
        raise
    except BaseException as exc:
        if threads.others_alive():  # python would print, then wait for them forever
            threads.end_like_python(exc, _print)
        raise


def _print(exc: BaseException) -> None:
    sys.excepthook(type(exc), exc, exc.__traceback__)
