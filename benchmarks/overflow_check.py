"""Time of one per-step gradient overflow check on the SSD-512 gradient set, ours vs peer.

Builds GluonCV's ``ssd_512_resnet50_v1_coco`` (``pretrained_base=False``, plain
``BatchNorm``; nothing is downloaded), initialises it on ``mx.cpu()`` and runs one
forward + backward on a random (1, 3, 512, 512) input (loss = sum of cls_preds + box_preds),
so every parameter has a materialised gradient. Then, in the same process, it times one
inf/NaN check over all those gradients, including the single host sync:

* ``ours``: ``gluon_amp.training.overflow.all_finite(params)`` (CPU float32/float16 gradients read in
  place by NumPy, one pass split across the cores); returns True when everything is finite.
* ``numpy``: one single-threaded NumPy read pass (``sum``) over copies of the same values,
  the yardstick: ours / numpy <= 1.0 is the goal.
* ``peer``: ``mxnet.contrib.amp.loss_scaler.LossScaler().has_overflow(params)``
  (``multi_all_finite`` in chunks of 200, one ``asnumpy``); returns True on overflow. It
  also updates its own loss-scale state each call, which does not affect the timing.

Each check is warmed up (``--warmup`` calls), then called ``--repeats`` times with
``mx.nd.waitall()`` before each timed call; median and min ms per check are reported,
plus speedup = peer / ours (medians). Correctness is checked both ways: with all-finite
gradients neither reports an overflow, and after writing a NaN into the last parameter's
gradient (and, separately, an inf into the first's) both must report one. The target is
ours <= ``TARGET_MS`` per check. The report is printed as JSON, then as a table.

Run::

    PYTHONPATH=. python benchmarks/overflow_check.py [--repeats 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
from _report import emit  # benchmarks/ is on sys.path when run as a script

TARGET_MS = 50.0
LIBS = ("ours", "peer")


def build_ssd(mx: Any) -> Any:
    """SSD-512 ResNet50 with random weights and materialised gradients (one fwd+bwd)."""
    from mxnet import autograd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from gluoncv.model_zoo import get_model
        net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False,
                        norm_layer=mx.gluon.nn.BatchNorm)
        net.initialize(ctx=mx.cpu())
        x = mx.nd.random.uniform(shape=(1, 3, 512, 512), ctx=mx.cpu())
        with autograd.record():
            cls_preds, box_preds, _anchors = net(x)
            loss = cls_preds.sum() + box_preds.sum()
        loss.backward()
    mx.nd.waitall()
    return net


def _time(mx: Any, fn: Callable[[], Any], warmup: int, repeats: int) -> List[float]:
    """ms per call, one sample per call; the queue is drained before each timed call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        mx.nd.waitall()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def _set_one(mx: Any, grad: Any, flat_index: int, value: float) -> float:
    """Write ``value`` into one element of ``grad`` (in place); return the old value."""
    arr = grad.asnumpy()
    old = float(arr.flat[flat_index])
    arr.flat[flat_index] = value
    grad[:] = mx.nd.array(arr, ctx=grad.context, dtype=grad.dtype)
    mx.nd.waitall()
    return old


def check_correctness(mx: Any, params: List[Any], ours: Callable[[], bool],
                      peer: Callable[[], bool]) -> Dict[str, Any]:
    """Overflow verdicts (True = overflow detected) for clean grads and two injections."""
    def verdicts() -> Dict[str, bool]:
        return {"ours": not ours(), "peer": bool(peer())}

    res: Dict[str, Any] = {"clean": verdicts()}
    with_grad = [p for p in params if p.grad_req != "null"]
    for case, p, idx, val in (("nan_in_last_param", with_grad[-1], -1, float("nan")),
                              ("inf_in_first_param", with_grad[0], 0, float("inf"))):
        g = p.list_grad()[0]
        old = _set_one(mx, g, idx, val)
        res[case] = {"param": p.name, **verdicts()}
        _set_one(mx, g, idx, old)
    res["restored_clean"] = verdicts()
    expected = {"clean": False, "nan_in_last_param": True, "inf_in_first_param": True,
                "restored_clean": False}
    res["ok"] = {lib: all(res[c][lib] == e for c, e in expected.items()) for lib in LIBS}
    res["all_ok"] = all(res["ok"].values())
    return res


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import mxnet as mx
    from gluon_amp.training import overflow
    from mxnet.contrib.amp.loss_scaler import LossScaler as PeerScaler

    t0 = time.perf_counter()
    net = build_ssd(mx)
    build_s = time.perf_counter() - t0
    params = list(net.collect_params().values())
    with_grad = [p for p in params if p.grad_req != "null"]
    n_elems = sum(g.size for p in with_grad for g in p.list_grad())

    scaler = PeerScaler()
    fns: Dict[str, Callable[[], bool]] = {
        "ours": lambda: overflow.all_finite(params),
        "peer": lambda: scaler.has_overflow(params),
    }
    correctness = check_correctness(mx, params, fns["ours"], fns["peer"])

    import numpy as np
    host = [g.asnumpy() for p in with_grad for g in p.list_grad()]  # copies, made before timing
    fns["numpy"] = lambda: all(np.isfinite(a.sum()) for a in host)  # one single-threaded read pass
    timings: Dict[str, Any] = {}
    for lib in (*LIBS, "numpy"):
        s = _time(mx, fns[lib], args.warmup, args.repeats)
        timings[lib] = {"median_ms": round(statistics.median(s), 3), "min_ms": round(min(s), 3),
                        "samples_ms": [round(v, 3) for v in s]}
    ours_med = timings["ours"]["median_ms"]
    return {
        "model": "ssd_512_resnet50_v1_coco", "context": "cpu(0)",
        "build_and_backward_s": round(build_s, 2),
        "num_params": len(params), "num_grad_arrays": len(with_grad),
        "num_grad_elements": int(n_elems),
        "warmup": args.warmup, "repeats": args.repeats, "statistic": "median",
        "timings": timings,
        "speedup_peer_over_ours": round(timings["peer"]["median_ms"] / ours_med, 3),
        "speedup_peer_over_ours_min": round(timings["peer"]["min_ms"] / timings["ours"]["min_ms"], 3),
        "target_ms": TARGET_MS, "meets_target": ours_med <= TARGET_MS,
        "ratio_ours_over_numpy_pass": round(ours_med / timings["numpy"]["median_ms"], 3),
        "load_average": os.getloadavg()[0],
        "correctness": correctness,
    }


def format_table(rep: Dict[str, Any]) -> str:
    head = f"{'lib':<6}{'median ms':>11}{'min ms':>9}{'correct':>9}"
    lines = [f"overflow check on {rep['model']} grads: {rep['num_grad_arrays']} arrays, "
             f"{rep['num_grad_elements'] / 1e6:.1f}M elements, {rep['context']} "
             f"(median/min of {rep['repeats']} calls after {rep['warmup']} warm-up)",
             head, "-" * len(head)]
    for lib in LIBS:
        t = rep["timings"][lib]
        ok = "yes" if rep["correctness"]["ok"][lib] else "NO"
        lines.append(f"{lib:<6}{t['median_ms']:>11.2f}{t['min_ms']:>9.2f}{ok:>9}")
    t = rep["timings"]["numpy"]
    lines.append(f"{'numpy':<6}{t['median_ms']:>11.2f}{t['min_ms']:>9.2f}{'-':>9}   (one single-threaded "
                 "read pass over copies of the same values)")
    lines.append(f"ours / numpy read pass: {rep['ratio_ours_over_numpy_pass']:.2f} (goal <= 1.0); "
                 f"load average {rep['load_average']:.1f}")
    lines.append(f"speedup peer/ours: {rep['speedup_peer_over_ours']:.2f}x (median), "
                 f"{rep['speedup_peer_over_ours_min']:.2f}x (min)")
    lines.append(f"target: ours <= {rep['target_ms']:.0f} ms -> "
                 f"{'met' if rep['meets_target'] else 'NOT met'} "
                 f"({rep['timings']['ours']['median_ms']:.2f} ms)")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="timed calls; median and min reported")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    rep = run(args)
    emit(rep, format_table(rep), args.json)


if __name__ == "__main__":
    main()
