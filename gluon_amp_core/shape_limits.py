"""Where a low-precision kernel fails at some shapes: the op table's input-shape rules.

A rule says, from an op's attributes and its data input's shape, that MXNet's kernel in the
target dtype must not run there (it is wrong, or it corrupts memory, or it falls back to a path
that makes it and its readers slower than float32), so the op runs float32
(:func:`gluon_amp_core.decide.decide`, reason ``narrow_input``). Rules are facts of MXNet's
kernels, not of the host: a plan typed with them runs on any machine it is moved to. Pure: no
MXNet.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

_INT = re.compile(r"-?\d+")
_CHANNELS_LAST = ("NWC", "NHWC", "NDHWC")

Shape = Optional[Sequence[int]]


def attr_ints(value: object) -> Tuple[int, ...]:
    """An attribute as MXNet writes it (``'(2, 2)'``, ``'2'``) or as Python gives it, as ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in _INT.findall(value if isinstance(value, str) else str(value)))


def _spatial(shape: Sequence[int], attrs: Mapping[str, object]) -> Tuple[int, ...]:
    """The spatial axes of a data input (batch and channel axes dropped; ``layout`` read)."""
    channels_last = str(attrs.get("layout", "")).upper() in _CHANNELS_LAST
    return tuple(shape[1:-1] if channels_last else shape[2:])


@dataclass(frozen=True)
class NarrowRule:
    """Float32 where the data input is narrower than ``attrs[attr]``: its width (last spatial
    axis) smaller than the attribute's last value (:func:`is_narrower`)."""

    attr: str

    def applies(self, shape: Shape, attrs: Mapping[str, object]) -> bool:
        return is_narrower(shape, attrs, self)

    def describe(self) -> str:
        return f"its data input's width (last spatial axis) is smaller than its `{self.attr}`"


@dataclass(frozen=True)
class OutputPixelsRule:
    """Float32 where one output map (one image, one channel) has a number of pixels in
    ``pixels``, whatever its rank (1-, 2- or 3-d), for a kernel and a stride of this size on
    every axis (``None``: any), input channels that are a multiple of ``channel_multiple``, and,
    with ``plain``, no group, no padding and no dilation (``num_group`` 1, ``pad`` 0, ``dilate``
    1)."""

    pixels: FrozenSet[int]
    kernel: Optional[int] = None
    stride: Optional[int] = None
    channel_multiple: int = 1
    plain: bool = False

    def applies(self, shape: Shape, attrs: Mapping[str, object]) -> bool:
        if not shape or len(shape) < 3:
            return False
        spatial = _spatial(shape, attrs)
        channels = shape[-1] if str(attrs.get("layout", "")).upper() in _CHANNELS_LAST else shape[1]
        if not all(spatial) or channels % self.channel_multiple:  # 0: an axis not known yet
            return False
        kernel = attr_ints(attrs.get("kernel"))
        if len(kernel) != len(spatial) or not _every(kernel, self.kernel):
            return False
        if not _every(attr_ints(attrs.get("stride")) or (1,), self.stride):
            return False
        if self.plain and not (_every(attr_ints(attrs.get("num_group")) or (1,), 1)
                               and _every(attr_ints(attrs.get("pad")) or (0,), 0)
                               and _every(attr_ints(attrs.get("dilate")) or (1,), 1)):
            return False
        out = output_spatial(spatial, kernel, attrs)
        return out is not None and math.prod(out) in self.pixels

    def describe(self) -> str:
        kernel = "any kernel" if self.kernel is None else f"a kernel of {self.kernel} on every axis"
        stride = "" if self.stride is None else f", stride {self.stride}"
        channels = (f", input channels a multiple of {self.channel_multiple}" if self.channel_multiple > 1 else "")
        plain = ", no group, padding or dilation" if self.plain else ""
        return (f"one output map (1-, 2- or 3-d) has {', '.join(map(str, sorted(self.pixels)))} pixels "
                f"({kernel}{stride}{channels}{plain})")


def _every(values: Tuple[int, ...], want: Optional[int]) -> bool:
    """True when ``want`` is ``None`` or every one of ``values`` is ``want``."""
    return want is None or all(v == want for v in values)


@dataclass(frozen=True)
class OddChannelsRule:
    """Float32 where an ungrouped op's data input, a map of one of ``ranks`` spatial axes, has
    an odd number of channels below ``below`` (an image's 3, a grayscale map's 1)."""

    below: int
    ranks: Tuple[int, ...] = (2, 3)

    def applies(self, shape: Shape, attrs: Mapping[str, object]) -> bool:
        if not shape or len(shape) - 2 not in self.ranks or not _every(attr_ints(attrs.get("num_group")) or (1,), 1):
            return False
        channels = shape[-1] if str(attrs.get("layout", "")).upper() in _CHANNELS_LAST else shape[1]
        return 0 < channels < self.below and channels % 2 == 1

    def describe(self) -> str:
        ranks = " or ".join(f"{r}-d" for r in self.ranks)
        return f"its data input ({ranks}) has an odd number of channels below {self.below} (no group)"


ShapeRule = NarrowRule | OutputPixelsRule | OddChannelsRule


def output_spatial(spatial: Sequence[int], kernel: Sequence[int],
                   attrs: Mapping[str, object]) -> Optional[Tuple[int, ...]]:
    """The output's spatial extent of a convolution-like op (``stride``, ``pad``, ``dilate``
    as MXNet reads them, defaults 1, 0, 1); ``None`` where an attribute has the wrong length."""
    n = len(spatial)
    stride = attr_ints(attrs.get("stride")) or (1,) * n
    pad = attr_ints(attrs.get("pad")) or (0,) * n
    dilate = attr_ints(attrs.get("dilate")) or (1,) * n
    if not len(stride) == len(pad) == len(dilate) == n or min(stride) < 1:
        return None
    return tuple((x + 2 * p - d * (k - 1) - 1) // s + 1
                 for x, k, s, p, d in zip(spatial, kernel, stride, pad, dilate))


def is_narrower(shape: Shape, attrs: Mapping[str, object], rule: NarrowRule) -> bool:
    """True when ``shape``'s width is smaller than the last value of ``attrs[rule.attr]``.

    The width is the last spatial axis: the last axis, or the one before it for a
    channels-last ``layout`` attribute. Attribute values come as MXNet writes them
    (``'(2, 2)'``, ``'2'``) or as Python ints and tuples. An unknown shape, a shape with no
    spatial axis or a missing attribute is not narrower.
    """
    if not shape or len(shape) < 3:
        return False
    numbers = attr_ints(attrs.get(rule.attr))
    if not numbers:
        return False
    channels_last = str(attrs.get("layout", "")).upper() in _CHANNELS_LAST
    width = shape[-2] if channels_last else shape[-1]
    return 0 < width < numbers[-1]


def channels_from_weights(nodes: Sequence[dict], param_shapes: Mapping[str, Sequence[int]],
                          ops: FrozenSet[str] = frozenset({"Convolution"})) -> Dict[Tuple[str, int], Tuple[int, ...]]:
    """The data input's partial shape, ``(0, channels, 0, ...)`` (MXNet's 0: an axis not known),
    of each op of ``ops`` in ``nodes`` (MXNet's JSON form) whose weight is a parameter of a known
    shape, channels first: its weight's input channels times its groups. What a converter knows
    of its inputs before their shapes, for the rules that ask only the channels."""
    out: Dict[Tuple[str, int], Tuple[int, ...]] = {}
    for node in nodes:
        if node["op"] not in ops or len(node["inputs"]) < 2:
            continue
        attrs = node.get("attrs", {})
        weight = nodes[node["inputs"][1][0]]
        shape = param_shapes.get(weight["name"]) if weight["op"] == "null" else None
        if not shape or len(shape) < 3 or str(attrs.get("layout", "")).upper() in _CHANNELS_LAST:
            continue
        groups = (attr_ints(attrs.get("num_group")) or (1,))[0]
        data = nodes[node["inputs"][0][0]]
        out[(data["name"], node["inputs"][0][1])] = (0, shape[1] * groups) + (0,) * (len(shape) - 2)
    return out


def keeps_fp32(rules: Sequence[ShapeRule], shape: Shape, attrs: Mapping[str, object]) -> bool:
    """True when one of an op's ``rules`` applies to its data input's ``shape``."""
    return any(rule.applies(shape, attrs) for rule in rules)


def limited_nodes(nodes: Sequence[dict], dtypes: Mapping[Tuple[str, int], Optional[str]],
                  shapes: Mapping[Tuple[str, int], Optional[Tuple[int, ...]]],
                  rules: Mapping[str, Sequence[ShapeRule]], low: str) -> FrozenSet[str]:
    """Names of the op nodes of a typed graph (MXNet's JSON ``nodes``, with its casts) that
    compute in ``low`` (their first output has it) where one of their op's ``rules`` applies
    to their data input's shape (``shapes``: entry -> shape, as MXNet infers them)."""
    out = set()
    for node in nodes:
        op_rules = rules.get(node["op"])
        if not op_rules or not node["inputs"] or dtypes.get((node["name"], 0)) != low:
            continue
        e = node["inputs"][0]
        if keeps_fp32(op_rules, shapes.get((nodes[e[0]]["name"], e[1])), node.get("attrs", {})):
            out.add(node["name"])
    return frozenset(out)
