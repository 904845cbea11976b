"""benchmarks/convergence.py: its data, its metric and its pipeline (the full run is a benchmark)."""
import json
import os
import subprocess
import sys
from typing import Any, Dict

import numpy as np
import pytest
import mxnet as mx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import convergence  # noqa: E402


def test_the_data_set_is_seeded_and_its_boxes_lie_inside_the_images():
    x, y = convergence.make_dataset(64, seed=3)
    x2, y2 = convergence.make_dataset(64, seed=3)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert not np.array_equal(x, convergence.make_dataset(64, seed=4)[0])
    real = y[y[:, :, 0] >= 0]
    counts = (y[:, :, 0] >= 0).sum(axis=1)
    assert counts.min() >= 1 and counts.max() <= 4
    assert set(real[:, 0].astype(int)) == set(range(len(convergence.CLASSES)))
    assert (real[:, 1] >= 0).all() and (real[:, 3] <= convergence.SIZE).all() and (real[:, 1] < real[:, 3]).all()
    # an object is really drawn: its box differs from the background around it
    i, j = np.argwhere(y[:, :, 0] >= 0)[0]
    _, x0, y0, x1, y1 = y[i, j].astype(int)
    assert np.abs(x[i, :, y0:y1, x0:x1].mean(axis=(1, 2)) - x[i].mean(axis=(1, 2))).max() > 0.05


def test_the_metric_scores_ground_truth_as_perfect_and_noise_as_poor():
    from gluoncv.utils.metrics.voc_detection import VOC07MApMetric
    _, y = convergence.make_dataset(32, seed=5)
    boxes, ids = mx.nd.array(y[:, :, 1:5]), mx.nd.array(y[:, :, 0:1])
    scores = mx.nd.where(ids >= 0, mx.nd.ones_like(ids), -mx.nd.ones_like(ids))
    m = VOC07MApMetric(iou_thresh=0.5, class_names=convergence.CLASSES)
    m.update(boxes, ids, scores, boxes, ids)
    assert m.get()[1][-1] == pytest.approx(1.0)
    m.reset()
    m.update(boxes[::-1], ids, scores, boxes, ids)  # every image gets another image's boxes
    assert m.get()[1][-1] < 0.5


def test_smoke_run_trains_every_mode_and_writes_the_table(tmp_path):
    out = tmp_path / "c.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "convergence.py"), "--smoke",
                        "--json", str(out), "--plot", str(tmp_path / "c.png")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    modes = [res["mode"] for res in doc["results"]]
    assert modes[0] == "fp32" and "emulated-float16" in modes and "emulated-bfloat16" in modes
    for res in doc["results"]:
        assert 0.0 <= res["final_map"] <= 1.0 and np.isfinite(res["final_loss"])
        assert len(res["losses"]) == doc["train"] // doc["batch_size"] and res["skipped_steps"] >= 0
    emulated = [res for res in doc["results"] if res["mode"].startswith("emulated")]
    assert all(res["runtime_mode"] == "emulated" for res in emulated)
    assert set(doc["verdict"]["modes"]) == set(modes) - {"fp32"}
    assert "verdict:" in r.stdout and (tmp_path / "c.png").stat().st_size > 1000
    import gluon_amp
    info = gluon_amp.runtime_info()
    if info["bf16"] == "native":  # native bfloat16 runs where the host has its kernels ...
        assert "bfloat16" in modes and not doc["skipped"]
    else:  # ... and elsewhere the table says why it did not
        assert "bfloat16" not in modes and doc["skipped"] == [f"native bfloat16 not run: {info['bf16_why']}"]
        assert doc["skipped"][0] in r.stdout


def _result(mode: str, final_map: float) -> Dict[str, Any]:
    return {"mode": mode, "final_map": final_map}


def test_the_verdict_allows_the_fp32_spread_or_one_map_point_if_that_is_larger():
    v = convergence.verdict([_result("fp32", 0.70), _result("fp32", 0.74), _result("a", 0.68),
                             _result("b", 0.765), _result("c", 0.6)])
    assert v["fp32_mean_map"] == pytest.approx(0.72) and v["fp32_spread"] == pytest.approx(0.04)
    assert v["allowed"] == pytest.approx(0.04)
    assert v["modes"]["a"] == {"map_diff": pytest.approx(-0.04), "within": True}
    assert v["modes"]["b"]["within"] is False and v["modes"]["c"]["within"] is False
    tight = convergence.verdict([_result("fp32", 0.700), _result("fp32", 0.702), _result("a", 0.692),
                                 _result("b", 0.689)])
    assert tight["allowed"] == pytest.approx(0.01)
    assert tight["modes"]["a"]["within"] is True and tight["modes"]["b"]["within"] is False
    assert "fp32" not in tight["modes"]


@pytest.mark.parametrize("flags", [["--epochs", "0"], ["--batch-size", "-1"], ["--lr", "0"], ["--epochs", "x"]])
def test_bad_flags_are_argparse_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        convergence.parse_args(flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_an_emulated_mode_this_gluon_amp_cannot_run_is_reported_not_failed(monkeypatch):
    import gluon_amp

    def old_init(target_dtype: Any = None, **options: Any) -> None:
        if "emulate" in options:
            raise TypeError("init() got an unexpected keyword argument 'emulate'")

    monkeypatch.setattr(gluon_amp, "init", old_init)
    r = convergence.train_mode("emulated-float16", 0, epochs=1, n_train=4, n_test=4, batch=4, lr=0.1, data_seed=0)
    assert r["mode"] == "emulated-float16" and "not available yet" in r["unavailable"]
