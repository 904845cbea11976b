"""python -m gluon_amp.conformance [--write] [--dtypes bfloat16,float16] [--speed] [OP ...]

Without --write: print the verdicts and the coverage. --write: record them as this host's facts
(gluon_amp_core/lists/verdicts_measured*.py: the module naming this host, or a new one beside the
other hosts') and render docs/op_conformance.md (from a checkout). --speed: time each op's
bfloat16 kernel against float32 with its casts instead (gluon_amp.conformance.speed); with
--write, record them (gluon_amp_core/lists/kernel_speed_measured*.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gluon_amp.conformance", description=__doc__.splitlines()[2])
    parser.add_argument("ops", nargs="*", help="ops to run (default: every candidate)")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--write", action="store_true", help="record the facts and render the docs page")
    parser.add_argument("--models", action="store_true",
                        help="with --write: trace the model zoos' graphs again (minutes); else keep the recorded ones")
    parser.add_argument("--speed", action="store_true",
                        help="time each op in bfloat16 against float32 with its casts instead (with --write: "
                             "record them as this host's kernel timings)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speed-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.speed or args.speed_worker:
        return _speed(parser, args)
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("bfloat16", "float16")]
    if bad:
        parser.error(f"--dtypes takes bfloat16 and/or float16, got {bad}")
    import gluon_amp  # noqa: F401  its numpy shim first
    from . import cases, harness
    if args.worker:
        harness.worker(args.ops, dtypes)
        return 0
    ops = _chosen(parser, args, cases.candidates(), "not candidate ops (no plan places them in a low dtype)",
                  "--write records every candidate op: give no op names")
    results = harness.run_all(ops, dtypes, log=lambda m: print(m, file=sys.stderr, flush=True))
    for r in results:
        if r.excluded:
            print(f"{r.op}: not run: {r.excluded}")
            continue
        cells = [f"{dt} {res.verdict or 'needs another host'}"
                 + (f" ({res.error:.3g})" if res.error is not None else "")
                 + "".join(f", {m}-mode backward {v} ({e:.3g})" for m, v, e in res.backward if v != "ok")
                 for dt, res in r.results.items()]
        print(f"{r.op}: " + "; ".join(cells))
    print(harness.summary(results))
    if args.write:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.exists(os.path.join(root, "gluon_amp_core", "lists")):
            print("--write needs a checkout of gluon-amp (gluon_amp_core/lists/ not found)", file=sys.stderr)
            return 2
        data = harness.data_path(root, harness.host()[0])
        if args.models:
            from .models import model_ops
            print("tracing the model zoos' graphs", file=sys.stderr, flush=True)
            traced = model_ops()
        elif os.path.basename(data) == "verdicts_measured.py":
            from gluon_amp_core.lists import verdicts_measured as recorded
            traced = ({m: ops.split() for m, ops in recorded.MODEL_OPS.items()}, dict(recorded.MODEL_FAILED))
        else:  # the graphs are the same on every host: the first host's module keeps them
            traced = None
        harness.write_data(results, data, traced)
        from gluon_amp_core import conformance_report
        import importlib
        import gluon_amp_core.lists.verdicts as v
        for name in v.MEASURED_MODULES:
            importlib.reload(importlib.import_module(f"gluon_amp_core.lists.{name}"))
        importlib.reload(v)
        with open(os.path.join(root, "docs", "op_conformance.md"), "w", encoding="utf-8") as f:
            f.write(conformance_report.render())
        print(f"wrote {data} and docs/op_conformance.md", file=sys.stderr)
    return 0


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace, known: Sequence[str], not_known: str,
            not_with_write: str) -> List[str]:
    """The ops named on the command line, all of ``known`` where none is; a usage error for a
    name not in ``known``, or for names given with ``--write`` (which records every op)."""
    unknown = [o for o in args.ops if o not in known]
    if unknown:
        parser.error(f"{not_known}: {unknown}")
    if args.write and args.ops:
        parser.error(not_with_write)
    return args.ops or list(known)


def _speed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import gluon_amp  # noqa: F401  its numpy shim first
    from . import harness, speed
    if args.speed_worker:
        speed.worker(args.ops)
        return 0
    ops = _chosen(parser, args, speed.candidates(),
                  "not ops a bfloat16 plan runs in bfloat16 outside the low-precision class",
                  "--speed --write times every candidate op: give no op names")
    timings, untimed = speed.run_all(ops, log=lambda m: print(m, file=sys.stderr, flush=True))
    for t in timings:
        print(f"{t.key}: bfloat16 {t.low_ms:.3f} ms, float32 with casts {t.fp32_ms:.3f} ms ({t.ratio:.2f}x)"
              + (" slow" if t.slow else "") + f"  [{t.case}]")
    for op, why in sorted(untimed.items()):
        print(f"{op}: not timed: {why}")
    if args.write:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.exists(os.path.join(root, "gluon_amp_core", "lists")):
            print("--write needs a checkout of gluon-amp (gluon_amp_core/lists/ not found)", file=sys.stderr)
            return 2
        host = harness.host()
        path = speed.data_path(root, host[0])
        with open(path, "w", encoding="utf-8") as f:
            f.write(speed.data_module(timings, untimed, host))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
