"""What each data input of a graph must hold, to draw a valid random batch for it: its
dtype, and for token ids, indices and lengths the integer range the ops reading it accept.

The graph says it: an input that reaches (through ops that only move its values, such as
reshape or cast) an ``Embedding``'s data holds ids in ``[0, input_dim)``; ``take``'s or
``pick``'s indices lie within the axis they index; the ``length`` of ``softmax`` or the
``sequence_length`` of ``SequenceMask`` lies in ``[1, size of that axis]``. Axis sizes
come from MXNet's shape inference at the given input shapes; the caller may state any
dtype or range instead."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np
import mxnet as mx
from mxnet.base import MXNetError
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import CODE_DTYPE, FLOAT_DTYPES
from gluon_amp_core.emulate import VALUE_PRESERVING

from ..mxnet_internals import error_line
from ..type_inference import infer_dtypes, infer_shapes

#: The dtypes a data input may be drawn in.
INPUT_DTYPES = ("float32", "float16", "float64", "int32", "int64", "int8", "uint8")


class _Bound(NamedTuple):
    """How an op bounds one of its inputs: integers in ``[low, size)`` where ``size`` is the
    attribute ``size_attr``, or the size of input 0's axis (``axis_attr``, else ``axis``);
    ``low=1, inclusive=True`` for lengths (``[1, size]``). Only when ``flag`` (an
    attribute) is true, if named."""

    position: int
    low: int
    size_attr: Optional[str] = None
    axis_attr: Optional[str] = None
    axis: int = 0
    flag: Optional[str] = None
    inclusive: bool = False


#: Ops that read an input as ids, indices or lengths.
BOUNDS: Dict[str, _Bound] = {
    "Embedding": _Bound(0, 0, size_attr="input_dim"),
    "one_hot": _Bound(0, 0, size_attr="depth"),
    "take": _Bound(1, 0, axis_attr="axis", axis=0),
    "batch_take": _Bound(1, 0, axis=1),
    "pick": _Bound(1, 0, axis_attr="axis", axis=-1),
    "softmax": _Bound(1, 1, axis_attr="axis", axis=-1, flag="use_length", inclusive=True),
    "log_softmax": _Bound(1, 1, axis_attr="axis", axis=-1, flag="use_length", inclusive=True),
    "SequenceMask": _Bound(1, 1, axis_attr="axis", axis=0, flag="use_sequence_length", inclusive=True),
    "SequenceLast": _Bound(1, 1, axis_attr="axis", axis=0, flag="use_sequence_length", inclusive=True),
    "SequenceReverse": _Bound(1, 1, axis=0, flag="use_sequence_length", inclusive=True),
}
#: Ops whose kernels reject a float input at that position (MXNet 1.9.1: "This operation
#: only support integer types"): an input reaching one without a cast must be an integer.
INTEGER_ONLY = frozenset({"softmax", "log_softmax"})
_CASTS = frozenset({"Cast", "cast", "amp_cast", "amp_multicast"})
#: Ops whose output holds the values of some inputs only (the others are indices or masks).
_PRESERVING_INPUTS = {"take": (0,), "pick": (0,), "gather_nd": (0,), "batch_take": (0,), "where": (1, 2)}
_MOVES_VALUES = VALUE_PRESERVING | _CASTS | {"broadcast_axis", "broadcast_axes", "reshape_like"}


@dataclass(frozen=True)
class InputSpec:
    """How to draw one data input: ``low``/``high`` set, integers in ``[low, high)``; else
    standard normal values. ``why`` says where the dtype and the range came from."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    low: Optional[int] = None
    high: Optional[int] = None
    why: str = ""

    def __str__(self) -> str:
        values = f"integers in [{self.low}, {self.high})" if self.low is not None else "normal(0, 1)"
        return f"{self.name}: {self.dtype} {self.shape} {values}" + (f" ({self.why})" if self.why else "")


def _true(value: Optional[str]) -> bool:
    return str(value).lower() in ("true", "1")


class _Reach(NamedTuple):
    """An op input an input reaches: the node, the position, and whether a cast lies between."""

    node: int
    position: int
    cast: bool


def _reaches(nodes: List[dict], consumers: Mapping[Tuple[int, int], List[Tuple[int, int]]],
             start: int) -> List[_Reach]:
    """Every op input that ``nodes[start]``'s values reach through ops that only move values
    (``consumers``: entry -> the (node, position) pairs reading it)."""
    outputs: Dict[int, Set[int]] = {}
    for i, k in consumers:
        outputs.setdefault(i, set()).add(k)
    found: List[_Reach] = []
    todo, seen = [((start, 0), False)], set()
    while todo:
        entry, cast = todo.pop()
        if (entry, cast) in seen:
            continue
        seen.add((entry, cast))
        for j, pos in consumers.get(entry, []):
            op = nodes[j]["op"]
            found.append(_Reach(j, pos, cast))
            if op in _MOVES_VALUES and pos in _PRESERVING_INPUTS.get(op, (pos,)):
                todo += [((j, k), cast or op in _CASTS) for k in outputs.get(j, ())]
    return found


def _bound(node: dict, rule: _Bound, shapes: Mapping[Tuple[str, int], Optional[Tuple[int, ...]]],
           nodes: List[dict]) -> Optional[Tuple[int, int]]:
    """``[low, high)`` the op accepts at the rule's input; None where the size is unknown."""
    attrs = node.get("attrs", {})
    if rule.size_attr:
        size = attrs.get(rule.size_attr)
        return (rule.low, int(size)) if size is not None else None
    data = node["inputs"][0]
    shape = shapes.get((nodes[data[0]]["name"], data[1]))
    if not shape:
        return None
    axis = int(attrs.get(rule.axis_attr, rule.axis)) if rule.axis_attr else rule.axis
    if not -len(shape) <= axis < len(shape):
        return None
    return rule.low, shape[axis] + rule.inclusive


def input_specs(sym: Symbol, shapes: Mapping[str, Sequence[int]], param_dtypes: Mapping[str, str],
                dtypes: Optional[Mapping[str, str]] = None,
                ranges: Optional[Mapping[str, Tuple[int, int]]] = None) -> List[InputSpec]:
    """How to draw each data input of ``sym`` (the keys of ``shapes``, in order).

    The dtype is ``dtypes[name]``, else the variable's declared ``__dtype__``, else int32
    where the input reaches an integer-only op input without a cast, else float32. The
    range is ``ranges[name]`` (``(low, high)``: integers in ``[low, high)``), else the
    intersection of the bounds of every op reading it as ids, indices or lengths (see
    :data:`BOUNDS`). Raises ``ValueError`` for unknown names, bad dtypes or ranges, an
    integer input nothing bounds, bounds that exclude each other, and dtypes the graph
    does not type-check with.
    """
    dtypes, ranges = dict(dtypes or {}), dict(ranges or {})
    names = list(shapes)
    for what, given in (("dtype", dtypes), ("range", ranges)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{what} given for {unknown}, which are not data inputs; the data inputs are {names}")
    bad = {n: d for n, d in dtypes.items() if d not in INPUT_DTYPES}
    if bad:
        raise ValueError(f"input dtypes {bad} are not supported; choose from {', '.join(INPUT_DTYPES)}")
    for n, r in ranges.items():
        if not (len(r) == 2 and all(isinstance(v, int) for v in r) and r[0] < r[1]):
            raise ValueError(f"range for {n} must be two integers LOW < HIGH (values in [LOW, HIGH)), got {r!r}")
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    nodes = graph["nodes"]
    entry_shapes = infer_shapes(sym, {n: tuple(s) for n, s in shapes.items()})
    consumers: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for j, node in enumerate(nodes):
        for pos, e in enumerate(node["inputs"]):
            consumers.setdefault((e[0], e[1]), []).append((j, pos))
    specs = []
    for name in names:
        index = next((i for i, n in enumerate(nodes) if n["op"] == "null" and n["name"] == name), None)
        if index is None:
            raise ValueError(f"{name} is not an input of the graph; its inputs are {sym.list_inputs()}")
        bounds: List[Tuple[int, int, str]] = []
        integer_only: List[str] = []
        for reach in _reaches(nodes, consumers, index):
            node = nodes[reach.node]
            rule = BOUNDS.get(node["op"])
            flag_off = rule is not None and rule.flag and not _true(node.get("attrs", {}).get(rule.flag))
            if rule is None or reach.position != rule.position or flag_off:
                continue
            found = _bound(node, rule, entry_shapes, nodes)
            if found is not None:
                bounds.append((*found, f"{node['op']} {node['name']}"))
            if node["op"] in INTEGER_ONLY and not reach.cast:
                integer_only.append(f"{node['op']} {node['name']}")
        specs.append(_spec(name, tuple(shapes[name]), nodes[index], dtypes.get(name), ranges.get(name),
                           bounds, integer_only))
    _check_types(sym, specs, param_dtypes)
    return specs


def _spec(name: str, shape: Tuple[int, ...], var: dict, dtype: Optional[str], given: Optional[Tuple[int, int]],
          bounds: List[Tuple[int, int, str]], integer_only: List[str]) -> InputSpec:
    declared = var.get("attrs", {}).get("__dtype__")
    why = []
    if dtype is None and declared is not None and int(declared) in CODE_DTYPE:
        dtype = CODE_DTYPE[int(declared)]
        why.append("dtype declared in the graph")
    elif dtype is None and integer_only:
        dtype = "int32"
        why.append(f"{integer_only[0]} needs integers")
    dtype = dtype or "float32"
    if integer_only and dtype in FLOAT_DTYPES:
        raise ValueError(f"{name} cannot be {dtype}: {integer_only[0]} reads it as integers (MXNet rejects "
                         f"float there); give an integer dtype, e.g. --dtype {name}:int32")
    if given is not None:
        low, high = given
        why.append("range given")
    elif bounds:
        low, high = max(b[0] for b in bounds), min(b[1] for b in bounds)
        if low >= high:
            raise ValueError(f"the ops reading {name} accept no common value: "
                             + ", ".join(f"{b[2]} takes [{b[0]}, {b[1]})" for b in bounds)
                             + f"; give its range (--range {name}:LOW,HIGH)")
        why.append("read by " + ", ".join(sorted({b[2] for b in bounds})))
    else:
        low = high = None
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} is {dtype} but no op of the graph bounds its values (as ids, indices or "
                             f"lengths): give its range, e.g. --range {name}:0,100 (integers in [0, 100))")
    return InputSpec(name, shape, dtype, low, high, "; ".join(why))


def _check_types(sym: Symbol, specs: Sequence[InputSpec], param_dtypes: Mapping[str, str]) -> None:
    """MXNet's type inference must accept the inputs' dtypes."""
    given = {**param_dtypes, **{s.name: s.dtype for s in specs}}
    try:
        ok = infer_dtypes(sym, given) is not None
        reason = ""
    except MXNetError as exc:
        ok, reason = False, error_line(exc)
    if not ok:
        raise ValueError(f"the graph does not type-check with data dtypes {({s.name: s.dtype for s in specs})}"
                         f"{': ' + reason if reason else ''}; give the dtypes (--dtype NAME:DTYPE)")


def draw(specs: Sequence[InputSpec], seed: int) -> List[mx.nd.NDArray]:
    """One random batch: each input as its spec says, from a NumPy generator of ``seed``
    (MXNet's own generator is left alone)."""
    rng = np.random.RandomState(seed)
    out = []
    for s in specs:
        values = rng.randint(s.low, s.high, size=s.shape) if s.low is not None else rng.normal(size=s.shape)
        out.append(mx.nd.array(values, dtype=s.dtype))
    return out
