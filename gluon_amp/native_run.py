"""What a plan runs natively in bfloat16, past the plan itself: the passes MXNet's executor gets
and the plan (what ``export`` and the converters write) never holds. One place, so the graph a
block trains and the graph the tuner times are the same graph.
"""
from __future__ import annotations

import json
from typing import Collection, Dict, Iterable, Mapping, Optional, Tuple

import mxnet as mx
from mxnet.symbol import Symbol

from gluon_amp_core.accumulating_casts import cast_accumulating_inputs
from gluon_amp_core.decide import Reason, users_casts
from gluon_amp_core.filter_blocks import AMX_BLOCK, BLOCK, filters_to_pad, whole_filter_blocks
from gluon_amp_core.fusion_barriers import keep_batchnorms_apart
from gluon_amp_core.graph_pass import is_kept
from gluon_amp_core.layout_guards import BATCHNORM_OPS, batchnorms_at_risk, guard_batchnorm_layouts
from gluon_amp_core.paired_casts import pair_param_casts
from gluon_amp_core.plain_views import VIEW_OPS, plain_before_views
from gluon_amp_core.padded_inputs import pad_image_inputs
from gluon_amp_core.retype import in_float32
from gluon_amp_core.shape_limits import OddChannelsRule, limited_nodes
from gluon_amp_core.shape_only import SHAPE_ONLY_INPUTS, stop_shape_only_gradients
from gluon_amp_core.table import OpClass, OpTable, default_table
from gluon_amp_core.walk import Note

from . import runtime
from .mxnet_internals import symbol_graph
from .type_inference import infer_dtypes, infer_shapes

Key = Tuple[str, int]


def native_passes(plan: Symbol, typed: Mapping[Key, Optional[str]], shapes: Mapping[str, Tuple[int, ...]],
                  devices: Iterable[str], pair: bool, accumulating: Optional[Collection[str]],
                  fused: bool = False) -> Symbol:
    """What a plan typed ``typed`` runs natively in bfloat16, past its plan: first, in float32, the
    ops whose bfloat16 kernel fails at these shapes (:func:`within_kernel_limits`); a plain copy
    of each 5-d value a reshape reads (:func:`with_plain_views`); the casts of inputs
    that accumulate through an identity (a CPU), then, for a training graph (``pair``), on a
    CPU no gradient pass for values read only for their shape (:func:`with_shape_only_stops`),
    on AMX the batch norms' layout guards, the weight casts paired with their ops' data, and
    each convolution on whole blocks of filters (:func:`with_whole_filter_blocks`); where
    MXNet's oneDNN fusion partitions what runs (``fused``), the batch norms it would fold anew
    on every call kept apart where that costs less (:func:`with_batchnorms_apart`). The tuner
    times its graphs through this too, so a verdict is the graph's that will run. ``plan``
    itself where nothing applies."""
    low = set(typed.values())
    run = plan
    if "bfloat16" in low:
        run, typed = within_kernel_limits(run, typed, shapes)
        run = with_plain_views(run, typed, shapes)
    if "bfloat16" in low and "cpu" in devices:
        run = with_accumulating_casts(run, typed, accumulating)
    if pair and "bfloat16" in low and "cpu" in devices:
        run = with_shape_only_stops(run)
    if pair and "bfloat16" in low:
        run = with_paired_casts(with_layout_guards(run, typed, shapes) if guards_layouts(pair) else run, typed)
        if pads_filters(pair, devices):
            run = with_whole_filter_blocks(run, typed, shapes)
    if fused and "cpu" in devices:
        run = with_batchnorms_apart(run, typed, shapes)
    return run


def within_kernel_limits(plan: Symbol, typed: Mapping[Key, Optional[str]], shapes: Mapping[str, Tuple[int, ...]]
                         ) -> Tuple[Symbol, Mapping[Key, Optional[str]]]:
    """``plan`` with the ops it runs in bfloat16 where their kernel fails at these ``shapes``
    (the bfloat16 table's input-shape rules, :mod:`gluon_amp_core.shape_limits`) computing in
    float32, the ops after them that follow their inputs' dtype too, up to the next
    low-precision op (:func:`gluon_amp_core.retype.in_float32`: a convolution, its batch norm
    and its residual add stay in one dtype, so MXNet's oneDNN fusion still partitions them),
    and its typing. A converted plan holds no shapes, and a bound one may meet any: ``init``
    keeps such ops float32 as its blocks meet their shapes, and this is the same rule where
    any plan is bound. ``plan`` and ``typed`` themselves where none is; the plan is never
    changed."""
    rules = default_table("bfloat16").narrow_fp32
    graph = symbol_graph(plan)
    if not any(n["op"] in rules and typed.get((n["name"], 0)) == "bfloat16" for n in graph["nodes"]):
        return plan, typed
    limited = limited_nodes(graph["nodes"], typed, infer_shapes(plan, shapes), rules, "bfloat16")
    if not limited:
        return plan, typed
    table = default_table("bfloat16")

    def follows(node: dict) -> bool:  # as the converter types what comes after a float32 op
        return table.classes.get(table.canonical(node["op"])) is not OpClass.LOW_PRECISION and not is_kept(node)

    inputs = {n["name"]: typed[(n["name"], 0)] for n in graph["nodes"]
              if n["op"] == "null" and typed.get((n["name"], 0)) is not None}
    for how in (follows, None):  # the float32 values flowing on to the next low op; else cast back at once
        run = mx.sym.load_json(json.dumps(in_float32(graph, limited, typed, users_casts(graph), how)))
        run_typed = infer_dtypes(run, inputs, partial=True)
        if run_typed:
            return run, run_typed
    return run, {}


def with_plain_views(plan: Symbol, typed: Mapping[Key, Optional[str]],
                     shapes: Mapping[str, Tuple[int, ...]]) -> Symbol:
    """``plan`` with each reshape of a 5-d bfloat16 value reading a plain copy of it, as MXNet
    1.9.1 cannot use a reshaped view of a oneDNN 5-d bfloat16 array
    (:func:`gluon_amp_core.plain_views.plain_before_views`). ``plan`` itself where there is
    none; the plan is never changed."""
    graph = symbol_graph(plan)
    if not any(n["op"] in VIEW_OPS and typed.get((n["name"], 0)) == "bfloat16" for n in graph["nodes"]):
        return plan
    graph, copied = plain_before_views(graph, typed, infer_shapes(plan, shapes), "bfloat16")
    return mx.sym.load_json(json.dumps(graph)) if copied else plan


def with_batchnorms_apart(plan: Symbol, typed: Mapping[Key, Optional[str]],
                          shapes: Mapping[str, Tuple[int, ...]]) -> Symbol:
    """``plan`` with a batch norm that reads a convolution whose weight is cast in the graph,
    and larger than its output at these ``shapes``, kept out of that convolution's oneDNN
    fusion, which would fold it again on every call
    (:func:`gluon_amp_core.fusion_barriers.keep_batchnorms_apart`). ``plan`` itself where
    there is none; the plan is never changed (what ``export`` writes)."""
    graph = symbol_graph(plan)
    if not any(n["op"] == "Convolution" for n in graph["nodes"]):
        return plan
    graph, kept = keep_batchnorms_apart(graph, typed, infer_shapes(plan, shapes))
    return mx.sym.load_json(json.dumps(graph)) if kept else plan


def with_shape_only_stops(plan: Symbol) -> Symbol:
    """``plan`` with a ``BlockGrad`` where a value enters a path that reads it only for its
    shape (SSD's anchors: ``slice_like(anchors, feature * 0)``), so that no zero gradient of it
    runs backward and reaches the value's gradient sum as a plain array
    (:func:`gluon_amp_core.shape_only.stop_shape_only_gradients`). ``plan`` itself where there
    is none; the plan is never changed (what ``export`` writes)."""
    graph = symbol_graph(plan)
    if not any(n["op"] in SHAPE_ONLY_INPUTS for n in graph["nodes"]):
        return plan
    graph, stopped = stop_shape_only_gradients(graph)
    return mx.sym.load_json(json.dumps(graph)) if stopped else plan


def with_padded_images(run: Symbol, known: Mapping[str, str], shapes: Mapping[str, Tuple[int, ...]],
                       data: Collection[str], table: OpTable) -> Tuple[Symbol, Dict[str, Tuple[int, str]]]:
    """``run``, a block's training graph bound on a CPU without AMX, with each image input whose
    first convolution the table's odd-channels rule keeps in float32 read as a map of one
    channel more, in bfloat16, so that it and the layers after it train in bfloat16 on
    oneDNN's blocked kernels (:mod:`gluon_amp_core.padded_inputs`); and, by input name, the
    channels and dtype the caller feeds it (:mod:`gluon_amp.mxnet_internals.padded_inputs`).
    ``run`` itself and ``{}`` where none is, or where MXNet does not type the result as before."""
    rules = [r for r in table.narrow_fp32.get("Convolution", ()) if isinstance(r, OddChannelsRule)]
    if not rules or not any(len(shapes.get(n, ())) == 4 for n in data):
        return run, {}
    typed = infer_dtypes(run, known, partial=True) or {}
    entry_shapes = infer_shapes(run, shapes)
    graph, pads = pad_image_inputs(symbol_graph(run), typed, entry_shapes, data,
                                   lambda shape, attrs: any(r.applies(shape, attrs) for r in rules), "bfloat16")
    if not pads:
        return run, {}
    padded = mx.sym.load_json(json.dumps(graph))
    after = infer_dtypes(padded, {**known, **{n: "bfloat16" for n in pads}}, partial=True) or {}
    # every input's shape given: MXNet cannot infer a weight from its concatenation with zeros
    inputs = {n: entry_shapes.get((n, 0)) for n in run.list_inputs()}
    out_shapes = infer_shapes(padded, {k: (v[:1] + (pads[k],) + v[2:] if k in pads else v)
                                       for k, v in {**inputs, **shapes}.items() if v})
    nodes = graph["nodes"]
    heads = [(nodes[h[0]]["name"], h[1]) for h in graph["heads"]]
    if any(after.get(h) is None or after.get(h) != typed.get(h) or not out_shapes.get(h) for h in heads):
        return run, {}
    return padded, {n: (c, "bfloat16") for n, c in pads.items()}


def padded_image_notes(typed: Mapping[Key, Optional[str]], padded: Symbol, known: Mapping[str, str],
                       pads: Mapping[str, Tuple[int, str]]) -> Dict[str, Note]:
    """What the report says of the plan's float32 nodes (``typed``: the plan's dtypes) that
    ``padded``, the graph :func:`with_padded_images` made, runs in a low dtype: by node name,
    the plan's reason and what runs."""
    after = infer_dtypes(padded, {**known, **{n: t for n, (_, t) in pads.items()}}, partial=True) or {}
    fed = ", ".join(f"{n!r} fed with {c} channels, the last zero" for n, (c, _) in sorted(pads.items()))
    return {name: Note(Reason.NARROW_INPUT.value, f"trains in {after[(name, 0)]} here, on a padded image ({fed}; "
                                                  "gluon_amp_core.padded_inputs)")
            for (name, k), t in typed.items()
            if k == 0 and t == "float32" and after.get((name, 0)) not in (None, "float32")}


def pads_filters(pair: bool, devices: Iterable[str]) -> bool:
    """True when a training graph's (``pair``) bfloat16 convolutions run whole blocks of
    filters here (:func:`filter_block` of them): on a CPU."""
    return pair and "cpu" in devices


def filter_block() -> int:
    """The filter counts oneDNN's bfloat16 convolutions run blocked here: multiples of 32 where
    it runs AMX, of 16 without."""
    return AMX_BLOCK if runtime.amx_active() else BLOCK


def with_whole_filter_blocks(plan: Symbol, typed: Mapping[Key, Optional[str]],
                             shapes: Mapping[str, Tuple[int, ...]]) -> Symbol:
    """``plan`` with each bfloat16 convolution whose filter count is not a multiple of
    :func:`filter_block` given zero filters up to one and its output sliced back, so that oneDNN
    runs its blocked kernels rather than a GEMM on plain arrays, or AMX's data gradient rather
    than its ``avx512_core_bf16`` one (:func:`gluon_amp_core.filter_blocks.whole_filter_blocks`).
    ``plan`` itself where there is none; the plan is never changed (what ``export`` writes)."""
    graph = symbol_graph(plan)
    block = filter_block()
    if not any(filters_to_pad(n, typed, "bfloat16", block) for n in graph["nodes"]):
        return plan
    graph, padded = whole_filter_blocks(graph, typed, infer_shapes(plan, shapes), "bfloat16", block)
    return mx.sym.load_json(json.dumps(graph)) if padded else plan


def guards_layouts(pair: bool) -> bool:
    """True when a training graph's (``pair``) bfloat16 batch norms get layout guards here (AMX)."""
    return pair and runtime.amx_active()


def guarded_batchnorms(graph: dict, typed: Mapping[Key, Optional[str]],
                       entry_shapes: Mapping[Key, Optional[Tuple[int, ...]]], pair: bool) -> Iterable[int]:
    """The node indices of ``graph``'s (a plan's, MXNet's JSON form) batch norms that
    :func:`native_passes` gives a layout guard here, at these entry shapes."""
    if not guards_layouts(pair) or "bfloat16" not in set(typed.values()):
        return []
    return batchnorms_at_risk(graph, typed, entry_shapes, "bfloat16")


def with_paired_casts(plan: Symbol, typed: Mapping[Key, Optional[str]]) -> Symbol:
    """``plan`` with its bfloat16 casts of parameters paired with their op's data input, so
    that each weight's gradient is cast back to float32, and its bfloat16 buffer freed, as the
    backward pass reaches the op (:func:`gluon_amp_core.paired_casts.pair_param_casts`).
    ``plan`` itself where there is nothing to pair."""
    graph, paired = pair_param_casts(symbol_graph(plan), typed, "bfloat16")
    return mx.sym.load_json(json.dumps(graph)) if paired else plan


def with_accumulating_casts(plan: Symbol, typed: Mapping[Key, Optional[str]],
                            accumulating: Optional[Collection[str]]) -> Symbol:
    """``plan`` with the bfloat16 casts of the float32 inputs in ``accumulating`` (``None``:
    all) reading them through an identity: MXNet 1.9.1's CPU ``amp_cast``/``amp_multicast``
    drop a gradient they add to (:mod:`gluon_amp_core.accumulating_casts`). ``plan`` itself
    where no such input is cast."""
    if accumulating is not None and not accumulating:
        return plan
    graph, changed = cast_accumulating_inputs(symbol_graph(plan), typed, "bfloat16",
                                              accumulating)
    return mx.sym.load_json(json.dumps(graph)) if changed else plan


def with_layout_guards(plan: Symbol, typed: Mapping[Key, Optional[str]],
                       shapes: Mapping[str, Tuple[int, ...]]) -> Symbol:
    """``plan`` with a plain-making ``Reshape`` before each bfloat16 batch norm whose backward
    pass would meet two oneDNN layouts on an AMX host, and run oneDNN's reference kernel
    (:func:`gluon_amp_core.layout_guards.guard_batchnorm_layouts`). ``plan`` itself where
    there is none; the plan is never changed (what ``export`` writes)."""
    graph = symbol_graph(plan)
    if not any(n["op"] in BATCHNORM_OPS for n in graph["nodes"]):
        return plan
    graph, guarded = guard_batchnorm_layouts(graph, typed, infer_shapes(plan, shapes), "bfloat16")
    return mx.sym.load_json(json.dumps(graph)) if guarded else plan
