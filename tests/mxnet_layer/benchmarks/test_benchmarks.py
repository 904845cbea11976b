"""Smoke tests: the benchmark scripts run at tiny sizes and report what they promise."""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers import no_bf16_env

from helpers import ROOT
# Each test runs a benchmark script in a process of its own: 6 s (its argparse) to a minute.
pytestmark = pytest.mark.slow


def _run(script, *args, timeout=900, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env or {**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.bf16_kernels
def test_ssd_synthetic_amp_smoke(tmp_path):
    out = tmp_path / "ssd.json"
    plot = tmp_path / "ssd.png"
    r = _run("ssd_synthetic.py", "--amp", "--target-dtype", "bfloat16", "--batch-size", "1",
             "--iters", "2", "--warmup", "0", "--json", str(out), "--plot", str(plot))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [m["mode"] for m in doc["modes"]] == ["fp32", "gluon_amp"]
    for m in doc["modes"]:
        for key in ("samples_per_sec", "sec_per_iter", "final_ce", "final_smoothl1", "rss_delta_mb",
                    "skipped_steps", "speedup_vs_fp32"):
            assert key in m, key
        assert m["samples_per_sec"] > 0 and m["iters"] == 2
        assert math.isfinite(m["final_ce"]) and math.isfinite(m["final_smoothl1"])
    amp = doc["modes"][1]
    assert amp["loss_scale"] == 1.0 and amp["skipped_steps"] == 0  # bfloat16 losses are not scaled
    assert all(math.isfinite(v) for c in doc["loss_curves"].values() for v in c["ce"] + c["smoothl1"])
    assert "gluon_amp" in doc["loss_match"]
    assert "[Epoch 0][Batch 1], Speed:" in r.stdout and "CrossEntropy=" in r.stdout
    assert "samples/s" in r.stdout and "vs fp32" in r.stdout and "training" in r.stdout
    assert '"modes"' not in r.stdout  # the JSON goes to --json only
    assert plot.stat().st_size > 1000 and str(plot) in r.stdout


def test_ssd_synthetic_names_the_steps_emulated_float16_skips_and_compares_like_with_like(tmp_path):
    """A starting scale of 2^24 overflows float16 on every step here (planted skips): FP32 updates
    twice, float16 never, so their last losses are far apart; the verdict compares the first
    step (equal weights) and the equal update counts only, and names each skip with its scale."""
    out = tmp_path / "ssd.json"
    r = _run("ssd_synthetic.py", "--emulate", "float16", "--batch-size", "1", "--iters", "2", "--warmup", "0",
             "--no-memory", "--no-progress", "--init-scale", str(2.0 ** 24), "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    fp32, fp16 = doc["loss_history"]["fp32"], doc["loss_history"]["emulated-float16"]
    assert all(s["updated"] for s in fp32) and not any(s["updated"] for s in fp16)
    assert abs(fp16[-1]["loss"] - fp32[-1]["loss"]) > 0.02 * fp32[-1]["loss"]  # what the old verdict compared
    match = doc["loss_match"]["emulated-float16"]
    assert match["skipped"] == [{"step": i, "scale": 2.0 ** (23 - i)} for i in range(3)]
    assert [p["updates"] for p in match["pairs"]] == [0] and match["within"]
    assert "skipped step 0 (overflow; scale -> 8.38861e+06)" in r.stdout and "NOT within" not in r.stdout
    assert "first step (equal weights)" in r.stdout


def test_ssd_synthetic_runs_every_step_of_an_amp_mode_under_its_policy(tmp_path):
    """The default scaler scales float16 steps only, decided from the policy in force when the
    step runs: a mode built under AMP must also step under it (its steps after the first ran
    with AMP off, so emulated float16 trained at scale 1 while its table said so)."""
    out = tmp_path / "ssd.json"
    r = _run("ssd_synthetic.py", "--emulate", "float16", "--batch-size", "1", "--iters", "1", "--warmup", "0",
             "--no-memory", "--no-progress", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    history = doc["loss_history"]["emulated-float16"]
    scale = {m["mode"]: m["loss_scale"] for m in doc["modes"]}["emulated-float16"]
    assert all(s["scale"] > 1 for s in history) and scale == history[-1]["scale"]


def test_ssd_synthetic_without_bf16_kernels_runs_fp32_and_says_why(tmp_path, no_bf16_why):
    """`make bench`'s command on a host without bf16 kernels (simulated on any CPU)."""
    out = tmp_path / "ssd.json"
    r = _run("ssd_synthetic.py", "--amp", "--batch-size", "1", "--iters", "1", "--warmup", "0",
             "--no-progress", "--json", str(out), env=no_bf16_env())
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [m["mode"] for m in doc["modes"]] == ["fp32"]
    assert "AMP was not run" in r.stdout and no_bf16_why in r.stdout
    assert doc["runtime"]["bf16"] == "none" and doc["runtime"]["bf16_why"] == no_bf16_why
    assert math.isfinite(doc["modes"][0]["final_ce"])


def test_ssd_synthetic_where_bfloat16_was_measured_slower_runs_fp32_and_gives_the_figures(native_host, tmp_path):
    """`make bench`'s command on a host whose probe measured bfloat16 slower (issue 26's Intel
    figures, planted in this machine's cache): AMP stays off, and the table says why."""
    from helpers import planted_probe, probe_host_items
    out = tmp_path / "ssd.json"
    with planted_probe(probe_host_items("intel_xeon_no_amx"), tmp_path / "cache"):  # the subprocess reads it
        r = _run("ssd_synthetic.py", "--amp", "--batch-size", "1", "--iters", "1", "--warmup", "0",
                 "--no-progress", "--no-memory", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [m["mode"] for m in doc["modes"]] == ["fp32"]
    assert doc["runtime"]["speed"]["decision"] == "float32" and doc["runtime"]["speed"]["source"] == "cached"
    assert "AMP was not run" in r.stdout and "0.78x" in r.stdout and "target-dtype bfloat16" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--impl", "tensorrt"], "--impl"),
    (["--batch-size", "0"], "--batch-size"),
    (["--target-dtype", "int8"], "invalid choice"),
    (["--ctx", "gpu"], "no GPU"),
])
def test_ssd_synthetic_bad_flags(args, message):
    r = _run("ssd_synthetic.py", *args, timeout=120)
    assert r.returncode != 0 and message in r.stderr


@pytest.mark.bf16_kernels
def test_dispatch_overhead_smoke(tmp_path):
    out = tmp_path / "d.json"
    r = _run("dispatch_overhead.py", "--calls", "50", "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    fc = doc["ops"]["FullyConnected"]
    # both workers really ran patched: the low-precision op returned bfloat16
    assert fc["ours"]["patched_out_dtype"] == fc["peer"]["patched_out_dtype"] == "bfloat16"
    assert doc["ops"]["softmax"]["ours"]["patched_out_dtype"] == "float32"
    assert math.isfinite(doc["mean_overhead_us"]["ours"])  # a figure, not a timing assertion
    assert "mean overhead" in r.stdout and '"ops"' not in r.stdout


def test_dispatch_overhead_without_bf16_kernels_skips_the_bf16_op_and_says_why(tmp_path, no_bf16_why):
    out = tmp_path / "d.json"
    r = _run("dispatch_overhead.py", "--calls", "50", "--repeats", "1", "--json", str(out),
             env=no_bf16_env())
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert "FullyConnected" not in doc["ops"] and "softmax" in doc["ops"]
    assert "not measured" in r.stdout and no_bf16_why in doc["not_measured"]


@pytest.mark.bf16_kernels
def test_ssd_synthetic_opt_level_smoke(tmp_path):
    out = tmp_path / "o.json"
    r = _run("ssd_synthetic.py", "--opt-level", "O2", "--target-dtype", "bfloat16", "--batch-size", "1",
             "--iters", "1", "--warmup", "0", "--no-progress", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [m["mode"] for m in doc["modes"]] == ["fp32", "O2"]
    assert all(math.isfinite(m["final_ce"]) for m in doc["modes"])


def test_profile_step_profiles_fp32_op_by_op(tmp_path):
    out = tmp_path / "p.json"
    r = _run("profile_step.py", "--batch-size", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    fp32 = doc["results"][0]
    assert fp32["mode"] == "fp32" and max(fp32["ops_ms"], key=fp32["ops_ms"].get) == "Convolution"
    assert not any(op.startswith("_backward_") for op in fp32["ops_ms"])  # forward and backward summed
    assert 0.5 * fp32["step_ms"] <= sum(fp32["ops_ms"].values()) <= 1.5 * fp32["step_ms"]
    assert "Convolution" in r.stdout and "sum of ops" in r.stdout
    if doc["skipped"]:  # AMP off here (no bf16 kernels, or the speed probe measured them slower): FP32 alone, and why
        assert len(doc["results"]) == 1 and doc["runtime"]["default_why"] in doc["skipped"]
    else:
        assert all(c["ceiling_ms"] > 0 for c in doc["ceilings"].values())


def test_vs_peer_on_a_host_without_bfloat16_kernels_says_which_variants_it_cannot_measure(tmp_path):
    """DNNL_MAX_CPU_ISA=AVX2 (any host: an AVX2 one's kernels): FP32 is timed, ours and the peer
    say they need bfloat16 kernels and why, instead of failing with a traceback's last line."""
    out = tmp_path / "vs.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "DNNL_MAX_CPU_ISA": "AVX2"}
    r = _run("vs_peer.py", "--quick", "--rounds", "1", "--rows", "infer:resnet50", "--iters", "1",
             "--warmup", "0", "--min-seconds", "0", "--json", str(out), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(out.read_text())["rows"]["infer:resnet50"]
    assert row["variants"]["fp32"]["ms"] > 0 and row["ratios"]["ours_vs_fp32"] is None
    for v in ("ours", "peer"):
        (why,) = row["variants"][v]["errors"]
        assert why.startswith("needs bfloat16 kernels, which this host lacks") and "avx2" in why.lower(), why
    assert r.stdout.count("not measurable here: needs bfloat16 kernels") == 2 and "FAILED" not in r.stdout


def test_vs_peer_times_each_process_for_its_steps_and_its_minimum_seconds(tmp_path):
    """A fast row's process times past its --train-iters / --launcher-iters until its timed steps
    add up to --min-seconds; a row of fewer steps than that would time only its count."""
    out = tmp_path / "vs.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "DNNL_MAX_CPU_ISA": "AVX2"}  # the same variants on any host
    r = _run("vs_peer.py", "--quick", "--rounds", "1", "--rows", "train:rnn,launcher:wavenet", "--train-iters",
             "2", "--launcher-iters", "3", "--warmup", "0", "--min-seconds", "0.4", "--json", str(out), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    raw = json.loads(out.read_text())["raw"][0]
    # FP32 everywhere, and the launcher's default (float32 without bfloat16 kernels)
    for row, v, least in (("train:rnn", "fp32", 2), ("launcher:wavenet", "fp32", 3), ("launcher:wavenet", "ours", 3)):
        ms = raw[row][v]["ms"]
        assert len(ms) >= least and sum(ms) >= 400, (row, v, len(ms), sum(ms))
        assert sum(ms[:-1]) < 400 or len(ms) == least, (row, v, ms)  # it stops once both are met


def test_vs_peer_pins_every_process_to_the_cpus_it_is_given(tmp_path):
    out = tmp_path / "vs.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "DNNL_MAX_CPU_ISA": "AVX2"}
    cpu = max(os.sched_getaffinity(0))
    r = _run("vs_peer.py", "--quick", "--rounds", "1", "--rows", "train:rnn", "--train-iters", "1", "--warmup", "0",
             "--min-seconds", "0", "--pin", str(cpu), "--json", str(out), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["raw"][0]["train:rnn"]["fp32"]["cpus"] == [cpu]
    assert f"every process pinned to CPU {cpu}" in r.stdout
    for bad, says in (("x", "is not a comma-separated list of CPU numbers"), ("4096", "are not all among")):
        r = _run("vs_peer.py", "--pin", bad)
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_vs_peer_enough_counts_calls_and_seconds():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import vs_peer
    assert not vs_peer.enough([], 1, 0.0) and vs_peer.enough([5.0], 1, 0.0)
    assert not vs_peer.enough([400.0, 500.0], 3, 0.5) and vs_peer.enough([400.0, 500.0, 1.0], 3, 0.5)
    assert not vs_peer.enough([100.0] * 4, 2, 0.5) and vs_peer.enough([100.0] * 5, 2, 0.5)
    assert vs_peer.enough([0.001] * vs_peer.MAX_CALLS, 1, 60.0)  # a bound, however fast the call


@pytest.mark.bf16_kernels
def test_vs_peer_quick_runs_each_variant_in_its_own_process_and_reports_ratios(tmp_path):
    out = tmp_path / "vs.json"
    r = _run("vs_peer.py", "--quick", "--rounds", "1", "--rows", "infer:resnet50,launcher:wavenet",
             "--iters", "1", "--launcher-iters", "1", "--warmup", "0", "--min-seconds", "0", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert list(doc["rows"]) == ["infer:resnet50", "launcher:wavenet"]
    for row in doc["rows"].values():
        for v in ("fp32", "ours", "peer"):
            got = row["variants"][v]
            assert (got.get("ms") or 0) > 0 and (got.get("peak_rss_mb") or 0) > 0, (v, got)
        assert row["ratios"]["ours_vs_peer"] > 0 and row["ratios"]["ours_vs_fp32"] > 0
    conv = doc["rows"]["infer:resnet50"]["variants"]
    # host-independent: the default (fused) conversion casts only the input and the output
    assert conv["ours"]["casts"] == 2 and conv["ours"]["ops_by_dtype"]["bfloat16"] > 20
    assert conv["peer"]["casts"] > 20  # the peer keeps float32 weights and casts each one
    assert "ours/peer" in r.stdout and "avx512_bf16" in r.stdout


def test_module_head_times_each_mode_and_names_the_identity_it_bound(tmp_path):
    """Each mode in its own process: FP32 and the emulated modes timed; float16 binds the scaled
    identity elementwise (a CPU), bfloat16 none (the default scaler does not scale it); native,
    under DNNL_MAX_CPU_ISA=AVX2 (any host), says it needs bfloat16 kernels."""
    out = tmp_path / "head.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "DNNL_MAX_CPU_ISA": "AVX2"}
    r = _run("module_head.py", "--rounds", "1", "--warmup", "0", "--steps", "1", "--json", str(out), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["fp32"]["ms"] > 0 and rows["fp32"]["vs_fp32"] == 1.0 and rows["fp32"]["identity"] is None
    assert rows["float16"]["identity"] == "elemwise_mul" and rows["bfloat16"]["identity"] is None
    assert all(rows[m]["vs_fp32"] > 0 for m in ("float16", "bfloat16"))
    assert rows["native"]["skipped"].startswith("not measurable here: needs bfloat16 kernels")
    assert "| native | not measurable here" in r.stdout
    assert "host flags" in r.stdout and "DNNL_MAX_CPU_ISA=AVX2" in r.stdout


def test_module_head_bad_flags():
    r = _run("module_head.py", "--modes", "fp32,fp8")
    assert r.returncode == 2 and "fp8 not among fp32, float16, bfloat16, native" in r.stderr


def test_emulation_cost_interleaved_times_each_emulated_twin_beside_its_fp32_net(tmp_path):
    """Emulation runs on any CPU (the rounding is float32 arithmetic), so this runs everywhere."""
    out = tmp_path / "emu.json"
    r = _run("emulation_cost.py", "--interleaved", "--nets", "resnet18", "--rounds", "2", "--warmup", "0",
             "--steps", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["interleaved"] is True and set(doc["summary"]["resnet18"]) == {"float16", "bfloat16"}
    for mode, s in doc["summary"]["resnet18"].items():
        for run in doc["runs"]["resnet18"][mode]:
            assert len(run["ratios"]) + run["timed_skipped"] == 2, run
            assert all(v > 0 for v in run["ratios"])
        assert s["emulated_led"] == [False, True]  # each round gives the first step to the other net
        assert (s["time_vs_fp32"] is None) == (not any(run["ratios"] for run in doc["runs"]["resnet18"][mode]))
        assert s["rounding"]["path"] in ("kernel", "fallback")
    assert "time vs FP32" in r.stdout and "MXNet thread" in r.stdout
