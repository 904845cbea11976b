"""``benchmarks/model_families.py`` (issue 43): runs at tiny sizes and prints its table.

GluonTS (DeepAR) and GluonNLP are installed by ``make test`` (the Makefile's CLIENTS, the [test]
extra): a missing one is an error, not a skip.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers import ROOT, no_bf16_env

SCRIPT = os.path.join(ROOT, "benchmarks", "model_families.py")
TINY = ["--tiny", "--rounds", "1", "--warmup", "1", "--steps", "2"]


def _run(*args, env=None, timeout=900):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def _check_timed(row):
    assert row["it_per_s"] > 0 and math.isfinite(row["vs_fp32"]) and math.isfinite(row["last_loss"])
    assert row["best_it_per_s"] >= row["it_per_s"] and math.isfinite(row["best_vs_fp32"])
    assert row["cpu_it_per_s"] > 0 and math.isfinite(row["cpu_vs_fp32"])


@pytest.mark.slow  # six processes, each importing GluonTS or GluonNLP: about a minute on 2 cores
def test_every_family_runs_emulated_and_reports_its_plan(tmp_path):
    out = tmp_path / "mf.json"
    r = _run(*TINY, "--mode", "emulated-bfloat16", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["summary"]) == ["deepar", "lstm_lm", "transformer"]  # GluonTS's DeepAR, not the stand-in
    for net, modes in doc["summary"].items():
        assert list(modes) == ["fp32", "emulated-bfloat16"]
        fp32, amp = modes["fp32"], modes["emulated-bfloat16"]
        _check_timed(fp32)
        _check_timed(amp)
        assert fp32["ran"] == "float32" and fp32["vs_fp32"] == 1.0 and fp32["casts_per_low_op"] is None
        assert amp["ran"] == "bfloat16 emulated"
        assert amp["low_ops"] > 0 and amp["casts"] > 0  # the plan holds ops low and casts between them
        assert amp["casts_per_low_op"] == pytest.approx(amp["casts"] / amp["low_ops"])
        assert f"{net:<15} emulated-bfloat16  bfloat16 emulated" in r.stdout  # the table, one row each
    assert "host flags" in r.stdout and '"summary"' not in r.stdout


@pytest.mark.slow  # three processes of a few seconds each
def test_without_bf16_kernels_the_default_is_fp32_and_native_bfloat16_says_why(tmp_path, no_bf16_why):
    out = tmp_path / "mf.json"
    r = _run(*TINY, "--nets", "lstm_forecaster", "--mode", "default,bfloat16", "--json", str(out),
             env={**no_bf16_env(), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]["lstm_forecaster"]
    assert rows["default"]["ran"] == "float32" and rows["default"]["low_ops"] == 0  # AMP off: the FP32 graph
    _check_timed(rows["default"])
    assert rows["bfloat16"]["ran"] is None and no_bf16_why in rows["bfloat16"]["why_not"]
    assert "lstm_forecaster bfloat16           not run [1]" in r.stdout and no_bf16_why in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--mode", "float8"], "mode float8 unknown"),
    (["--nets", "resnet"], "net resnet unknown"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
])
def test_bad_flags_name_the_value_and_what_is_allowed(args, message):
    r = _run(*args, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.slow  # eight processes importing GluonCV
def test_the_cnn_families_run_when_named(tmp_path):
    out = tmp_path / "mf.json"
    nets = ["cifar_resnet", "mobilenet", "resnext", "alexnet"]
    r = _run(*TINY, "--nets", ",".join(nets), "--mode", "emulated-bfloat16", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]
    assert list(rows) == nets
    for net in nets:
        _check_timed(rows[net]["emulated-bfloat16"])
    assert rows["cifar_resnet"]["emulated-bfloat16"]["low_ops"] >= 22  # 21 convolutions and the dense layer, at least
    # every convolution and dense layer low: 27 + 1 (mobilenet1.0), 53 + 1 (resnext50_32x4d), 5 + 3 (alexnet)
    assert rows["mobilenet"]["emulated-bfloat16"]["low_ops"] >= 28
    assert rows["resnext"]["emulated-bfloat16"]["low_ops"] >= 54
    assert rows["alexnet"]["emulated-bfloat16"]["low_ops"] >= 8


@pytest.mark.slow  # two processes of a few seconds each
def test_interleaved_times_each_mode_beside_its_fp32_net_in_one_process(tmp_path):
    """Emulation runs on any CPU, so both rows run everywhere: each process alternates an FP32
    step and an AMP step, and the figure is FP32's time over the AMP step's, pair by pair."""
    out = tmp_path / "mf.json"
    r = _run("--interleaved", "--tiny", "--rounds", "1", "--warmup", "1", "--steps", "3", "--nets",
             "lstm_forecaster", "--mode", "default,emulated-bfloat16", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["interleaved"] is True and list(doc["summary"]["lstm_forecaster"]) == ["default", "emulated-bfloat16"]
    for mode, row in doc["summary"]["lstm_forecaster"].items():
        run = doc["runs"]["lstm_forecaster"][mode][0]
        assert len(run["ratios"]) + run["timed_skipped"] == 3 and run["ratios"], run
        assert all(v > 0 for v in run["ratios"]) and run["fp32_sec_per_step"] > 0 and run["sec_per_step"] > 0
        assert row["vs_fp32"] == pytest.approx(1 / run["ratio"]) and row["per_process"] == [round(row["vs_fp32"], 3)]
        assert f"lstm_forecaster {mode:<18} {row['ran']:<18}" in r.stdout
    emulated = doc["summary"]["lstm_forecaster"]["emulated-bfloat16"]
    assert emulated["ran"] == "bfloat16 emulated" and emulated["low_ops"] > 0  # the twin ran its plan
    assert doc["summary"]["lstm_forecaster"]["default"]["ran"] in ("float32", "bfloat16")
    assert "per process" in r.stdout and "MXNet thread" in r.stdout


@pytest.mark.slow  # two processes of a few seconds each
def test_interleaved_control_runs_fp32_beside_fp32_and_the_lead_changes_by_round(tmp_path):
    """``--mode fp32`` puts a second plain FP32 net where the AMP net goes: the ratio the harness
    alone gives. Which net steps first in a process decided AlexNet's figure 2x on an AVX2 host,
    so each round gives the lead to the other side, and the table marks the processes AMP led."""
    out = tmp_path / "mf.json"
    r = _run("--interleaved", "--tiny", "--rounds", "2", "--warmup", "1", "--steps", "3", "--nets",
             "lstm_forecaster", "--mode", "fp32", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    row = doc["summary"]["lstm_forecaster"]["fp32"]
    assert row["ran"] == "float32 (no AMP)" and row["low_ops"] == 0 and row["casts"] == 0
    assert [run["amp_led"] for run in doc["runs"]["lstm_forecaster"]["fp32"]] == [False, True]
    assert row["amp_led"] == [False, True] and len(row["per_process"]) == 2
    assert f"{row['per_process'][0]:.3f} {row['per_process'][1]:.3f}*" in r.stdout, r.stdout


@pytest.mark.parametrize("second_leads, first_pairs", [(False, ["a", "b", "b", "a"]), (True, ["b", "a", "a", "b"])])
def test_alternate_gives_the_first_step_to_the_side_asked(monkeypatch, second_leads, first_pairs):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from _report import alternate
    ran = []

    def side(name, seconds):
        return lambda: ran.append(name) or seconds

    pairs = alternate(side("a", 1.0), side("b", 2.0), warmup=1, steps=3, second_leads=second_leads)
    assert ran[:4] == first_pairs and len(ran) == 8
    assert pairs["ratios"] == [2.0, 2.0, 2.0] and pairs["first_seconds"] == 1.0 and pairs["second_seconds"] == 2.0
