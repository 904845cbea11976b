"""``python -m gluon_amp.debug MODEL-symbol.json MODEL-0000.params --shape data:1,3,512,512``.

Inputs are drawn at random as the graph says (see :mod:`gluon_amp.debug.inputs`): token
ids, indices and lengths as valid integers, in the dtype the ops need; ``--dtype`` and
``--range`` state them instead."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Tuple


def _shape(text: str) -> Tuple[str, Tuple[int, ...]]:
    """``NAME:D1,D2,...`` as ``(name, shape)``."""
    name, sep, dims = text.partition(":")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: use NAME:D1,D2,... with positive sizes, "
                                         "e.g. data:1,3,512,512")
    return name, shape


def _dtype(text: str) -> Tuple[str, str]:
    """``NAME:DTYPE`` as ``(name, dtype)`` (the dtype is checked with the graph)."""
    name, sep, dtype = text.partition(":")
    if not sep or not name or not dtype:
        raise argparse.ArgumentTypeError(f"--dtype {text!r}: use NAME:DTYPE, e.g. valid_length:int32")
    return name, dtype


def _range(text: str) -> Tuple[str, Tuple[int, int]]:
    """``NAME:LOW,HIGH`` as ``(name, (low, high))``."""
    name, sep, bounds = text.partition(":")
    try:
        low, high = (int(v) for v in bounds.split(","))
    except ValueError:
        low = high = 0
    if not sep or not name or not low < high:
        raise argparse.ArgumentTypeError(f"--range {text!r}: use NAME:LOW,HIGH with integers LOW < HIGH "
                                         "(values drawn in [LOW, HIGH)), e.g. token_ids:0,30522")
    return name, (low, high)


def _parser() -> argparse.ArgumentParser:
    """The CLI's arguments."""
    p = argparse.ArgumentParser(prog="python -m gluon_amp.debug",
                                description="Compare an exported FP32 model with its mixed-precision plan op by "
                                            "op, on random input, and optionally bisect the ops to keep in float32.")
    p.add_argument("symbol", help="MODEL-symbol.json")
    p.add_argument("params", help="MODEL-0000.params")
    p.add_argument("--shape", type=_shape, action="append", required=True, metavar="NAME:DIMS",
                   help="shape of a data input, e.g. data:1,3,512,512 (repeat for several inputs)")
    p.add_argument("--dtype", type=_dtype, action="append", default=[], metavar="NAME:DTYPE",
                   help="dtype of a data input (default: what the graph declares or its ops need, else float32)")
    p.add_argument("--range", type=_range, action="append", default=[], metavar="NAME:LOW,HIGH",
                   help="draw a data input as integers in [LOW, HIGH) (default: for token ids, indices and "
                        "lengths, the range the ops reading them accept; other inputs are normal(0, 1))")
    p.add_argument("--target-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                   help="the AMP target (auto: this machine's, or when emulating float16 with a GPU, "
                        "else bfloat16)")
    p.add_argument("--emulate", action="store_true",
                   help="emulate the target (default: emulate only where it cannot run natively)")
    p.add_argument("--tolerance", type=float, default=1e-2,
                   help="relative L2 error against FP32 an op's local error and the output may reach")
    p.add_argument("--bisect", action="store_true", help="also find the ops to keep in float32")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    p.add_argument("--json", metavar="PATH", help="write the comparison (and bisect result) as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of error against depth")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit status (2 for bad arguments or files)."""
    args = _parser().parse_args(argv)
    for path in (args.symbol, args.params):
        if not os.path.isfile(path):
            print(f"error: {path} not found (HybridBlock.export writes MODEL-symbol.json and MODEL-0000.params)",
                  file=sys.stderr)
            return 2
    if args.tolerance <= 0:
        print(f"error: --tolerance must be positive, got {args.tolerance}", file=sys.stderr)
        return 2
    import mxnet as mx
    numpy = _numpy_export(args.symbol)
    if not numpy:
        return _run(args, False)
    # loaded, fed and compared in numpy semantics, as the export was written (its params file
    # holds np-shape arrays, which legacy semantics refuse to load)
    with mx.util.np_shape(True), mx.util.np_array(True):
        return _run(args, True)


def _numpy_export(path: str) -> bool:
    """True for a graph exported in MXNet's numpy mode (``npx.set_np()``): its JSON says it
    has np-shape semantics, or it holds numpy-frontend ops (``_np_*``, ``_npi_*``, ``_npx_*``).
    False for a file that is not such JSON (loading it says what is wrong)."""
    try:
        with open(path) as f:
            graph = json.load(f)
        flag = graph.get("attrs", {}).get("is_np_shape", ["int", 0])
        ops = {n.get("op", "") for n in graph.get("nodes", [])}
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return str(flag[-1]) not in ("0", "") or any(op.startswith(("_np_", "_npi_", "_npx_")) for op in ops)


def _run(args: argparse.Namespace, numpy: bool) -> int:
    """Load the export, compare (and bisect) on random inputs, print and write the results;
    ``numpy``: the export is a numpy-mode one and numpy semantics are on."""
    import mxnet as mx
    from mxnet import gluon
    from gluon_amp_core.dtypes import dtype_name
    from . import bisect, compare
    from .inputs import draw, input_specs

    shapes: Dict[str, Tuple[int, ...]] = dict(args.shape)
    try:
        block = gluon.SymbolBlock.imports(args.symbol, list(shapes), args.params)
    except Exception as exc:  # a corrupt or mismatched file: MXNetError, JSON or assertion errors
        print(f"error: could not load {args.symbol} with inputs {list(shapes)}: {exc}", file=sys.stderr)
        return 2
    try:
        specs = input_specs(mx.sym.load(args.symbol), shapes,
                            {p.name: dtype_name(p.dtype) for p in block.collect_params().values()},
                            dict(args.dtype), dict(args.range))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for spec in specs:
        print(f"input {spec}")
    inputs = draw(specs, args.seed)
    if numpy:  # a numpy-mode block takes mx.np arrays
        inputs = [x.as_np_ndarray() for x in inputs]
    target = None if args.target_dtype == "auto" else args.target_dtype
    emulate = True if args.emulate else None
    try:
        report = compare(block, *inputs, target_dtype=target, emulate=emulate, tolerance=args.tolerance)
        result = bisect(block, *inputs, target_dtype=target, emulate=emulate,
                        tolerance=args.tolerance) if args.bisect else None
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    if result is not None:
        print(result)
        if result.excluded_sym_names:
            print(f"apply with: convert_hybrid_block(..., excluded_sym_names={result.excluded_sym_names}), "
                  f"init(..., excluded_sym_names={result.excluded_sym_names}) or python -m gluon_amp.convert "
                  "... " + " ".join(f"--exclude {n}" for n in result.excluded_sym_names))
    if args.json:
        doc = report.to_dict()
        doc["inputs"] = [asdict(s) for s in specs]
        if result is not None:
            doc["bisect"] = {k: getattr(result, k) for k in ("excluded_sym_names", "trials", "error_before",
                                                            "error_after", "candidates")}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0
