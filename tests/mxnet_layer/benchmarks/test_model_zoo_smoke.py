"""Smoke subset of benchmarks/model_zoo_sweep.py: a few zoo networks, every cell, ours only.

Each network is built in FP32 with random weights, then converted with convert_symbol,
convert_model and convert_hybrid_block and traced under ``autocast`` in float16 and
bfloat16, all at graph level (type inference; nothing runs in low precision). The picks
cover what broke before: YOLOv3 (``slice_like`` after low-precision convolutions) and
CenterNet (an explicit ``Cast`` to float32; the ResNet one runs its backbone in its constructor
to read a channel count, under targets this machine may not run) and a pre-quantized int8
network (oneDNN subgraph ops), next to plain classifiers.
"""
import os
import sys
import warnings

import pytest

import gluon_amp
from gluon_amp import runtime
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import model_zoo_sweep as sweep  # noqa: E402

NETWORKS = [
    "vision:resnet18_v1",
    "mobilenetv3_small",
    "squeezenet1.1",
    "yolo3_mobilenet0.25_coco",
    "center_net_mobilenetv3_small_duc_voc",
    "center_net_resnet18_v1b_voc",  # built under the target: its constructor runs its backbone
    "mobilenet1.0_int8",  # pre-quantized: its fused int8 ops keep their dtypes, the rest converts
]

#: Networks GluonCV loads as a SymbolBlock from a stored graph, so ``init`` never sees their ops.
LOADED_FROM_JSON = {"mobilenet1.0_int8"}


@pytest.mark.parametrize("name", NETWORKS)
def test_every_cell_converts(offline, name):
    res = sweep.ours_cells(name, sweep.DTYPES)
    assert "skip" not in res, f"{name} does not build in FP32: {res.get('skip')}"
    bad = {f"{d}/{c}": r["error"] for d, cells in res["cells"].items() for c, r in cells.items() if not r["ok"]}
    assert not bad, f"{name}: {bad}"
    for d, cells in res["cells"].items():
        for c, r in cells.items():
            if name in LOADED_FROM_JSON and c == "init":
                # a SymbolBlock read from a stored graph: no op function is called, nothing to patch
                assert r["lp_ops"] == 0
                continue
            assert r["lp_ops"] > 0, f"{name} {d}/{c}: no op runs in {d}"
            assert r["casts"] > 0, f"{name} {d}/{c}: no cast was inserted"
            assert r["lp_ops"] <= r["ops"]


def test_sweep_marks_a_network_that_does_not_build_as_skipped(offline):
    res = sweep.ours_cells("vgg16_ucf101", ["bfloat16"])  # GluonCV resets an uninitialized context
    assert set(res) == {"skip"} and "reset context" in res["skip"]


def test_sweep_table_and_totals_count_cells():
    ok = {"ok": True, "casts": 3, "lp_ops": 5, "ops": 9}
    fail = {"ok": False, "error": "boom"}
    cells = {d: {c: dict(ok) for c in sweep.CELLS} for d in sweep.DTYPES}
    cells["float16"]["init"] = fail
    results = {"a": {"ours": cells}, "b": {"skip": "no", "ours": cells}}
    totals = sweep.totals(results, sweep.DTYPES, peer=False)
    assert totals["built"] == 1 and totals["skipped"] == 1
    assert totals["ours/float16/init"] == "0/1" and totals["ours/bfloat16/init"] == "1/1"
    text = sweep.table(results, sweep.DTYPES, peer=False)
    assert "a ours float16 init: boom" in text and "b\tSKIP no" in text
    assert text.splitlines()[1].split("\t")[0] == "a" and text.count("FAIL") == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_plan_builds_without_running_under_a_target_this_cpu_may_not_run(offline, dtype):
    """init(target) without emulate: the model is constructed (CenterNet's constructor runs
    its backbone for a shape), its shapes inferred and its deferred parameters initialized
    without executing the plan; a real forward runs only where the target runs."""
    import mxnet as mx
    from gluoncv import model_zoo
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # init says where the target cannot run; the test checks what happens
        gluon_amp.init(target_dtype=dtype, tune=False)
    net = model_zoo.get_model("center_net_resnet18_v1b_voc", pretrained=False, pretrained_base=False)
    net.initialize()
    x = mx.nd.random.uniform(shape=(1, 3, 64, 64))
    net.infer_shape(x)  # shape inference traces the plan, runs nothing
    assert net.heads[0][-1].weight.shape == (20, 64, 1, 1)
    unknown = [p.name for p in net.collect_params().values() if not p.shape or 0 in p.shape]
    assert not unknown, unknown
    net.hybridize()
    if runtime.executable(dtype, "cpu"):
        assert len(net(x)) == 3
        return
    with pytest.raises(RuntimeError, match=r"emulate=True"):
        net(x)  # a real forward, hybridized: refused before anything runs
    net.hybridize(active=False)
    with pytest.raises(RuntimeError, match=r"emulate=True"):
        net(x)  # imperatively: the first low-precision op is refused

