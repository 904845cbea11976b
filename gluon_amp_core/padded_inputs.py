"""An image fed with one zero channel more, so its first convolution trains in bfloat16. Pure: no MXNet.

The bfloat16 table keeps a first convolution on an odd number of channels below 16 (an image's
3) in float32, with the batch norm, ReLU and pooling after it (``shape_limits.OddChannelsRule``):
oneDNN 2.4.4 runs it in bfloat16 as a GEMM on plain arrays. Its even counts run blocked and
fast. But a zero channel added inside the graph makes the convolution read an op's output,
whose gradient MXNet then computes (145 ms of a batch-8 SSD-512 step), and those float32
layers hold float32 activations (SSD-512's stem at batch 8: 1,511 MB, against 858 MB in
bfloat16 on a padded input).

So, where a training graph is bound for a block's calls, :func:`pad_image_inputs` has each such
graph input read as a ``channels + 1`` map in bfloat16, fed so by the caller, which pads the
block's argument with zeros at every call: the convolution reads a graph input again (no data
gradient), its weight is cast and given a zero input channel, and it and the layers after it
run in bfloat16, as the plan's other convolutions. Values: the zero channel adds nothing; the
image itself is rounded to bfloat16, as every other convolution's data is.
"""
from __future__ import annotations

from typing import Callable, Collection, Dict, List, Mapping, Optional, Tuple

from .filter_blocks import CONVOLUTION_OPS, with_shapes
from .retype import _Rebuilt
from .shape_limits import attr_ints

Key = Tuple[str, int]
Shape = Tuple[int, ...]
#: Suffix of the nodes that give the weight its zero input channel.
PADDED_SUFFIX = "_amp_padded_input"


def _readers(graph: dict) -> Dict[int, List[Tuple[int, int]]]:
    out: Dict[int, List[Tuple[int, int]]] = {}
    for j, node in enumerate(graph["nodes"]):
        for pos, e in enumerate(node.get("inputs", [])):
            out.setdefault(e[0], []).append((j, pos))
    return out


def paddable(graph: dict, dtypes: Mapping[Key, Optional[str]], shapes: Mapping[Key, Optional[Shape]],
             data: Collection[str], kept: Callable[[Shape, Mapping[str, object]], bool]) -> Dict[int, List[int]]:
    """The graph inputs named in ``data`` (by node index) that :func:`pad_image_inputs` pads, and
    the convolutions reading each: a float32 4-d map whose every reader is a 2-d ``Convolution``
    in float32 reading it as data, in the NCHW layout, that ``kept(shape, attrs)`` (the table's
    odd-channels rule) keeps in float32, whose weight (and bias) are float32 graph inputs of
    known shape read by it alone."""
    nodes = graph["nodes"]
    readers = _readers(graph)
    heads = {h[0] for h in graph["heads"]}
    found: Dict[int, List[int]] = {}
    for i, node in enumerate(nodes):
        shape = shapes.get((node["name"], 0))
        if (node["op"] != "null" or node["name"] not in data or i in heads or not shape or len(shape) != 4
                or dtypes.get((node["name"], 0)) != "float32" or not readers.get(i)):
            continue
        convs = []
        for j, pos in readers[i]:
            conv = nodes[j]
            attrs = conv.get("attrs", {})
            if (pos != 0 or conv["op"] not in CONVOLUTION_OPS or dtypes.get((conv["name"], 0)) != "float32"
                    or attrs.get("layout", "NCHW") not in ("NCHW", "None") or not kept(shape, attrs)):
                break
            params = conv["inputs"][1:]
            if len(attr_ints(attrs.get("kernel"))) != 2 or not params or not all(
                    nodes[e[0]]["op"] == "null" and dtypes.get((nodes[e[0]]["name"], 0)) == "float32"
                    and len(readers.get(e[0], [])) == 1 for e in params):
                break
            wshape = shapes.get((nodes[params[0][0]]["name"], 0))
            if not wshape or len(wshape) != 4 or wshape[1] != shape[1]:
                break
            convs.append(j)
        else:
            found[i] = convs
    return found


def pad_image_inputs(graph: dict, dtypes: Mapping[Key, Optional[str]], shapes: Mapping[Key, Optional[Shape]],
                     data: Collection[str], kept: Callable[[Shape, Mapping[str, object]], bool],
                     low: str) -> Tuple[dict, Dict[str, int]]:
    """``graph`` (MXNet's JSON form) with each input :func:`paddable` finds read as a map of one
    channel more, fed in ``low`` (module docstring): its convolutions' weights cast to ``low`` and
    given a zero input channel, their biases cast. Returns the graph and, by input name, the
    channel count it is to be fed with (``graph`` itself and ``{}`` where none is). The caller
    checks that MXNet types the result with those inputs in ``low``."""
    found = paddable(graph, dtypes, shapes, data, kept)
    if not found:
        return graph, {}
    nodes = graph["nodes"]
    convs = {j: i for i, js in found.items() for j in js}
    pinned: Dict[str, Shape] = {}  # MXNet cannot infer a concatenation's input from its output
    g = _Rebuilt(graph)
    for j, node in enumerate(nodes):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        if j in convs:
            name = node["name"]
            w = node["inputs"][1]
            wshape = shapes[(nodes[w[0]]["name"], 0)]
            f, _, kh, kw = wshape  # type: ignore[misc]
            pinned[nodes[w[0]]["name"]] = wshape  # type: ignore[assignment]
            cast = g.add({"op": "amp_cast", "name": f"{name}_weight{PADDED_SUFFIX}_cast",
                          "attrs": {"dtype": low}, "inputs": [inputs[1]]})
            zeros = g.add({"op": "_zeros", "name": f"{name}_weight{PADDED_SUFFIX}_zeros",
                           "attrs": {"shape": str((f, 1, kh, kw)), "dtype": low}, "inputs": []})
            inputs[1] = [g.add({"op": "Concat", "name": f"{name}_weight{PADDED_SUFFIX}",
                                "attrs": {"dim": "1", "num_args": "2"}, "inputs": [[cast, 0, 0], [zeros, 0, 0]]}), 0, 0]
            for k in range(2, len(inputs)):
                inputs[k] = [g.add({"op": "amp_cast", "name": f"{name}_in{k}{PADDED_SUFFIX}_cast",
                                    "attrs": {"dtype": low}, "inputs": [inputs[k]]}), 0, 0]
        g.keep(j, node, inputs)
    return with_shapes(g.result(), pinned), {nodes[i]["name"]: shapes[(nodes[i]["name"], 0)][1] + 1  # type: ignore[index]
                                             for i in found}
