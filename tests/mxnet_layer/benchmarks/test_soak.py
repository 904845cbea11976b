"""Smoke test of ``benchmarks/soak.py`` (issue 42): 4 threads, real SIGINTs, a few seconds.

Slow (15-40 s on 2 shared cores: MXNet's import, the emulation kernel's build in the session's fresh
cache, then 9 s of soak).
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow


def test_soak_runs_interrupted_threads_without_hangs_or_wrong_dtypes(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--minutes", "0.15",
                        "--sigint-every", "0.7", "--hang-after", "30", "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.exists(), r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["steps"] > 0 and doc["requests"] > 0 and doc["ops_checked"] > doc["steps"]
    assert doc["interrupts"] >= 1 and doc["interrupts"] <= doc["sigints_sent"]
    # issue 42's acceptance: no hang, no op in another dtype than its region's
    assert (doc["hangs"], doc["wrong_dtype_ops"]) == (0, 0), json.dumps(doc, indent=1)
    assert r.returncode == 0, r.stderr[-3000:]
    for key in ("dropped_batches", "wrong_scale_steps", "rss_growth_mb_per_1000_steps", "failures"):
        assert key in doc, key
