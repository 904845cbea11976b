"""Emulated low precision: the real AMP plan, run in float32 with the target's rounding. Pure.

:func:`emulate_graph` takes a graph as real AMP types it (the dtype of every entry) and
returns a graph in which every entry that real AMP holds in float16 or bfloat16 is a
float32 entry holding exactly the values that dtype can represent. Every op then runs in
float32 between the roundings, where real low-precision kernels accumulate in float32 and
round their result: that accumulation inside one op is the one difference in the forward pass.

What a rounding gives is defined by :func:`round_bits`, bit for bit. It is done by one of two
means, with the same values:

- gluon_amp's compiled operator (``kernel=`` its name): one node, one pass, in place where
  MXNet allows it (``gluon_amp/emulation_kernel``); a parameter's float16 rounding is its pair
  (:data:`PAIR_SUFFIX`), placed on the data input of the op that reads it
  (:func:`_pair_weight_roundings`);
- MXNet's own ops, where no kernel could be built: ``amp_cast`` down and up for float16,
  float32 arithmetic for bfloat16 (:data:`BF16_ROUNDING`).

In training, float16's rounding rounds each gradient where real AMP holds it in float16, so
the loss scaler sees real float16 overflows; bfloat16's rounding passes gradients through in
float32.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Mapping, Optional, Tuple

from .dtypes import LOW_PRECISION_DTYPES

Key = Tuple[str, int]  # (node name, output index)

def round_bits(bits: int, dtype: str) -> int:
    """The float32 bit pattern ``bits`` rounded to ``dtype``'s values, as float32 bits.

    The definition every rounding path meets bit for bit (the kernel and the fallback):

    - round to nearest, ties to even;
    - beyond the largest finite value (float16: from 65520 on; bfloat16: from
      3.40282357e38 on), +-inf;
    - the target's subnormals are kept (float16: multiples of 2^-24 below 2^-14;
      bfloat16: multiples of 2^-133 below 2^-126, float32's own range); nothing is flushed;
    - -0 stays -0, +-inf stay +-inf, a NaN stays a NaN (quiet; its payload cut to the
      target's bits).

    Raises
    ------
    ValueError
        If ``dtype`` is neither ``'float16'`` nor ``'bfloat16'``.
    """
    bits &= 0xFFFFFFFF
    sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
    if dtype == "bfloat16":
        if mag > 0x7F800000:
            return (bits | 0x00400000) & 0xFFFF0000
        return (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    if dtype == "float16":
        if mag > 0x7F800000:
            return sign | ((mag | 0x00400000) & 0xFFFFE000)
        if mag >= 0x477FF000:  # 65520: the tie above 65504 rounds to the even 65536, out of range
            return sign | 0x7F800000
        value = struct.unpack("<f", struct.pack("<I", mag))[0]
        half = struct.unpack("<e", struct.pack("<e", value))[0]  # CPython rounds half to even
        return sign | struct.unpack("<I", struct.pack("<f", half))[0]
    raise ValueError(f"round_bits: dtype must be 'float16' or 'bfloat16', got {dtype!r}")


#: Suffix of the node that holds an entry rounded: ``<node>_amp_emulated`` (the kernel's
#: node, or the last step of the fallback's; its other steps are ``<node>_amp_emulated_*``).
ROUND_SUFFIX = "_amp_emulated"

#: The kernel's pair op is named ``<kernel><PAIR_SUFFIX>``: ``(data, weight) -> (data, weight
#: rounded)``, and in float16 its backward rounds the weight's gradient (``rounding.cc``).
PAIR_SUFFIX = "_weight"

#: Ops whose outputs only hold values of their inputs: rounding after them changes
#: nothing, so it is skipped (speed only: rounding is idempotent).
VALUE_PRESERVING = frozenset({
    "Reshape", "reshape", "Flatten", "flatten", "transpose", "expand_dims", "squeeze",
    "slice", "slice_axis", "slice_like", "_slice", "Crop", "Concat", "concat", "stack",
    "SliceChannel", "split", "_split_v2", "relu", "max", "min", "_copy", "identity",
    "BlockGrad", "stop_gradient", "repeat", "tile", "broadcast_to", "broadcast_like", "take",
    "pick", "gather_nd", "SwapAxis", "swapaxes", "flip", "reverse", "zeros_like", "ones_like",
    "where", "_np_reshape", "_npi_concatenate", "_npx_reshape", "_npx_relu",
    # storage changes: their output may be sparse, which the rounding kernel does not take
    "cast_storage", "_sparse_retain",
})
#: Ops that preserve values for some attribute values only: op -> (attr, values, default).
VALUE_PRESERVING_IF = {"Activation": ("act_type", frozenset({"relu"}), ""),
                       "Pooling": ("pool_type", frozenset({"max"}), "max")}

_CAST_OPS = frozenset({"amp_cast", "Cast", "cast"})

#: Op inputs MXNet's kernels read directly: op -> the input index that must be a parameter
#: itself, never an op's output. MXNet 1.9.1's oneDNN deconvolution backward crashes (SIGSEGV,
#: or "could not execute a primitive") when its weight is any op's output, even ``w * 1.0``
#: or an ``amp_cast`` to float32, in plain float32 MXNet; its bias, and the parameters of
#: Convolution, FullyConnected, BatchNorm, Embedding, LayerNorm, InstanceNorm, GroupNorm, PReLU
#: and RNN, do not (measured on this build: tests/mxnet_layer/execution/test_direct_inputs.py).
#: Every op listed is linear in that input (see :func:`_direct_split`).
DIRECT_INPUTS: Mapping[str, int] = {"Deconvolution": 1}

#: Suffix of the nodes an emulated graph adds for an op of :data:`DIRECT_INPUTS` whose
#: parameter the plan rounds: ``<node>_amp_direct`` (the op on the parameter itself) and
#: ``<node>_amp_direct_correction`` (the op on the rounding's change, with no gradient).
DIRECT_SUFFIX = "_amp_direct"

#: Placeholder for the first step of :data:`BF16_ROUNDING`: see :func:`plain_layout`.
PLAIN_LAYOUT = "<plain layout>"

_P111, _P126, _P64 = str(2.0 ** 111), str(2.0 ** -126), str(2.0 ** -64)

#: The fallback's bfloat16 rounding: :func:`round_bits` in MXNet's float32 ops, where no kernel
#: could be built (MXNet's own float32->bfloat16 ``amp_cast`` flushes subnormals and is ~100x
#: slower than this on CPUs without AVX-512; its ``Cast`` truncates).
#:
#: Veltkamp's split rounds ``c`` to 8 significant bits, to nearest even: ``v = r - (r - c)``
#: with ``r = 65537 c`` (checked on every normal float32 ``c`` with ``65537 c`` finite), and
#: ``e = c - v`` is exact. ``c`` is ``x`` brought where the split holds:
#:
#: - ``|x| >= 2^111`` (``65537 x`` could overflow): ``x 2^-64``, and ``x``'s change is ``e 2^64``;
#: - ``|x| < 2^-126`` (float32 subnormals, which bfloat16 rounds to multiples of 2^-133):
#:   ``x +- 2^-126``, in the binade ``[2^-126, 2^-125)`` where 8 bits are that quantum;
#: - then ``clip(., +-3e33)``, which only changes +-inf (their change is then finite, and
#:   ``inf - finite`` is inf). Any bound from 2^111 to ``FLT_MAX / 65537`` does: MXNet parses
#:   clip's bounds in float32 arithmetic, not exactly (the scalars of ``_mul_scalar`` and the
#:   comparisons, parsed as doubles, give these powers of two exactly: the tests check it).
#:
#: The result is ``((x - BlockGrad(E)) 2^-16) 2^16`` with ``E`` x's change: the rounded
#: value, an identity gradient, and nothing kept for the backward pass. The chain reads ``x``
#: through a BlockGrad: MXNet calls the gradient of every op that has one, zero or not, and
#: several of these keep their inputs for it (abs, where, the product, clip); behind the
#: BlockGrad their gradients reach nothing and are dropped. The three nodes on the value's
#: path keep nothing. The scaling keeps the sign of
#: a zero, which a difference cannot: for a subnormal ``x`` (``s = +-1``), ``E`` carries an
#: extra ``-s 2^-149``, which the scaling by ``2^-16`` rounds away, except that a result of
#: zero ends as ``-s 0``: ``-0`` from a negative ``x``, as round_bits says. Unlike float16's
#: cast pair, bfloat16 emulation does not round gradients.
#: The first step matters for speed and memory only (see :func:`plain_layout`).
#: Steps: (op, inputs, attrs); an input is "x" or the index of an earlier step.
BF16_ROUNDING: Tuple[Tuple[str, Tuple, Dict[str, str]], ...] = (
    (PLAIN_LAYOUT, ("x",), {}),                                # 0: p, x in a plain layout
    ("BlockGrad", (0,), {}),                                   # 1: q, the chain's source
    ("abs", (1,), {}),                                         # 2
    ("_greater_equal_scalar", (2,), {"scalar": _P111}),        # 3: big (1 or 0)
    ("_lesser_scalar", (2,), {"scalar": _P126}),               # 4: subnormal
    ("_greater_scalar", (1,), {"scalar": "0"}),                # 5
    ("_lesser_scalar", (1,), {"scalar": "0"}),                 # 6
    ("elemwise_sub", (5, 6), {}),                              # 7: sign(x) (MXNet's sign op is slow)
    ("elemwise_mul", (7, 4), {}),                              # 8: s, +-1 where subnormal, else 0
    ("_mul_scalar", (8,), {"scalar": _P126}),                  # 9
    ("elemwise_add", (1, 9), {}),                              # 10: subnormals moved up by 2^-126
    ("_mul_scalar", (1,), {"scalar": _P64}),                   # 11: big values scaled down
    ("where", (3, 11, 10), {}),                                # 12
    ("clip", (12,), {"a_min": "-3e33", "a_max": "3e33"}),      # 13: c (see above)
    ("_mul_scalar", (13,), {"scalar": "65537.0"}),             # 14: r
    ("elemwise_sub", (14, 13), {}),                            # 15: r - c
    ("elemwise_sub", (14, 15), {}),                            # 16: v, c rounded
    ("elemwise_sub", (13, 16), {}),                            # 17: e = c - v
    ("_mul_scalar", (17,), {"scalar": str(2.0 ** 64)}),        # 18
    ("where", (3, 18, 17), {}),                                # 19: x's change, negated
    ("_mul_scalar", (8,), {"scalar": str(-2.0 ** -149)}),      # 20: -s 2^-149
    ("elemwise_add", (19, 20), {}),                            # 21: E
    ("BlockGrad", (21,), {}),                                  # 22
    ("elemwise_sub", (0, 22), {}),                             # 23
    ("_mul_scalar", (23,), {"scalar": str(2.0 ** -16)}),       # 24
    ("_mul_scalar", (24,), {"scalar": str(2.0 ** 16)}),        # 25: the result
)


def plain_layout(ndim: Optional[int], plain: bool) -> Optional[Tuple[str, Dict[str, str]]]:
    """The op (and attributes) that hands a value to the rounding's float32 ops, or ``None``
    for a value that is read as it is.

    The output of a oneDNN op (convolution, batch norm, pooling, add) is held in a blocked
    memory layout. Under ``static_alloc``, each non-oneDNN op that reads one keeps a private
    plain copy of it for the life of the graph (MXNet's storage fallback), which made
    emulated bfloat16 training hold 2-4x FP32's memory. oneDNN's transpose writes a plain copy
    and leaves the value's own layout alone; with the identity permutation it needs ``ndim``.
    Without it, a reshape to the same shape gives the plain layout at no copy, but converts
    the value in place. Values already ``plain`` (parameters) are read as they are: their
    shape may be known only from the op that reads the rounding (deferred initialisation),
    and MXNet's shape inference cannot go back through a reshape.
    """
    if plain:
        return None
    if ndim is not None and ndim >= 2:
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
    real_dtypes : dict
        Node name -> the dtype real AMP gives its first output, for the graph's variables and
        op nodes. Kept here, beside the graph: its nodes carry no attribute of gluon_amp's
        (MXNet hands every node attribute to a Python custom op's constructor).
    """

    graph: dict
    entries: Dict[Key, Key] = field(default_factory=dict)
    rounds: int = 0
    real_dtypes: Dict[str, str] = field(default_factory=dict)


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
    def __init__(self, dtypes: Mapping[Key, Optional[str]], ndims: Mapping[Key, int],
                 kernel: Optional[str]) -> None:
        self.dtypes = dtypes
        self.ndims = ndims
        self.kernel = kernel
        self.nodes: List[dict] = []
        self.rounds = 0

    def add(self, node: dict) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def round(self, entry: Tuple[int, int], dtype: str, base: str) -> Tuple[int, int]:
        """``entry`` (float32) rounded to ``dtype``'s values, back in float32."""
        if self.kernel is not None:
            j = self.add({"op": self.kernel, "name": f"{base}{ROUND_SUFFIX}", "attrs": {"dtype": dtype},
                          "inputs": [[entry[0], entry[1], 0]]})
            self.rounds += 1
            return j, 0
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
                layout = plain_layout(self.ndims.get((self.nodes[x[0]]["name"], x[1])), self.is_parameter(x))
                if layout is None:
                    made.append(x)
                    continue
                op, attrs = layout
            j = self.add({"op": op, "name": f"{base}{ROUND_SUFFIX}" + ("" if last else f"_bf16_{k}"),
                          "attrs": dict(attrs), "inputs": [[e[0], e[1], 0] for e in inputs]})
            made.append((j, 0))
        self.rounds += 1
        return made[-1]

    def is_parameter(self, entry: Tuple[int, int]) -> bool:
        """A variable, or a cast or BlockGrad of one (a parameter's value: never in a oneDNN layout)."""
        node = self.nodes[entry[0]]
        while node["op"] in _CAST_OPS or node["op"] == "BlockGrad":
            node = self.nodes[node["inputs"][0][0]]
        return node["op"] == "null"

    def up(self, entry: Tuple[int, int], base: str) -> Tuple[int, int]:
        """A low-precision ``entry`` back in float32: the second half of a rounding."""
        j = self.add({"op": "amp_cast", "name": f"{base}{ROUND_SUFFIX}",
                      "attrs": {"dtype": "float32"}, "inputs": [[entry[0], entry[1], 0]]})
        self.rounds += 1
        return j, 0


def _low_cast(rw: _Rewriter, graph: dict, dtypes: Mapping[Key, Optional[str]], node: dict,
              inputs: List[Tuple[int, int]]) -> Tuple[int, int]:
    """The entry holding the value of the plan's cast (``node``) of ``inputs[0]`` to a low dtype.

    Where the result is the cast's input itself (or that input cast to float32), the cast node
    stays, as a float32 identity or a cast to float32 under the plan's name; a rounding node
    is named after the cast (:func:`rounding_node`), and :attr:`EmulatedGraph.entries` maps the
    cast to whichever holds its value:

    - a cast of a value that has the dtype already (init's symbols cast every input of a
      low-precision op) is an identity: every low entry holds the target's values here;
    - with the kernel, a float32 value's rounding is the cast's value, and no cast node follows
      it: one would stand between each weight's gradient and the parameter's, and MXNet's
      planner then held a gradient buffer per parameter (ResNet-18's emulated bfloat16 training
      took 1.18x FP32's memory with it, 1.09x without); a value of another dtype (an int32 mask
      cast to float16) is cast to float32 first, then rounded;
    - without it, float16's cast down is half a rounding (the way back up is added), and
      bfloat16 rounds after the cast.
    """
    src, dtype = node["inputs"][0], node["attrs"]["dtype"]

    def cast(entry: Tuple[int, int], to: str) -> Tuple[int, int]:
        return rw.add({**node, "attrs": {**node["attrs"], "dtype": to}, "inputs": [[entry[0], entry[1], 0]]}), 0

    source = dtypes.get((graph["nodes"][src[0]]["name"], src[1]))
    if source == dtype:
        return cast(inputs[0], "float32")
    if rw.kernel is not None:
        if source not in (None, "float32"):  # ids, masks, float64: the kernel rounds float32 only
            return rw.round(cast(inputs[0], "float32"), dtype, node["name"])
        return rw.round(inputs[0], dtype, node["name"])
    if dtype == "bfloat16":
        return rw.round_bf16(cast(inputs[0], "float32"), node["name"])
    return rw.up(cast(inputs[0], dtype), node["name"])


def _parameter_behind(graph: dict, entry: list) -> Optional[int]:
    """The variable node whose value ``entry`` of ``graph`` is, through casts only, or None."""
    nodes = graph["nodes"]
    while True:
        node = nodes[entry[0]]
        if node["op"] == "null":
            return entry[0]
        if node["op"] in _CAST_OPS:
            entry = node["inputs"][0]
        elif node["op"] == "amp_multicast":
            entry = node["inputs"][entry[1]]
        else:
            return None


def _direct_split(rw: _Rewriter, graph: dict, dtypes: Mapping[Key, Optional[str]],
                  variables: Mapping[int, int], node: dict, attrs: Dict[str, str],
                  inputs: List[Tuple[int, int]]) -> int:
    """The new node for an op of :data:`DIRECT_INPUTS` (``node``, its inputs ``inputs`` in the
    new graph): the op reads its parameter itself, and its gradient is the parameter's only one.

    Where the plan holds the parameter as it is (casts to float32 only), the op reads the
    variable. Where the plan rounds it (``r``, from the parameter ``w``), the op being linear in
    it, ``op(x, r, b) = op(x, w, b) + op(x, BlockGrad(r - w))`` (the second without bias), with
    ``r`` rounded from ``BlockGrad(w)``: the value and the data's gradient are those of the
    rounded parameter (to float32 rounding in the sum), the parameter's gradient is the first
    op's alone, and the second op computes no parameter gradient (the faulty path). Unlike the
    plan, the parameter's gradient is not rounded to the low dtype. A parameter the caller feeds
    in a low dtype is read through an add of zero; one behind anything but casts (the user's own
    ops) is left as the plan has it.
    """
    k, name = DIRECT_INPUTS[node["op"]], node["name"]
    var = _parameter_behind(graph, node["inputs"][k])
    raw = variables.get(var) if var is not None else None
    if raw is None and var is not None:
        # a parameter the caller feeds low (GPU-style float16 code): the op cannot read it in
        # float32 itself. Read through an add of zero, measured not to take the faulty path
        # (tests/mxnet_layer/execution/test_direct_inputs.py), unlike casts and other ops.
        base = name + DIRECT_SUFFIX
        v = [inputs[k][0], inputs[k][1], 0]
        zeros = rw.add({"op": "zeros_like", "name": f"{base}_zeros", "inputs": [v]})
        still = rw.add({"op": "BlockGrad", "name": f"{base}_zeros_still", "inputs": [[zeros, 0, 0]]})
        added = rw.add({"op": "elemwise_add", "name": f"{base}_added", "inputs": [v, [still, 0, 0]]})
        fed = [[e[0], e[1], 0] for e in inputs]
        fed[k] = [added, 0, 0]
        return rw.add({**node, "attrs": attrs, "inputs": fed})
    if raw is None or inputs[k] == (raw, 0):
        return rw.add({**node, "attrs": attrs, "inputs": [[e[0], e[1], 0] for e in inputs]})
    plain = [[e[0], e[1], 0] for e in inputs]
    plain[k] = [raw, 0, 0]
    src = node["inputs"][k]
    held = dtypes.get((graph["nodes"][src[0]]["name"], src[1]))
    if held not in LOW_PRECISION_DTYPES:  # the same values: read the variable
        return rw.add({**node, "attrs": attrs, "inputs": plain})
    base = name + DIRECT_SUFFIX
    main = rw.add({**node, "name": base, "attrs": attrs, "inputs": plain})
    still = rw.add({"op": "BlockGrad", "name": f"{base}_param", "inputs": [[raw, 0, 0]]})
    rounded = rw.round((still, 0), held, base)
    delta = rw.add({"op": "elemwise_sub", "name": f"{base}_delta",
                    "inputs": [[rounded[0], rounded[1], 0], [still, 0, 0]]})
    delta = rw.add({"op": "BlockGrad", "name": f"{base}_delta_still", "inputs": [[delta, 0, 0]]})
    corr = rw.add({**node, "name": f"{base}_correction", "attrs": {**attrs, "no_bias": "True"},
                   "inputs": [[e[0], e[1], 0] for e in inputs[:k]] + [[delta, 0, 0]]})
    return rw.add({"op": "elemwise_add", "name": name, "inputs": [[main, 0, 0], [corr, 0, 0]]})


def _pair_weight_roundings(rw: _Rewriter, heads: List[Tuple[int, int]],
                           dtypes: Mapping[Key, Optional[str]]) -> Callable[[int, int], Tuple[int, int]]:
    """Make each kernel rounding of a parameter to float16 that one op alone reads the kernel's
    pair (:data:`PAIR_SUFFIX`) on that op's data input (its input 0, a float32 value of the
    graph, not a graph input), moved to just before the op, in ``rw.nodes``; returns where an
    entry ``(node, output)`` of the old list now is (the pair keeps the rounding's name; its
    output 1 is the rounded parameter).

    Why: float16's rounding rounds the parameter's gradient in the backward pass. Alone, that
    node is reached only from the parameter's gradient, and MXNet orders the backward pass by
    the graph inputs' gradients, parameters last: every op's weight gradient then waited in a
    buffer of its own until the end of the backward pass (emulated float16 ResNet-18: 1.23x
    FP32's memory). The pair's backward also passes the data's gradient on to the ops before,
    so it runs as the backward pass reaches the op. bfloat16 passes gradients through: nothing
    to move.
    """
    nodes, kernel = rw.nodes, rw.kernel
    readers: Dict[int, List[int]] = {}
    for c, node in enumerate(nodes):
        for e in node.get("inputs", []):
            readers.setdefault(e[0], []).append(c)
    for j, _ in heads:
        readers.setdefault(j, []).append(-1)

    def float32_value(e: list) -> bool:
        node = nodes[e[0]]
        if node["op"] == kernel:
            return True
        return node["op"] != "null" and dtypes.get((node["name"], e[1])) in ("float32", *LOW_PRECISION_DTYPES)

    pairs: Dict[int, int] = {}  # the op -> the rounding it reads
    for r, node in enumerate(nodes):
        if node["op"] != kernel or node["attrs"].get("dtype") != "float16":
            continue
        if not rw.is_parameter((node["inputs"][0][0], node["inputs"][0][1])):
            continue
        who = readers.get(r, [])
        if len(who) != 1 or who[0] < 0 or who[0] in pairs:
            continue
        op_inputs = nodes[who[0]]["inputs"]
        if op_inputs and op_inputs[0][0] != r and float32_value(op_inputs[0]):
            pairs[who[0]] = r
    if not pairs:
        return lambda j, k: (j, k)
    paired = set(pairs.values())
    new_index: Dict[int, int] = {}
    out: List[dict] = []

    def moved(j: int, k: int) -> Tuple[int, int]:
        return (new_index[j], 1) if j in paired else (new_index[j], k)

    for c, node in enumerate(nodes):
        if c in paired:
            continue
        if c in pairs:
            rounding, data = nodes[pairs[c]], node["inputs"][0]
            out.append({**rounding, "op": kernel + PAIR_SUFFIX,
                        "inputs": [[*moved(data[0], data[1]), 0], [*moved(*rounding["inputs"][0][:2]), 0]]})
            new_index[pairs[c]] = len(out) - 1
        inputs = [[*moved(e[0], e[1]), 0] for e in node.get("inputs", [])]
        if c in pairs:
            inputs[0] = [new_index[pairs[c]], 0, 0]
        out.append({**node, "inputs": inputs} if "inputs" in node else dict(node))
        new_index[c] = len(out) - 1
    rw.nodes[:] = out
    return moved


def _outputs(dtypes: Mapping[Key, Optional[str]], name: str) -> List[Optional[str]]:
    outs, k = [], 0
    while (name, k) in dtypes:
        outs.append(dtypes[(name, k)])
        k += 1
    return outs


def _low_heads(rw: _Rewriter, graph: dict, dtypes: Mapping[Key, Optional[str]], heads: List[List[int]],
              fed: Optional[str]) -> List[List[int]]:
    """``heads`` (float32 entries) for a graph the caller feeds low-precision data: each one
    real AMP holds in a low dtype cast to ``fed``, the dtype the caller's code works in (or,
    fed several, to real AMP's): exact where that is real AMP's dtype, as under a float16
    target fed float16; a bfloat16 value beyond float16's range becomes what float16 makes
    of it."""
    out: List[List[int]] = []
    made: Dict[Tuple[int, int, str], int] = {}
    for head, (j, k, _) in zip(graph["heads"], heads):
        name = graph["nodes"][head[0]]["name"] + (f"_{head[1]}" if head[1] else "")
        dtype = dtypes.get((graph["nodes"][head[0]]["name"], head[1]))
        if dtype in LOW_PRECISION_DTYPES:
            dtype = fed or dtype
            if (j, k, dtype) not in made:
                made[(j, k, dtype)] = rw.add({"op": "amp_cast", "name": f"{name}{ROUND_SUFFIX}_out",
                                              "attrs": {"dtype": dtype}, "inputs": [[j, k, 0]]})
            j, k = made[(j, k, dtype)], 0
        out.append([j, k, 0])
    return out


def emulate_graph(graph: dict, dtypes: Mapping[Key, Optional[str]],
                  ndims: Optional[Mapping[Key, int]] = None, kernel: Optional[str] = None,
                  fed: Optional[Mapping[str, str]] = None) -> EmulatedGraph:
    """Rewrite a graph typed by real AMP (``dtypes``: every entry's dtype) for emulation.

    ``kernel``, the name of gluon_amp's rounding op where it is loaded, rounds each entry in
    one node; without it, MXNet's own ops do (the same values). ``ndims`` (entry -> number of
    dimensions, where known) lets the fallback's bfloat16 rounding keep oneDNN's layouts
    (:func:`plain_layout`); the values are the same without it. ``fed`` (input name -> the
    dtype of the array the executor feeds it, where known) says which inputs come in a low
    dtype.

    Variables real AMP holds in a low dtype that the caller feeds in that dtype (GPU-only
    code's ``net(x.astype('float16'))``, a parameter stored low) keep it and are cast to
    float32, exactly; the graph then gives each output real AMP holds in low precision back
    in the caller's low dtype (:func:`_low_heads`). Other variables real AMP stores in a low
    dtype (a converter's parameters, stored float32 in emulation) become float32 variables
    followed by a rounding. A graph fed float32 gives float32 holding the rounded values.
    Casts to a low dtype become roundings (identities where the input has that dtype
    already); ``amp_multicast`` nodes resolve to the roundings their typed outputs need;
    every other op runs in float32 and its low-precision outputs are rounded (unless the op
    only moves values around).
    """
    rw, index = _Rewriter(dtypes, ndims or {}, kernel), {}
    variables: Dict[int, int] = {}  # variable node -> its node in the new graph, read as it is
    fed, fed_low = fed or {}, set()  # fed_low: the low dtypes the caller feeds
    entries: Dict[Key, Key] = {}
    real_dtypes: Dict[str, str] = {}

    def new_entry(e: list) -> Tuple[int, int]:
        return index[(e[0], e[1])]

    for i, node in enumerate(graph["nodes"]):
        name, op, attrs = node["name"], node["op"], dict(node.get("attrs", {}))
        real = _outputs(dtypes, name)
        if real and real[0] is not None:
            real_dtypes[name] = str(real[0])
        inputs = [new_entry(e) for e in node["inputs"]]
        if op == "amp_multicast":
            for k, e in enumerate(inputs):
                src = dtypes.get((graph["nodes"][node["inputs"][k][0]]["name"], node["inputs"][k][1]))
                want = real[k] if k < len(real) else None
                index[(i, k)] = (rw.round(e, want, f"{name}_{k}") if want in LOW_PRECISION_DTYPES
                                 and src != want else e)
            continue
        if op == "null":
            if real and real[0] in LOW_PRECISION_DTYPES and fed.get(name) == real[0]:
                fed_low.add(real[0])  # the caller's array, in its dtype: cast to float32, exactly
                j = rw.add({**node, "attrs": attrs})
                index[(i, 0)] = rw.up((j, 0), name)
            elif real and real[0] in LOW_PRECISION_DTYPES:
                if "__dtype__" in attrs:
                    attrs["__dtype__"] = "0"
                j = variables[i] = rw.add({**node, "attrs": attrs})
                index[(i, 0)] = rw.round((j, 0), real[0], name)
            else:
                j = variables[i] = rw.add(dict(node))
                index[(i, 0)] = (j, 0)
            continue
        low_cast = op in _CAST_OPS and attrs.get("dtype") in LOW_PRECISION_DTYPES
        if attrs.get("dtype") in LOW_PRECISION_DTYPES and not low_cast:
            attrs["dtype"] = "float32"  # an op that creates low-precision data (zeros, ones)
        if low_cast:
            index[(i, 0)] = _low_cast(rw, graph, dtypes, {**node, "attrs": attrs}, inputs)
            continue
        if op == "amp_cast" and attrs.get("dtype") == "float32" and dtypes.get(
                (graph["nodes"][node["inputs"][0][0]]["name"], node["inputs"][0][1])) == "float32":
            index[(i, 0)] = inputs[0]  # an identity cast: read through (see DIRECT_INPUTS)
            continue
        if op in DIRECT_INPUTS and DIRECT_INPUTS[op] < len(inputs):
            j = _direct_split(rw, graph, dtypes, variables, node, attrs, inputs)
        else:
            j = rw.add({**node, "attrs": attrs, "inputs": [[e[0], e[1], 0] for e in inputs]})
        exact = preserves_values(op, attrs)
        for k, dt in enumerate(real or [None]):
            e = (j, k)
            if dt in LOW_PRECISION_DTYPES and not exact:
                e = rw.round((j, k), dt, name + (f"_{k}" if k else ""))  # see rounding_node
            index[(i, k)] = e
    if kernel is not None:
        moved = _pair_weight_roundings(rw, [index[(h[0], h[1])] for h in graph["heads"]], dtypes)
        index = {key: moved(*e) for key, e in index.items()}
    for (i, k), (j, kk) in index.items():
        entries[(graph["nodes"][i]["name"], k)] = (rw.nodes[j]["name"], kk)
    heads = [[*index[(h[0], h[1])], 0] for h in graph["heads"]]
    if fed_low:
        heads = _low_heads(rw, graph, dtypes, heads, fed_low.pop() if len(fed_low) == 1 else None)
    out = {key: v for key, v in graph.items() if key not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    out["nodes"] = rw.nodes
    out["arg_nodes"] = [j for j, n in enumerate(rw.nodes) if n["op"] == "null"]
    out["heads"] = heads
    return EmulatedGraph(out, entries, rw.rounds, real_dtypes)


def lift_input_roundings(graph: dict, names: Collection[str], kernel: str) -> Tuple[dict, Dict[str, str]]:
    """``graph`` (an emulated graph rounding with ``kernel``) reading each graph input named in
    ``names`` as it is, where the graph only rounds it, and which dtype each such input's array
    must be rounded to before it is fed: ``(graph, {input name: dtype})``; ``graph`` itself and
    ``{}`` where none qualifies.

    Why: an op that reads an op's output gets its data gradient computed by MXNet, and one that
    reads a graph input the caller needs no gradient for does not. An image's rounding in the
    graph made its first convolution compute a data gradient nobody reads (ResNet-18, batch 8:
    6 ms of a 290 ms step), which FP32 skips. Rounded by the caller, as a recorded op, the image
    gets its gradient only where it has one (a second block fed the first's output does).

    An input qualifies where every reader is one rounding by ``kernel`` to one dtype (the
    ``dtype`` of its attributes) and the input is no output of the graph. A weight rounding
    paired on that rounding's output (:func:`_pair_weight_roundings`) becomes the weight's
    single rounding again: a pair on a graph input would make its op read an op's output."""
    nodes = graph["nodes"]
    pair = kernel + PAIR_SUFFIX
    readers: Dict[int, List[int]] = {}
    for j, node in enumerate(nodes):
        for e in node.get("inputs", []):
            readers.setdefault(e[0], []).append(j)
    heads = {h[0] for h in graph["heads"]}
    lifted: Dict[int, int] = {}  # rounding node -> the variable it rounds
    dtypes: Dict[str, str] = {}
    for i, node in enumerate(nodes):
        if node["op"] != "null" or node["name"] not in names or i in heads:
            continue
        who = readers.get(i, [])
        kinds = {nodes[j]["attrs"].get("dtype") for j in who if nodes[j]["op"] == kernel}
        if not who or len(kinds) != 1 or any(nodes[j]["op"] != kernel or j in heads for j in who):
            continue
        for j in who:
            lifted[j] = i
        dtypes[node["name"]] = str(kinds.pop())
    if not lifted:
        return graph, {}
    out: List[dict] = []
    new_of: Dict[int, int] = {}  # old node -> new
    moved: Dict[Tuple[int, int], Tuple[int, int]] = {}  # entries of removed or remade nodes

    def entry(e: list) -> list:
        j, k = moved[(e[0], e[1])] if (e[0], e[1]) in moved else (new_of[e[0]], e[1])
        return [j, k, 0]

    for j, node in enumerate(nodes):
        if j in lifted:
            moved[(j, 0)] = (new_of[lifted[j]], 0)
            continue
        inputs = [entry(e) for e in node.get("inputs", [])]
        if node["op"] == pair and out[inputs[0][0]]["op"] == "null":
            moved[(j, 0)] = (inputs[0][0], inputs[0][1])  # the data, as it is
            out.append({**node, "op": kernel, "inputs": [inputs[1]]})
            moved[(j, 1)] = (len(out) - 1, 0)
            continue
        out.append({**node, "inputs": inputs} if "inputs" in node else dict(node))
        new_of[j] = len(out) - 1
    result = {key: v for key, v in graph.items() if key not in ("nodes", "arg_nodes", "heads", "node_row_ptr")}
    result["nodes"] = out
    result["arg_nodes"] = [j for j, n in enumerate(out) if n["op"] == "null"]
    result["heads"] = [entry(h) for h in graph["heads"]]
    return result, dtypes
