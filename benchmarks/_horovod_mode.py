"""``ssd_synthetic.py --horovod N``: its gluon_amp mode under Horovod, 1 process against N.

Each run is ``horovodrun -np P -H localhost:P --gloo`` of this file with ``--worker``: every
process trains SSD-512 with gluon_amp at the per-process batch (weak scaling) through
``hvd.DistributedTrainer`` and writes its own per-iteration times. The report gives each
worker's samples/s, the total (their sum) and the total against one process. The cores are
split evenly between the processes (``OMP_NUM_THREADS``), so on a small machine N processes
share what one process had (a 1-process run as narrow as each of the N is reported too): the
numbers say what Horovod costs or gains here, not what more hardware would give.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from _report import write_json

HERE = os.path.dirname(os.path.abspath(__file__))


def _horovodrun() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(path):
        raise SystemExit("error: --horovod needs horovodrun next to this Python; install Horovod "
                         "with MXNet support: `make install-dist` (see README, 'Training on several "
                         "processes or machines')")
    return path


def _launch(procs: int, threads: int, args: argparse.Namespace, out_dir: str,
            timeout: float) -> List[Dict[str, Any]]:
    cmd = [_horovodrun(), "-np", str(procs), "-H", f"localhost:{procs}", "--gloo",
           sys.executable, os.path.join(HERE, "_horovod_worker.py"), "--out", out_dir,
           "--batch-size", str(args.batch_size), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--seed", str(args.seed), "--target-dtype", args.target_dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # start_new_session + killpg: horovodrun's workers must not outlive a timeout.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise SystemExit(f"error: horovodrun -np {procs} did not finish in {timeout:.0f} s")
    if rc != 0:
        raise SystemExit(f"error: horovodrun -np {procs} failed with exit code {rc}")
    ranks = []
    for rank in range(procs):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            ranks.append({**json.load(f), "threads": threads})
    return ranks


def run(args: Any, processes: int, timeout: float = 3600) -> Dict[str, Any]:
    """Run the AMP mode with 1 and with ``processes`` Horovod processes; print and return the report."""
    if processes < 2:
        raise SystemExit(f"error: --horovod N needs N >= 2 (got {processes}); 1 process is the baseline it runs anyway")
    import gluon_amp
    # Decided once, here: workers probing on their own (their OMP_NUM_THREADS is another cache
    # key) could reach different dtypes, or time each other. float32: AMP is off here.
    res = gluon_amp.runtime.resolve(None if args.target_dtype == "auto" else args.target_dtype, warn=False)
    target = res.dtype if res.executable else "float32"
    if target == "float32":
        print(f"AMP is off in the workers (float32 with the loss scaler): {res.warning}", flush=True)
    opts = argparse.Namespace(batch_size=args.batch_size or 2, iters=args.iters or 6,
                              warmup=args.warmup, seed=args.seed, target_dtype=target)
    cores = os.cpu_count() or 1
    narrow = max(1, cores // processes)
    # 1 process on every core (the baseline), 1 process as narrow as each of the N (shows how
    # much of any gain is thread scaling, not Horovod), then the N processes.
    plan = [(1, cores)] + ([(1, narrow)] if narrow != cores else []) + [(processes, narrow)]
    runs = []
    for procs, threads in plan:
        with tempfile.TemporaryDirectory() as out:
            print(f"OMP_NUM_THREADS={threads} horovodrun -np {procs} -H localhost:{procs} --gloo ... "
                  f"(batch {opts.batch_size} per process, {opts.iters} timed iterations)", flush=True)
            ranks = _launch(procs, threads, opts, out, timeout)
        total = sum(r["samples_per_sec"] for r in ranks)
        runs.append({"processes": procs, "threads_per_process": ranks[0]["threads"],
                     "load_avg_1min_after": os.getloadavg()[0],
                     "per_worker_samples_per_sec": [r["samples_per_sec"] for r in ranks],
                     "total_samples_per_sec": total, "ranks": ranks})
    base = runs[0]["total_samples_per_sec"]
    for r in runs:
        r["total_vs_1_process"] = r["total_samples_per_sec"] / base
    doc = {"benchmark": "ssd_512_resnet50_v1_coco synthetic training, gluon_amp under Horovod (gloo)",
           "batch_size_per_process": opts.batch_size, "iters": opts.iters, "warmup": opts.warmup,
           "cpu_count": os.cpu_count(), "target_dtype": runs[0]["ranks"][0]["target_dtype"], "runs": runs}
    print_report(doc)
    write_json(doc, getattr(args, "json", None))
    return doc


def print_report(doc: Dict[str, Any]) -> None:
    print(f"\nSSD-512 gluon_amp ({doc['target_dtype']}) under Horovod/gloo, batch "
          f"{doc['batch_size_per_process']} per process, {doc['iters']} timed iterations (median), "
          f"{doc['cpu_count']} cores split between the processes")
    head = (f"{'processes':>9}{'threads':>9}  {'per-worker samples/s':<24}{'total':>8}{'vs 1 proc':>11}"
            f"{'load':>6}  scale / skipped per rank")
    print(head)
    print("-" * len(head))
    for r in doc["runs"]:
        per = ", ".join(f"{v:.3f}" for v in r["per_worker_samples_per_sec"])
        agree = ", ".join(f"{k['loss_scale']:g}/{k['skipped_steps']}" for k in r["ranks"])
        print(f"{r['processes']:>9}{r['threads_per_process']:>9}  {per:<24}{r['total_samples_per_sec']:>8.3f}"
              f"{r['total_vs_1_process']:>10.2f}x{r['load_avg_1min_after']:>6.1f}  {agree}")
    n = doc["runs"][-1]["processes"]
    print(f"The {n} processes share the {doc['cpu_count']} cores the first row had: no hardware is "
          "added. Their total against the first row is what Horovod costs or gains on this machine; "
          "the narrow single process shows how much of that is only thread scaling. 'load' is the "
          "1-minute load average after each run: above the core count, other work shared the CPU "
          "and the row is not comparable.")
