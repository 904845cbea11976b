"""Batch norms kept out of MXNet's oneDNN convolution fusion where it would fold them on every
call. Pure: no MXNet.

MXNet 1.9.1's fused convolution (``_sg_mkldnn_conv`` with batch norm) folds the batch norm into
its weights once, and folds again whenever its weight input is a new array: in a plan, a weight
cast inside the graph (``amp_cast``, ``amp_multicast``) is written anew on every call, so the
fold, the weight's reorder and the primitive are redone on each one. A converted plan stores
most weights in the low dtype, but not a grouped convolution's (oneDNN 2.4 cannot reorder stored
bfloat16 grouped weights unfused): GluonCV's ResNeSt-50 ran its fused bfloat16 graph at 366-398
ms a call against 200-213 ms unfused.

:func:`keep_batchnorms_apart` puts an ``amp_cast`` to the convolution's own output dtype (it
converts nothing; MXNet runs it in place) between such a convolution and the batch norm that
reads it, which MXNet's fusion pattern (convolution, then batch norm) no longer matches: the
convolution fuses alone (its weight reordered per call, as unfused), the batch norm runs as its
own op. Values and dtypes are those of the plan.

That is not free: the batch norm then reads and writes the convolution's output, in whatever
layout oneDNN gave it (a 4-channel block for ShuffleNet's groups, where oneDNN 2.4 has only its
reference batch norm). The fold redoes work in proportion to the weight, keeping the batch norm
apart in proportion to the output, so only a convolution whose weight has more elements than its
output (at the shapes it runs) gets a barrier. Measured, converted with the defaults, batch 1,
224x224, bfloat16 on AMX, speed over FP32 with every such batch norm apart / none apart:
ResNeSt-14 1.93 / 1.23 (weights 1.2 million, outputs 0.2 million), ResNeXt-50 1.73 / 3.17,
SE-ResNeXt-50 1.55 / 2.24, MobileNet 1.0 2.58 / 3.15, ShuffleNet v1 0.63 / 0.74 (grouped and
depthwise weights of a few thousand elements).
"""
from __future__ import annotations

from math import prod
from typing import Mapping, Optional, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]

#: Suffix of the cast that keeps a batch norm out of its convolution's fusion.
BARRIER_SUFFIX = "_amp_unfolded"
#: The batch norms MXNet's oneDNN convolution fusion folds.
FOLDED_OPS = frozenset({"BatchNorm", "_contrib_SyncBatchNorm"})


def keep_batchnorms_apart(graph: dict, dtypes: Mapping[Key, Optional[str]],
                          shapes: Mapping[Key, Optional[Tuple[int, ...]]]) -> Tuple[dict, int]:
    """``graph`` (MXNet's JSON form) with a same-dtype ``amp_cast`` between each ``Convolution``
    whose weight or bias is computed in the graph (not a graph input), its weight larger than its
    output, and each batch norm that reads its output as data (module docstring), and how many
    were put in. ``dtypes`` and ``shapes``: every entry's dtype and shape by (node name, output
    index), as MXNet infers them; a convolution whose output dtype or whose weight's or output's
    shape is unknown is left as it is. ``graph`` itself (and 0) where there is none."""
    nodes = graph["nodes"]

    def size(e: list) -> Optional[int]:
        shape = shapes.get((nodes[e[0]]["name"], e[1]))
        return None if shape is None else prod(shape)

    def computed(node: dict) -> bool:
        if not any(nodes[e[0]]["op"] != "null" for e in node["inputs"][1:]):
            return False
        weight, out = size(node["inputs"][1]), shapes.get((node["name"], 0))
        return weight is not None and out is not None and weight > prod(out)

    g = _Rebuilt(graph)
    made = {}
    for i, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        if node["op"] in FOLDED_OPS and inputs:
            src = node["inputs"][0]
            conv = nodes[src[0]]
            dtype = dtypes.get((conv["name"], src[1]))
            if conv["op"] == "Convolution" and dtype is not None and computed(conv):
                if src[0] not in made:
                    made[src[0]] = g.add({"op": "amp_cast", "name": f"{conv['name']}{BARRIER_SUFFIX}",
                                          "attrs": {"dtype": dtype}, "inputs": [inputs[0]]})
                inputs[0] = [made[src[0]], 0, 0]
        g.keep(i, node, inputs)
    return (g.result(), len(made)) if made else (graph, 0)
