"""The one graph walker: a decision for every op node of a graph in MXNet's JSON form. Pure.

The converter, the precision report and the tests all consume what it yields, so they
read the same decision for the same node.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Collection, Iterator, Mapping, Optional, Sequence, Tuple

from .decide import Decision, MeasuredChoice, Reason, decide
from .table import OpTable

Entry = Tuple[int, int]  # (node index, output index)
_NONE: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class Note:
    """What a graph's plan says of one op node beyond what its dtypes show: the reason of a
    decision taken outside the walk (input shapes, the tuner), and its figures in words.

    Kept beside the graph, keyed by node name, never in node attributes: MXNet hands every
    node attribute to a Python custom op's constructor, and a plan is a plain MXNet graph.
    """

    reason: str
    detail: str = ""


def measured_note(choice: MeasuredChoice) -> Note:
    """The note of a tuner's choice."""
    return Note(Reason.MEASURED.value, choice.describe())


@dataclass(frozen=True)
class NodeDecision:
    """What was decided for one op node."""

    index: int
    name: str
    op: str
    input_dtypes: Tuple[Optional[str], ...]
    decision: Decision

    @property
    def reason(self) -> Reason:
        return self.decision.reason


def walk(nodes: Sequence[dict], table: OpTable, dtype_of: Callable[[Entry], Optional[str]],
         excluded: Collection[str] = (),
         shape_of: Optional[Callable[[Entry], Optional[Tuple[int, ...]]]] = None,
         measured: Mapping[str, str] = _NONE) -> Iterator[NodeDecision]:
    """Yield a :class:`NodeDecision` for every op node, in graph (topological) order.

    ``dtype_of((node, output))`` gives the dtype of an input, or ``None`` when unknown. It
    is called when the node is reached, so a caller may fill it in as it goes (the
    converter does). A node named in ``excluded`` runs in float32. ``shape_of((node, output))``,
    when given, is the shape of an input (``None`` when unknown), for the table's input-shape
    rules. ``measured`` maps node names to the dtype the tuner chose.
    """
    for i, node in enumerate(nodes):
        if node["op"] == "null":
            continue
        attrs = node.get("attrs", {})
        in_types = tuple(dtype_of((e[0], e[1])) for e in node["inputs"])
        is_excluded = node["name"] in excluded
        shapes = None if shape_of is None else [shape_of((e[0], e[1])) for e in node["inputs"]]
        chosen = measured.get(node["name"])
        yield NodeDecision(i, node["name"], node["op"], in_types,
                           decide(node["op"], attrs, in_types, table, excluded=is_excluded,
                                  measured=chosen, input_shapes=shapes))
