"""Batch norms whose backward pass would meet two oneDNN layouts, given a plain input. Pure: no MXNet.

On a CPU with AMX, oneDNN lays a bfloat16 activation out channels-last (``acdb``) where its
AMX convolution kernels run, and in 16-channel blocks (``aBcd16b``) where a convolution falls
back to its ``avx512_core_bf16`` kernels: measured with MXNet 1.9.1's oneDNN 2.4.4, a
convolution with a channel count that is not a multiple of 32 (16, 48) on either side runs
one of its three passes there, and a grouped or depthwise one runs there whatever its
channels. A batch norm can then get its data in one layout and its output's gradient in the
other. MXNet's ``_backward_BatchNorm`` reorders the two to one layout only when one of them
is plain; otherwise oneDNN runs its reference kernel, 50-100x slower (GluonCV's
``cifar_resnet20_v1``, batch 32: 30-58 ms a call against 0.5 ms, the default step 1.9x
FP32's; ``mobilenet1.0``, batch 4: 594 ms a step in those batch norms, 11x FP32's step;
``resnext50_32x4d``: 1.2x FP32's step, 0.58x with guards).

:func:`guard_batchnorm_layouts` gives such a batch norm its data through a ``Reshape`` to its
own shape: MXNet's oneDNN ``Reshape`` writes a plain array, so the batch norm's backward
pass reorders the data to its gradient's layout. The values, shapes and dtypes are the plan's.
Only batch norms next to such a convolution get one: elsewhere the plain input costs more
than it saves (a channels-last batch norm's own kernels are faster).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .retype import _Rebuilt

Key = Tuple[str, int]
Shape = Tuple[int, ...]

#: Suffix of the reshape that gives a batch norm a plain input.
GUARD_SUFFIX = "_amp_layout"
#: The batch norms MXNet's oneDNN backward pass runs (the same code with and without ReLU).
BATCHNORM_OPS = ("BatchNorm", "_contrib_BatchNormWithReLU")
#: The channel counts AMX's bfloat16 convolutions take in all three passes (measured).
AMX_CHANNEL_BLOCK = 32
#: The channel block of oneDNN's non-AMX bfloat16 layout: a convolution whose channel counts are
#: not multiples of it runs on plain arrays (a GEMM), whose gradients MXNet reorders itself.
BLOCKED_CHANNELS = 16
#: Ops between a batch norm and a convolution that reads its output which pass the values
#: and their layout on, one to one (their gradients come back in the layout the convolution's
#: backward pass chose). Not additions: a residual sum's gradient reaches the whole chain of
#: blocks after it, whose batch norms measured no slower without a guard (SSD-512).
_PASS_THROUGH = frozenset({"Activation", "relu", "LeakyReLU", "Dropout", "amp_cast", "identity", "_copy"})


def guard_batchnorm_layouts(graph: dict, dtypes: Mapping[Key, Optional[str]],
                            shapes: Mapping[Key, Optional[Shape]], low_dtype: str,
                            block: int = AMX_CHANNEL_BLOCK) -> Tuple[dict, int]:
    """``graph`` with a plain-making ``Reshape`` before the data of each batch norm at risk
    (:func:`batchnorms_at_risk`), and how many got one. ``graph`` itself (and 0) where none is."""
    at_risk = set(batchnorms_at_risk(graph, dtypes, shapes, low_dtype, block))
    if not at_risk:
        return graph, 0
    g = _Rebuilt(graph)
    for i, node in enumerate(graph["nodes"]):
        inputs = [g.entry(e) for e in node.get("inputs", [])]
        if i in at_risk:
            r = g.add({"op": "Reshape", "name": f"{node['name']}{GUARD_SUFFIX}",
                       "attrs": {"shape": "(0, 0, 0, 0)"}, "inputs": [inputs[0]]})
            inputs[0] = [r, 0, 0]
        g.keep(i, node, inputs)
    return g.result(), len(at_risk)


def batchnorms_at_risk(graph: dict, dtypes: Mapping[Key, Optional[str]],
                       shapes: Mapping[Key, Optional[Shape]], low_dtype: str,
                       block: int = AMX_CHANNEL_BLOCK) -> List[int]:
    """The node indices of the batch norms at risk (module docstring), in graph order.

    A batch norm is at risk where it normalises axis 1 of 4-D data that ``dtypes`` holds in
    ``low_dtype`` and an op node (not a graph input) gives it, and a channel count next to it
    is a multiple of :data:`BLOCKED_CHANNELS` but not of ``block`` (the 16-channel blocks):
    its own, or that of a ``Convolution`` next to it: the one that gives its data (seen
    through casts; its ``num_filter`` and its data's axis 1 in ``shapes``, where known), or
    one that reads its output directly or through ops of :data:`_PASS_THROUGH`; or such a
    ``Convolution`` is grouped (``num_group`` above 1: depthwise included)."""
    nodes = graph["nodes"]
    readers: Dict[int, List[int]] = {}
    for i, node in enumerate(nodes):
        for e in node.get("inputs", []):
            readers.setdefault(e[0], []).append(i)

    def entry(e: Sequence[int]) -> Key:
        return nodes[e[0]]["name"], e[1]

    def odd_conv(i: int) -> bool:
        node = nodes[i]
        if node["op"] != "Convolution":
            return False
        attrs = node.get("attrs", {})
        if int(attrs.get("num_group", 1)) > 1:
            return True  # grouped and depthwise kernels are not AMX's
        channels = [int(attrs.get("num_filter", 0))]
        data = shapes.get(entry(node["inputs"][0]))
        if data is not None and len(data) > 1:
            channels.append(int(data[1]))
        return any(c % block and not c % BLOCKED_CHANNELS for c in channels if c > 0)

    def producer(e: Sequence[int]) -> int:
        while nodes[e[0]]["op"] in ("amp_cast", "amp_multicast"):
            e = nodes[e[0]]["inputs"][e[1] if nodes[e[0]]["op"] == "amp_multicast" else 0]
        return e[0]

    def odd_reader(i: int) -> bool:
        seen, todo = {i}, list(readers.get(i, ()))
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            seen.add(j)
            if odd_conv(j):
                return True
            if nodes[j]["op"] in _PASS_THROUGH:
                todo.extend(readers.get(j, ()))
        return False

    at_risk = []
    for i, node in enumerate(nodes):
        data = node["inputs"][0] if node["op"] in BATCHNORM_OPS and node.get("inputs") else None
        shape = shapes.get(entry(data)) if data is not None else None
        if (data is None or nodes[data[0]]["op"] == "null" or dtypes.get(entry(data)) != low_dtype
                or shape is None or len(shape) != 4 or int(node.get("attrs", {}).get("axis", 1)) not in (1, -3)
                or not ((shape[1] % block and not shape[1] % BLOCKED_CHANNELS)
                        or odd_conv(producer(data)) or odd_reader(i))):
            continue
        at_risk.append(i)
    return at_risk
