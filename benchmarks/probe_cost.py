"""What the speed probe costs: its first run on a machine, and every later (cached) one.

    python benchmarks/probe_cost.py [--rounds 3] [--json out.json]

Each round starts two fresh processes on an empty cache folder (``XDG_CACHE_HOME``): the
first measures (the probe times its blocks in float32 and bfloat16), the second reads the
figures the first stored. Reported per process: the probe's own time (``SpeedVerdict.seconds``:
locking, reading, timing and writing the cache) and the whole ``runtime.resolve(None)`` call
(which also runs the capability check once per process). Where this machine has no native
bfloat16 there is nothing to time: that is printed and no probe runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _report import write_json  # noqa: E402

CHILD = r'''
import json, time, warnings
warnings.simplefilter("ignore")
import gluon_amp
t0 = time.perf_counter()
res = gluon_amp.runtime.resolve(None, warn=False)
resolve_s = time.perf_counter() - t0
speed = res.speed
print(json.dumps({"source": speed.source if speed else None, "probe_s": speed.seconds if speed else None,
                  "resolve_s": resolve_s, "speedup": speed.speedup if speed else None, "dtype": res.dtype,
                  "why_not": None if speed else gluon_amp.runtime_info()["speed"]["source"]}))
'''


def child(cache: str) -> Dict[str, Any]:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"probe process failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    rows = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            rows.append(("first", child(cache)))
            rows.append(("cached", child(cache)))
    if rows[0][1]["source"] is None:
        print(f"no probe ran: {rows[0][1]['why_not']}")
        doc = {"probe": None, "why_not": rows[0][1]["why_not"]}
    else:
        print(f"{'run':<8}{'source':<10}{'probe ms':>10}{'resolve ms':>12}{'speedup':>9}{'picks':>10}")
        for kind, r in rows:
            print(f"{kind:<8}{r['source']:<10}{r['probe_s'] * 1e3:>10.2f}{r['resolve_s'] * 1e3:>12.1f}"
                  f"{r['speedup']:>9.2f}{r['dtype']:>10}")
        first = [r["probe_s"] for k, r in rows if k == "first"]
        cached = [r["probe_s"] for k, r in rows if k == "cached"]
        print(f"probe cost: first run max {max(first):.2f} s (target <= 2 s), cached max {max(cached) * 1e3:.2f} ms "
              f"(target <= 5 ms); median {statistics.median(first):.2f} s / {statistics.median(cached) * 1e3:.2f} ms")
        doc = {"rows": [{"run": k, **r} for k, r in rows], "first_max_s": max(first),
               "cached_max_ms": max(cached) * 1e3}
    write_json(doc, args.json)
    return doc


if __name__ == "__main__":
    main()
