"""benchmarks/zoo_convert_speed.py: its summary from planted records, and one network timed."""
import argparse
import math
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import zoo_convert_speed as zcs  # noqa: E402


def _ok(speedup):
    return {"status": "ok", "speedup": speedup}


def test_the_summary_names_what_is_slower_than_fp32_or_the_peer():
    results = {
        "ours": {"a": _ok(2.0), "b": _ok(0.9), "c": _ok(1.2), "d": {"status": "fail", "why": "boom"},
                 "e": _ok(1.5), "f": {"status": "skipped", "why": "slow"}},
        "peer": {"a": _ok(1.0), "b": _ok(0.8), "c": _ok(1.5), "d": _ok(1.0), "e": {"status": "fail", "why": "x"},
                 "f": {"status": "skipped", "why": "slow"}},
    }
    s = zcs.summary(results, slow=0.97)
    assert s["ours_below_fp32"] == {"b": 0.9}
    assert s["ours_below_peer"] == {"c": 0.8}  # 1.2 against the peer's 1.5
    assert s["peer_failed_ours_ran"] == ["e"]
    assert s["failures"] == {"ours:d": "boom", "peer:e": "x"}
    assert s["counts"] == {"ours": {"ok": 4, "fail": 1, "skipped": 1}, "peer": {"ok": 4, "fail": 1, "skipped": 1}}
    assert s["geomean_ours_vs_fp32"] == round(math.exp((math.log(2.0) + math.log(0.9) + math.log(1.2)
                                                        + math.log(1.5)) / 4), 3)
    assert s["geomean_ours_vs_peer"] == round(math.exp((math.log(2.0) + math.log(0.9 / 0.8)
                                                        + math.log(1.2 / 1.5)) / 3), 3)


@pytest.mark.slow
def test_one_network_is_timed_against_its_conversion(offline):
    args = argparse.Namespace(batch=1, rounds=1, block_s=0.05, max_ms=5000.0)
    rec = zcs.run_one("ours", "vision:resnet18_v1", args)
    assert rec["status"] == "ok", rec
    assert rec["shape"] == (1, 3, 224, 224) and rec["fp32_ms"] > 0 and rec["converted_ms"] > 0
    assert abs(rec["speedup"] - rec["fp32_ms"] / rec["converted_ms"]) <= 1e-3 * rec["speedup"]
    assert rec["target"] in ("bfloat16", "float32") and isinstance(rec["fallbacks"], list)
    skipped = zcs.run_one("ours", "vision:resnet18_v1", argparse.Namespace(**{**vars(args), "max_ms": 0.0}))
    assert skipped["status"] == "skipped" and "--max-ms" in skipped["why"]
