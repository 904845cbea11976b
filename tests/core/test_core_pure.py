"""The core needs neither MXNet nor NumPy, and importing it changes nothing."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE = r'''
import json, os, sys
for blocked in ("mxnet", "numpy"):
    sys.modules[blocked] = None          # any import of them now raises ImportError
env_before = dict(os.environ)
import gluon_amp_core
from gluon_amp_core import capability, decide, dtypes, fold, graph_pass, loss_scale, policy, resolve, table
from gluon_amp_core import accumulating_casts, layout_guards, paired_casts, timing_cache, walk
from gluon_amp_core.speed import probe
from gluon_amp_core.tuning import problem, schedule
from gluon_amp_core.op_reference import render
p = policy.Policy.create("float16", fp32_ops=["softmax"])
d = decide.decide("Convolution", {}, ["float32"], p.table)
s = loss_scale.LossScaler(init_scale=4.0)
s.update(False)
def rule(op, attrs, in_dtypes):
    t = next((x for x in in_dtypes if x), None)
    return tuple(x or t for x in in_dtypes), (t,)
g = {"nodes": [{"op": "null", "name": "x", "inputs": []}, {"op": "null", "name": "w", "inputs": []},
               {"op": "FullyConnected", "name": "fc", "attrs": {"num_hidden": "2"}, "inputs": [[0, 0, 0], [1, 0, 0]]}],
     "arg_nodes": [0, 1], "heads": [[2, 0, 0]], "attrs": {}}
r = graph_pass.convert_graph(g, p, ["x"], {}, rule, {}, cast_optional_params=True)
print(json.dumps({"decision": d.dtype, "scale": s.loss_scale, "w": r.param_dtypes["w"],
                  "rendered": len(render()) > 1000, "env_unchanged": dict(os.environ) == env_before,
                  "mxnet_loaded": sys.modules.get("mxnet") is not None,
                  "none_on_avx2": resolve.resolve_target(None, capability.classify(
                      frozenset({"avx2"}), False, None, probe_error="x")).dtype}))
'''


def test_core_imports_and_works_without_mxnet_or_numpy():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"decision": "float16", "scale": 2.0, "w": "float16", "rendered": True,
                   "env_unchanged": True, "mxnet_loaded": False, "none_on_avx2": "float32"}
