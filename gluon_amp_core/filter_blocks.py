"""A low-precision convolution runs whole blocks of filters. Pure: no MXNet.

MXNet 1.9.1 refuses oneDNN's padded blocked layouts, so oneDNN 2.4.4 (without AMX) runs a
bfloat16 convolution whose filter count is not a multiple of 16 as a GEMM on plain arrays:
SSD-512's class predictors (324 and 486 filters) and two box predictors (24). In training
that costs twice:

- the GEMM is slower than the blocked kernel (1024 -> 324 filters at 32x32, batch 8: 295 ms
  a pass against 240);
- its data gradient comes back plain, and the gradient sum (``add_n``) of a value that also
  feeds blocked convolutions then leaves oneDNN's sum for MXNet's own loop, which converts
  each bfloat16 input to float32 and back.

:func:`whole_filter_blocks` gives each such convolution zero filters up to a multiple of
:data:`BLOCK` (its weight and bias concatenated with zeros) and slices its output back to the
filters it had: the same values, on the blocked kernel. One such predictor with two blocked
neighbours on one map, forward and backward at batch 8: 1133 -> 847 ms.

With AMX, oneDNN's blocks are 32 channels (:data:`AMX_BLOCK`): 324 or 24 filters run the GEMM,
and 336 or 48 run AMX forward but the data gradient on its ``avx512_core_bf16`` kernel
(a 3x3 convolution, 512 -> 336 filters at 64x64, batch 8: 1,888 ms for the data gradient
against 247 at 352). There each convolution gets zero filters up to a multiple of 32, 16
filters too: alone, doubling them costs more than AMX's data gradient saves (20.6 -> 23.6 ms),
but that gradient comes back in the 16-channel layout, and where it meets AMX's channels-last
gradients in a sum (SSD-512's box predictor of 16 on stage 3's map) oneDNN sums them with its
reference kernel, and the batch norms that gradient then reaches get the two layouts and run
theirs: 7 of them took 11.7 s of a 19 s step at batch 8.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from .layout_guards import AMX_CHANNEL_BLOCK, BLOCKED_CHANNELS
from .retype import _Rebuilt, source_through_casts
from .shape_limits import attr_ints

Key = Tuple[str, int]

#: oneDNN's block of channels in its bfloat16 layouts without AMX (``aBcd16b``).
BLOCK = BLOCKED_CHANNELS
#: The filter counts AMX's bfloat16 convolutions run in all three passes: multiples of this.
AMX_BLOCK = AMX_CHANNEL_BLOCK
#: Suffix of the convolution that runs the whole blocks; the slice keeps the node's own name.
PADDED_SUFFIX = "_amp_whole_blocks"
#: The convolutions it applies to: MXNet's names in a graph's JSON.
CONVOLUTION_OPS = frozenset({"Convolution"})


def _flag(text: Optional[str]) -> bool:
    return str(text).lower() in ("true", "1")


def filters_to_pad(node: dict, dtypes: Mapping[Key, Optional[str]], low: str, block: int = BLOCK) -> int:
    """How many zero filters :func:`whole_filter_blocks` gives ``node`` (MXNet's JSON form): for
    a 2-d ``Convolution`` in ``low`` with no groups, in the NCHW layout, whose filter count is
    not a multiple of ``block`` (:data:`BLOCK`, or :data:`AMX_BLOCK` where oneDNN runs AMX),
    those up to the next multiple; else 0."""
    if node["op"] not in CONVOLUTION_OPS or dtypes.get((node["name"], 0)) != low:
        return 0
    attrs = node.get("attrs", {})
    filters = attr_ints(attrs.get("num_filter"))
    if len(attr_ints(attrs.get("kernel"))) != 2 or len(filters) != 1 or filters[0] <= 0:
        return 0
    if attr_ints(attrs.get("num_group")) not in ((), (1,)) or attrs.get("layout", "NCHW") not in ("NCHW", "None"):
        return 0
    return -filters[0] % block


def whole_filter_blocks(graph: dict, dtypes: Mapping[Key, Optional[str]],
                        shapes: Mapping[Key, Optional[Tuple[int, ...]]], low: str,
                        block: int = BLOCK) -> Tuple[dict, List[str]]:
    """``graph`` (MXNet's JSON form) with each convolution :func:`filters_to_pad` names run on
    whole blocks of filters: its weight (and bias) concatenated with zeros in ``low``, the
    convolution renamed ``<name>`` + :data:`PADDED_SUFFIX`, and a ``slice_axis`` of its first
    filters under the node's own name, so every reader and every ``(name, output)`` key stays
    as it was. A convolution whose weight's shape is not known (``shapes``, by entry) is left.
    Returns the graph and the names of the convolutions padded (``graph`` itself and none
    where there is none)."""
    nodes = graph["nodes"]
    g = _Rebuilt(graph)
    padded: List[str] = []
    pinned: Dict[str, Tuple[int, ...]] = {}  # variable -> its shape, where a concatenation reads it
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        extra = filters_to_pad(node, dtypes, low, block)
        weight = node["inputs"][1] if extra and len(node["inputs"]) > 1 else None
        wshape = shapes.get((nodes[weight[0]]["name"], weight[1])) if weight is not None else None
        if not wshape or len(wshape) != 4:
            g.keep(i, node, inputs)
            continue
        name, attrs = node["name"], node.get("attrs", {})
        filters = int(attrs["num_filter"])

        def zeros_after(at: int, shape: Tuple[int, ...], what: str) -> List[int]:
            src = node["inputs"][at]  # the zeros in its dtype: a plan may keep a bias float32
            dtype = dtypes.get((nodes[src[0]]["name"], src[1])) or low
            zeros = g.add({"op": "_zeros", "name": f"{name}_{what}{PADDED_SUFFIX}_zeros",
                           "attrs": {"shape": str(shape), "dtype": dtype}, "inputs": []})
            return [g.add({"op": "Concat", "name": f"{name}_{what}{PADDED_SUFFIX}",
                           "attrs": {"dim": "0", "num_args": "2"}, "inputs": [inputs[at], [zeros, 0, 0]]}), 0, 0]

        inputs[1] = zeros_after(1, (extra,) + tuple(wshape[1:]), "weight")
        pinned.update(_variables(nodes, node["inputs"][1:2], wshape))
        if len(inputs) > 2 and not _flag(attrs.get("no_bias")):
            inputs[2] = zeros_after(2, (extra,), "bias")
            pinned.update(_variables(nodes, node["inputs"][2:3], (filters,)))
        conv = g.add({**node, "name": name + PADDED_SUFFIX,
                      "attrs": {**attrs, "num_filter": str(filters + extra)}, "inputs": inputs})
        g.at[i] = g.add({"op": "slice_axis", "name": name,
                         "attrs": {"axis": "1", "begin": "0", "end": str(filters)}, "inputs": [[conv, 0, 0]]})
        padded.append(name)
    return (with_shapes(g.result(), pinned), padded) if padded else (graph, [])


def _variables(nodes: List[dict], entries: List[list], shape: Tuple[int, ...]) -> Dict[str, Tuple[int, ...]]:
    """The graph inputs behind ``entries`` (seen through casts), each with ``shape``."""
    out = {}
    for e in entries:
        src = source_through_casts(nodes, (e[0], e[1]))
        if nodes[src[0]]["op"] == "null":
            out[nodes[src[0]]["name"]] = tuple(shape)
    return out


def with_shapes(graph: dict, shapes: Mapping[str, Tuple[int, ...]]) -> dict:
    """``graph`` with each variable named in ``shapes`` declaring it (``__shape__``): MXNet cannot
    infer an input of a concatenation from the concatenation's shape (``Module`` and
    ``simple_bind`` give only the data's shapes). Its nodes' attributes are copied, not changed."""
    for node in graph["nodes"]:
        if node["op"] == "null" and node["name"] in shapes:
            node["attrs"] = {**node.get("attrs", {}), "__shape__": str(shapes[node["name"]])}
    return graph
