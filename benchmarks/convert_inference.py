"""Inference throughput of models converted to bfloat16 for deployment: FP32 vs ours vs peer.

For each model (random weights, nothing is downloaded) this builds the FP32 network on
``mx.cpu()``, hybridizes it (``static_alloc=True, static_shape=True``) and runs it once,
then, in the same process, converts it two ways:

* ``fp32``: the original hybridized block.
* ``ours``: ``gluon_amp.convert_hybrid_block(net, 'bfloat16', cast_optional_params=True,
  fuse=False)``: the plain mixed-precision graph.
* ``fused``: the same call with the default ``fuse`` (on a CPU: MXNet's oneDNN subgraph
  backend, conv+BN+ReLU+sum, with batch norm folded into the weights in float32 first).
* ``peer``: ``mxnet.contrib.amp.amp.convert_hybrid_block(net, target_dtype='bfloat16',
  ctx=mx.cpu(), cast_optional_params=True)`` (the peer's ``amp.init()`` is NOT called: it
  is not needed for conversion and would patch MXNet globally).

Each converted block is hybridized the same way as the FP32 one. Models:

* ``resnet50``: ``mxnet.gluon.model_zoo.vision.get_model('resnet50_v1')``, input
  (``--batch-resnet``, 3, 224, 224); numerics: relative L2 error of the logits vs FP32
  and the fraction of images whose argmax agrees with FP32.
* ``ssd512``: GluonCV ``ssd_512_resnet50_v1_coco`` (``pretrained_base=False``, plain
  ``BatchNorm``), input (``--batch-ssd``, 3, 512, 512), predict mode (plain forward
  returning ids, scores, boxes); numerics: relative L2 error of the scores output
  (index 1) vs FP32 and whether every output is finite.

Conv/dense weights are re-initialised with He-normal values from a fixed seed, and every
BatchNorm's running statistics are set from one training-mode forward on (up to 4 images
of) the benchmark input, so the random network behaves like a trained one numerically
(unit-scale activations, unsaturated SSD scores, finite boxes). SSD's scores come out
sorted per image, so the scores error compares the k-th best detection of each variant
(robust to NMS reordering).

After ``--warmup`` untimed rounds, ``--iters`` timed rounds run the three variants
interleaved (fp32, ours, peer, fp32, ...) to spread drift on a noisy machine evenly; each
forward is timed between two ``mx.nd.waitall()``. Median seconds per batch and images/s
are reported, with the speedups ours/fp32, peer/fp32 and ours/peer (throughput ratios). A
variant that fails to convert or run is recorded with its error and the others carry on.
The targets from the issue are SSD-512 with gluon_amp's default (fused on a CPU) >=
``TARGET_SSD_SPEEDUP`` x FP32 and ResNet-50 unfused ("ours", the peer's graph) no slower
than the peer. ``gluon_amp.runtime_info()`` is included (AMX or not). The
report is printed as JSON, then as a table.

Run::

    PYTHONPATH=. python benchmarks/convert_inference.py [--models resnet50,ssd512]
        [--batch-resnet 32] [--batch-ssd 4] [--iters N] [--warmup 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Tuple

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)
from gluon_amp_core.dtypes import dtype_name  # noqa: E402  (pure: no MXNet)

from _report import emit  # benchmarks/ is on sys.path when run as a script

MODELS = ("resnet50", "ssd512")
VARIANTS = ("fp32", "ours", "fused", "peer")
DEFAULT_ITERS = {"resnet50": 10, "ssd512": 5}
TARGET_SSD_SPEEDUP = 3.0
NOISE_TOL = 0.01  # "no slower" allows this much relative timing noise
OUT_INDEX = {"resnet50": 0, "ssd512": 1}  # the output compared: logits / scores


def _calibrate_batchnorm(mx: Any, net: Any, x: Any) -> int:
    """Set every BatchNorm's running mean/var to the per-channel statistics of its input in
    one training-mode forward on ``x[:4]``, as a trained network's would be; returns how many
    BatchNorms were set. Works on the hybridized net's cached graph, so it also reaches the
    BatchNorms inside SSD's symbolic feature extractor. In training mode every BatchNorm
    normalises with its batch statistics, so all of them can be read from one pass. Without
    this the random network's BatchNorms (mean 0, var 1) do not normalise, activations blow
    up through 50 residual layers and SSD's outputs saturate (all scores 1.0, inf boxes),
    which would make the numerics comparison meaningless."""
    from mxnet import autograd
    inputs, sym = net._cached_graph
    nodes = json.loads(sym.tojson())["nodes"]
    internals = sym.get_internals()
    names = set(internals.list_outputs())
    params = {p.name: p for p in net.collect_params().values()}
    taps, stats = [], []
    for node in nodes:
        if node["op"] != "BatchNorm":
            continue
        src, idx = nodes[node["inputs"][0][0]], node["inputs"][0][1]
        out = src["name"] if src["op"] == "null" else f"{src['name']}_output"
        if out not in names:
            out = f"{src['name']}_output{idx}"
        taps.append(internals[out])
        stats.append(tuple(nodes[i[0]]["name"] for i in node["inputs"][3:5]))
    probe = mx.gluon.SymbolBlock(mx.sym.Group(taps), inputs, params=net.collect_params())
    with autograd.train_mode():
        acts = _outputs(probe(x[:4]))  # up to 4 images are enough for the statistics
    for act, (mean_name, var_name) in zip(acts, stats):
        params[mean_name].set_data(act.mean(axis=(0, 2, 3)))
        params[var_name].set_data(((act - act.mean(axis=(0, 2, 3), keepdims=True)) ** 2)
                                  .mean(axis=(0, 2, 3)))
    mx.nd.waitall()
    return len(taps)


def build_model(mx: Any, model: str, batch: int) -> Tuple[Any, Any]:
    """The FP32 block, hybridized and run once (so it has a cached graph), and its input."""
    import numpy as np
    mx.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model == "resnet50":
            net = mx.gluon.model_zoo.vision.get_model("resnet50_v1")
            shape = (batch, 3, 224, 224)
        else:
            from gluoncv.model_zoo import get_model
            net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False,
                            norm_layer=mx.gluon.nn.BatchNorm)
            shape = (batch, 3, 512, 512)
        net.initialize(ctx=mx.cpu())
        x = mx.nd.random.uniform(-1, 1, shape=shape, ctx=mx.cpu())
        net(x)  # imperative; completes deferred initialisation, so every shape is known
        # He init of every conv/dense weight, from a fixed seed.
        rng = np.random.RandomState(0)
        params = net.collect_params()
        for name in sorted(params):
            p = params[name]
            if name.endswith("weight") and len(p.shape) >= 2:
                std = (2.0 / float(np.prod(p.shape[1:]))) ** 0.5
                p.set_data(mx.nd.array(rng.normal(0.0, std, p.shape), ctx=mx.cpu(), dtype=p.dtype))
        net.hybridize(static_alloc=True, static_shape=True)
        net(x)
        _calibrate_batchnorm(mx, net, x)
        net(x)
    mx.nd.waitall()
    return net, x


def convert(mx: Any, variant: str, net: Any, x: Any) -> Any:
    """The ``variant`` block, hybridized and run once."""
    if variant == "fp32":
        return net
    if variant in ("ours", "fused"):
        import gluon_amp
        fuse = None if variant == "fused" else False  # None: the default, fused on a CPU
        block = gluon_amp.convert_hybrid_block(net, "bfloat16", cast_optional_params=True, fuse=fuse)
    else:
        from mxnet.contrib.amp import amp as peer_amp
        block = peer_amp.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu(),
                                              cast_optional_params=True)
    block.hybridize(static_alloc=True, static_shape=True)
    block(x)
    mx.nd.waitall()
    return block


def _to_numpy(mx: Any, out: Any) -> Any:
    import numpy as np
    if dtype_name(out.dtype) != "float32":
        out = mx.nd.amp_cast(out, dtype="float32")
    return out.asnumpy().astype(np.float64)


def _outputs(out: Any) -> List[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _rel_l2(a: Any, b: Any) -> float:
    import numpy as np
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def numerics(mx: Any, model: str, ref: List[Any], out: List[Any]) -> Tuple[Dict[str, Any], List[Any]]:
    """Compare one variant's outputs with FP32's (``ref`` already float64 numpy); also
    returns the variant's outputs as float64 numpy."""
    import numpy as np
    got = [_to_numpy(mx, o) for o in out]
    res: Dict[str, Any] = {"out_dtypes": [dtype_name(o.dtype) for o in out],
                           "all_finite": bool(all(np.isfinite(g).all() for g in got))}
    idx = OUT_INDEX[model]
    a, b = got[idx], ref[idx]
    res["rel_l2_err"] = _rel_l2(a, b)
    if model == "resnet50":
        res["argmax_agree"] = float((a.argmax(axis=1) == b.argmax(axis=1)).mean())
    else:
        res["max_abs_err"] = float(np.abs(a - b).max())
    return res, got


def _time_interleaved(mx: Any, blocks: Dict[str, Any], x: Any, warmup: int, iters: int,
                      errors: Dict[str, str]) -> Dict[str, List[float]]:
    """Seconds per batch for each variant; a variant that raises is dropped (error kept)."""
    samples: Dict[str, List[float]] = {v: [] for v in blocks}
    for i in range(warmup + iters):
        for v, block in blocks.items():
            if v in errors:
                continue
            try:
                mx.nd.waitall()
                t0 = time.perf_counter()
                block(x)
                mx.nd.waitall()
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 -- report, keep the other variants going
                errors[v] = f"run: {type(e).__name__}: {e}"
                continue
            if i >= warmup:
                samples[v].append(dt)
    return samples


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def bench_model(mx: Any, model: str, batch: int, warmup: int, iters: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    net, x = build_model(mx, model, batch)
    rep: Dict[str, Any] = {"batch": batch, "input_shape": list(x.shape), "warmup": warmup,
                           "iters": iters, "build_s": round(time.perf_counter() - t0, 2)}
    ref = [_to_numpy(mx, o) for o in _outputs(net(x))]
    # Sensitivity floor: FP32 net on the input merely rounded to bfloat16. A random network
    # is far more sensitive than a trained one, so the variants' errors are read against it.
    import numpy as np
    bf16 = np.dtype([("bfloat16", np.uint16)])  # MXNet's bfloat16 (a string is not accepted)
    xq = mx.nd.amp_cast(mx.nd.amp_cast(x, dtype=bf16), dtype="float32")
    idx = OUT_INDEX[model]
    rep["fp32_bf16_input_rel_err"] = _rel_l2(_to_numpy(mx, _outputs(net(xq))[idx]), ref[idx])
    got: Dict[str, List[Any]] = {}
    blocks: Dict[str, Any] = {}
    errors: Dict[str, str] = {}
    convert_s: Dict[str, float] = {}
    for v in VARIANTS:
        t1 = time.perf_counter()
        try:
            blocks[v] = convert(mx, v, net, x)
        except Exception as e:  # noqa: BLE001
            errors[v] = f"convert: {type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        if v != "fp32":
            convert_s[v] = round(time.perf_counter() - t1, 2)
    samples = _time_interleaved(mx, blocks, x, warmup, iters, errors)

    variants: Dict[str, Any] = {}
    for v in VARIANTS:
        r: Dict[str, Any] = {"ok": v not in errors}
        if v in errors:
            r["error"] = errors[v]
        if v in convert_s:
            r["convert_and_first_run_s"] = convert_s[v]
        s = samples.get(v) or []
        if s and v not in errors:
            med = statistics.median(s)
            r.update({"median_s_per_batch": round(med, 4), "min_s_per_batch": round(min(s), 4),
                      "images_per_s": round(batch / med, 2),
                      "samples_s": [round(t, 4) for t in s]})
        if v != "fp32" and v in blocks and v not in errors:
            try:
                r["numerics"], got[v] = numerics(mx, model, ref, _outputs(blocks[v](x)))
            except Exception as e:  # noqa: BLE001
                r["numerics_error"] = f"{type(e).__name__}: {e}"
        variants[v] = r
    rep["variants"] = variants
    rep["ours_vs_peer_rel_err"] = (_rel_l2(got["ours"][idx], got["peer"][idx])
                                   if "ours" in got and "peer" in got else None)
    ips = {v: variants[v].get("images_per_s") for v in VARIANTS}
    rep["speedup"] = {"ours_over_fp32": _ratio(ips.get("ours"), ips["fp32"]),
                      "fused_over_fp32": _ratio(ips.get("fused"), ips["fp32"]),
                      "peer_over_fp32": _ratio(ips.get("peer"), ips["fp32"]),
                      "ours_over_peer": _ratio(ips.get("ours"), ips.get("peer"))}
    if model == "ssd512":  # what a user gets: the default, fused on a CPU
        sp = rep["speedup"]["fused_over_fp32"]
        rep["target"] = {"desc": f"gluon_amp's default (fused) >= {TARGET_SSD_SPEEDUP:g}x fp32",
                         "met": None if sp is None else sp >= TARGET_SSD_SPEEDUP}
    else:
        o, p = (variants.get(v, {}).get("median_s_per_batch") for v in ("ours", "peer"))
        rep["target"] = {"desc": f"ours no slower than peer (within {NOISE_TOL:.0%} timing noise)",
                         "met": None if not (o and p) else o <= p * (1 + NOISE_TOL)}
    del net, blocks
    mx.nd.waitall()
    return rep


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import gluon_amp  # first: enables AMX (if any) before MXNet builds oneDNN primitives
    import mxnet as mx

    batches = {"resnet50": args.batch_resnet, "ssd512": args.batch_ssd}
    t0 = time.perf_counter()
    models: Dict[str, Any] = {}
    for m in args.models:
        iters = args.iters if args.iters is not None else DEFAULT_ITERS[m]
        try:
            models[m] = bench_model(mx, m, batches[m], args.warmup, iters)
        except Exception as e:  # noqa: BLE001 -- e.g. the FP32 build itself failed
            traceback.print_exc()
            models[m] = {"error": f"{type(e).__name__}: {e}"}
    return {"context": "cpu(0)", "target_dtype": "bfloat16", "cast_optional_params": True,
            "statistic": "median", "runtime_info": gluon_amp.runtime_info(),
            "models": models, "total_s": round(time.perf_counter() - t0, 1)}


def format_table(rep: Dict[str, Any]) -> str:
    def f(v: Optional[float], fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    head = (f"{'model':<10}{'variant':<8}{'s/batch':>9}{'img/s':>9}{'x fp32':>8}"
            f"{'rel err':>10}{'argmax':>8}{'finite':>8}{'out dtype':>11}")
    lines = [f"bfloat16 inference, {rep['context']}, median over timed iters (interleaved "
             f"fp32/ours/peer); rel err = rel L2 vs fp32 (resnet50: logits, ssd512: scores)",
             head, "-" * len(head)]
    for m, r in rep["models"].items():
        if "error" in r:
            lines.append(f"{m:<10}FAILED: {r['error']}")
            continue
        for v in VARIANTS:
            d = r["variants"][v]
            if not d["ok"]:
                lines.append(f"{m:<10}{v:<8}FAILED: {d['error']}")
                continue
            n = d.get("numerics", {})
            sp = 1.0 if v == "fp32" else r["speedup"][f"{v}_over_fp32"]
            agree = n.get("argmax_agree")
            fin = n.get("all_finite")
            lines.append(
                f"{m:<10}{v:<8}{f(d.get('median_s_per_batch'), '.3f'):>9}{f(d.get('images_per_s')):>9}"
                f"{f(sp):>8}{f(n.get('rel_l2_err'), '.2e') if n else '-':>10}"
                f"{f(agree, '.3f') if agree is not None else '-':>8}"
                f"{('yes' if fin else 'NO') if fin is not None else '-':>8}"
                f"{','.join(sorted(set(n.get('out_dtypes', [])))) or '-':>11}")
        s = r["speedup"]
        t = r["target"]
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        x = {k: "n/a" if v is None else f"{v:.2f}x" for k, v in s.items()}
        lines.append(f"{'':<10}batch {r['batch']}, {r['iters']} iters; ours/fp32 {x['ours_over_fp32']}, "
                     f"fused/fp32 {x['fused_over_fp32']}, "
                     f"peer/fp32 {x['peer_over_fp32']}, ours/peer {x['ours_over_peer']}; "
                     f"target {t['desc']}: {met}")
        lines.append(f"{'':<10}rel err ours vs peer {f(r['ours_vs_peer_rel_err'], '.2e')}; "
                     f"fp32 on bf16-rounded input vs fp32 {f(r['fp32_bf16_input_rel_err'], '.2e')} "
                     f"(sensitivity floor of this random net)")
    ri = rep["runtime_info"]
    lines.append(f"runtime: mxnet {ri['mxnet']}, oneDNN {ri['onednn']}, bf16 ISA {ri['bf16_isa']} "
                 f"(avx512_bf16 {ri['cpu_avx512_bf16']}, amx_bf16 {ri['cpu_amx_bf16']}); "
                 f"total {rep['total_s']:.0f} s")
    speed = ri.get("speed", {})
    if "speedup" in speed:
        lines.append(f"gluon_amp speed probe ({speed['source']}): bfloat16 estimated {speed['speedup']:.2f}x float32 ("
                     + ", ".join(f"{o['label']} {o['low_ms']:.1f} vs {o['fp32_ms']:.1f} ms" for o in speed["items"])
                     + f"); target_dtype=None picks {speed['decision']}"
                     + ("" if speed["decision"] != "float32" else
                        ": these bfloat16 rows are what an explicit target_dtype='bfloat16' gives here"))
    else:
        lines.append(f"gluon_amp speed probe {speed.get('source', 'not run')}; target_dtype=None picks "
                     f"{ri['default_target_dtype']}")
    if not ri["amx_permission"]:
        lines.append("note: no AMX on this machine, so the issue's 'with AMX' comparison cannot be "
                     "made here; these figures are AVX512-BF16 (or emulated) only.")
    return "\n".join(lines)


def _models(s: str) -> List[str]:
    ms = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in ms if m not in MODELS]
    if bad or not ms:
        raise argparse.ArgumentTypeError(f"unknown model(s) {bad}; choose from {','.join(MODELS)}")
    return ms


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=_models, default=list(MODELS),
                    help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--batch-resnet", type=int, default=32, help="ResNet-50 batch size")
    ap.add_argument("--batch-ssd", type=int, default=4, help="SSD-512 batch size")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed rounds per model (default: resnet50 %d, ssd512 %d)"
                         % (DEFAULT_ITERS["resnet50"], DEFAULT_ITERS["ssd512"]))
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.batch_resnet < 1 or args.batch_ssd < 1 or args.warmup < 0 or (
            args.iters is not None and args.iters < 1):
        ap.error("batch sizes and --iters must be >= 1, --warmup >= 0")
    global VARIANTS
    import gluon_amp
    res = gluon_amp.runtime.resolve("bfloat16", warn=False)
    not_run = None
    if not res.executable:
        not_run = f"AMP was not run (FP32 only): {res.warning}"
        print(not_run)
        VARIANTS = ("fp32",)
    rep = run(args)
    rep["amp_not_run"] = not_run
    emit(rep, format_table(rep) + (f"\n{not_run}" if not_run else ""), args.json)


if __name__ == "__main__":
    main()
