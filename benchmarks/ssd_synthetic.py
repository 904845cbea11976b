"""SSD-512 ResNet-50 training on synthetic data: FP32 against AMP, as in MXNet's AMP tutorial.

    python benchmarks/ssd_synthetic.py --amp                     # FP32 baseline and gluon_amp, interleaved
    python benchmarks/ssd_synthetic.py --amp --impl gluon_amp,mxnet-contrib
    python benchmarks/ssd_synthetic.py --amp --no-baseline --batch-size 8 --iters 50
    python benchmarks/ssd_synthetic.py --amp --untuned            # also gluon_amp with tune=False
    python benchmarks/ssd_synthetic.py --amp --no-baseline --impl gluon_amp-untuned --batch-size 8   # one mode alone
    python benchmarks/ssd_synthetic.py --opt-level O1,O2,O3   # Apex opt levels (initialize), with FP32

The workload is the tutorial's: GluonCV ``ssd_512_resnet50_v1_coco`` (``pretrained_base=False``,
nothing is downloaded), inputs uniform in (-1, 1), SSDMultiBoxLoss, SGD(lr 0.001, wd 0.0005,
momentum 0.9), ``hybridize(static_alloc=True, static_shape=True)``.

With ``--amp`` an FP32 baseline runs in the same process (``--no-baseline`` drops it); every
mode is built from the same seed and the modes take turns, one iteration each, so drift on a
busy machine hits them alike; the ratio is per-mode median throughput over FP32's.
``mxnet-contrib`` (the peer) patches MXNet for good, so it is built last. On a machine that
cannot run the target dtype usefully (no bfloat16 kernels, only emulated ones, or bfloat16
measured slower than float32 by gluon_amp's speed probe, with ``--target-dtype auto``), AMP
modes are not run: FP32 runs alone and the reason, with the probe's figures, is printed.
``--target-dtype bfloat16`` runs AMP there anyway. The ``gluon_amp`` mode is ``init()``'s
default: the graph's tuned choices where the timing cache holds them (ops kept in float32 where
the whole graph measured faster so), else the plan (tuning runs in training loops, within its
budget: docs/speed.md); ``--untuned`` adds ``gluon_amp-untuned`` (also an ``--impl``):
``init(tune=False)``, the op table's plan as it is.
stdout carries the log lines, a progress bar and the closing table; ``--json`` writes the
full document.

The loss verdict (``benchmarks/loss_match.py``) compares each AMP mode's total loss with
FP32's like with like: the first step (untimed, inside the build), where both modes have the
same initial weights; then, since every step trains on the same batch, the losses after
equal numbers of updates (up to 12), so that a step the loss scaler skipped (named, with the
scale it went to) shifts the curve instead of failing it. "NOT within 2%" means the numerics
differ.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gluon_amp  # noqa: E402  first: its numpy shim (docs/python.md) and AMX, before MXNet loads
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from _report import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from loss_match import CurveMatch, Step, match_curves  # noqa: E402  (benchmarks/ is on sys.path)

IMPLS = ("gluon_amp", "gluon_amp-untuned", "mxnet-contrib")
OPT_LEVELS = ("O0", "O1", "O2", "O3")
NUM_ANCHORS = 6132
logger = logging.getLogger("ssd_synthetic")


@dataclass
class ModeResult:
    mode: str
    target_dtype: Optional[str]
    batch_size: int
    iter_seconds: List[float] = field(default_factory=list)
    ce: List[float] = field(default_factory=list)
    smoothl1: List[float] = field(default_factory=list)
    rss_delta_mb: float = 0.0
    loss_scale: Optional[float] = None
    skipped_steps: int = 0
    build_seconds: float = 0.0
    #: every step, the untimed ones included: its loss, whether it updated, the scale after it
    history: List[Step] = field(default_factory=list)

    def summary(self) -> Dict[str, Any]:
        med = statistics.median(self.iter_seconds) if self.iter_seconds else float("nan")
        return {"mode": self.mode, "target_dtype": self.target_dtype, "batch_size": self.batch_size,
                "samples_per_sec": self.batch_size / med, "sec_per_iter": med,
                "final_ce": self.ce[-1] if self.ce else None,
                "final_smoothl1": self.smoothl1[-1] if self.smoothl1 else None,
                "rss_delta_mb": self.rss_delta_mb, "loss_scale": self.loss_scale,
                "skipped_steps": self.skipped_steps, "iters": len(self.iter_seconds)}


#: Prefix of the --emulate modes' names: ``emulated-float16``, ``emulated-bfloat16``.
EMULATED = "emulated-"
#: The gluon_amp mode with ``tune=False`` (the op table's plan, untimed).
UNTUNED = "gluon_amp-untuned"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def own_peak_rss_mb() -> float:
    """This process's own peak RSS. ``ru_maxrss`` keeps the parent's peak across exec on
    Linux; ``VmHWM`` belongs to the address space exec made."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return peak_rss_mb()


class SyntheticData:
    """The tutorial's synthetic batch, made once (seeded) and reused every iteration."""

    def __init__(self, batch_size: int, ctx: mx.Context, seed: int) -> None:
        mx.random.seed(seed)
        self.data = mx.nd.random.uniform(-1, 1, shape=(batch_size, 3, 512, 512), ctx=ctx)
        self.cls_targets = mx.nd.random.uniform(0, 1, shape=(batch_size, NUM_ANCHORS), ctx=ctx)
        self.box_targets = mx.nd.random.uniform(0, 1, shape=(batch_size, NUM_ANCHORS, 4), ctx=ctx)


class Mode:
    """One way of training (fp32, gluon_amp or the peer) with its own net and trainer."""

    def __init__(self, name: str, ctx: mx.Context, batch: SyntheticData, seed: int,
                 target_dtype: Optional[str], init_scale: Optional[float] = None) -> None:
        self.name, self.ctx, self.batch, self.target_dtype = name, ctx, batch, target_dtype
        self.result = ModeResult(name, target_dtype, batch.data.shape[0])
        self.loss_fn = None
        self.scaler = None
        self.peer = None
        self.policy = None  # the gluon_amp op policy this mode's steps run under (None: AMP off)
        self.built = False  # the first step, inside the build, runs under the build's own AMP state
        rss0, t0 = rss_mb(), time.time()
        self.emulated = name.startswith(EMULATED)
        if name in ("gluon_amp", UNTUNED) or self.emulated:
            with warnings.catch_warnings():
                # the FP32 mode's graph is cached on purpose: it must stay FP32
                warnings.filterwarnings("ignore", message=".*cached its graph before gluon_amp.init")
                with gluon_amp.autocast(target_dtype, emulate=self.emulated or None,
                                        tune=False if name == UNTUNED else None):
                    self._build(seed)
                    # its later steps run under the same policy (_use_policy): the scale a step's
                    # loss gets is decided from the policy in force, float16's only under float16
                    self.policy = gluon_amp.current_policy()
                    self.scaler = gluon_amp.init_trainer(
                        self.trainer, "dynamic" if init_scale is None else gluon_amp.LossScaler(init_scale=init_scale))
                    self.step(record=False)  # the graph is cached on the first call, with AMP on
        elif name in OPT_LEVELS:
            self._build_opt_level(seed)
        elif name == "mxnet-contrib":
            from mxnet.contrib import amp as peer
            peer.init(target_dtype=target_dtype)
            self.peer = peer
            self._build(seed)
            peer.init_trainer(self.trainer)
            self.step(record=False)
        else:
            self._build(seed)
            self.step(record=False)
        mx.nd.waitall()
        self.built = True
        self.result.build_seconds = time.time() - t0
        self.result.rss_delta_mb = rss_mb() - rss0

    def _build(self, seed: int) -> None:
        import gluoncv as gcv
        from gluoncv.model_zoo import get_model
        mx.random.seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False,
                            norm_layer=gluon.nn.BatchNorm)
            net.initialize(ctx=self.ctx)
        net.hybridize(static_alloc=True, static_shape=True)
        self.net = net
        self.trainer = gluon.Trainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.001, "wd": 0.0005, "momentum": 0.9},
                                     update_on_kvstore=False)
        self.loss_fn = gcv.loss.SSDMultiBoxLoss()

    def _build_opt_level(self, seed: int) -> None:
        gluon_amp.disable()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*cached its graph before gluon_amp.init")
            self._build(seed)
            with autograd.train_mode():  # finish deferred init: O2/O3 cast the real weights
                self.net(self.batch.data[:1])
            gluon_amp.initialize(self.net, self.trainer, self.name, target_dtype=self.target_dtype)
        self.policy = gluon_amp.current_policy()
        self.scaler = gluon_amp.get_scaler(self.trainer)
        self.step(record=False)

    def _use_policy(self) -> None:
        """Opt levels differ in op policy (O3's batch norm), and init is process-wide: switch
        to this mode's policy before its step, outside the timed region. Peer modes are left alone."""
        if not self.built or self.peer is not None or gluon_amp.current_policy() == self.policy:
            return
        gluon_amp.disable()
        if self.policy is not None:
            # the switch back repeats the build's "mixed precision on" line at every step: quiet it
            patch_log = logging.getLogger("gluon_amp.patching")
            level = patch_log.level
            patch_log.setLevel(logging.WARNING)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*cached its graph before gluon_amp.init")
                    gluon_amp.init(self.policy)
            finally:
                patch_log.setLevel(level)

    def step(self, record: bool = True) -> float:
        b = self.batch
        self._use_policy()
        t0 = time.time()
        with autograd.record():
            cls_pred, box_pred, _ = self.net(b.data)
            sum_loss, cls_loss, box_loss = self.loss_fn([cls_pred], [box_pred], [b.cls_targets], [b.box_targets])
            if self.name in ("gluon_amp", UNTUNED) or self.name in OPT_LEVELS or self.emulated:
                with gluon_amp.scale_loss(sum_loss, self.trainer) as scaled:
                    autograd.backward(scaled)
            elif self.name == "mxnet-contrib":
                with self.peer.scale_loss(sum_loss, self.trainer) as scaled:
                    autograd.backward(scaled)
            else:
                autograd.backward(sum_loss)
        self.trainer.step(1)
        ce, l1 = float(cls_loss[0].mean().asscalar()), float(box_loss[0].mean().asscalar())
        # asscalar only waits for the forward pass; without this the backward and update of
        # one mode would be charged to the next mode's iteration.
        mx.nd.waitall()
        dt = time.time() - t0
        scaler = self.scaler
        self.result.history.append(Step(ce + l1, not scaler.last_step_skipped if scaler is not None else True,
                                        scaler.loss_scale if scaler is not None else None))
        if record:
            r = self.result
            r.iter_seconds.append(dt)
            r.ce.append(ce)
            r.smoothl1.append(l1)
            if self.scaler is not None or self.peer is not None:
                # the scale the next loss is multiplied by, as both libraries' trainers answer it
                r.loss_scale = self.trainer._amp_loss_scaler.loss_scale
            if self.scaler is not None:
                r.skipped_steps = self.scaler.skipped_steps
        return dt


def resolve_ctx(arg: str) -> mx.Context:
    gpus = mx.context.num_gpus()
    if arg == "gpu" and gpus == 0:
        raise SystemExit("error: --ctx gpu, but MXNet sees no GPU (is mxnet-cu112 installed and CUDA "
                         "available?); use --ctx cpu")
    return mx.gpu(0) if (arg == "gpu" or (arg == "auto" and gpus > 0)) else mx.cpu()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--amp", action="store_true",
                   help="train with AMP, interleaved with an FP32 baseline in the same process")
    p.add_argument("--compare", action="store_true", help="same as --amp (kept for old commands)")
    p.add_argument("--no-baseline", action="store_true", help="with --amp: skip the FP32 baseline")
    p.add_argument("--impl", default="gluon_amp",
                   help=f"AMP implementation(s), comma separated, from {', '.join(IMPLS)}")
    p.add_argument("--opt-level", default="",
                   help=f"Apex opt levels to run with gluon_amp.initialize, comma separated, from "
                        f"{', '.join(OPT_LEVELS)}; interleaved with the FP32 baseline")
    p.add_argument("--target-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                   help="auto: what gluon_amp picks here (CPU flags and its measured speed probe); a dtype "
                        "runs AMP even where it was measured slower")
    p.add_argument("--untuned", action="store_true",
                   help="with --amp: also train gluon_amp with tune=False (the op table's plan as it is, "
                        "untimed), beside the default (tuned where the timing cache holds the outcome)")
    p.add_argument("--emulate", default="", metavar="DTYPES",
                   help="also train gluon_amp with emulate=True for these target dtypes (float16, "
                        "bfloat16, comma separated): the AMP plan in float32 with the target's rounding, "
                        "on any CPU; loss, scale and skips are the target's, speed is not")
    p.add_argument("--init-scale", type=float, default=None, metavar="SCALE",
                   help="initial loss scale of the gluon_amp modes (dynamic; default gluon_amp's, 65536): "
                        "a high one makes float16 skip its first steps, as the loss verdict allows")
    p.add_argument("--ctx", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--batch-size", type=int, default=None, help="default 2 on CPU, 8 on GPU")
    p.add_argument("--iters", type=int, default=None, help="timed iterations; default 6 on CPU, 200 on GPU")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per mode after the first")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the full JSON document here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG with throughput bars and loss curves")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory figure: by default each mode is built again in a process of its "
                        "own, runs 3 steps, and its peak RSS is reported")
    p.add_argument("--peak-of", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--horovod", type=int, metavar="N", default=0,
                   help="run the gluon_amp mode under Horovod (gloo) with 1 and with N processes on "
                        "this machine and report per-worker and total throughput (_horovod_mode.py)")
    args = p.parse_args(argv)
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        p.error(f"--impl {args.impl!r}: choose from {', '.join(IMPLS)} (comma separated)")
    args.impls = impls
    levels = [s.strip() for s in args.opt_level.split(",") if s.strip()]
    if any(lv not in OPT_LEVELS for lv in levels) or len(set(levels)) != len(levels):
        p.error(f"--opt-level {args.opt_level!r}: choose distinct levels from {', '.join(OPT_LEVELS)} "
                "(comma separated, capital letter O)")
    if levels and (args.amp or args.compare) and "mxnet-contrib" in impls:
        p.error("--opt-level cannot run with --impl mxnet-contrib: the peer patches MXNet for good")
    if args.untuned and not (args.amp or args.compare):
        p.error("--untuned adds a gluon_amp mode: use it with --amp")
    if levels and args.horovod:
        p.error("--opt-level cannot run with --horovod (that mode trains the gluon_amp mode only)")
    args.opt_levels = levels
    emulated = [s.strip() for s in args.emulate.split(",") if s.strip()]
    if any(d not in ("float16", "bfloat16") for d in emulated) or len(set(emulated)) != len(emulated):
        p.error(f"--emulate {args.emulate!r}: choose distinct dtypes from float16, bfloat16 (comma separated)")
    args.emulated = emulated
    for name in ("batch_size", "iters"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.init_scale is not None and not args.init_scale >= 1:
        p.error(f"--init-scale must be >= 1, got {args.init_scale}")
    return args


def plan_modes(args: argparse.Namespace) -> Tuple[List[str], str, Optional[str]]:
    """The modes to run, the target dtype, and why AMP is not run natively (``None`` if it is).

    Emulated modes (``--emulate``) run on any machine, after the native ones."""
    emulated = [EMULATED + d for d in args.emulated]
    amp = args.amp or args.compare or bool(args.opt_levels)
    requested = None if args.target_dtype == "auto" else args.target_dtype
    res = gluon_amp.runtime.resolve(requested, warn=False)
    if res.speed is not None:
        logger.info("gluon_amp speed probe: %s; decision: %s", res.speed.describe(), res.dtype)
    skip_amp = None
    if amp and (res.dtype == "float32" or not res.executable):
        skip_amp = f"AMP was not run: {res.warning}"
    elif amp and res.warning:
        logger.warning("%s", res.warning)
    names = [] if (amp and args.no_baseline and not skip_amp) else ["fp32"]
    if amp and not skip_amp:
        impls = args.impls if (args.amp or args.compare) else []
        names += [n for n in impls if n != "mxnet-contrib"]
        names += [UNTUNED] if args.untuned and UNTUNED not in impls else []
        names += args.opt_levels
        names += [n for n in impls if n == "mxnet-contrib"]  # irreversible: built last
    if emulated:
        names = [n for n in names if n != "mxnet-contrib"] + emulated + [n for n in names if n == "mxnet-contrib"]
    return names, res.dtype, skip_amp


def train(modes: List[Mode], iters: int, args: argparse.Namespace, batch_size: int) -> None:
    """Warm up, then run the modes in turns, logging as the tutorial does."""
    for _ in range(args.warmup):
        for m in modes:
            m.step(record=False)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=iters * len(modes), desc="training", unit="it", file=sys.stdout)
    for i in range(iters):
        for m in modes:
            m.step()
            if bar is not None:
                bar.update(1)
            r = m.result
            if (i + 1) % args.log_interval == 0 or i + 1 == iters:
                span = r.iter_seconds[-min(args.log_interval, len(r.iter_seconds)):]
                log = bar.write if bar is not None else print
                log(f"INFO:ssd_synthetic:[{m.name}][Epoch 0][Batch {i}], Speed: "
                    f"{batch_size * len(span) / sum(span):.3f} samples/sec, "
                    f"CrossEntropy={statistics.mean(r.ce):.3f}, SmoothL1={statistics.mean(r.smoothl1):.3f}")
    if bar is not None:
        bar.close()


#: Steps after fewer updates than this are compared with FP32 (the loss verdict's horizon).
LOSS_HORIZON = 12


def loss_agreement(histories: Dict[str, List[Step]]) -> Dict[str, Any]:
    """Per AMP mode: its total loss against FP32's by benchmarks/loss_match.py's rule (the
    same batch every step, so at equal update counts; the first step, at the initial weights,
    included; steps the loss scaler skipped named with the scale it went to)."""
    if "fp32" not in histories:
        return {}
    ref = histories["fp32"]
    return {name: match_curves(h, ref, max_updates=LOSS_HORIZON).to_dict()
            for name, h in histories.items() if name != "fp32"}


def peak_of(mode: str, args: argparse.Namespace, target: Optional[str], batch_size: int) -> float:
    """Peak RSS (MB) of a process that builds ``mode`` alone and trains it 3 steps: what the
    mode needs, not what an allocator shared with other modes happens to reuse."""
    import json
    import subprocess
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-of", mode, "--batch-size", str(batch_size),
           "--seed", str(args.seed), "--ctx", args.ctx] + (["--target-dtype", target] if target else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"memory run of {mode} failed:\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"])


def _peak_worker(args: argparse.Namespace) -> None:
    import json
    ctx = resolve_ctx(args.ctx)
    name = args.peak_of
    dtype = name[len(EMULATED):] if name.startswith(EMULATED) else (
        None if name == "fp32" else (None if args.target_dtype == "auto" else args.target_dtype))
    if dtype is None and name != "fp32":
        dtype = gluon_amp.runtime.resolve(None, warn=False).dtype
    mode = Mode(name, ctx, SyntheticData(args.batch_size, ctx, args.seed), args.seed, dtype)
    for _ in range(2):
        mode.step(record=False)
    print(json.dumps({"mode": name, "peak_rss_mb": own_peak_rss_mb()}))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.peak_of:
        _peak_worker(args)
        return {}
    if args.horovod:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _horovod_mode import run as run_horovod
        return run_horovod(args, args.horovod)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s",
                        stream=sys.stdout)
    ctx = resolve_ctx(args.ctx)
    on_gpu = ctx.device_type == "gpu"
    batch_size = args.batch_size or (8 if on_gpu else 2)
    iters = args.iters or (200 if on_gpu else 6)
    names, target, skip_amp = plan_modes(args)
    if skip_amp:
        emulated = [n for n in names if n.startswith(EMULATED)]
        logger.warning("%s Running FP32%s.", skip_amp, f" and {', '.join(emulated)}" if emulated else " only")

    batch = SyntheticData(batch_size, ctx, args.seed)
    modes = []
    for n in names:
        logger.info("building %s (batch %d, %s)", n, batch_size, ctx)
        dtype = n[len(EMULATED):] if n.startswith(EMULATED) else (None if n == "fp32" else target)
        modes.append(Mode(n, ctx, batch, args.seed, dtype, args.init_scale))
    train(modes, iters, args, batch_size)

    summaries = [m.result.summary() for m in modes]
    base = next((s for s in summaries if s["mode"] == "fp32"), None)
    curves = {m.name: {"ce": m.result.ce, "smoothl1": m.result.smoothl1} for m in modes}
    histories = {m.name: m.result.history for m in modes}
    plan = [(m.name, m.target_dtype) for m in modes]
    peak_here = peak_rss_mb()
    del modes, batch  # the memory runs below need the room: every mode's net is dropped here
    gc.collect()
    mx.nd.waitall()
    for s, (name, target_dtype) in zip(summaries, plan):
        s["speedup_vs_fp32"] = s["samples_per_sec"] / base["samples_per_sec"] if base else None
        if not args.no_memory and name != "mxnet-contrib":
            s["peak_rss_mb"] = peak_of(name, args, target_dtype, batch_size)
    for s in summaries:
        s["peak_vs_fp32"] = (s["peak_rss_mb"] / base["peak_rss_mb"]
                             if base and s.get("peak_rss_mb") and base.get("peak_rss_mb") else None)
    doc = {"benchmark": "ssd_512_resnet50_v1_coco synthetic training", "ctx": str(ctx),
           "batch_size": batch_size, "iters": iters, "warmup": args.warmup, "seed": args.seed,
           "target_dtype": target, "amp_not_run": skip_amp, "modes": summaries,
           "loss_curves": curves, "loss_match": loss_agreement(histories),
           "loss_history": {n: [st.to_dict() for st in h] for n, h in histories.items()},
           "peak_rss_mb_process": peak_here, "runtime": gluon_amp.runtime_info(),
           "command": " ".join(["python", "benchmarks/ssd_synthetic.py"]
                               + (argv if argv is not None else sys.argv[1:]))}
    print_table(doc)
    write_json(doc, args.json)
    if args.plot:
        plot(doc, args.plot)
        print(f"plot written to {args.plot}")
    return doc


def print_table(doc: Dict[str, Any]) -> None:
    print(f"\nSSD-512 ResNet-50 synthetic training, batch {doc['batch_size']}, {doc['ctx']}, "
          f"{doc['iters']} timed iterations (median), target {doc['target_dtype']}, "
          f"bf16 ISA: {doc['runtime']['bf16_isa']}")
    speed = doc["runtime"]["speed"]
    if "speedup" in speed:
        print(f"gluon_amp speed probe ({speed['source']}{', ' + speed['path'] if speed['path'] else ''}): "
              f"bfloat16 estimated {speed['speedup']:.2f}x float32; "
              + ", ".join(f"{o['label']} {o['low_ms']:.1f} vs {o['fp32_ms']:.1f} ms" for o in speed["items"])
              + f"; default target: {speed['decision']}")
    else:
        print(f"gluon_amp speed probe {speed['source']}; default target: {speed['decision']}")
    head = (f"{'mode':<18}{'samples/s':>10}{'s/iter':>9}{'vs fp32':>9}{'peak MB':>9}{'vs fp32':>9}{'CE':>8}"
            f"{'SmoothL1':>10}{'scale':>10}{'skipped':>8}")
    print(head)
    print("-" * len(head))
    for s in doc["modes"]:
        sp = f"{s['speedup_vs_fp32']:.2f}x" if s["speedup_vs_fp32"] else "-"
        scale = f"{s['loss_scale']:.6g}" if s["loss_scale"] is not None else "-"
        peak = f"{s['peak_rss_mb']:.0f}" if s.get("peak_rss_mb") else "-"
        pv = f"{s['peak_vs_fp32']:.2f}x" if s.get("peak_vs_fp32") else "-"
        print(f"{s['mode']:<18}{s['samples_per_sec']:>10.2f}{s['sec_per_iter']:>9.2f}{sp:>9}{peak:>9}{pv:>9}"
              f"{s['final_ce']:>8.3f}{s['final_smoothl1']:>10.3f}{scale:>10}{s['skipped_steps']:>8}")
    for name, m in doc["loss_match"].items():
        print(CurveMatch.from_dict(m).describe(name))
    print("'peak MB': each mode built alone in a process of its own and trained 3 steps (its peak RSS); "
          f"this process, all modes together: {doc['peak_rss_mb_process']:.0f} MB")
    if any(s["mode"].startswith(EMULATED) for s in doc["modes"]):
        print(f"{EMULATED}* modes: gluon_amp.init(emulate=True), float32 kernels with the target's "
              "rounding; their speed columns are emulated (float32 plus rounding), not the target's")
    if doc["amp_not_run"]:
        print(doc["amp_not_run"])


def plot(doc: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [s["mode"] for s in doc["modes"]]
    a.bar(names, [s["samples_per_sec"] for s in doc["modes"]],
          color=["#888", "#2a7", "#c73", "#37c", "#a4a", "#bb3"][:len(names)])
    a.set_ylabel("samples/s")
    a.set_title(f"SSD-512 training, batch {doc['batch_size']}")
    for name, c in doc["loss_curves"].items():
        b.plot([x + y for x, y in zip(c["ce"], c["smoothl1"])], label=name)
    b.set_xlabel("iteration")
    b.set_ylabel("CrossEntropy + SmoothL1")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
