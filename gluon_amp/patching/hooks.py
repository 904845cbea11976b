"""The rule gluon_amp's HybridBlock hooks apply to a graph before it first runs.

:func:`gluon_amp.init` installs the hooks (:func:`gluon_amp.mxnet_internals.install_block_hooks`);
this module says what they do with a freshly built graph: the input-shape rules first
(:mod:`.shape_rules`), then the emulated graph (:mod:`gluon_amp.emulation`) or the check that
the call's device can run the plan's dtypes.
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.emulate import REAL_DTYPE_ATTR
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import AMP_CAST_DTYPES, drop_identity_casts

from .. import mxnet_internals as mxi, runtime
from ..emulation import emulate_symbol
from ..type_inference import infer_dtypes
from .shape_rules import ShapeRules


def graph_rewriter(policy: Policy) -> Tuple[Callable, Optional[Callable], Callable]:
    """What :func:`gluon_amp.init` hooks into every HybridBlock: ``(rewrite, reshaped, watch)``.

    ``rewrite(block, args, inputs, out)`` runs on each fresh graph build. First the ops that
    the input shapes keep in float32 are fed float32 (:class:`gluon_amp.shape_rules.ShapeRules`),
    emulated or not, so both run one plan. Emulated policies get the emulated graph.
    Otherwise, a graph holding a dtype the call's device cannot execute raises a
    ``RuntimeError`` before MXNet fails on it.

    ``reshaped(block, args, inputs, out)`` runs when a block is called with other input
    shapes than before: True when its graph must be rebuilt (more ops kept in float32).
    It is None when the policy has no shape rules (nothing to check); ``watch(block)`` says
    whether a block's graph has an op whose rule other shapes could change.
    """
    rules = ShapeRules(policy)

    def rewrite(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> Symbol:
        if getattr(block, "amp_result", None) is not None:
            return out  # converted by gluon_amp: its plan was fixed then
        known, shapes = mxi.call_inputs(block, args, inputs)
        out = rules.apply(block, out, shapes)
        dtypes = infer_dtypes(out, known, partial=True) or {}
        if any(t is not None and t not in AMP_CAST_DTYPES for t in dtypes.values()):
            graph, dropped = drop_identity_casts(json.loads(out.tojson(remove_amp_cast=False)), dtypes)
            if dropped:  # the wrappers cast ids, lengths and float64 values too: oneDNN rejects some
                out = mx.sym.load_json(json.dumps(graph))
                dtypes = infer_dtypes(out, known, partial=True) or {}
        low = {t for t in dtypes.values() if t in LOW_PRECISION_DTYPES}
        if not low:
            return out
        if policy.emulate:
            return emulate_symbol(out, dtypes, shapes, fed=known)[0]  # float16 data: read as float16
        for device in {a.context.device_type for a in mxi.call_arrays(args) if isinstance(a, NDArray)}:
            for dtype in sorted(low):
                if not runtime.executable(dtype, device):
                    raise RuntimeError(cannot_run(f"block {block.name!r}", dtype, device))
        return out

    def reshaped(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> bool:
        return rules.keeps_more(block, out, mxi.call_inputs(block, args, inputs)[1])

    return rewrite, (reshaped if rules.active else None), rules.watches


def holds_amp_plan(sym: Symbol) -> bool:
    """True when ``sym`` carries an AMP plan: casts the symbolic wrappers or a converter
    inserted, or an emulated graph's typed nodes."""
    return any(n["op"] in ("amp_cast", "amp_multicast") or REAL_DTYPE_ATTR in n.get("attrs", {})
               for n in json.loads(sym.tojson(remove_amp_cast=False))["nodes"])


def cannot_run(what: str, dtype: str, device: str) -> str:
    """The message for a low-precision op this machine cannot execute."""
    why = ("MXNet's CPU build has no float16 convolution or GEMM" if dtype == "float16"
           else runtime.capability().why)
    return (f"gluon_amp: {what} would run {dtype} kernels on the {device}, which this machine cannot "
            f"execute ({why}). Call gluon_amp.init(target_dtype={dtype!r}, emulate=True) to run the "
            "same plan emulated in float32 on this CPU (for numerics), or run on hardware with "
            f"{dtype} kernels.")
