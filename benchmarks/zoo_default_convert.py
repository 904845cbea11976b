"""GluonCV's model zoo converted with the defaults: ``convert_hybrid_block(net)``, then run.

For every network of ``gluoncv.model_zoo.get_model_list()`` that builds offline with random
weights (``pretrained=False``, ``pretrained_base=False``; sockets blocked, as in
``model_zoo_sweep.py``, whose builders this reuses), at the smallest input size that runs in
FP32 (tiny first: 64x64 for the classifiers), the FP32 net runs once, is converted with no
argument but the net (the machine's default target, fusion, everything on by default), and the
converted block runs on the same input. Each network gets one of:

* ``ok``: the converted block ran; ``rel`` is the largest relative difference from FP32 over its
  float outputs (max |low - fp32| / max |fp32|), ``fallbacks`` what the converter left out;
* ``fail``: converting or running the converted block raised (the first line of the error);
* ``crash``/``timeout``: the worker died or stalled on it (restarted after it);
* ``skipped``: the network does not build or run in FP32 at any tried size.

Workers append one JSON line per network to ``--state`` (resumable). Run::

    PYTHONPATH=. python benchmarks/zoo_default_convert.py [--models all|a,b] [--timeout 600]
        [--state /tmp/zoo_default_convert.jsonl] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
import model_zoo_sweep as zoo

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
Shape = Tuple[int, ...]
_SWEEP_SHAPES = zoo.input_shapes


def tiny_shapes(name: str) -> List[Shape]:
    """The sweep's candidate shapes, with a 64x64 image first for plain classifiers."""
    shapes = _SWEEP_SHAPES(name)
    if shapes == [(1, 3, 224, 224)]:
        return [(1, 3, 64, 64), (1, 3, 224, 224)]
    return shapes


def _floats(out: Any) -> List[Any]:
    import mxnet as mx
    items = out if isinstance(out, (list, tuple)) else [out]
    flat: List[Any] = []
    for o in items:
        if isinstance(o, (list, tuple)):
            flat += _floats(o)
        elif isinstance(o, mx.nd.NDArray):
            flat.append(o.astype("float32").asnumpy())
    return flat


def run_one(name: str) -> Dict[str, Any]:
    import numpy as np
    import mxnet as mx
    import gluon_amp as amp
    zoo.input_shapes = tiny_shapes  # build_fp32 reads the module's
    try:
        mx.random.seed(0)
        net, shape = zoo.build_fp32(name)
    except Exception as exc:  # noqa: BLE001
        return {"model": name, "status": "skipped", "why": zoo.first_line(exc)}
    finally:
        zoo.input_shapes = _SWEEP_SHAPES
    x = mx.nd.array(np.random.default_rng(0).uniform(-1, 1, size=shape))
    ref = _floats(net(x))
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            low = amp.convert_hybrid_block(net)
            got = _floats(low(x))
    except Exception as exc:  # noqa: BLE001
        return {"model": name, "status": "fail", "shape": shape, "why": zoo.first_line(exc)}
    rec: Dict[str, Any] = {"model": name, "status": "ok", "shape": shape,
                           "seconds": round(time.perf_counter() - start, 2),
                           "target": low.amp_result.policy.target_dtype if low.amp_result.policy.enabled else "float32",
                           "fused": low.fuse_backend, "fallbacks": list(getattr(low, "amp_fallbacks", ()))}
    if [r.shape for r in ref] != [g.shape for g in got]:
        rec.update(status="fail",
                   why=f"output shapes {[g.shape for g in got]} differ from FP32's {[r.shape for r in ref]}")
        return rec
    rels = [float(np.abs(g - r).max() / max(float(np.abs(r).max()), 1e-30)) for r, g in zip(ref, got) if r.size]
    rec["rel"] = max(rels) if rels else 0.0
    rec["nonfinite"] = bool(any(not np.isfinite(g).all() and np.isfinite(r).all() for r, g in zip(ref, got)))
    return rec


def worker(models: Sequence[str], state: str) -> None:
    zoo.block_network()
    for name in models:
        _append(state, {"model": name, "begin": True})
        _append(state, run_one(name))
        import gc
        import mxnet as mx
        mx.nd.waitall()
        gc.collect()


def _append(path: str, rec: Dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_state(path: str) -> Tuple[Dict[str, Dict[str, Any]], Optional[str]]:
    """Finished records by model, and the model begun last without a record (if any)."""
    done: Dict[str, Dict[str, Any]] = {}
    begun: Optional[str] = None
    if os.path.exists(path):
        for line in open(path):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("begin"):
                begun = rec["model"]
            else:
                done[rec["model"]] = rec
                if begun == rec["model"]:
                    begun = None
    return done, begun


def orchestrate(models: Sequence[str], state: str, timeout: float, script: Optional[str] = None,
                extra: Sequence[str] = ()) -> Dict[str, Dict[str, Any]]:
    """Run ``script --worker MODELS --state STATE EXTRA...`` (this file by default) until every
    model has a record, restarting after a crash or a stall of ``timeout`` seconds."""
    while True:
        done, _ = read_state(state)
        todo = [m for m in models if m not in done]
        if not todo:
            return {m: done[m] for m in models}
        cmd = [sys.executable, script or os.path.abspath(__file__), "--worker", ",".join(todo),
               "--state", state, *extra]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
        err = open(state + ".stderr", "w")  # a file, not a pipe: MXNet's warnings would fill it and block
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        size, last = -1, time.time()
        while proc.poll() is None:
            time.sleep(2)
            now = os.path.getsize(state) if os.path.exists(state) else 0
            if now != size:
                size, last = now, time.time()
            elif time.time() - last > timeout:
                proc.kill()
                proc.wait()
                _, begun = read_state(state)
                if begun:
                    _append(state, {"model": begun, "status": "timeout", "why": f"no progress in {timeout:.0f} s"})
                break
        else:
            _, begun = read_state(state)
            if begun:
                err.close()
                lines = [ln for ln in open(state + ".stderr").read().strip().splitlines() if ln.strip()]
                tail = lines[-1:] or [f"exit {proc.returncode}"]
                _append(state, {"model": begun, "status": "crash", "why": tail[0][:300]})
            elif proc.returncode:
                raise SystemExit(f"worker failed before any network: exit {proc.returncode}")


def summary(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    by: Dict[str, int] = {}
    for r in results.values():
        by[r["status"]] = by.get(r["status"], 0) + 1
    ok = [r for r in results.values() if r["status"] == "ok"]
    return {"counts": by, "fallbacks": sorted(m for m, r in results.items() if r.get("fallbacks")),
            "rel_over_0.05": sorted(m for m, r in results.items() if r.get("rel", 0) > 0.05),
            "nonfinite": sorted(m for m, r in results.items() if r.get("nonfinite")),
            "targets": sorted({r.get("target") for r in ok}),
            "failures": {m: r["why"] for m, r in results.items() if r["status"] in ("fail", "crash", "timeout")}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all")
    ap.add_argument("--state", default="/tmp/zoo_default_convert.jsonl")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker.split(","), args.state)
        return 0
    models = [m for m in zoo.select_models(args.models) if not m.startswith(zoo.VISION)]
    results = orchestrate(models, args.state, args.timeout)
    out = {"summary": summary(results), "results": results}
    print(json.dumps(out["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
