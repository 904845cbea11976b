"""Where a plan meets a device: the graph MXNet runs for a plan bound here.

A plan is a pure MXNet graph (the user's graph with ``amp_cast``/``amp_multicast`` and MXNet's
dtype attributes). When MXNet binds one (a hybridized block's CachedOp, ``Symbol.bind`` /
``simple_bind``, and so ``Module``, ``BucketingModule``, an ``Executor``), :func:`graph_to_run`
decides what runs instead: the plan itself (native, or nothing in low precision), its emulated
copy (the policy emulates), or gluon_amp's ``RuntimeError`` naming ``emulate=True`` (the
device cannot run its dtypes). The copy is handed to MXNet's executor only: the user's Symbol,
a block's cached graph (what ``export``, ``convert_*``, ``infer_shape`` read) keep the plan.

The policy is the one a converter was asked for (``convert_*(..., emulate=True)`` results,
remembered here by identity) or else the one in force (``init``, the launcher).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
import warnings
import weakref
from typing import Any, Collection, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.decide import users_casts
from gluon_amp_core.dtypes import CODE_DTYPE, LOW_PRECISION_DTYPES, dtype_name
from gluon_amp_core.emulate import lift_input_roundings
from gluon_amp_core.graph_pass import params_read_through_casts, params_stored_low
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import cast_each_input, drop_identity_casts, heads_cast
from gluon_amp_core.switches import switched_off
from gluon_amp_core.table import kernel_verdicts
from gluon_amp_core.verdicts import Verdict

from . import emulation_kernel, mxnet_internals as mxi, plan_notes, runtime, state
from .emulation import emulate_symbol, round_nd
from .gc_pause import while_gc_paused
from .native_run import native_passes, padded_image_notes, with_batchnorms_apart, with_padded_images
from .same_shape_run import with_twins
from .slow_kernels import slow_kernels_in_float32
from .type_inference import infer_dtypes

Key = Tuple[str, int]

#: Suffix of the cast that widens a low-precision graph input to float32 in an emulated copy.
WIDEN_SUFFIX = "_amp_widened"


def graph_to_run(plan: Symbol, dtypes: Mapping[str, Any], shapes: Mapping[str, Tuple[int, ...]],
                 devices: Iterable[str], policy: Optional[Policy], what: str,
                 plan_heads: Optional[Sequence[Optional[str]]] = None, pair: bool = True,
                 accumulating: Optional[Collection[str]] = None,
                 typed: Optional[Mapping[Key, Optional[str]]] = None, fused: bool = False) -> Symbol:
    """The graph MXNet runs for ``plan`` bound with inputs of ``dtypes`` (input name -> dtype,
    those known) and ``shapes`` on ``devices`` under ``policy``.

    Returns ``plan`` itself when it holds nothing in low precision or when no policy applies;
    where every device runs the dtypes its kernels compute in, the plan with its outputs in the
    dtype the caller feeds (:func:`outputs_as_fed`); a new emulated Symbol when ``policy.emulate``,
    and on a simulated native host (:func:`gluon_amp.runtime.simulated`) where the plan runs
    bfloat16 kernels, with or without a policy: that host's only change to what runs.
    ``plan_heads``: the dtypes of the plan's outputs before measured choices (the tuner) moved
    some to float32, whose outputs then still come back as fed (timings never change them).
    ``pair``: a plan run natively in bfloat16 casts each weight together with its op's data
    (:func:`gluon_amp.native_run.with_paired_casts`), and where oneDNN runs AMX, gives the batch norms its mixed
    layouts would slow down a plain input (:func:`gluon_amp.native_run.with_layout_guards`); False for a converter's
    result, an inference graph, where the pairs save nothing and cost an op per layer
    (MobileNetV3: 2% of its time) and no backward pass meets the layouts.

    ``accumulating``: the inputs whose gradients accumulate (``grad_req='add'``; ``None``: any
    may), whose bfloat16 casts a CPU feeds through an identity (:func:`gluon_amp.native_run.with_accumulating_casts`).
    ``typed``: ``plan``'s dtypes as :func:`plan_dtypes` gives them for ``dtypes``, where the
    caller has them already. ``fused``: MXNet partitions what runs with its oneDNN fusion (a
    block hybridized with ``backend``, a converted block's default).

    Raises
    ------
    RuntimeError
        gluon_amp's, naming ``emulate=True``, when a device cannot run a low dtype the plan's
        kernels compute in (:func:`kernel_dtypes`), before MXNet fails on it with its own error.
    """
    simulated = runtime.simulated()
    if (policy is None or not policy.enabled) and not simulated:
        return plan
    typed = plan_dtypes(plan, dtypes) if typed is None else typed
    low = {t for t in typed.values() if t in LOW_PRECISION_DTYPES}
    if not low:
        return outputs_as_fed(plan, typed, dtypes, plan_heads) if plan_heads and policy is not None else plan
    if policy is not None and policy.enabled and policy.emulate:
        return emulated(plan, typed, shapes, fed=dtypes)
    kernels = kernel_dtypes(plan, typed)
    target = policy.target_dtype if policy is not None and policy.enabled else None
    for device in sorted(set(devices)):
        for dtype in sorted(kernels):
            if runtime.executable(dtype, device):
                continue
            if dtype == target:
                raise CannotRun(cannot_run(what, dtype, device))
            missing = kernels_missing(plan, typed, dtype, device)  # the script's own dtype: op by op
            if missing:
                raise CannotRun(cannot_run(what, dtype, device, missing))
    if simulated and "bfloat16" in kernels:  # a simulated native host: its bfloat16 kernels emulated
        return emulated(plan, typed, shapes, fed=dtypes)
    run = native_passes(plan, typed, shapes, devices, pair, accumulating, fused)
    run = outputs_as_fed(run, typed, dtypes, plan_heads) if policy is not None and policy.enabled else run
    return without_float16_multicasts(run, typed) if "cpu" in devices and "float16" in low else run


def plan_dtypes(plan: Symbol, dtypes: Mapping[str, Any]) -> Dict[Key, Optional[str]]:
    """``plan``'s dtypes (node name, output) -> dtype, as MXNet infers them for inputs of ``dtypes``
    (those it cannot infer left out; empty where it infers nothing)."""
    return dict(infer_dtypes(plan, dtypes, partial=True) or {})


def without_float16_multicasts(plan: Symbol, typed: Mapping[Key, Optional[str]]) -> Symbol:
    """``plan`` as a CPU runs it: a multicast with a float16 input becomes one cast per input
    (oneDNN runs the CPU's ``amp_multicast`` and has no float16;
    :func:`gluon_amp_core.retype.cast_each_input`). ``plan`` itself where it has none."""
    graph, split = cast_each_input(mxi.symbol_graph(plan), typed, "float16")
    return mx.sym.load_json(json.dumps(graph)) if split else plan


#: Suffix of the cast that gives a natively run plan's low-precision output in the fed dtype.
OUTPUT_SUFFIX = "_amp_output"


def outputs_as_fed(plan: Symbol, typed: Mapping[Key, Optional[str]], fed: Mapping[str, Any],
                   plan_heads: Optional[Sequence[Optional[str]]] = None) -> Symbol:
    """``plan`` run natively, its outputs in the dtype the caller works in, as its emulated
    copy gives them (:func:`gluon_amp_core.emulate.emulate_graph`): an output the plan holds in
    a low dtype comes back float32 to a caller that fed no low-precision input, and in the low
    dtype a caller fed (GPU-style float16 code), if one. ``plan`` itself where nothing changes.

    NumPy has no bfloat16: a bfloat16 array handed to float32 code reads as raw 16-bit words
    (``asnumpy()`` gives a structured ``uint16`` array, ``tolist()`` a ``(..., 1)`` shape).
    Only the executor's graph changes; the plan (what ``export`` writes) is left as it is.
    ``plan_heads`` (see :func:`graph_to_run`) count as the plan's own output dtypes."""
    fed_low = {dtype_name(t) if not isinstance(t, str) else t for t in fed.values()} & set(LOW_PRECISION_DTYPES)
    if len(fed_low) > 1:
        return plan  # several low dtypes fed: the plan's own outputs
    want = fed_low.pop() if fed_low else "float32"

    def cast_to(i: int, name: str, k: int) -> Optional[str]:
        held = plan_heads[i] if plan_heads is not None and i < len(plan_heads) else None
        if held not in LOW_PRECISION_DTYPES:
            held = typed.get((name, k))
        return want if held in LOW_PRECISION_DTYPES and typed.get((name, k)) != want else None

    graph = mxi.symbol_graph(plan)
    cast = heads_cast(graph, cast_to, OUTPUT_SUFFIX)
    return plan if cast is graph else mx.sym.load_json(json.dumps(cast))


#: Ops that only convert a value's dtype: MXNet's ``amp_cast`` (and ``Cast``) convert between any float
#: dtypes on any device (a float16 array cast to bfloat16 on a CPU runs no float16 kernel).
_CASTS = frozenset({"amp_cast", "Cast"})


def kernel_dtypes(plan: Symbol, typed: Mapping[Key, Optional[str]]) -> set:
    """The low dtypes ``plan`` (typed by MXNet as ``typed``) computes in: the outputs of its op
    nodes but casts. A graph input in a low dtype that is only cast (GPU-style code's float16
    data fed to a bfloat16 plan: ``net.cast('float16')``, ``net(x.astype('float16'))``) runs no
    kernel of that dtype, as the same plan run op by op does not."""
    nodes = mxi.symbol_graph(plan)["nodes"]
    exempt = {n["name"] for n in nodes if n["op"] == "null" or n["op"] in _CASTS}
    return {t for (name, _), t in typed.items() if t in LOW_PRECISION_DTYPES and name not in exempt}


def kernels_missing(plan: Symbol, typed: Mapping[Key, Optional[str]], dtype: str, device: str) -> list:
    """The ops of ``plan`` computing in ``dtype`` that have no kernel for it on ``device``, by
    the recorded facts (:func:`gluon_amp_core.table.kernel_verdicts`: ``no_kernel``). MXNet's
    CPU build runs most elementwise ops in float16, and has no float16 GEMM or convolution.
    An op the facts do not know runs as plain MXNet runs it: the script computes in that dtype
    itself, so AMP adds no failure there."""
    verdicts = kernel_verdicts(dtype, device)
    nodes = mxi.symbol_graph(plan)["nodes"]
    computing = {name for (name, _), t in typed.items() if t == dtype}
    missing = []
    for node in nodes:
        op = node["op"]
        if op == "null" or op in _CASTS or node["name"] not in computing:
            continue
        keys = [op] + [f"{op}:{k}={v}" for k, v in sorted(node.get("attrs", {}).items())]
        if any(verdicts.get(k) is Verdict.NO_KERNEL for k in keys):
            missing.append(op)
    return sorted(set(missing))


def without_identity_casts(plan: Symbol, typed: Mapping[Key, Optional[str]]) -> Symbol:
    """``plan`` without its casts that convert nothing (``plan`` itself when it has none):
    a symbol built under ``init`` casts every input of a decided op before dtypes are known,
    and such a cast changes how MXNet runs the op that reads it (a block's plan has none: the
    block hooks drop them, :mod:`gluon_amp.patching.hooks`)
    (:func:`gluon_amp_core.retype.drop_identity_casts`)."""
    graph, dropped = drop_identity_casts(mxi.symbol_graph(plan), typed)
    return mx.sym.load_json(json.dumps(graph)) if dropped else plan


class CannotRun(RuntimeError):
    """gluon_amp's refusal of a plan whose low dtypes a device of this machine cannot execute."""


def emulated(plan: Symbol, typed: Mapping[Key, Optional[str]],
             shapes: Optional[Mapping[str, Tuple[int, ...]]] = None, portable: bool = False,
             widen: bool = True, fed: Optional[Mapping[str, str]] = None) -> Symbol:
    """The emulated copy of ``plan`` (typed by MXNet as ``typed``).

    ``fed`` (input name -> the dtype of the array the executor feeds it, where known): an input
    fed in a low dtype is read as it is and cast to float32 exactly, and the outputs real AMP
    holds low come back in the fed dtype (:func:`gluon_amp_core.emulate.emulate_graph`).
    Without it, low-precision graph inputs are kept in their dtype and widened to float32 where
    read (:func:`widen_low_inputs`); ``widen=False``: those inputs become float32 variables (a
    self-contained float32 model). ``portable`` copies round with MXNet's ops only (they may be
    saved and loaded elsewhere)."""
    if fed is not None:
        return emulate_symbol(plan, typed, shapes, portable=portable, fed=fed)[0]
    graph = mxi.symbol_graph(plan)
    if widen:
        graph, typed = widen_low_inputs(graph, typed)
    return emulate_symbol(mx.sym.load_json(json.dumps(graph)), typed, shapes, portable=portable)[0]


def widen_low_inputs(graph: dict, typed: Mapping[Key, Optional[str]]) -> Tuple[dict, Dict[Key, Optional[str]]]:
    """``graph`` (MXNet's JSON) with each variable the plan holds in float16/bfloat16 (a
    converted model's parameters, float16 data, a ``net.cast('float16')``) read through an
    ``amp_cast`` to float32, and the dtypes for the result.

    The variable keeps its dtype, so an executor binds the arrays the user has (a
    ``convert_model`` result's bfloat16 parameters, a block's float16 weights) without a copy,
    and gradients reach them in their dtype; the emulated ops read exact float32 values of
    them. (The emulation rewrite would otherwise make such variables float32 themselves.)
    """
    nodes, typed = graph["nodes"], dict(typed)
    low = {i for i, n in enumerate(nodes) if n["op"] == "null" and typed.get((n["name"], 0)) in LOW_PRECISION_DTYPES}
    if not low:
        return graph, typed
    out: list = []
    moved: Dict[int, int] = {}  # old node index -> new
    widened: Dict[int, int] = {}  # old variable index -> its widening cast

    def entry(e: list) -> list:
        return [widened[e[0]], 0, 0] if e[0] in widened else [moved[e[0]], e[1], 0]

    for i, node in enumerate(nodes):
        out.append({**node, "inputs": [entry(e) for e in node.get("inputs", [])]})
        moved[i] = len(out) - 1
        if i in low:
            name = node["name"] + WIDEN_SUFFIX
            out.append({"op": "amp_cast", "name": name, "attrs": {"dtype": "float32"},
                        "inputs": [[moved[i], 0, 0]]})
            widened[i] = len(out) - 1
            typed[(node["name"], 0)] = "float32"  # the emulation then leaves the variable as it is
            typed[(name, 0)] = "float32"
    graph = {**graph, "nodes": out, "arg_nodes": [j for j, n in enumerate(out) if n["op"] == "null"],
             "heads": [entry(h) for h in graph["heads"]]}
    graph.pop("node_row_ptr", None)
    return graph, typed


# -- which policy applies ----------------------------------------------------------------

# The converted results remembered, and their policies, live in state (state.process.converted:
# one home, one reset). Kept here: the bookkeeping of the hooks installed in MXNet (the hooks,
# who holds them, their lock), which follows what MXNet holds and must survive a state.reset().
#: how many converted Symbols are held (the newest)
_KEEP_SYMBOLS = 64
_lock = threading.Lock()
#: the execution hooks (Symbol.bind/simple_bind, the block's CachedOp build), installed while
#: anyone holds them (``init``; converted results)
hooks_held = state.Held(lambda: mxi.install_execution_hooks(while_gc_paused(mxi.shared_reads()(_for_block)),
                                                            while_gc_paused(mxi.shared_reads()(_for_symbol)),
                                                            _take_forward_only),
                        mxi.remove_execution_hooks)


def remember(result: Any, policy: Policy) -> None:
    """Run ``result`` (a converter's Symbol or block) as ``policy`` says wherever it is
    bound in this process, with or without ``init``: natively where its dtypes run, emulated
    with ``policy.emulate``, else refused with gluon_amp's error naming ``emulate=True``."""
    with state.lock:
        converted = state.process.converted
        if isinstance(result, Symbol):
            symbols = converted.symbols
            symbols[mxi.symbol_address(result)] = (result, policy)
            symbols.move_to_end(mxi.symbol_address(result))
            while len(symbols) > _KEEP_SYMBOLS:
                symbols.popitem(last=False)
        else:
            converted.blocks[result] = policy
    hold("converted")  # for the process: remembered results may be bound at any time


def carry_converted(old: Symbol, new: Symbol) -> Symbol:
    """``new``, made from ``old`` by adding to it (a Module's scaled loss heads), bound as
    ``old`` would be: under the policy of ``old``'s converter, where it is a converter's."""
    policy = _remembered(old)
    if policy is not None:
        remember(new, policy)
    return new


def policy_for(obj: Any) -> Optional[Policy]:
    """The policy a bound Symbol or block runs under: the one its converter was asked for,
    else the one in force, else None (plain MXNet)."""
    mine = _remembered(obj)
    active = state.current_policy()
    if mine is None:
        return active
    if not mine.emulate and active is not None and active.emulate:
        return dataclasses.replace(mine, emulate=True, tune=False)  # this thread emulates what it runs
    return mine


def _remembered(obj: Any) -> Optional[Policy]:
    converted = state.process.converted
    if isinstance(obj, Symbol):
        mine = converted.symbols.get(mxi.symbol_address(obj))
        return mine[1] if mine is not None and mine[0] is obj else None
    return converted.blocks.get(obj) if isinstance(obj, HybridBlock) else None


def forget_converted() -> None:
    """Forget every converter result remembered (:func:`remember`) and release the hooks they
    held (tests; a process that has no more use for them). :func:`gluon_amp.state.reset` does
    it too."""
    with state.lock:
        state.process.converted.blocks.clear()
        state.process.converted.symbols.clear()
    release("converted")


def hold(owner: str) -> None:
    """Install the execution hooks (Symbol.bind/simple_bind, the block's CachedOp build)
    while any owner holds them (``init``; converted results)."""
    hooks_held.hold(owner)


def release(owner: str) -> None:
    """Remove the execution hooks when no owner holds them any more (``disable``)."""
    hooks_held.release(owner)


def _on_init(policy: Policy) -> None:
    """Nothing: ``init`` holds the hooks itself (:func:`hold`), where it patches."""


def _on_disable() -> None:
    """Nothing: ``disable`` releases the hooks itself (:func:`release`)."""


def _forget() -> None:
    """After :func:`gluon_amp.state.reset` forgot the converted results: release the hooks they
    held."""
    release("converted")


state.register_extension(state.Extension(_on_init, _on_disable, _forget))
# a simulated native host (tests): graphs bound without a policy hold bfloat16 kernels too
runtime.on_simulation(lambda: hold("simulated"), lambda: release("simulated"))


def executed_graph(block: HybridBlock) -> Optional[Symbol]:
    """The graph ``block``'s CachedOp runs where it is not the block's plan (an emulated copy,
    or the plan with its outputs as fed: :func:`outputs_as_fed`), else None."""
    return mxi.executed_graph(block)


def runs_emulated(obj: Any) -> bool:
    """True for a block whose CachedOp runs an emulated copy of its plan, and for a
    converter's result asked with ``emulate=True``."""
    if isinstance(obj, HybridBlock) and executed_graph(obj) is not None:
        policy = policy_for(obj)
        return policy is not None and policy.emulate  # else the plan, its outputs as fed
    mine = _remembered(obj)
    return mine is not None and mine.emulate


# -- the two binding sites --------------------------------------------------------------

def _for_block(block: HybridBlock, args: tuple, plan: Symbol, inputs: Any) -> Symbol:
    _FORWARD_ONLY.pop(block, None)
    policy = policy_for(block)
    if policy is None and not runtime.simulated():
        return plan
    # before a simulated host's stand-ins: a real host stores those low
    converted_casts = _reads_params_through_casts(block, plan)
    stand_in = getattr(block, "float32_stand_in_params", ())
    if stand_in:  # held float32 for the float32 graph: the plan reads them through casts
        graph = params_read_through_casts(mxi.symbol_graph(plan), stand_in)
        plan = mx.sym.load_json(json.dumps(graph))
    known, shapes = mxi.call_inputs(block, args, inputs)
    if policy is not None and policy.enabled and policy.emulate:
        known = _as_declared_low(plan, known)
    # a converter's result bound outside autograd: slow ops of one shape as their fast twins (in a
    # training graph their bfloat16 gradients reach batch norms in a layout oneDNN runs slowly)
    plan = with_twins(block, plan, known, shapes,
                      policy if _remembered(block) is not None and not mx.autograd.is_recording() else None)
    plan_notes.record_fed(block, known)  # report types the plan as it runs (gluon_amp.reporting)
    devices = {a.ctx.device_type for a in mxi.call_arrays(args) if isinstance(a, NDArray)}
    typed = plan_dtypes(plan, known)
    run = graph_to_run(plan, known, shapes, devices, policy, f"block {block.name!r}", plan_notes.plan_heads(block),
                       pair=_remembered(block) is None, accumulating=mxi.accumulating_params(block),
                       typed=typed, fused=mxi.block_backend(block)[0] is not None)
    float32 = bool(typed) and not any(t in LOW_PRECISION_DTYPES for t in typed.values())
    if getattr(block, "amp_speed_rule", False) and policy is not None and not policy.emulate:
        faster = _float32_where_slower(block, plan, known, shapes, policy)
        run, float32 = (run, float32) if faster is None else (faster, True)
        block.runs_float32_stand_in = faster is not None  # it may store its weights float32 for it
    if not float32 and (converted_casts if _remembered(block) is not None else run is not plan) and policy is not None \
            and policy.enabled and not policy.emulate and stores_casts() and mxi.casts_storable():
        # the partial holds no reference to the block: the weak dictionary's entry dies with it
        _FORWARD_ONLY[block] = functools.partial(_forward_only_graph, f"block {block.name!r}",
                                                 frozenset(block.collect_params().keys()),
                                                 plan_notes.plan_heads(block), plan, known, shapes, devices, policy)
    plan_notes.record(block, "padded_inputs", {})
    if (not float32 and _remembered(block) is None and policy is not None and policy.enabled
            and not policy.emulate and run is not plan and "cpu" in devices and not runtime.amx_active()
            and not runtime.simulated() and mxi.block_backend(block)[0] is None and not mx.util.is_np_array()):
        # an image's first convolution trains in bfloat16 on a zero channel more (the caller pads);
        # not on AMX, whose float32 stem ran faster than its bfloat16 on 3 or 4 channels (docs/speed.md)
        run, pads = with_padded_images(run, known, shapes, [i.name for i in inputs], policy.table)
        if pads:
            mxi.padded_inputs.record_pads(block, pads)
            plan_notes.record(block, "padded_inputs", padded_image_notes(typed, run, known, pads))
    if (run is not plan and policy is not None and policy.enabled and policy.emulate and "cpu" in devices
            and mxi.block_backend(block)[0] is None and not mx.util.is_np_array()):
        run = _inputs_rounded_by_caller(block, run, [i.name for i in inputs])
    if run is not plan and policy is not None and policy.emulate:  # the report says which nodes real AMP runs low
        plan_notes.record_emulated(block, {name: t for (name, i), t in typed.items()
                                           if i == 0 and t in LOW_PRECISION_DTYPES})
    return run


def _as_declared_low(plan: Symbol, known: Mapping[str, str]) -> Dict[str, str]:
    """``known`` with each float32 input the graph declares low (``__dtype__``) typed as declared:
    a given graph converted to float16 (``SymbolBlock.imports`` of one), whose parameters the
    emulated cast rule holds float32 with rounded values (:mod:`gluon_amp.patching.low_cast`).
    Typed as stored, its data cast to float16 met float32 weights: no dtype for any op, and MXNet
    ran the graph as given, on float16 kernels a CPU lacks."""
    declared = plan.attr_dict()
    out = dict(known)
    for name, dtype in known.items():
        code = declared.get(name, {}).get("__dtype__")
        low = CODE_DTYPE.get(int(code)) if code is not None else None
        if dtype == "float32" and low in LOW_PRECISION_DTYPES:
            out[name] = low
    return out


def _inputs_rounded_by_caller(block: HybridBlock, run: Symbol, data: Sequence[str]) -> Symbol:
    """``run``, an emulated graph of ``block``, reading each data input it only rounds as it is,
    the block's CachedOp fed the call's array rounded, as a recorded op: the first ops then read
    a graph input, and MXNet computes no data gradient for an image that needs none
    (:func:`gluon_amp_core.emulate.lift_input_roundings`)."""
    graph, dtypes = lift_input_roundings(mxi.symbol_graph(run), data, emulation_kernel.OP_NAME)
    if not dtypes:
        return run
    mxi.padded_inputs.record_rounded(block, {name: functools.partial(round_nd, dtype=d) for name, d in dtypes.items()})
    return mx.sym.load_json(json.dumps(graph))


def _reads_params_through_casts(block: HybridBlock, plan: Symbol) -> bool:
    """Whether ``block``, a converter's result, reads parameters through casts to a low dtype: a
    numpy-mode block's weights stay float32 (1.9.1's ``mx.np`` has no bfloat16), or
    ``cast_optional_params=False``. Its fused ops then prepare each weight again at every
    call; a ResNet-50 in numpy mode, batch 1: 66 ms a call, 48 on stored casts (docs/speed.md)."""
    return _remembered(block) is not None and \
        bool(params_stored_low(mxi.symbol_graph(plan), frozenset(block.collect_params().keys()))[1])


#: Environment variable that turns stored casts off (``0``, ``off``, ``false``, ``no``): every
#: call of a block under ``init`` then casts its parameters, as a recording call does.
STORED_CASTS_ENV = "GLUON_AMP_STORED_CASTS"


def stores_casts() -> bool:
    """Whether blocks bound from now on under ``init`` run their calls that record nothing on
    parameter casts made once (:mod:`gluon_amp.mxnet_internals.forward_only`)."""
    return not switched_off(os.environ, STORED_CASTS_ENV)


#: blocks bound under ``init`` whose calls that record nothing may run on their parameters'
#: casts made once: how to make that graph (:func:`_forward_only_graph`)
_FORWARD_ONLY: "weakref.WeakKeyDictionary[HybridBlock, mxi.forward_only.Make]" = weakref.WeakKeyDictionary()


def _take_forward_only(block: HybridBlock) -> Optional["mxi.forward_only.Make"]:
    """How to make ``block``'s graph for calls that record nothing, once, where its binding gave one."""
    return _FORWARD_ONLY.pop(block, None)


def _forward_only_graph(what: str, params: Collection[str], plan_heads: Optional[Sequence[Optional[str]]],
                        plan: Symbol, known: Mapping[str, str], shapes: Mapping[str, Tuple[int, ...]],
                        devices: Collection[str], policy: Policy) -> Optional["mxi.forward_only.Made"]:
    """For the calls that record nothing of a block (``what``, its ``params`` by name, its
    ``plan_heads``: :func:`graph_to_run`): its plan with each parameter that it reads
    only through casts to one low dtype stored in that dtype, run as a converter's result is
    (no casts paired for a backward pass), with those parameters' dtypes and how to make what
    is fed for each: its cast, or on a simulated native host, whose bfloat16 runs emulated,
    its rounded float32 values (the emulated graph rounds them again, to the same values).
    None where the plan casts no parameter so."""
    graph, low = params_stored_low(mxi.symbol_graph(plan), params)
    if not low:
        return None
    variant = mxi.like_frontend(plan, mx.sym.load_json(json.dumps(graph)))
    stored = {**known, **low}
    rounded = runtime.simulated() and "bfloat16" in low.values()
    fed = {**known, **{n: "float32" for n in low}} if rounded else stored
    run = graph_to_run(variant, fed, shapes, devices, policy, what, plan_heads, pair=False,
                       accumulating=frozenset(), typed=plan_dtypes(variant, stored), fused=False)
    return mxi.forward_only.Made(mxi.like_frontend(plan, run), low, round_nd if rounded else mxi.forward_only.cast)


def _float32_where_slower(block: HybridBlock, plan: Symbol, known: Mapping[str, str],
                          shapes: Mapping[str, Tuple[int, ...]], policy: Policy) -> Optional[Symbol]:
    """For a converted block nothing measured: the same graph in float32 where the rule for a
    graph not measured yet (``init``'s: the plan's multiply-adds per element its casts
    convert, at these shapes) says its plan is slower, else None. The block keeps its plan;
    its report's fallbacks say what ran. Fed data in a low dtype runs the plan as fed."""
    from .tuning.tuner import Target, applier
    if not policy.enabled or not shapes or any(known.get(n, "float32") != "float32" for n in shapes):
        return None
    target = Target(plan, known, applier(plan, known, policy), policy, train=False)
    if not target.low_ops() or not target.unmeasured_fp32(shapes):
        return None
    why = "float32: the block " + target.describe_unmeasured(
        "converted without input_shapes", shapes) + "; convert with input_shapes to measure it, or tune=False to " \
        "run the plan as it is"
    said = tuple(getattr(block, "amp_fallbacks", ()))
    if why not in said:
        block.amp_fallbacks = said + (why,)  # what the report says ran; the plan stays as converted
        warnings.warn(f"gluon_amp: {why}", UserWarning, stacklevel=2)
    fp32 = target.fp32()  # its stored bfloat16 weights cast to float32 on every call: keep their batch norms apart
    if mxi.block_backend(block)[0] is None:
        return fp32
    return with_batchnorms_apart(fp32, plan_dtypes(fp32, known), shapes)


def _for_symbol(sym: Symbol, ctx: Any, dtypes: Mapping[str, Any], shapes: Mapping[str, Tuple[int, ...]],
                group2ctx: Optional[Mapping[str, Any]], accumulating: Collection[str] = frozenset(),
                trains: bool = True) -> Union[Symbol, "mxi.RefusedRun"]:
    policy = policy_for(sym)
    if policy is None and not runtime.simulated():
        return sym
    converted = _remembered(sym) is not None
    devices = {ctx.device_type, *(c.device_type for c in (group2ctx or {}).values())}
    declared = sym.attr_dict()
    inputs = sym.list_inputs()
    # MXNet's executors allocate what a variable declares, else float32
    known = {n: CODE_DTYPE.get(int(declared[n]["__dtype__"]), "float32") if "__dtype__" in declared.get(n, {})
             else "float32" for n in inputs}
    known.update({k: mxi.FLOAT_NAMES.get(v) or dtype_name(v) for k, v in dtypes.items() if k in set(inputs)})
    fused = mxi.partitioned_when_bound(devices, trains)
    if policy is not None:  # else a simulated host's plain graph (graph_to_run), run as MXNet has it
        typed = infer_dtypes(sym, known, partial=True) or {}
        if not converted and typed:  # traced under init before dtypes were known, as a block's first build retypes it
            sym, typed, _ = slow_kernels_in_float32(sym, known, dict(typed), policy, users_casts(mxi.symbol_graph(sym)))
        sym = without_identity_casts(sym, typed)
        if not converted:
            sym = _bound_verdict(sym, known, shapes, devices, policy, trains, fused)
    try:
        # bound without gradients, MXNet fuses each convolution with its batch norm, which then
        # folds the batch norm into the weight cast anew at every call: kept apart where that costs less
        return graph_to_run(sym, known, shapes, devices, policy, "the bound symbol", pair=not converted and trains,
                            accumulating=accumulating, fused=fused)
    except CannotRun as refused:
        # Binding is also how users infer a graph's shapes and types (and Module binds before it
        # runs): the executor binds, and its first forward raises this before MXNet's kernels would.
        return mxi.RefusedRun(sym, refused)


def _bound_verdict(sym: Symbol, known: Mapping[str, str], shapes: Mapping[str, Tuple[int, ...]],
                   devices: Collection[str], policy: Policy, trains: bool, fused: bool) -> Symbol:
    """``init``'s per-graph verdict for a plan bound as a Symbol (``Module``, an executor), as a
    hybridized block's graph gets it at its first call (:mod:`gluon_amp.tuning.schedule`): the
    whole-graph outcome stored for this graph where the timing cache holds one, else the rule
    for a graph not measured yet at the bind's shapes (a small product between casts runs
    float32; so does every plan where the speed probe found the dtype slower). A bind times
    nothing: a Module binds once, before any step could pay for it. ``tune=False``, emulation,
    GPUs and data fed in a low dtype keep the plan."""
    from .tuning.tuner import Target, applier, check_applied, choices_to_run, graph_key, load_outcome
    if not policy.enabled or not policy.tune or policy.emulate or set(devices) != {"cpu"} or not shapes:
        return sym
    if any(known.get(n, "float32") != "float32" for n in shapes if n in known):
        return sym
    target = Target(sym, known, applier(sym, known, policy), policy, train=trains, fused=fused, casts_weights=True)
    if not target.low_ops():
        return sym
    outcome = load_outcome(runtime.timing_cache(), graph_key(target), len(target.graph["nodes"]))
    choices, why = choices_to_run(target, outcome, shapes)
    if not choices:
        return sym
    run = target.apply(choices)
    if check_applied(run, known, choices):
        return sym  # the untuned plan, as a block whose choices do not apply runs it
    owner = state.thread.binding_module  # a Module's bind: once for it and the buckets on its memory
    if (all(c.dtype == "float32" for c in choices.values()) and set(choices) == set(target.low_ops())
            and (owner is None or state.first_for(owner))):
        measured = outcome is not None and outcome.verdict is not None
        state.say_once(f"gluon_amp: a bound symbol (graph {graph_key(target)[:8]}: {len(choices)} "
                       f"{policy.target_dtype} ops, {mxi.symbol_graph(sym)['nodes'][-1]['name']!r} last) {why}"
                       f"{'' if measured else '; a bind measures nothing, so it stays float32'} "
                       "(init(..., tune=False) runs its plan as it is)"
                       + ("; said once per Module, for a BucketingModule once for all its buckets"
                          if owner is not None else ""), category=UserWarning,
                       past=(mxi.MXNET_PACKAGE, contextlib.__file__))  # the hooks' decorators
    return run


def cannot_run(what: str, dtype: str, device: str, ops: Sequence[str] = ()) -> str:
    """The message for a low-precision op this machine cannot execute (``ops``: those, where
    only some of the graph's ops in ``dtype`` lack a kernel)."""
    why = ("MXNet's CPU build has no float16 convolution or GEMM" if dtype == "float16"
           else runtime.capability().why)
    which = f"{', '.join(ops)} in {dtype}" if ops else f"{dtype} kernels"
    return (f"gluon_amp: {what} would run {which} on the {device}, which this machine cannot "
            f"execute ({why}). Call gluon_amp.init(target_dtype={dtype!r}, emulate=True) (under "
            f"python -m gluon_amp.run: --emulate --target-dtype {dtype}) to run the same plan emulated "
            f"in float32 on this CPU (for numerics), or run on hardware with {dtype} kernels.")
