"""The rule gluon_amp's HybridBlock hooks apply to a graph before it first runs.

:func:`gluon_amp.init` installs the hooks (:func:`gluon_amp.mxnet_internals.install_block_hooks`);
this module says what they do with a freshly built graph: the plan's steps, the input-shape
rules (:mod:`.shape_rules`) and the casts dropped that convert nothing (identity casts included). The block keeps the
plan; how it executes (natively, emulated, or refused) is decided where MXNet binds it
(:mod:`gluon_amp.execution`).
"""
from __future__ import annotations

import json
from typing import Callable, Collection, Dict, Mapping, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.emulate import ROUND_SUFFIX
from gluon_amp_core.decide import Reason, users_casts
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import drop_identity_casts, unique_op_names
from gluon_amp_core.walk import Note

from .. import mxnet_internals as mxi, plan_notes
from ..native_run import within_kernel_limits
from ..slow_kernels import slow_kernels_in_float32
from ..tuning.casts import with_fewer_casts
from ..type_inference import infer_dtypes
from .shape_rules import ShapeRules

Key = Tuple[str, int]


def graph_rewriter(policy: Policy) -> Tuple[Callable, Optional[Callable], Callable]:
    """What :func:`gluon_amp.init` hooks into every HybridBlock: ``(rewrite, reshaped, watch)``.

    ``rewrite(block, args, inputs, out)`` runs on each fresh graph build and gives the plan
    the block keeps: the ops that the input shapes keep in float32 are fed float32
    (:class:`gluon_amp.patching.shape_rules.ShapeRules`), and the casts the wrappers put on values
    they do not convert are dropped. Emulated or not, both run this one plan
    (:func:`gluon_amp.execution.graph_to_run` decides how, when the block's CachedOp is built).

    ``reshaped(block, args, inputs, out)`` runs when a block is called with other input
    shapes than before: True when its graph must be rebuilt (more ops kept in float32).
    It is None when the policy has no shape rules (nothing to check); ``watch(block)`` says
    whether a block's graph has an op whose rule other shapes could change.
    """
    rules = ShapeRules(policy)

    def rewrite(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> Symbol:
        if getattr(block, "amp_result", None) is not None:
            return out  # converted by gluon_amp: its plan was fixed then
        plan_notes.record_emulated(block, None)
        known, shapes = mxi.call_inputs(block, args, inputs)
        graph, renamed = unique_op_names(mxi.symbol_graph(out))
        if renamed:  # a block called twice in this trace: every pass below types by node name
            out = mx.sym.load_json(json.dumps(graph))
        users = users_casts(graph)  # the block's own casts stay
        ruled = rules.apply(block, out, shapes)
        dtypes = infer_dtypes(ruled, known, partial=True)
        if ruled is not out and not dtypes:
            # the float32 values reach an op that has no cast of its own: a graph traced without the
            # wrappers, in one dtype (O2's SymbolBlock): cast back before the next low op instead
            typed = infer_dtypes(out, known, partial=True)
            ruled, dtypes = within_kernel_limits(out, typed, shapes) if typed else (out, typed)
        out, dtypes = ruled, dict(dtypes or {})
        if dtypes:
            # before the casts are dropped: the readers of a slow op's now float32 output keep theirs
            out, dtypes = _slow_kernels_in_float32(block, out, known, dtypes, policy, users)
            # the wrappers cast every input before dtypes are known: ids, lengths and float64
            # values (oneDNN rejects some), and values that have the dtype already (a cast
            # between a weight and its op changes how MXNet runs it)
            graph, dropped = drop_identity_casts(mxi.symbol_graph(out), dtypes)
            if dropped:
                out = mx.sym.load_json(json.dumps(graph))
                dtypes = infer_dtypes(out, known, partial=True) or {}
        # none back and forth between neighbours
        return with_fewer_casts(out, known, policy.table, dtypes, keep=users)[0]

    def reshaped(block: HybridBlock, args: tuple, inputs: Sequence[Symbol], out: Symbol) -> bool:
        return rules.keeps_more(block, out, mxi.call_shapes(args, inputs))

    return rewrite, (reshaped if rules.active else None), rules.watches


def _slow_kernels_in_float32(block: HybridBlock, out: Symbol, known: Mapping[str, str],
                             dtypes: Dict[Key, Optional[str]], policy: Policy,
                             users: Collection[str]) -> Tuple[Symbol, Dict[Key, Optional[str]]]:
    """``out`` with each widest op whose kernel in the target dtype is slow fed float32 where
    the graph's dtypes would run it in the target (:mod:`gluon_amp.slow_kernels`): the wrappers
    traced it before any dtype was known. With the graph's dtypes; the block's notes say which."""
    plan_notes.record(block, "slow_kernels", {})
    new, typed, changed = slow_kernels_in_float32(out, known, dtypes, policy, users)
    if changed:
        plan_notes.record(block, "slow_kernels", {n: Note(Reason.SLOW_KERNEL.value) for n in changed})
    return new, typed


def holds_amp_plan(sym: Symbol) -> bool:
    """True when ``sym`` carries an AMP plan: casts the symbolic wrappers or a converter
    inserted, or an emulated graph's roundings."""
    return any(n["op"] in ("amp_cast", "amp_multicast") or n["name"].endswith(ROUND_SUFFIX)
               for n in mxi.symbol_graph(sym)["nodes"])
