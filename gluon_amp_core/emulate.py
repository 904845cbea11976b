"""Emulated low precision: the real AMP plan, run in float32 with the target's rounding. Pure.

:func:`emulate_graph` takes a graph as real AMP types it (the dtype of every entry) and
returns a graph in which every entry that real AMP holds in float16 or bfloat16 is a
float32 entry holding exactly the values that dtype can represent. The rounding is a pair
of ``amp_cast`` nodes (to the low dtype and back), which MXNet runs on every CPU: round
to nearest even, float16 overflow to +-inf, float16 subnormals kept. Every op then runs
in float32 between the roundings, where real low-precision kernels accumulate in float32
and round their result: that accumulation inside one op is the one difference in the
forward pass. bfloat16 rounds with float32 arithmetic instead (:data:`BF16_ROUNDING`).

In training, the backward of float16's cast pair rounds each gradient where real AMP holds
it in float16, so the loss scaler sees real float16 overflows; bfloat16's rounding passes
gradients through in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from .dtypes import LOW_PRECISION_DTYPES

Key = Tuple[str, int]  # (node name, output index)

#: Suffix of the nodes that round an entry: ``<node>_amp_emulated`` (back in float32)
#: after ``<node>_amp_emulated_<dtype>`` (the cast down).
ROUND_SUFFIX = "_amp_emulated"
#: Node attribute with the dtype real AMP gives the node's first output.
REAL_DTYPE_ATTR = "__amp_dtype__"

#: Ops whose outputs only hold values of their inputs: rounding after them changes
#: nothing, so it is skipped (speed only: rounding is idempotent).
VALUE_PRESERVING = frozenset({
    "Reshape", "reshape", "Flatten", "flatten", "transpose", "expand_dims", "squeeze",
    "slice", "slice_axis", "slice_like", "_slice", "Crop", "Concat", "concat", "stack",
    "SliceChannel", "split", "_split_v2", "relu", "max", "min", "_copy", "identity",
    "BlockGrad", "stop_gradient", "repeat", "tile", "broadcast_to", "broadcast_like", "take",
    "pick", "gather_nd", "SwapAxis", "swapaxes", "flip", "reverse", "zeros_like", "ones_like",
    "where", "_np_reshape", "_npi_concatenate", "_npx_reshape", "_npx_relu",
})
#: Ops that preserve values for some attribute values only: op -> (attr, values, default).
VALUE_PRESERVING_IF = {"Activation": ("act_type", frozenset({"relu"}), ""),
                       "Pooling": ("pool_type", frozenset({"max"}), "max")}

_CAST_OPS = frozenset({"amp_cast", "Cast", "cast"})

#: Placeholder for the first step of :data:`BF16_ROUNDING`: see :func:`plain_layout`.
PLAIN_LAYOUT = "<plain layout>"

#: Round float32 ``x`` to bfloat16 to nearest even, in float32 arithmetic (MXNet's own
#: float32->bfloat16 ``amp_cast`` is ~10x slower than this on CPUs without AVX-512, and flushes
#: subnormals; its ``Cast`` truncates). Veltkamp's split on ``c = clip(x, +-2**111)``:
#: ``v = r - (r - c)`` with ``r = 65537 c`` is ``c`` rounded to 8 significant bits, to nearest
#: even (checked on every normal float32), and ``d = v - c`` is exact. The result is
#: ``x + BlockGrad(d)``: forward ``v`` (``x`` where the clip changed it: ``d`` is then 0), the
#: gradient the identity, and nothing kept for the backward pass (only the last node is
#: differentiated). Unlike float16's cast pair, bfloat16 emulation does not round gradients.
#: Values of magnitude >= 2**111, inf and NaN pass as they are; float32 subnormals (below
#: 1.2e-38) are rounded to 8 bits relative to their own size, where MXNet's cast flushes them
#: to zero; -0 becomes +0. (The shorter ``RN(65537 x) - 65536 x`` is off by half a step just
#: below each power of two, where the product carries into the next binade.)
#: The first step matters for speed and memory only (see :func:`plain_layout`).
#: Steps: (op, inputs, attrs); an input is "x" or the index of an earlier step.
BF16_ROUNDING: Tuple[Tuple[str, Tuple, Dict[str, str]], ...] = (
    (PLAIN_LAYOUT, ("x",), {}),                                # 0: x in a plain layout
    ("clip", (0,), {"a_min": str(-2.0 ** 111), "a_max": str(2.0 ** 111)}),  # 1: c; 65537 c is finite
    ("_mul_scalar", (1,), {"scalar": "65537.0"}),              # 2: r
    ("elemwise_sub", (2, 1), {}),                              # 3: r - c
    ("elemwise_sub", (2, 3), {}),                              # 4: v, c rounded
    ("elemwise_sub", (4, 1), {}),                              # 5: d, the rounding's change (exact)
    ("BlockGrad", (5,), {}),                                   # 6
    ("elemwise_add", ("x", 6), {}),                            # 7: the result
)


def plain_layout(ndim: Optional[int], plain: bool) -> Tuple[str, Dict[str, str]]:
    """The op (and attributes) that hands a value to the rounding's float32 ops.

    The output of a oneDNN op (convolution, batch norm, pooling, add) is held in a blocked
    memory layout. Under ``static_alloc``, each non-oneDNN op that reads one keeps a private
    plain copy of it for the life of the graph (MXNet's storage fallback), which made
    emulated bfloat16 training hold 2-4x FP32's memory. oneDNN's transpose writes a plain copy
    and leaves the value's own layout alone, so the ops after the rounding (batch norm,
    pooling: several times slower on a plain layout) still get the blocked one; with the
    identity permutation it needs ``ndim``. Without it, a reshape to the same shape gives
    the plain layout at no copy, but converts the value in place. Values already ``plain``
    (parameters) need neither: the reshape is then free.
    """
    if ndim is not None and ndim >= 2 and not plain:
        return "transpose", {"axes": str(tuple(range(ndim)))}
    return "Reshape", {"shape": "(-2,)"}


@dataclass
class EmulatedGraph:
    """The emulated graph and where each real entry's value lives in it.

    Attributes
    ----------
    graph : dict
        MXNet's JSON form; every float entry is float32.
    entries : dict
        ``(node name, output)`` of the real graph -> the entry of ``graph`` holding its
        value (the rounding node after it, when there is one).
    rounds : int
        Rounding pairs inserted.
    """

    graph: dict
    entries: Dict[Key, Key] = field(default_factory=dict)
    rounds: int = 0


def rounding_node(name: str, output: int = 0) -> str:
    """Name of the node that holds output ``output`` of node ``name`` rounded, in an
    emulated graph (it exists only where the plan holds that output in low precision)."""
    return f"{name}{f'_{output}' if output else ''}{ROUND_SUFFIX}"


def preserves_values(op: str, attrs: Mapping[str, str]) -> bool:
    """True when ``op`` with ``attrs`` outputs only values found in its inputs."""
    if op in VALUE_PRESERVING:
        return True
    rule = VALUE_PRESERVING_IF.get(op)
    return rule is not None and attrs.get(rule[0], rule[2]) in rule[1]


class _Rewriter:
    def __init__(self, dtypes: Mapping[Key, Optional[str]], ndims: Mapping[Key, int]) -> None:
        self.dtypes = dtypes
        self.ndims = ndims
        self.nodes: List[dict] = []
        self.rounds = 0

    def add(self, node: dict) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def round(self, entry: Tuple[int, int], dtype: str, base: str) -> Tuple[int, int]:
        """``entry`` (float32) rounded to ``dtype``'s values, back in float32."""
        if dtype == "bfloat16":
            return self.round_bf16(entry, base)
        down = self.add({"op": "amp_cast", "name": f"{base}{ROUND_SUFFIX}_{dtype}",
                         "attrs": {"dtype": dtype}, "inputs": [[entry[0], entry[1], 0]]})
        return self.up((down, 0), base)

    def round_bf16(self, x: Tuple[int, int], base: str) -> Tuple[int, int]:
        """bfloat16 rounding in float32 arithmetic: see :data:`BF16_ROUNDING`."""
        made: List[Tuple[int, int]] = []
        for k, (op, args, attrs) in enumerate(BF16_ROUNDING):
            last = k == len(BF16_ROUNDING) - 1
            inputs = [x if a == "x" else made[a] for a in args]
            if op == PLAIN_LAYOUT:
                op, attrs = plain_layout(self.ndims.get((self.nodes[x[0]]["name"], x[1])), self.is_parameter(x))
            j = self.add({"op": op, "name": f"{base}{ROUND_SUFFIX}" + ("" if last else f"_bf16_{k}"),
                          "attrs": dict(attrs), "inputs": [[e[0], e[1], 0] for e in inputs]})
            made.append((j, 0))
        self.rounds += 1
        return made[-1]

    def is_parameter(self, entry: Tuple[int, int]) -> bool:
        """A variable, or a cast of one (a parameter's value: never in a oneDNN layout)."""
        node = self.nodes[entry[0]]
        while node["op"] in _CAST_OPS:
            node = self.nodes[node["inputs"][0][0]]
        return node["op"] == "null"

    def up(self, entry: Tuple[int, int], base: str) -> Tuple[int, int]:
        """A low-precision ``entry`` back in float32: the second half of a rounding."""
        j = self.add({"op": "amp_cast", "name": f"{base}{ROUND_SUFFIX}",
                      "attrs": {"dtype": "float32"}, "inputs": [[entry[0], entry[1], 0]]})
        self.rounds += 1
        return j, 0


def _outputs(dtypes: Mapping[Key, Optional[str]], name: str) -> List[Optional[str]]:
    outs, k = [], 0
    while (name, k) in dtypes:
        outs.append(dtypes[(name, k)])
        k += 1
    return outs


def emulate_graph(graph: dict, dtypes: Mapping[Key, Optional[str]],
                  ndims: Optional[Mapping[Key, int]] = None) -> EmulatedGraph:
    """Rewrite a graph typed by real AMP (``dtypes``: every entry's dtype) for emulation.

    ``ndims`` (entry -> number of dimensions, where known) lets the bfloat16 rounding keep
    oneDNN's layouts (:func:`plain_layout`); the values are the same without it.

    Variables real AMP stores in a low dtype become float32 variables followed by a
    rounding; casts to a low dtype become roundings (identities where the input has that
    dtype already); ``amp_multicast`` nodes resolve to
    the roundings their typed outputs need; every other op runs in float32 and its
    low-precision outputs are rounded (unless the op only moves values around).
    """
    rw, index = _Rewriter(dtypes, ndims or {}), {}
    entries: Dict[Key, Key] = {}

    def new_entry(e: list) -> Tuple[int, int]:
        return index[(e[0], e[1])]

    for i, node in enumerate(graph["nodes"]):
        name, op, attrs = node["name"], node["op"], dict(node.get("attrs", {}))
        real = _outputs(dtypes, name)
        inputs = [new_entry(e) for e in node["inputs"]]
        if op == "amp_multicast":
            for k, e in enumerate(inputs):
                src = dtypes.get((graph["nodes"][node["inputs"][k][0]]["name"], node["inputs"][k][1]))
                want = real[k] if k < len(real) else None
                index[(i, k)] = (rw.round(e, want, f"{name}_{k}") if want in LOW_PRECISION_DTYPES
                                 and src != want else e)
            continue
        if op == "null":
            if real and real[0] in LOW_PRECISION_DTYPES:
                if "__dtype__" in attrs:
                    attrs["__dtype__"] = "0"
                j = rw.add({**node, "attrs": {**attrs, REAL_DTYPE_ATTR: real[0]}})
                index[(i, 0)] = rw.round((j, 0), real[0], name)
            else:
                index[(i, 0)] = (rw.add(dict(node)), 0)
            continue
        low_cast = op in _CAST_OPS and attrs.get("dtype") in LOW_PRECISION_DTYPES
        if attrs.get("dtype") in LOW_PRECISION_DTYPES and not low_cast:
            attrs["dtype"] = "float32"  # an op that creates low-precision data (zeros, ones)
        if real and REAL_DTYPE_ATTR not in attrs:  # present: emulated before (a converted block in a parent)
            attrs[REAL_DTYPE_ATTR] = str(real[0])
        j = rw.add({**node, "attrs": attrs, "inputs": [[e[0], e[1], 0] for e in inputs]})
        if low_cast:
            src = node["inputs"][0]
            if dtypes.get((graph["nodes"][src[0]]["name"], src[1])) == attrs["dtype"]:
                # A no-op in the plan (init's symbols cast every input of a low-precision op):
                # its input holds the target's values already, as every low entry here does.
                rw.nodes[j]["attrs"] = {**attrs, "dtype": "float32"}
                index[(i, 0)] = (j, 0)
                continue
            if attrs["dtype"] == "bfloat16":  # the plan's cast stays (as float32) for readers
                rw.nodes[j]["attrs"] = {**attrs, "dtype": "float32"}
                index[(i, 0)] = rw.round_bf16((j, 0), name)
            else:  # the cast down is half a rounding already: add the way back up
                index[(i, 0)] = rw.up((j, 0), name)
            continue
        exact = preserves_values(op, attrs)
        for k, dt in enumerate(real or [None]):
            e = (j, k)
            if dt in LOW_PRECISION_DTYPES and not exact:
                e = rw.round((j, k), dt, name + (f"_{k}" if k else ""))  # see rounding_node
            index[(i, k)] = e
    for (i, k), (j, kk) in index.items():
        entries[(graph["nodes"][i]["name"], k)] = (rw.nodes[j]["name"], kk)
    heads = [[*index[(h[0], h[1])], 0] for h in graph["heads"]]
    out = {key: v for key, v in graph.items() if key not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    out["nodes"] = rw.nodes
    out["arg_nodes"] = [j for j, n in enumerate(rw.nodes) if n["op"] == "null"]
    out["heads"] = heads
    return EmulatedGraph(out, entries, rw.rounds)
