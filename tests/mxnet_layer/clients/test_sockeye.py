"""Sockeye 2.3.24, unmodified, under ``python -m gluon_amp.run --emulate --target-dtype float16``
(issue 37): ``sockeye.train --amp``, a resumed run (Sockeye restores the peer scaler's fields by
assignment) and ``sockeye.translate --dtype float16``, on a generated reversal corpus with a
1-layer transformer. The validation perplexities stay within ``TOLERANCE`` of an FP32 run's.

``make test`` installs Sockeye with ``--no-deps`` (see the Makefile's CLIENTS).
"""
import os
import random
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

#: relative distance of emulated float16's validation perplexity from FP32's, per checkpoint
TOLERANCE = 0.05
LAUNCH = [sys.executable, "-m", "gluon_amp.run", "--emulate", "--target-dtype", "float16", "-m"]
MODEL = ["--encoder", "transformer", "--decoder", "transformer", "--num-layers", "1",
         "--transformer-model-size", "16", "--transformer-attention-heads", "2",
         "--transformer-feed-forward-num-hidden", "32", "--num-embed", "16", "--batch-size", "64",
         "--batch-type", "sentence", "--checkpoint-interval", "10", "--max-seq-len", "10",
         "--decode-and-evaluate", "0", "--seed", "1", "--use-cpu", "--initial-learning-rate", "0.01", "--quiet"]


def _corpus(path):
    """Digit sequences and their reversal: train (300 lines) and dev (30)."""
    rng = random.Random(0)
    for name, n in (("train", 300), ("dev", 30)):
        src = [" ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(2, 6))) for _ in range(n)]
        (path / f"{name}.src").write_text("\n".join(src) + "\n")
        (path / f"{name}.trg").write_text("\n".join(" ".join(reversed(s.split())) for s in src) + "\n")


def _run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd[-6:])} failed:\n{r.stderr[-4000:]}"
    return r


def _train(cwd, out, updates, amp):
    data = ["-s", "train.src", "-t", "train.trg", "-vs", "dev.src", "-vt", "dev.trg"]
    cmd = (LAUNCH if amp else [sys.executable, "-m"]) + ["sockeye.train", *data, *MODEL,
                                                         "--max-updates", str(updates), "-o", out]
    _run(cmd + (["--amp"] if amp else []), cwd)


def _perplexities(model_dir):
    """Validation perplexity per checkpoint, from Sockeye's metrics file."""
    rows = (line.split("\t") for line in (model_dir / "metrics").read_text().splitlines() if line)
    return [float(next(f.split("=")[1] for f in row if f.startswith("perplexity-val="))) for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FP32 for 40 updates; emulated float16 --amp for 20, then resumed to 40 in the same folder."""
    cwd = tmp_path_factory.mktemp("sockeye")
    _corpus(cwd)
    _train(cwd, "fp32", 40, amp=False)
    _train(cwd, "amp", 20, amp=True)
    first = _perplexities(cwd / "amp")
    _train(cwd, "amp", 40, amp=True)  # Sockeye resumes from amp/training_state
    return cwd, _perplexities(cwd / "fp32"), first, _perplexities(cwd / "amp")


def test_train_amp_tracks_fp32(runs):
    _, fp32, first, _ = runs
    assert len(first) == 2
    for k, (a, b) in enumerate(zip(first, fp32)):
        assert abs(a - b) / b < TOLERANCE, f"checkpoint {k + 1}: float16 emulated {a:.4f} vs FP32 {b:.4f}"


def test_a_resumed_amp_run_continues_from_its_checkpoint_as_fp32_does(runs):
    _, fp32, first, resumed = runs
    assert resumed[:2] == first  # the first run's checkpoints, kept
    assert len(resumed) == len(fp32) == 4
    for k, (a, b) in enumerate(zip(resumed, fp32)):
        assert abs(a - b) / b < TOLERANCE, f"checkpoint {k + 1}: float16 emulated {a:.4f} vs FP32 {b:.4f}"
    assert resumed[3] < resumed[1]  # it went on learning after the restart


def test_translate_in_float16(runs):
    cwd = runs[0]
    _run(LAUNCH + ["sockeye.translate", "-m", "amp", "--dtype", "float16", "--use-cpu", "-i", "dev.src",
                   "-o", "out.txt", "--quiet"], cwd)
    assert len((cwd / "out.txt").read_text().splitlines()) == len((cwd / "dev.src").read_text().splitlines())
