"""``python -m gluon_amp.convert PREFIX EPOCH --target-dtype bfloat16 --out OUT``."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any, List, Optional, Tuple

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.resolve import EMULATE_HINT


def _nbytes(params) -> int:
    import numpy as np
    total = 0
    for v in params.values():
        total += int(np.prod(v.shape)) * (2 if str(v.dtype).find("bfloat16") >= 0 else np.dtype(v.dtype).itemsize)
    return total


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gluon_amp.convert",
        description="Convert an exported FP32 model (PREFIX-symbol.json + PREFIX-EPOCH.params) "
                    "to mixed precision for inference.")
    parser.add_argument("prefix", help="model prefix, as given to HybridBlock.export")
    parser.add_argument("epoch", type=int, help="epoch number of the .params file")
    parser.add_argument("--target-dtype", default="auto", choices=("auto",) + LOW_PRECISION_DTYPES,
                        help="auto: float16 with a GPU, bfloat16 on a CPU with native bf16, else "
                             "no conversion (the model is written unchanged, and the reason printed)")
    parser.add_argument("--out", required=True, help="output prefix; writes OUT-symbol.json and OUT-EPOCH.params")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME",
                        help="op node to keep in float32 (repeatable)")
    parser.add_argument("--fp32-op", action="append", default=None, metavar="OP",
                        help="replace the float32 op list with these ops (repeatable)")
    parser.add_argument("--no-cast-params", action="store_true",
                        help="keep every parameter in float32 (default: store low-precision-only ones cast)")
    parser.add_argument("--emulate", action="store_true",
                        help="write the plan emulated in float32 (runs on any CPU; values rounded to the "
                             "target dtype wherever the plan holds it); auto picks bfloat16 on a CPU")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=D1,D2,...",
                        type=_shape_arg, help="shape of a data input the model will run with, e.g. "
                                               "data=16,3,224,224 (repeatable). With it, the converter times "
                                               "the model's low-precision ops on this machine and keeps in "
                                               "float32 those that do not make the whole model faster")
    parser.add_argument("--no-tune", action="store_true",
                        help="with --input-shape: convert by the op table alone, without timing")
    parser.add_argument("--no-fuse", action="store_true",
                        help="write the plain graph (default for bfloat16 with a oneDNN build of MXNet: "
                             "fold batch norm into the convolutions in float32 and write the graph "
                             "partitioned by MXNet's oneDNN backend, conv+BN+ReLU+sum fused)")
    return parser


def _shape_arg(text: str) -> Tuple[str, Tuple[int, ...]]:
    name, sep, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=D1,D2,... with positive integers, "
                                         "e.g. data=16,3,224,224")
    return name, shape


def _path_error(args: argparse.Namespace) -> Optional[str]:
    for path in (f"{args.prefix}-symbol.json", f"{args.prefix}-{args.epoch:04d}.params"):
        if not os.path.isfile(path):
            return (f"{path} not found; PREFIX and EPOCH must name an exported model "
                    "(HybridBlock.export(PREFIX, EPOCH) writes both files)")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        return f"output directory {out_dir} does not exist"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    error = _path_error(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    import mxnet as mx
    from .api import convert_model, fusion_plan
    from .fold import fold_batch_norm
    from ..policy_builder import make_policy
    from ..reporting.report import report
    from .. import runtime

    requested = None if args.target_dtype == "auto" else args.target_dtype
    if args.emulate:
        resolution = runtime.Resolution(runtime.emulated_target(requested), None)
    else:
        resolution = runtime.resolve(requested, warn=False)
    if resolution.warning:  # this command's user turns emulation on with its option
        print(resolution.warning.replace(EMULATE_HINT, EMULATE_HINT.replace("Pass emulate=True", "Add --emulate")))
    elif resolution.speed is not None:
        print(f"gluon_amp speed probe: {resolution.speed.describe()}")
    if args.no_tune and not args.input_shape:
        print("error: --no-tune applies with --input-shape (without it nothing is timed)", file=sys.stderr)
        return 2
    tune = bool(args.input_shape) and not args.no_tune and not args.emulate

    try:
        sym, arg_params, aux_params = mx.model.load_checkpoint(args.prefix, args.epoch)
    except Exception as exc:  # a corrupt file: MXNetError or JSON errors
        print(f"error: could not load {args.prefix} epoch {args.epoch}: {exc}", file=sys.stderr)
        return 2
    try:
        policy = make_policy(requested, fp32_ops=args.fp32_op, emulate=args.emulate or None, tune=tune)
        plan = fusion_plan(False if args.no_fuse else None, "cpu", policy)
        fuse = plan.backend is not None and policy.enabled  # a float32 fallback is written unchanged
        if plan.fold:
            arg_params, aux_params, _ = fold_batch_norm(sym, arg_params, aux_params)
        new_sym, new_args, new_aux = convert_model(
            sym, arg_params, aux_params, target_dtype=policy,
            excluded_sym_names=args.exclude or None, cast_optional_params=not args.no_cast_params,
            input_shapes=dict(args.input_shape) or None)
    except (ValueError, TypeError) as exc:  # in the words of this command's options
        print("error: " + str(exc).replace("excluded_sym_names", "--exclude").replace(
            "gluon_amp.report(sym)", "gluon_amp.report(mx.sym.load(PREFIX-symbol.json)) in Python"),
            file=sys.stderr)
        return 2
    rep = report(new_sym, target_dtype=policy) if resolution.dtype != "float32" else None  # its emulate too
    label = resolution.dtype + " (emulated in float32)" * args.emulate
    if args.emulate and policy.enabled:  # asked for a model that runs emulated anywhere: the float32 copy
        new_sym, new_args, new_aux = _emulated_model(new_sym, new_args, new_aux)
    if fuse:
        new_sym = new_sym.optimize_for("MKLDNN")  # the partitioned graph: _sg_mkldnn_* nodes
    new_sym.save(f"{args.out}-symbol.json", remove_amp_cast=False)
    mx.nd.save(f"{args.out}-{args.epoch:04d}.params",
               {**{f"arg:{k}": v for k, v in new_args.items()}, **{f"aux:{k}": v for k, v in new_aux.items()}})
    before = _nbytes({**arg_params, **aux_params})
    after = _nbytes({**new_args, **new_aux})
    if rep is None:
        print(f"not converted: wrote {args.prefix} epoch {args.epoch} unchanged (float32) -> {args.out}")
        return 0
    print(f"converted {args.prefix} epoch {args.epoch} to {label} -> {args.out}")
    print(f"ops per dtype:   {dict(sorted(Counter(r.dtype for r in rep.rows).items()))}")
    print(f"casts inserted:  {rep.casts}")
    print(f"parameter bytes: {before:,} -> {after:,} ({after / max(before, 1):.0%})")
    if args.exclude:
        print(f"kept in float32: {', '.join(args.exclude)}")
    tuned = [r for r in rep.rows if r.reason == "measured"]
    if tune:
        print(f"tuned:           {len(tuned)} op(s) chosen by measured speed"
              + "".join(f"\n  {r.name} ({r.op}): {r.detail}" for r in tuned))
    fused = sum(1 for n in json.loads(new_sym.tojson())["nodes"] if n["op"].startswith("_sg_"))
    print(f"oneDNN fusion:   {f'{fused} fused subgraph ops (--no-fuse writes the plain graph)' if fuse else 'off'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _emulated_model(sym: Any, arg_params: dict, aux_params: dict) -> Tuple[Any, dict, dict]:
    """A converted plan as a self-contained float32 model: the plan emulated with MXNet's ops
    (loads without gluon_amp) and its parameters in float32 (the plan's values, exactly)."""
    from ..execution import emulated
    from ..type_inference import infer_dtypes
    params = {**arg_params, **aux_params}
    known = {n: "float32" for n in sym.list_inputs() if n not in params}
    typed = infer_dtypes(sym, {**known, **{k: _dtype_name(v) for k, v in params.items()}}, partial=True) or {}
    sym = emulated(sym, typed, portable=True, widen=False)
    as32 = {k: v.astype("float32") for k, v in params.items()}
    return sym, {k: as32[k] for k in arg_params}, {k: as32[k] for k in aux_params}


def _dtype_name(array: Any) -> str:
    from ..mxnet_internals import FLOAT_NAMES
    from gluon_amp_core.dtypes import dtype_name
    return FLOAT_NAMES.get(array.dtype) or dtype_name(array.dtype)
