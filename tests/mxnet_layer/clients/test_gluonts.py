"""GluonTS 0.11, unmodified, under ``python -m gluon_amp.run`` (issue 41, "Real programs").

A driver of the test's own (written to a temporary folder, as a user's script would be) trains
GluonTS's ``SimpleFeedForwardEstimator`` and ``DeepAREstimator`` with GluonTS's own trainer
(hybridized, its ``gluon.Trainer`` loop) on a generated daily set, then forecasts with the
predictor (Student-t samples: ``F.sample_gamma``/``F.sample_normal``) and evaluates. Each mode
runs the launcher in a process of its own; plain ``python`` gives FP32's losses. Checked: the
program exits 0, every forecast is finite, and each epoch's mean training loss is within
``LOSS_TOL`` of FP32's (float16 keeps 11 significant bits, bfloat16 8). The native bfloat16 mode
needs a CPU with bfloat16 kernels: there GluonTS's forecasting once died on ``_sample_normal``
getting a bfloat16 mean and a float32 scale.

``make test`` installs GluonTS with ``--no-deps`` (the Makefile's CLIENTS).
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow  # one process per mode, ~10-20 s each on 2 cores

LOSS_TOL = {"float16": 0.01, "bfloat16": 0.03}
MODES = {
    "emulated-float16": ["--emulate", "--target-dtype", "float16"],
    "emulated-bfloat16": ["--emulate", "--target-dtype", "bfloat16"],
    "native-bfloat16": ["--target-dtype", "bfloat16"],
    "simulated-bfloat16": ["--target-dtype", "bfloat16"],  # native, simulated: every CPU
}

DRIVER = '''
import json, sys
import mxnet as mx, numpy as np, pandas as pd
from gluonts.dataset.common import ListDataset
from gluonts.evaluation import Evaluator, make_evaluation_predictions
from gluonts.mx import DeepAREstimator, SimpleFeedForwardEstimator
from gluonts.mx.trainer import Trainer
from gluonts.mx.trainer.callback import TrainingHistory

rng = np.random.RandomState(0)
t = np.arange(200)
series = [(10 + 5 * np.sin(2 * np.pi * t / 7 + i) + rng.randn(len(t))).astype("float32") for i in range(8)]
start = pd.Period("2020-01-01", freq="D")  # GluonTS 0.11 does not know pandas 2's hourly alias "h"
train = ListDataset([{"target": s[:-7], "start": start} for s in series], freq="D")
test = ListDataset([{"target": s, "start": start} for s in series], freq="D")
results = {}
for name in ("sff", "deepar"):
    mx.random.seed(0)
    np.random.seed(0)
    hist = TrainingHistory()
    trainer = Trainer(epochs=2, num_batches_per_epoch=5, callbacks=[hist])
    if name == "sff":
        est = SimpleFeedForwardEstimator(prediction_length=7, trainer=trainer, num_hidden_dimensions=[16, 16])
    else:
        est = DeepAREstimator(freq="D", prediction_length=7, trainer=trainer, num_layers=1, num_cells=16)
    predictor = est.train(train)
    fit, ts = make_evaluation_predictions(test, predictor=predictor, num_samples=20)
    forecasts, tss = list(fit), list(ts)
    agg, _ = Evaluator(quantiles=[0.5])(iter(tss), iter(forecasts), num_series=len(test))
    results[name] = {"losses": hist.loss_history, "forecasts": len(forecasts),
                     "finite": bool(all(np.isfinite(f.samples).all() for f in forecasts)),
                     "shape": list(forecasts[0].samples.shape), "mase": float(agg["MASE"])}
print("RESULT " + json.dumps(results))
'''


def _run(tmp_path, launcher_args):
    script = tmp_path / "gluonts_driver.py"
    script.write_text(DRIVER)
    cmd = [sys.executable] + (["-m", "gluon_amp.run", *launcher_args] if launcher_args is not None else []) \
        + [str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd[1:])} failed:\n{r.stderr[-4000:]}"
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fp32"), None)


@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.bf16_kernels] if m.startswith("native") else
                                                 [pytest.mark.simulated_native] if m.startswith("simulated") else [])
                                  for m in MODES])
def test_gluonts_trains_and_forecasts_under_the_launcher(mode, fp32, tmp_path):
    got = _run(tmp_path, MODES[mode])
    tol = LOSS_TOL[mode.split("-")[1]]
    for model in ("sff", "deepar"):
        ours, ref = got[model], fp32[model]
        assert ours["forecasts"] == 8 and ours["finite"] and ours["shape"] == [20, 7], (model, ours)
        assert len(ours["losses"]) == len(ref["losses"]) == 2
        for a, b in zip(ours["losses"], ref["losses"]):
            assert abs(a - b) <= tol * abs(b), (model, ours["losses"], ref["losses"])
