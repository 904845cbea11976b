"""runtime_info()["threads"]: the count libgomp holds once MXNet has started, against the
prediction of gluon_amp_core.threads, in fresh processes (the count is fixed at MXNet's start)."""
import json
import os
import subprocess
import sys

import pytest

from gluon_amp_core.threads import MXNET_MAX, OMP, expected_threads
from helpers import ROOT

CHILD = """
import json, os, sys
if sys.argv[1] == "one":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before libgomp reads the mask
import gluon_amp
print(json.dumps({"threads": gluon_amp.runtime_info()["threads"], "cpus": len(os.sched_getaffinity(0))}))
"""

ENVS = {"unset": {}, "omp1": {OMP: "1"}, "omp3": {OMP: "3"}, "mxnet_max": {MXNET_MAX: "1"}}


def _run(extra, cpus_mode):
    env = {k: v for k, v in os.environ.items() if k not in (OMP, MXNET_MAX)}
    env.update(extra, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", CHILD, cpus_mode], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return env, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cpus_mode", ["all", "one"])
@pytest.mark.parametrize("name", sorted(ENVS))
def test_the_count_mxnet_started_with_is_the_one_predicted(name, cpus_mode):
    env, got = _run(ENVS[name], cpus_mode)
    t = got["threads"]
    assert t["cpus"] == got["cpus"]
    assert t["threads"] == expected_threads(env, got["cpus"]), t
    per_core = t["threads_per_core"]
    assert per_core is None or per_core >= 1
    idle = t["threads"] < t["cpus"] and name == "unset" and per_core == 1
    assert (t["note"] is not None) == idle, t
