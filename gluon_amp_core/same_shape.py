"""An op whose low-precision kernel is slow, run as its same-shape twin where its inputs allow.

MXNet 1.9.1's numpy add (``_npi_add``), ``broadcast_add`` and relu (the op, and numpy's) have no
oneDNN kernel: their bfloat16 loops are slower than float32 with its casts, so the op table runs
them float32 (reason ``slow_kernel``). Where their inputs have one shape they compute what
``elemwise_add`` or ``Activation(act_type=relu)`` computes, whose bfloat16 kernels are oneDNN's
(``OpTable.same_shape_twins``, data). A plan holds no shapes, so the plan keeps the op; where
it is bound, at known shapes, such a node whose inputs come from values in the target dtype runs
as its twin in that dtype (:func:`twins_to_run`), and a later call at other shapes asks
:func:`one_shape_still` first.
Pure: no MXNet.
"""
from __future__ import annotations

from typing import Callable, Collection, Dict, Mapping, Optional, Tuple

from .decide import CAST_OPS
from .retype import heads_cast, source_through_casts
from .table import OpClass, OpTable
from .verdicts import Verdict

Entry = Tuple[int, int]


Twin = Tuple[str, Tuple[Tuple[str, str], ...]]


def _one_shape(n: dict, shape_of: Callable[[Entry], Optional[Tuple[int, ...]]]) -> bool:
    """True when the node's inputs have one known shape (a single input: always)."""
    if len(n["inputs"]) < 2:
        return True
    shapes = {shape_of(tuple(e[:2])) for e in n["inputs"]}
    return len(shapes) == 1 and None not in shapes


def twins_to_run(graph: dict, table: OpTable, shape_of: Callable[[Entry], Optional[Tuple[int, ...]]],
                 dtype_of: Callable[[Entry], Optional[str]], keep: Collection[str] = ()) -> Dict[str, Twin]:
    """Op node name -> its twin (op, attributes), for each node of ``graph`` (MXNet's JSON form,
    a typed plan) that ``table`` runs as its twin here: the op has one (``same_shape_twins``),
    the kernel verdicts find it slow and its twin not, its inputs have one known shape
    (``shape_of(entry)``), and all come, through casts, from values in the table's target dtype
    (``dtype_of(entry)``). ``keep``: the user's casts, never seen through."""
    twins = table.same_shape_twins
    if not twins:
        return {}
    nodes = graph["nodes"]
    found: Dict[str, Twin] = {}
    for n in nodes:
        op = table.canonical(n["op"])
        twin = twins.get(op)
        if twin is None or not n["inputs"]:
            continue
        if table.verdicts.get(op) is not Verdict.SLOW or table.verdicts.get(twin[0]) is Verdict.SLOW:
            continue
        sources = (source_through_casts(nodes, tuple(e[:2]), keep) for e in n["inputs"])
        if _one_shape(n, shape_of) and all(dtype_of(e) == table.target_dtype for e in sources):
            found[n["name"]] = twin
    return found


def renamed(graph: dict, twins: Mapping[str, Twin]) -> dict:
    """``graph`` with each node named in ``twins`` running that op with those attributes."""
    return dict(graph, nodes=[dict(n, op=twins[n["name"]][0], attrs=dict(twins[n["name"]][1]))
                              if n["name"] in twins else n for n in graph["nodes"]])


def follows_safely(graph: dict, table: OpTable, before: Callable[[str, int], Optional[str]],
                   after: Callable[[str, int], Optional[str]], twins: Collection[str]) -> bool:
    """True when every op node of ``graph`` (the plan with ``twins`` run as their twins) that
    now reads an input in the target dtype it did not read so in the plan (``before``/``after``:
    an entry's dtype by node name and output) runs on what it is given: a widest or neutral op
    whose kernel in the target is not slow, or a twin. Where another op would (a float32 op, a
    slow loop), the twins must not run so."""
    nodes = graph["nodes"]
    target = table.target_dtype
    for n in nodes:
        if n["op"] == "null" or n["name"] in twins or n["op"] in CAST_OPS:
            continue
        changed = any(after(nodes[e[0]]["name"], e[1]) == target != before(nodes[e[0]]["name"], e[1])
                      for e in n["inputs"])
        if not changed:
            continue
        op = table.canonical(n["op"])
        op_class, rule = table.classes.get(op), table.conditions.get(op)
        if op_class is OpClass.CONDITIONAL_FP32 and rule is not None:
            op_class = OpClass.FP32 if str(n.get("attrs", {}).get(rule.attr)) in rule.values else OpClass.NEUTRAL
        if op_class not in (OpClass.WIDEST, OpClass.NEUTRAL, OpClass.LOW_PRECISION) \
                or table.verdicts.get(op) is Verdict.SLOW:
            return False
    return True


def heads_as_before(graph: dict, before: Callable[[str, int], Optional[str]],
                    after: Callable[[str, int], Optional[str]]) -> dict:
    """``graph`` with each output whose dtype a twin changed (``before``/``after``: an entry's
    dtype by node name and output) cast back to the plan's: the caller gets what the plan gives."""
    def back(i: int, name: str, k: int) -> Optional[str]:
        was = before(name, k)
        return was if was is not None and after(name, k) != was else None

    return heads_cast(graph, back, "_as_planned")


def one_shape_still(graph: dict, names: Collection[str],
                    shape_of: Callable[[Entry], Optional[Tuple[int, ...]]]) -> bool:
    """True when each node of ``graph`` named in ``names`` still reads two inputs of one known
    shape (``shape_of``, at a call's new shapes): its twin then still computes what it did."""
    return all(_one_shape(n, shape_of) for n in graph["nodes"] if n["name"] in names)
