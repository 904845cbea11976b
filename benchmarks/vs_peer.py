"""gluon-amp against the peer (``mxnet.contrib.amp``) and FP32, each variant in a process of its own.

    PYTHONPATH=. python benchmarks/vs_peer.py --rounds 2 [--rows infer:resnet50,train:bert] [--json out.json]
    PYTHONPATH=. python benchmarks/vs_peer.py --quick --rounds 1 --rows infer:resnet50   # seconds, for the tests

Rows (random weights, nothing is downloaded; GluonCV / GluonNLP models with ``pretrained=False``):

* ``infer:*``: converted inference, batch ``--batch`` (8): ``resnet50`` (GluonCV ``resnet50_v1``),
  ``inceptionv3`` (299x299), ``mobilenetv3`` (``mobilenetv3_large``), ``bert`` (a BERT-base encoder,
  GluonNLP ``BERTEncoder``, 12 layers of 768, sequence 128). Each variant as a user runs it: FP32 the
  block hybridized with ``static_alloc``/``static_shape``; ``ours``
  ``gluon_amp.convert_hybrid_block(net, target_dtype='bfloat16')`` called as returned (its defaults:
  fused on a CPU); ``peer`` ``mxnet.contrib.amp.convert_hybrid_block(net, target_dtype='bfloat16',
  ctx=mx.cpu())`` called as returned. Timed: one forward between two ``waitall``.
* ``train:*``: training under ``init``: ``ssd512`` (``benchmarks/ssd_synthetic.py``'s modes: FP32,
  ``gluon_amp`` and ``mxnet-contrib``, batch ``--ssd-batch``), ``bert`` (the BERT-base encoder with
  an L2 head, SGD, batch 8, sequence 128), ``rnn`` (a GluonTS DeepAR-style 2-layer LSTM of 40 cells
  with a dense head, batch 32, 72 steps). ``ours``: ``gluon_amp.init('bfloat16')`` before the
  build, ``init_trainer``, ``scale_loss``; ``peer``: the same three calls of ``mxnet.contrib.amp``.
  Timed: one forward, backward and update.
* ``launcher:wavenet``: ``benchmarks/_vs_peer_script.py``, a plain MXNet training script (a
  GluonTS WaveNet-style stack of dilated ``Conv1D``), run unmodified: FP32 ``python SCRIPT``,
  ``ours`` ``python -m gluon_amp.run SCRIPT`` (the launcher's defaults), ``peer`` the script
  after ``mxnet.contrib.amp.init(target_dtype='bfloat16')`` (the peer has no launcher: this is the
  one line a user would add).

Each round runs every row's variants in fresh processes, the variant order rotating between
rounds, so that load on a shared machine hits them alike; ratios are taken within a round,
then the median over rounds. Each process times at least ``--iters`` calls (inference),
``--train-iters`` steps (training) or ``--launcher-iters`` steps (the launcher), and goes on
until its timed calls add up to ``--min-seconds`` (3): with 3 steps of a few milliseconds, one
process's median moved with whatever else the host ran. ``--pin 0`` runs every process on one
CPU, for a VM whose vCPUs run at two speeds. Per variant: median milliseconds per
call, the process's peak RSS (``VmHWM``), and for the low-precision variants
``gluon_amp.report``'s ops per dtype and casts per low-precision op of the graph that ran. A
variant that fails says why; the others carry on. On a host without bfloat16 kernels (AVX2 and
below) the variants that need them say "not measurable here" and why, instead of failing:
there, the rows that run are FP32 and the launcher's default.
The targets (issue 48): ours at least 1.0x the peer on every row, at least 0.97x FP32.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("fp32", "ours", "peer")
INFER = ("infer:resnet50", "infer:inceptionv3", "infer:mobilenetv3", "infer:bert")
TRAIN = ("train:ssd512", "train:bert", "train:rnn")
LAUNCH = ("launcher:wavenet",)
ROWS = INFER + TRAIN + LAUNCH
MARK = "VS_PEER_RESULT "
TARGET_VS_PEER, TARGET_VS_FP32 = 1.0, 0.97


# ---------------------------------------------------------------- worker side (one variant)

def _bert_encoder(mx: Any, quick: bool) -> Any:
    from gluonnlp.model.bert import BERTEncoder

    class Encoder(mx.gluon.HybridBlock):
        """BERT-base's encoder stack on embedded inputs ``(batch, seq, 768)``, every position valid."""

        def __init__(self) -> None:
            super().__init__()
            with self.name_scope():
                self.enc = BERTEncoder(num_layers=2 if quick else 12, units=768, hidden_size=3072,
                                       num_heads=12, max_length=512, dropout=0.0)

        def hybrid_forward(self, F: Any, x: Any) -> Any:
            out = self.enc(x)
            return out[0] if isinstance(out, (list, tuple)) else out

    return Encoder()


def _infer_inputs(mx: Any, row: str, batch: int, quick: bool) -> List[Any]:
    if row == "infer:bert":
        seq = 16 if quick else 128
        return [mx.nd.random.uniform(-1, 1, shape=(batch, seq, 768))]
    size = {"infer:inceptionv3": 299}.get(row, 64 if quick else 224)
    return [mx.nd.random.uniform(-1, 1, shape=(batch, 3, size, size))]


def _infer_net(mx: Any, row: str, quick: bool) -> Any:
    if row == "infer:bert":
        return _bert_encoder(mx, quick)
    from gluoncv.model_zoo import get_model
    name = {"infer:resnet50": "resnet50_v1", "infer:inceptionv3": "inceptionv3",
            "infer:mobilenetv3": "mobilenetv3_large"}[row]
    return get_model(name, pretrained=False)


def _graph_figures(gluon_amp: Any, block: Any) -> Dict[str, Any]:
    """Ops per dtype and casts per low-precision op of the graph ``block`` runs."""
    try:
        r = gluon_amp.report(block)
    except Exception as e:  # noqa: BLE001 -- a figure we cannot read is reported, not fatal
        return {"report_error": f"{type(e).__name__}: {e}"}
    return {"ops_by_dtype": r.totals_by_dtype, "casts": r.casts, "casts_per_low_op": r.casts_per_low_op}


#: The most timed calls a process makes, whatever ``--min-seconds`` asks.
MAX_CALLS = 2000


def enough(ms: List[float], iters: int, min_seconds: float) -> bool:
    """True once ``ms`` (timed calls, milliseconds) holds ``iters`` calls and ``min_seconds`` in
    all, or ``MAX_CALLS``: a row of 8 ms steps gets hundreds, not 3 (its median was noise)."""
    return len(ms) >= MAX_CALLS or (len(ms) >= iters and sum(ms) >= 1e3 * min_seconds)


def _time_calls(mx: Any, call: Any, warmup: int, iters: int, min_seconds: float = 0.0) -> List[float]:
    for _ in range(warmup):
        call()
    mx.nd.waitall()
    out: List[float] = []
    while not enough(out, iters, min_seconds):
        t0 = time.perf_counter()
        call()
        mx.nd.waitall()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_infer(row: str, variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    import warnings
    import gluon_amp
    import mxnet as mx
    warnings.simplefilter("ignore")
    mx.random.seed(0)
    net = _infer_net(mx, row, args.quick)
    net.initialize(mx.init.Xavier())
    xs = _infer_inputs(mx, row, args.batch, args.quick)
    net.hybridize(static_alloc=True, static_shape=True)
    net(*xs)
    mx.nd.waitall()
    res: Dict[str, Any] = {}
    t0 = time.perf_counter()
    if variant == "fp32":
        block = net
    elif variant == "ours":
        block = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")
    else:
        from mxnet.contrib.amp import amp as peer
        block = peer.convert_hybrid_block(net, target_dtype="bfloat16", ctx=mx.cpu())
    block(*xs)
    mx.nd.waitall()
    res["convert_and_first_call_s"] = round(time.perf_counter() - t0, 2)
    res["ms"] = _time_calls(mx, lambda: block(*xs), args.warmup, args.iters, args.min_seconds)
    if variant != "fp32":
        res.update(_graph_figures(gluon_amp, block))
    return res


def _train_net(mx: Any, row: str, quick: bool) -> Any:
    if row == "train:bert":
        enc = _bert_encoder(mx, quick)
        return enc
    net = mx.gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(mx.gluon.rnn.LSTM(40, num_layers=2, layout="NTC"))
        net.add(mx.gluon.nn.Dense(1, flatten=False))
    return net


def run_train(row: str, variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    import warnings
    import gluon_amp
    import mxnet as mx
    from mxnet import autograd, gluon
    warnings.simplefilter("ignore")
    res: Dict[str, Any] = {}
    if row == "train:ssd512":
        sys.path.insert(0, HERE)
        from ssd_synthetic import Mode, SyntheticData
        name = {"fp32": "fp32", "ours": "gluon_amp", "peer": "mxnet-contrib"}[variant]
        batch = SyntheticData(args.ssd_batch, mx.cpu(), 0)
        mode = Mode(name, mx.cpu(), batch, 0, None if variant == "fp32" else "bfloat16")
        for _ in range(args.warmup):
            mode.step()
        ms: List[float] = []
        while not enough(ms, args.train_iters, args.min_seconds):
            ms.append(mode.step() * 1e3)
        res["ms"] = ms
        if variant != "fp32":
            res.update(_graph_figures(gluon_amp, mode.net))
        return res
    peer = None
    if variant == "ours":
        gluon_amp.init("bfloat16")
    elif variant == "peer":
        from mxnet.contrib import amp as peer
        peer.init(target_dtype="bfloat16")
    mx.random.seed(0)
    net = _train_net(mx, row, args.quick)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    if row == "train:bert":
        seq = 16 if args.quick else 128
        xs = [mx.nd.random.uniform(-1, 1, shape=(8, seq, 768))]
        target = mx.nd.random.uniform(-1, 1, shape=(8, seq, 768))
    else:
        xs = [mx.nd.random.uniform(-1, 1, shape=(32, 72, 4))]
        target = mx.nd.random.uniform(-1, 1, shape=(32, 72, 1))
    loss_fn = gluon.loss.L2Loss()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-3, "momentum": 0.9},
                            update_on_kvstore=False)
    if variant == "ours":
        gluon_amp.init_trainer(trainer)
    elif peer is not None:
        peer.init_trainer(trainer)

    def step() -> None:
        with autograd.record():
            loss = loss_fn(net(*xs), target)
            if variant == "ours":
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            elif peer is not None:
                with peer.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        trainer.step(xs[0].shape[0])

    step()
    res["ms"] = _time_calls(mx, step, args.warmup, args.train_iters, args.min_seconds)
    if variant != "fp32":
        res.update(_graph_figures(gluon_amp, net))
    return res


def launcher_command(variant: str, args: argparse.Namespace) -> List[str]:
    """The command that runs the unmodified script as ``variant``."""
    script = [os.path.join(HERE, "_vs_peer_script.py"), "--iters", str(args.launcher_iters),
              "--warmup", str(args.warmup), "--min-seconds", str(args.min_seconds)]
    script += ["--quick"] if args.quick else []
    if variant == "fp32":
        return [sys.executable] + script
    if variant == "ours":
        return [sys.executable, "-m", "gluon_amp.run"] + script
    # _numpy_shim first, as the script itself does: MXNet 1.9.1 reads numpy aliases gone since 1.24
    peer = ("import _numpy_shim, runpy, sys; from mxnet.contrib import amp; amp.init(target_dtype='bfloat16'); "
            f"sys.argv = {script!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", peer]


#: How a run that needs bfloat16 kernels fails where there are none: gluon_amp's refusal (it
#: names emulate=True) and oneDNN's, through the peer.
NO_KERNEL_ERRORS = ("CannotRun", "could not create a primitive descriptor iterator")


def worker(row: str, variant: str, args: argparse.Namespace) -> None:
    try:
        res = run_infer(row, variant, args) if row in INFER else run_train(row, variant, args)
    except Exception as exc:  # noqa: BLE001  classified below, else raised as it was
        from gluon_amp import runtime
        from gluon_amp_core.capability import Bf16
        cap = runtime.capability()
        text = f"{type(exc).__name__}: {exc}"
        if cap.bf16 is not Bf16.NONE or not any(e in text for e in NO_KERNEL_ERRORS):
            raise
        print(MARK + json.dumps({"not_here": f"needs bfloat16 kernels, which this host lacks ({cap.why})"}),
              flush=True)
        return
    from _report import own_peak_rss_mb  # benchmarks/ is on sys.path when run as a script
    res["peak_rss_mb"] = round(own_peak_rss_mb(), 1)
    res["cpus"] = sorted(os.sched_getaffinity(0))
    print(MARK + json.dumps(res), flush=True)


# ---------------------------------------------------------------- driver side

def _env() -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}


def run_variant(row: str, variant: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One variant of one row in a fresh process: its figures, or ``error``."""
    if row in LAUNCH:
        cmd = launcher_command(variant, args)
    else:
        cmd = ([sys.executable, os.path.abspath(__file__), "--worker", row, variant, "--batch", str(args.batch),
                "--ssd-batch", str(args.ssd_batch), "--iters", str(args.iters), "--train-iters",
                str(args.train_iters), "--warmup", str(args.warmup), "--min-seconds", str(args.min_seconds)]
               + (["--quick"] if args.quick else []))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_env(), cwd=ROOT,
                           preexec_fn=(lambda: os.sched_setaffinity(0, args.pin)) if args.pin else None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    wall = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        tail = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
        where = [ln.strip() for ln in tail if ln.strip().startswith("File ")]  # the innermost frame
        return {"error": f"exit {p.returncode}: " + (tail[-1][:300] if tail else "no output")
                + (f" (at {where[-1][:200]})" if where else ""), "wall_s": wall}
    res = json.loads(lines[-1][len(MARK):])
    res["wall_s"] = wall
    if "not_here" in res:
        return {"error": res["not_here"], "not_here": True, "wall_s": wall}
    return res


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(rounds: List[Dict[str, Dict[str, Any]]], rows: List[str]) -> Dict[str, Any]:
    """Per row and variant: median ms over rounds (each round's own median), peak RSS, graph
    figures; ratios (speed: the other's time over ours) per round, then their median."""
    out: Dict[str, Any] = {}
    for row in rows:
        per: Dict[str, Any] = {}
        for v in VARIANTS:
            runs = [r[row][v] for r in rounds if row in r and v in r[row]]
            ok = [x for x in runs if "error" not in x]
            errors = sorted({x["error"] for x in runs if "error" in x})
            med = [statistics.median(x["ms"]) for x in ok if x.get("ms")]
            d: Dict[str, Any] = {"ms": round(_median(med), 1) if med else None,
                                 "ms_per_round": [round(m, 1) for m in med],
                                 "peak_rss_mb": max((x["peak_rss_mb"] for x in ok), default=None)}
            if errors:
                d["errors"] = errors
            last = ok[-1] if ok else {}
            for k in ("ops_by_dtype", "casts", "casts_per_low_op", "report_error", "convert_and_first_call_s"):
                if k in last:
                    d[k] = last[k]
            per[v] = d
        ratios: Dict[str, Optional[float]] = {}
        for other in ("peer", "fp32"):
            rs = []
            for r in rounds:
                a, b = r.get(row, {}).get("ours", {}), r.get(row, {}).get(other, {})
                if a.get("ms") and b.get("ms") and "error" not in a and "error" not in b:
                    rs.append(statistics.median(b["ms"]) / statistics.median(a["ms"]))
            ratios[f"ours_vs_{other}"] = round(_median(rs), 3) if rs else None
        p, f = per["peer"].get("peak_rss_mb"), per["fp32"].get("peak_rss_mb")
        ratios["peer_vs_fp32"] = (round(per["fp32"]["ms"] / per["peer"]["ms"], 3)
                                  if per["fp32"]["ms"] and per["peer"]["ms"] else None)
        ratios["ours_memory_vs_fp32"] = (round(per["ours"]["peak_rss_mb"] / f, 3)
                                         if f and per["ours"].get("peak_rss_mb") else None)
        ratios["peer_memory_vs_fp32"] = round(p / f, 3) if p and f else None
        vp, vf = ratios["ours_vs_peer"], ratios["ours_vs_fp32"]
        met = {"vs_peer": None if vp is None else vp >= TARGET_VS_PEER,
               "vs_fp32": None if vf is None else vf >= TARGET_VS_FP32}
        out[row] = {"variants": per, "ratios": ratios, "target_met": met}
    return out


def format_table(doc: Dict[str, Any]) -> str:
    from _report import threads_text  # benchmarks/ is on sys.path when run as a script
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    head = (f"{'row':<19}{'fp32 ms':>9}{'ours ms':>9}{'peer ms':>9}{'ours/peer':>10}{'ours/fp32':>10}"
            f"{'peer/fp32':>10}{'mem ours':>9}{'mem peer':>9}{'casts/low ours':>15}{'peer':>6}")
    lines = [f"vs_peer: {doc['rounds']} round(s), each variant in its own process; speed ratios = other's "
             "time / ours (>1: ours faster), per round then median; mem = peak RSS / FP32's", head, "-" * len(head)]
    for row, r in doc["rows"].items():
        v, q = r["variants"], r["ratios"]
        ms = "".join(f"{f(v[n]['ms'], '.1f'):>9}" for n in VARIANTS)
        speed = "".join(f"{f(q[k], '.2f'):>10}" for k in ("ours_vs_peer", "ours_vs_fp32", "peer_vs_fp32"))
        mem = "".join(f"{f(q[k], '.2f'):>9}" for k in ("ours_memory_vs_fp32", "peer_memory_vs_fp32"))
        casts = f"{f(v['ours'].get('casts_per_low_op'), '.3f'):>15}{f(v['peer'].get('casts_per_low_op'), '.3f'):>6}"
        lines.append(f"{row:<19}{ms}{speed}{mem}{casts}")
        for name in VARIANTS:
            for e in v[name].get("errors", []):
                said = "not measurable here" if e.startswith("needs bfloat16 kernels") else "FAILED"
                lines.append(f"{'':<19}{name} {said}: {e}")
    h = doc["host"]
    pin = doc["args"].get("pin")
    lines.append(f"host: flags {' '.join(h['flags'])}, {h['cpus']} CPUs"
                 + (f" (every process pinned to CPU {','.join(map(str, pin))})" if pin else "")
                 + f", {threads_text(h)}, load average "
                 f"{doc['load_before']} "
                 f"before, {doc['load_after']} after; {doc['total_s']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of every row's variants (default 2)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    p.add_argument("--batch", type=int, default=8, help="inference batch (default 8)")
    p.add_argument("--ssd-batch", type=int, default=2, help="SSD-512 training batch (default 2)")
    p.add_argument("--iters", type=int, default=10, help="timed inference calls per process (default 10)")
    p.add_argument("--train-iters", type=int, default=3, help="timed training steps per process (default 3)")
    p.add_argument("--launcher-iters", type=int, default=8,
                   help="timed training steps per process of the launcher row (default 8)")
    p.add_argument("--min-seconds", type=float, default=3.0,
                   help="time each process at least this long in all, beyond its --iters / --train-iters / "
                        f"--launcher-iters (at most {MAX_CALLS} calls; default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (64x64 images, 2 BERT layers, batch 1): "
                   "checks the machinery, not the speed")
    p.add_argument("--pin", metavar="CPUS", default="",
                   help="run every variant's process on these CPUs only (comma-separated, e.g. 0): on a VM "
                        "whose vCPUs run at two speeds, each variant then meets the same one")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per process (default 1200)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON document here")
    p.add_argument("--worker", nargs=2, metavar=("ROW", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        p.error(f"--rows: unknown {bad}; choose from {','.join(ROWS)}")
    if min(args.rounds, args.batch, args.ssd_batch, args.iters, args.train_iters, args.launcher_iters) < 1 \
            or args.warmup < 0 or not args.min_seconds >= 0:
        p.error("--rounds, --batch, --ssd-batch, --iters, --train-iters and --launcher-iters must be >= 1, "
                "--warmup and --min-seconds >= 0")
    args.rows = rows
    try:
        args.pin = sorted({int(c) for c in args.pin.split(",") if c.strip()})
    except ValueError:
        p.error(f"--pin: {args.pin!r} is not a comma-separated list of CPU numbers (e.g. 0 or 0,1)")
    allowed = sorted(os.sched_getaffinity(0))
    if any(c not in allowed for c in args.pin):
        p.error(f"--pin: CPUs {args.pin} are not all among this process's CPUs {allowed}")
    if args.quick:
        args.batch, args.ssd_batch = 1, 1
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], args)
        return {}
    sys.path.insert(0, HERE)
    from _report import emit, host_info
    t0 = time.perf_counter()
    load_before = round(os.getloadavg()[0], 2)
    rounds: List[Dict[str, Dict[str, Any]]] = []
    for k in range(args.rounds):
        order = VARIANTS[k % 3:] + VARIANTS[:k % 3]  # rotate, so no variant always runs first
        this: Dict[str, Dict[str, Any]] = {}
        for row in args.rows:
            this[row] = {}
            for v in order:
                this[row][v] = run_variant(row, v, args)
                print(f"round {k + 1} {row} {v}: " + (this[row][v].get("error") or
                      f"{statistics.median(this[row][v]['ms']):.1f} ms"), file=sys.stderr, flush=True)
        rounds.append(this)
    doc = {"rounds": args.rounds, "host": host_info(), "load_before": load_before,
           "load_after": round(os.getloadavg()[0], 2), "args": {k: v for k, v in vars(args).items() if k != "worker"},
           "rows": summarize(rounds, args.rows), "raw": rounds, "total_s": round(time.perf_counter() - t0, 1)}
    emit(doc, format_table(doc), args.json)
    return doc


if __name__ == "__main__":
    main()
