"""Graph-level mixed-precision sweep over the GluonCV and Gluon model zoos: ours vs the peer.

For every network of ``gluoncv.model_zoo.get_model_list()`` and of
``mxnet.gluon.model_zoo.vision`` (prefixed ``vision:``) that builds offline with random
weights (``pretrained=False``, ``pretrained_base=False``; sockets are blocked and
``MXNET_HOME`` points to a temporary directory, so any download attempt fails the build),
and for each target dtype, four cells are measured:

* ``convert_symbol``: the hybridized FP32 graph, converted; the result must type-check
  with float32 data (``infer_type``).
* ``convert_model``: with the FP32 parameters and ``cast_optional_params=True``; the
  result must type-check with the returned parameters' dtypes.
* ``convert_hybrid_block``: the returned block's parameters must have the dtypes its
  graph infers for them.
* ``init``: the training graph, i.e. the net built and traced (``net(mx.sym.var('data'))``)
  under AMP (ours: ``with gluon_amp.autocast(dtype)``; the peer: ``amp.init(dtype)``, one
  process per dtype since it cannot be undone); it must type-check with float32 data.

Nothing runs in low precision: the FP32 net runs one forward on a small input (to create
the parameters and the cached graph), everything else is type inference. Each cell records
ok/fail (the first line of the error), the cast nodes (``amp_cast``/``amp_multicast``) and
the op nodes with a low-precision output. Networks that do not build or run in FP32 are
listed as skipped with the reason.

Every implementation runs in its own worker processes (the peer never shares a process
with gluon_amp). Pre-quantized ``*_int8`` networks get workers of their own with
``GLUON_AMP_DISABLE_AMX=1``: importing gluon_amp lets oneDNN use AMX, and MXNet 1.9.1's
oneDNN 2.4.4 segfaults running GluonCV's int8 pose networks with AMX (reproduced without
gluon_amp: the AMX permission and ``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX`` are enough). Workers append one
JSON line per network to ``--state`` (default
``/tmp/model_zoo_sweep.jsonl``), so an interrupted sweep resumes where it stopped; a
worker that crashes or stalls for ``--timeout`` seconds is restarted after the network it
was on, which is recorded as failed.

Run::

    PYTHONPATH=. python benchmarks/model_zoo_sweep.py [--models resnet18_v1,yolo3 | all]
        [--dtypes float16,bfloat16] [--jobs 2] [--no-peer | --peer-only] [--redo] [--json out.json]
        [--state s.jsonl]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import _numpy_shim  # noqa: F401  first: numpy aliases MXNet needs (benchmarks/ is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DTYPES = ("float16", "bfloat16")
CELLS = ("convert_symbol", "convert_model", "convert_hybrid_block", "init")
IMPLS = ("ours", "peer")
VISION = "vision:"
Shape = Tuple[int, ...]


# ---------------------------------------------------------------- offline guard

def block_network() -> str:
    """Point MXNet/GluonCV homes at a temp dir and make any socket connection raise."""
    home = tempfile.mkdtemp(prefix="zoo_sweep_home_")
    os.environ["MXNET_HOME"] = home
    os.environ["GLUON_MODEL_LOCK_TIMEOUT"] = "1"  # GluonCV waits 300 s on a model file lock

    def refuse(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("download attempted (network is blocked in the sweep)")

    socket.socket.connect = refuse  # type: ignore[assignment]
    socket.create_connection = refuse  # type: ignore[assignment]
    return home


# ---------------------------------------------------------------- model list

def vision_names() -> List[str]:
    """Names ``mxnet.gluon.model_zoo.vision.get_model`` accepts (read from its table)."""
    from mxnet.gluon.model_zoo import vision
    src = inspect.getsource(vision.get_model)
    return sorted(set(re.findall(r"'([a-z0-9_.]+)'\s*:", src)))


def all_models() -> List[str]:
    import gluoncv
    return list(gluoncv.model_zoo.get_model_list()) + [VISION + n for n in vision_names()]


def select_models(spec: Optional[str]) -> List[str]:
    """``None``/'all': everything; else comma-separated exact names or substrings."""
    models = all_models()
    if not spec or spec == "all":
        return models
    out: List[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        hits = [m for m in models if m == part] or [m for m in models if part in m]
        if not hits:
            raise SystemExit(f"--models: {part!r} matches no network; e.g. {models[:5]}")
        out += [h for h in hits if h not in out]
    return out


# ---------------------------------------------------------------- building

def input_shapes(name: str) -> List[Shape]:
    """Candidate input shapes, smallest first; the first that runs in FP32 is used."""
    n = name.split(":")[-1]
    if n.startswith("cifar"):
        return [(1, 3, 32, 32)]
    if n.startswith(("c3d", "p3d", "r2plus1d")):
        return [(1, 3, 16, 112, 112)]
    if n.startswith("i3d"):
        return [(1, 3, 8, 112, 112), (1, 3, 32, 224, 224)]
    if n.startswith("slowfast"):
        return [(1, 3, 36, 112, 112), (1, 3, 36, 224, 224), (1, 3, 40, 224, 224)]
    if "pose" in n and not n.startswith("monodepth"):
        return [(1, 3, 256, 192)]
    if n.startswith("monodepth2"):
        return [(1, 6, 192, 640)] if "posenet" in n else [(1, 3, 192, 640)]
    if n.startswith("ssd_300"):
        return [(1, 3, 300, 300)]
    if n.startswith("ssd_512"):
        return [(1, 3, 320, 320), (1, 3, 512, 512)]
    if n.startswith(("yolo3", "center_net", "faster_rcnn", "mask_rcnn", "doublehead", "custom_")):
        return [(1, 3, 320, 320), (1, 3, 512, 512)]
    if n.startswith(("fcn", "psp", "deeplab", "danet", "icnet", "fastscnn")):
        return [(1, 3, 256, 256), (1, 3, 480, 480), (1, 3, 1024, 2048)]
    if n.startswith("siamrpn"):
        return [(1, 3, 127, 127)]
    if "inception" in n:
        return [(1, 3, 299, 299)]
    if n == "nasnet_6_4032":
        return [(1, 3, 331, 331)]
    return [(1, 3, 224, 224)]


def construct(name: str) -> Any:
    """The FP32 network with random weights (not initialized yet); never downloads.

    Offline keywords are passed where the zoo function takes them: ``pretrained_base=False``,
    ``use_kinetics_pretrain=False`` (action-recognition fine-tunes), and two dummy
    ``classes`` for the ``*_custom`` detectors.
    """
    if name.startswith(VISION):
        from mxnet.gluon.model_zoo import vision
        return vision.get_model(name[len(VISION):], pretrained=False)
    from gluoncv.model_zoo import model_zoo
    fn = model_zoo._models[name.lower()]
    params = inspect.signature(fn).parameters
    kwargs: Dict[str, Any] = {"pretrained": False}
    for key, value in (("pretrained_base", False), ("use_kinetics_pretrain", False),
                       ("classes", ["a", "b"])):
        if key in params:
            kwargs[key] = value
    if "classes" in kwargs and params["classes"].default is not inspect.Parameter.empty:
        del kwargs["classes"]
    if "pretrained_base" not in kwargs and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        try:  # e.g. fcn_resnet50_voc(**kwargs) hands it on to the class
            return fn(pretrained_base=False, **kwargs)
        except (TypeError, Warning) as exc:  # darknet53 raises Warning for unknown kwargs
            if "pretrained_base" not in str(exc) and "kwargs" not in str(exc):
                raise
    return fn(**kwargs)


def _quiet() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def build_fp32(name: str) -> Tuple[Any, Shape]:
    """Construct, initialize, hybridize and run the net once in FP32; return (net, shape)."""
    import mxnet as mx
    errors = []
    for shape in input_shapes(name):
        with _quiet():
            net = construct(name)
            net.initialize(mx.init.Uniform(0.05), force_reinit=True)  # any shape, incl. 1-D "weight"s
            net.hybridize()
            try:
                out = net(mx.nd.random.uniform(shape=shape))
                mx.nd.waitall()
                del out
                return net, shape
            except Exception as exc:  # try the next candidate size
                errors.append(f"{shape}: {first_line(exc)}")
                del net
                gc.collect()
    raise RuntimeError("FP32 forward failed for every input shape: " + "; ".join(errors))


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [s for s in text.splitlines() if s.strip() and not s.startswith(("Stack trace", "  File"))]
    if lines and lines[0].endswith("Traceback (most recent call last):"):  # MXNet's C++ trace
        lines = [f"{type(exc).__name__}: {s}" for s in lines[1:] if "Check failed" in s or "Error" in s] or lines
    return (lines[0] if lines else type(exc).__name__)[:300]


# ---------------------------------------------------------------- graph metrics

def dtype_str(t: Any) -> str:
    import numpy as np
    if isinstance(t, np.dtype) and t.names == ("bfloat16",):
        return "bfloat16"
    return np.dtype(t).name


def graph_counts(sym: Any, input_types: Dict[str, Any], target: str) -> Dict[str, int]:
    """Type-check ``sym`` (raises if it does not) and count casts and low-precision ops."""
    internals = sym.get_internals()
    inputs = set(internals.list_inputs())
    given = {k: v for k, v in input_types.items() if k in inputs}
    _, types, _ = internals.infer_type(**given)
    if types is None or any(t is None for t in types):
        raise RuntimeError("the graph does not type-check (infer_type left outputs untyped)")
    by_node: Dict[str, List[str]] = {}
    for out_name, t in zip(internals.list_outputs(), types):
        m = re.match(r"^(.*)_output\d*$", out_name)
        if m:
            by_node.setdefault(m.group(1), []).append(dtype_str(t))
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    casts = lp = ops = 0
    for node in nodes:
        op = node["op"]
        if op == "null":
            continue
        if op in ("amp_cast", "amp_multicast"):
            casts += 1
            continue
        ops += 1
        lp += target in by_node.get(node["name"], ())
    return {"casts": casts, "lp_ops": lp, "ops": ops}


def fp32_graph(net: Any) -> Tuple[Any, List[str], Dict[str, Any], Dict[str, Any]]:
    """(symbol, data names, arg_params, aux_params) of a hybridized net that ran once."""
    inputs, sym = net._cached_graph
    params = {p.name: p.data() for p in net.collect_params().values()}
    args = {n: params[n] for n in sym.list_arguments() if n in params}
    aux = {n: params[n] for n in sym.list_auxiliary_states() if n in params}
    return sym, [i.name for i in inputs], args, aux


def _types(names: Iterable[str], params: Dict[str, Any]) -> Dict[str, Any]:
    import numpy as np
    return {**{n: np.float32 for n in names}, **{k: v.dtype for k, v in params.items()}}


def block_check(block: Any, data_names: Sequence[str], target: str) -> Dict[str, int]:
    """The converted block's parameter dtypes must be what its own graph infers for them."""
    import numpy as np
    sym = block._cached_graph[1] if getattr(block, "_cached_graph", ()) else None
    if sym is None:
        sym = block(*[__import__("mxnet").sym.var(n) for n in data_names])
    internals = sym.get_internals()
    arg_t, _, aux_t = internals.infer_type(**{n: np.float32 for n in data_names})
    if arg_t is None:
        raise RuntimeError("the converted block's graph does not type-check")
    want = dict(zip(internals.list_arguments(), arg_t))
    want.update(zip(internals.list_auxiliary_states(), aux_t))
    for p in block.collect_params().values():
        have, need = dtype_str(p.data().dtype), dtype_str(want.get(p.name, p.data().dtype))
        if have != need:
            raise RuntimeError(f"parameter {p.name} is stored as {have} but the graph reads it as {need}")
    return graph_counts(sym, _types(data_names, {p.name: p.data() for p in block.collect_params().values()}),
                        target)


# ---------------------------------------------------------------- one implementation's cells

def cell(fn: Callable[[], Dict[str, int]]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    try:
        with _quiet():
            res = fn()
        return {"ok": True, **res, "sec": round(time.perf_counter() - t0, 2)}
    except Exception as exc:
        return {"ok": False, "error": first_line(exc), "sec": round(time.perf_counter() - t0, 2)}


def converter_cells(api: Any, net: Any, dtype: str, peer: bool) -> Dict[str, Dict[str, Any]]:
    """convert_symbol / convert_model / convert_hybrid_block through ``api`` (ours or the peer)."""
    import mxnet as mx
    sym, data, args, aux = fp32_graph(net)

    def c_symbol():
        out = api.convert_symbol(sym, target_dtype=dtype, data_names=list(data))
        return graph_counts(out, _types(data, {}), dtype)

    def c_model():
        a = {k: v.copy() for k, v in args.items()}  # the peer writes into the dicts
        x = {k: v.copy() for k, v in aux.items()}
        out, a2, x2 = api.convert_model(sym, a, x, target_dtype=dtype, cast_optional_params=True)
        return graph_counts(out, _types(data, {**a2, **x2}), dtype)

    def c_block():
        extra = {"ctx": mx.cpu()} if peer else {}  # the peer's default is gpu(0)
        out = api.convert_hybrid_block(net, target_dtype=dtype, **extra)
        return block_check(out, data, dtype)

    return {"convert_symbol": cell(c_symbol), "convert_model": cell(c_model),
            "convert_hybrid_block": cell(c_block)}


def trace_training_graph(name: str, shape: Shape, dtype: str) -> Dict[str, int]:
    """Build the net under AMP (already on) and type-check its traced training graph."""
    import mxnet as mx
    import numpy as np
    net = construct(name)
    out = net(mx.sym.var("data"))
    sym = mx.sym.Group(list(out)) if isinstance(out, (list, tuple)) else out
    return graph_counts(sym, {"data": np.float32}, dtype)


def ours_cells(name: str, dtypes: Sequence[str], built: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """Every cell for gluon_amp: {'shape', 'cells': {dtype: {cell: result}}} or {'skip': why}.

    ``built`` is called once the FP32 network ran (the worker logs it: a crash before that
    means the network does not build, after it that a conversion crashed).
    """
    import gluon_amp
    try:
        net, shape = build_fp32(name)
    except Exception as exc:
        return {"skip": first_line(exc)}
    built()
    cells = {}
    for dtype in dtypes:
        cells[dtype] = converter_cells(gluon_amp, net, dtype, peer=False)

        def under_init(dtype: str = dtype) -> Dict[str, int]:
            with gluon_amp.autocast(dtype):
                return trace_training_graph(name, shape, dtype)

        cells[dtype]["init"] = cell(under_init)
    del net
    gc.collect()
    return {"shape": list(shape), "cells": cells}


def peer_convert_cells(name: str, dtypes: Sequence[str], built: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    from mxnet.contrib import amp
    try:
        net, shape = build_fp32(name)
    except Exception as exc:
        return {"skip": first_line(exc)}
    built()
    cells = {d: converter_cells(amp, net, d, peer=True) for d in dtypes}
    del net
    gc.collect()
    return {"shape": list(shape), "cells": cells}


def peer_init_cells(name: str, dtype: str) -> Dict[str, Any]:
    """The peer's training graph; ``amp.init(dtype)`` was called once for this process."""
    shape = input_shapes(name)[0]
    res = cell(lambda: trace_training_graph(name, shape, dtype))
    gc.collect()
    return {"cells": {dtype: {"init": res}}}


# ---------------------------------------------------------------- workers

def worker(kind: str, models: Sequence[str], dtypes: Sequence[str], state: str) -> None:
    """Process ``models`` one at a time, appending one JSON line each to ``state``."""
    block_network()
    if kind.startswith("peer-init-"):
        from mxnet.contrib import amp
        with _quiet():
            amp.init(target_dtype=kind[len("peer-init-"):])
    for name in models:
        _append(state, {"kind": kind, "model": name, "status": "started"})
        built = lambda name=name: _append(state, {"kind": kind, "model": name, "status": "built"})  # noqa: E731
        t0 = time.perf_counter()
        try:
            if kind == "ours":
                res = ours_cells(name, dtypes, built)
            elif kind == "peer-convert":
                res = peer_convert_cells(name, dtypes, built)
            else:
                res = peer_init_cells(name, kind[len("peer-init-"):])
        except Exception as exc:  # a bug in the sweep itself: record and go on
            res = {"error": first_line(exc), "trace": traceback.format_exc()[-800:]}
        _append(state, {"kind": kind, "model": name, "status": "done",
                        "sec": round(time.perf_counter() - t0, 1), **res})


def _append(path: str, rec: Dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()


def read_state(path: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """(kind, model) -> last record; 'started' without 'done' means it crashed there."""
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[(rec["kind"], rec["model"])] = rec
    return out


def forget(path: str, models: set, kinds: set) -> None:
    """Drop the records of ``models`` x ``kinds`` from the state file."""
    if not os.path.exists(path):
        return
    with open(path) as fh:
        keep = [line for line in fh if not _matches(line, models, kinds)]
    with open(path, "w") as fh:
        fh.writelines(keep)


def _matches(line: str, models: set, kinds: set) -> bool:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return True
    return rec.get("model") in models and rec.get("kind") in kinds


def worker_kinds(dtypes: Sequence[str], peer: bool, ours: bool = True) -> List[str]:
    return (["ours"] if ours else []) + (["peer-convert"] + [f"peer-init-{d}" for d in dtypes] if peer else [])


def orchestrate(models: Sequence[str], dtypes: Sequence[str], peer: bool, jobs: int, state: str,
                timeout: float, ours: bool = True) -> None:
    """Run worker processes (``jobs`` at a time) until every (kind, model) is done."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    pending: List[Tuple[str, List[str]]] = []
    for kind in worker_kinds(dtypes, peer, ours):
        todo = [m for m in models if read_state(state).get((kind, m), {}).get("status") != "done"]
        if kind == "ours":  # int8 networks run with AMX off (see the module docstring)
            pending += [(kind, [m]) for m in todo if m.endswith("_int8")]
            todo = [m for m in todo if not m.endswith("_int8")]
        per = max(1, -(-len(todo) // max(1, jobs if kind in ("ours", "peer-convert") else 1)))
        pending += [(kind, todo[i:i + per]) for i in range(0, len(todo), per)]
    running: List[Tuple[subprocess.Popen, str, List[str], float, int]] = []
    while pending or running:
        while pending and len(running) < jobs:
            kind, chunk = pending.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--models", ",".join(chunk),
                   "--dtypes", ",".join(dtypes), "--state", state]
            amx_off = {"GLUON_AMP_DISABLE_AMX": "1"} if all(m.endswith("_int8") for m in chunk) else {}
            proc = subprocess.Popen(cmd, env={**env, **amx_off}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            running.append((proc, kind, chunk, time.time(), _size(state)))
        time.sleep(2)
        for item in list(running):
            proc, kind, chunk, since, size = item
            now_size = _size(state)
            if now_size != size:
                running[running.index(item)] = item = (proc, kind, chunk, time.time(), now_size)
            stalled = time.time() - item[3] > timeout
            if proc.poll() is None and not stalled:
                continue
            if stalled:
                proc.kill()
                proc.wait()
            running.remove(item)
            _recover(state, kind, chunk, "stalled" if stalled else f"worker exit {proc.returncode}", pending)


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _recover(state: str, kind: str, chunk: List[str], why: str, pending: list) -> None:
    """Mark the network a dead worker was on as failed; requeue the rest of its chunk."""
    recs = read_state(state)
    left = [m for m in chunk if recs.get((kind, m), {}).get("status") != "done"]
    if not left:
        return
    status = recs.get((kind, left[0]), {}).get("status")
    if status == "started" and kind in ("ours", "peer-convert"):
        _append(state, {"kind": kind, "model": left[0], "status": "done",
                        "skip": f"the process died building the FP32 network ({why})"})
        left = left[1:]
    elif status in ("started", "built"):
        _append(state, {"kind": kind, "model": left[0], "status": "done",
                        "error": f"the process died converting this network ({why})"})
        left = left[1:]
    if left:
        pending.append((kind, left))


# ---------------------------------------------------------------- report

def collect(models: Sequence[str], dtypes: Sequence[str], peer: bool, state: str) -> Dict[str, Any]:
    """Merge the worker records into {model: {'ours': {dtype: {cell: ...}}, 'peer': ...}}."""
    recs = read_state(state)
    out: Dict[str, Any] = {}
    for m in models:
        ours = recs.get(("ours", m), {})
        row: Dict[str, Any] = {"shape": ours.get("shape")}
        if "skip" in ours:
            row["skip"] = ours["skip"]
        row["ours"] = _impl_cells(ours, dtypes, CELLS)
        if peer:
            conv = recs.get(("peer-convert", m), {})
            cells = _impl_cells(conv, dtypes, CELLS[:3])
            for d in dtypes:
                cells[d].update(_impl_cells(recs.get((f"peer-init-{d}", m), {}), [d], ("init",))[d])
            row["peer"] = cells
        out[m] = row
    return out


def _impl_cells(rec: Dict[str, Any], dtypes: Sequence[str], names: Sequence[str]) -> Dict[str, Dict]:
    if not rec or rec.get("status") != "done":
        why = "not run"
    else:
        why = rec.get("skip") and f"skipped: {rec['skip']}" or rec.get("error")
    cells = rec.get("cells", {}) if rec else {}
    return {d: {c: cells.get(d, {}).get(c) or {"ok": False, "error": why or "missing"} for c in names}
            for d in dtypes}


def totals(results: Dict[str, Any], dtypes: Sequence[str], peer: bool) -> Dict[str, Any]:
    """ok counts per (impl, dtype, cell) over the networks that build in FP32."""
    built = [m for m, r in results.items() if "skip" not in r]
    out: Dict[str, Any] = {"networks": len(results), "built": len(built),
                           "skipped": len(results) - len(built)}
    for impl in IMPLS if peer else IMPLS[:1]:
        for d in dtypes:
            for c in CELLS:
                ok = sum(1 for m in built if results[m][impl][d][c].get("ok"))
                out[f"{impl}/{d}/{c}"] = f"{ok}/{len(built)}"
    return out


def table(results: Dict[str, Any], dtypes: Sequence[str], peer: bool) -> str:
    short = {"convert_symbol": "sym", "convert_model": "model", "convert_hybrid_block": "block", "init": "init"}
    head = ["network"] + [f"{i}:{d[:4]}:{short[c]}" for d in dtypes for c in CELLS
                          for i in (IMPLS if peer else IMPLS[:1])]
    lines = ["\t".join(head)]
    for m, r in results.items():
        if "skip" in r:
            lines.append(f"{m}\tSKIP {r['skip'][:120]}")
            continue
        row = [m]
        for d in dtypes:
            for c in CELLS:
                for i in IMPLS if peer else IMPLS[:1]:
                    x = r[i][d][c]
                    row.append(f"ok {x.get('casts')}c/{x.get('lp_ops')}lp" if x.get("ok") else "FAIL")
        lines.append("\t".join(row))
    fails = [f"{m} {i} {d} {c}: {r[i][d][c].get('error')}" for m, r in results.items() if "skip" not in r
             for i in (IMPLS if peer else IMPLS[:1]) for d in dtypes for c in CELLS
             if not r[i][d][c].get("ok")]
    return "\n".join(lines + ["", "failures:"] + fails)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "gluon_amp"], capture_output=True,
                               text=True).stdout.strip()
        return head + ("+dirty gluon_amp" if dirty else "")
    except OSError:
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="comma list of names or substrings, or 'all'")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-only", action="store_true",
                    help="run only the peer's workers (e.g. into another --state, concatenated later)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--state", default="/tmp/model_zoo_sweep.jsonl")
    ap.add_argument("--timeout", type=float, default=900, help="seconds without progress before a worker is killed")
    ap.add_argument("--redo", action="store_true", help="forget earlier results of the selected networks")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"--dtypes: {bad} not in {DTYPES}")
    if a.worker:
        worker(a.worker, a.models.split(","), dtypes, a.state)
        return 0
    models = select_models(a.models)
    if a.redo:
        forget(a.state, set(models), set(worker_kinds(dtypes, not a.no_peer, not a.peer_only)))
    orchestrate(models, dtypes, not a.no_peer, a.jobs, a.state, a.timeout, ours=not a.peer_only)
    results = collect(models, dtypes, not a.no_peer, a.state)
    report = {"commit": _commit(), "dtypes": dtypes, "peer": not a.no_peer,
              "totals": totals(results, dtypes, not a.no_peer),
              "networks": results}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
    print(table(results, dtypes, not a.no_peer))
    print()
    print(json.dumps(report["totals"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
