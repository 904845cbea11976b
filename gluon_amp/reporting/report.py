"""Precision report: every op of a graph with its dtype and why."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mxnet.base import MXNetError
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from gluon_amp_core.decide import Reason
from gluon_amp_core.dtypes import DTYPE_CODE, LOW_PRECISION_DTYPES, dtype_name
from gluon_amp_core.emulate import ROUND_SUFFIX
from gluon_amp_core.graph_pass import PassResult
from gluon_amp_core.policy import Policy
from gluon_amp_core.table import default_table
from gluon_amp_core.walk import Note, walk

from .. import execution, mxnet_internals as mxi, plan_notes, runtime
from ..state import current_policy
from ..policy_builder import make_policy
from ..type_inference import infer_dtypes


@dataclass(frozen=True)
class OpRow:
    name: str
    op: str
    dtype: str
    reason: str
    emulated: bool = False
    #: the tuner's figures, where the reason is ``measured``
    detail: str = ""


@dataclass
class Report:
    """Rows per op node, plus totals. ``str(report)`` is a readable table."""

    target_dtype: str
    rows: List[OpRow]
    casts: int
    totals_by_dtype: Dict[str, int] = field(default_factory=dict)
    totals_by_reason: Dict[str, int] = field(default_factory=dict)
    #: the graph runs the plan emulated in float32 (dtypes shown are the plan's)
    emulated: bool = False
    #: where tuning stands for this block's graph ("" when it was not tuned)
    tuning: str = ""
    #: optional steps a converter left out on this graph, and why (its fusion failing)
    fallbacks: Tuple[str, ...] = ()

    @property
    def low_ops(self) -> int:
        """How many ops run in a low-precision dtype."""
        return sum(n for d, n in self.totals_by_dtype.items() if d in LOW_PRECISION_DTYPES)

    @property
    def casts_per_low_op(self) -> Optional[float]:
        """Cast nodes per low-precision op (``None`` where no op runs low): what a plan pays
        in casts for what it runs low; host-independent."""
        return self.casts / self.low_ops if self.low_ops else None

    def to_dict(self) -> Dict[str, Any]:
        return {"target_dtype": self.target_dtype, "casts": self.casts, "emulated": self.emulated,
                "casts_per_low_op": self.casts_per_low_op, "tuning": self.tuning, "fallbacks": list(self.fallbacks),
                "totals_by_dtype": self.totals_by_dtype, "totals_by_reason": self.totals_by_reason,
                "ops": [r.__dict__ for r in self.rows]}

    def __str__(self) -> str:
        w = max([len(r.name) for r in self.rows] + [4])
        lines = [f"{'node':<{w}}  {'op':<22} {'dtype':<9} reason", "-" * (w + 45)]
        lines += [f"{r.name:<{w}}  {r.op:<22} {r.dtype:<9} {r.reason}" + " (emulated)" * r.emulated
                  + (f": {r.detail}" if r.detail else "") for r in self.rows]
        lines += ["", f"ops by dtype:  {dict(sorted(self.totals_by_dtype.items()))}",
                  f"ops by reason: {dict(sorted(self.totals_by_reason.items()))}",
                  f"casts: {self.casts}"
                  + (f", {self.casts_per_low_op:.2f} per low-precision op" if self.casts_per_low_op is not None else "")
                  + f"  (target dtype {self.target_dtype}"
                  + (", emulated in float32: dtypes are the plan's, values rounded to them)" if self.emulated else ")")]
        lines += [f"tuning: {self.tuning}"] if self.tuning else []
        lines += [f"fallback: {why}" for why in self.fallbacks]
        return "\n".join(lines)


def _graph_and_policy(obj: Any, target_dtype: Any) -> Tuple[Symbol, Optional[Policy]]:
    """The graph to report on, and the policy that made it when that is known."""
    made_by = getattr(getattr(obj, "amp_result", None), "policy", None)  # a converter's result
    if isinstance(obj, Symbol):
        sym = obj
    elif isinstance(obj, HybridBlock):
        sym = mxi.cached_graph(obj, "gluon_amp.report")[1]
    else:
        raise TypeError(f"report expects a Symbol or a hybridized HybridBlock, got {type(obj).__name__}")
    if isinstance(target_dtype, Policy):
        return sym, target_dtype
    if target_dtype is not None:
        return sym, make_policy(target_dtype)
    return sym, made_by or current_policy()


@dataclass(frozen=True)
class _Beside:
    """What is known of a graph besides the graph: notes by node name, and, where it runs
    its plan emulated, the plan's dtypes by node name (``None`` otherwise)."""

    notes: Dict[str, Note]
    real: Optional[Dict[str, str]]


def _beside(obj: Any) -> _Beside:
    """A converter's result (its ``amp_result``), or a block's notes (:mod:`gluon_amp.plan_notes`)."""
    result = getattr(obj, "amp_result", None)
    if isinstance(result, PassResult):
        details = result.details
        notes = {n: Note(r, details.get(n, "")) for n, r in result.reasons.items()}
        if isinstance(obj, HybridBlock):  # what its bind added (gluon_amp.same_shape_run)
            notes.update(plan_notes.notes(obj))
        emulated = result.policy is not None and result.policy.emulate
        real = {name: str(t) for (name, k), t in result.dtypes.items() if k == 0 and t is not None}
        return _Beside(notes, real if emulated else None)
    if isinstance(obj, HybridBlock):
        return _Beside(plan_notes.notes(obj), plan_notes.emulated_dtypes(obj))
    return _Beside({}, None)


def _label(policy: Optional[Policy], dtypes: Dict[Tuple[str, int], Optional[str]]) -> str:
    """The target dtype to print: the policy's, else the low precision the graph uses."""
    if policy is not None:
        return policy.target_dtype
    present = set(dtypes.values())
    return next((d for d in LOW_PRECISION_DTYPES if d in present), "float32")


def _untyped(inputs: List[str], fed: Dict[str, Any], why: str) -> str:
    given = ", ".join(f"{n}={fed[n]}" for n in inputs[:8] if n in fed)
    return (f"gluon_amp.report: could not infer the graph's dtypes with its inputs as {{{given}}} ({why}); "
            "pass the dtype of every data input, e.g. report(sym, data='float32'); "
            f"inputs: {inputs[:8]}")


def report(symbol_or_block: Any, target_dtype: Any = None, **input_types: Any) -> Report:
    """List every op of a graph with its dtype and the reason for it.

    Works on training graphs built under :func:`gluon_amp.init` and on converted
    inference graphs. Data inputs default to float32; pass ``name=dtype`` to change one.
    Reasons are the walker's (:mod:`gluon_amp_core.walk`), or the ones kept beside the graph
    (a converter's ``amp_result``, the shape rules' and the tuner's notes of a block trained
    under ``init``). ``target_dtype`` (a dtype or a Policy)
    defaults to the policy that made the graph, the one in force, or the low-precision
    dtype found in the graph.
    """
    sym, policy = _graph_and_policy(symbol_or_block, target_dtype)
    beside = _beside(symbol_or_block)
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    attrs = sym.attr_dict()
    inputs = sym.list_inputs()
    known = {n: "float32" for n in inputs if "__dtype__" not in attrs.get(n, {})}
    if isinstance(symbol_or_block, HybridBlock):
        # as its executor was fed (O2's boundary casts the data, GPU-style code feeds float16) and its
        # parameters are stored (O2 and a GPU-style cast store them low; the graph may declare float32)
        given = {**mxi.param_dtypes(symbol_or_block), **plan_notes.fed_dtypes(symbol_or_block)}
        held = set(getattr(symbol_or_block, "float32_stand_in_params", ()))  # held float32 for a stand-in:
        known.update({n: t for n, t in given.items() if n in set(inputs) and n not in held})  # the plan's own
    for name, dtype in input_types.items():
        try:
            ok = dtype_name(dtype) in DTYPE_CODE
        except TypeError:
            ok = False
        if not ok:
            raise (ValueError if isinstance(dtype, str) else TypeError)(
                f"report: {name}={dtype!r} is not a dtype MXNet has (one of {sorted(DTYPE_CODE)}); pass "
                "input_name=dtype, e.g. data='float16'")
    fed = {**known, **{n: dtype_name(t) for n, t in input_types.items()}}
    try:
        with mxi.quiet_stdout():  # 1.9.1 prints the arguments it rejects
            by_name = infer_dtypes(sym, fed)
    except MXNetError as error:
        raise ValueError(_untyped(inputs, fed, mxi.error_line(error))) from None
    if by_name is None:
        raise ValueError(_untyped(inputs, fed, "MXNet left some dtypes unknown"))
    label = _label(policy, {(n, 0): t for n, t in beside.real.items()} if beside.real else by_name)
    table = policy.table if policy is not None and policy.enabled else \
        default_table(label if label in LOW_PRECISION_DTYPES else runtime.emulated_target(None))
    rows, casts = [], 0
    ran = execution.runs_emulated(symbol_or_block)  # the graph is the plan; its execution is emulated
    excluded = policy.excluded if policy is not None else frozenset()
    for nd in walk(nodes, table, lambda e: by_name.get((nodes[e[0]]["name"], e[1])), excluded):
        node_attrs = nodes[nd.index].get("attrs", {})
        if ROUND_SUFFIX in nd.name:  # an emulated rounding: not an op or a cast of the plan
            continue
        if nd.reason is Reason.CAST:
            casts += 1
            continue
        note = beside.notes.get(nd.name)
        reason = note.reason if note is not None else nd.reason.value
        rule = table.conditions.get(table.canonical(nd.op))
        if rule is not None and reason.startswith("conditional"):
            reason += f" ({rule.attr}={node_attrs.get(rule.attr, 'default')})"
        real = beside.real.get(nd.name) if beside.real is not None else None
        rows.append(OpRow(nd.name, nd.op, real or by_name.get((nd.name, 0)) or "?", reason, real is not None or ran,
                          note.detail if note is not None else ""))
    tuning = getattr(symbol_or_block, "amp_tuning", None)
    return Report(label, rows, casts, dict(Counter(r.dtype for r in rows)),
                  dict(Counter(r.reason.split(" ")[0] for r in rows)), any(r.emulated for r in rows),
                  getattr(tuning, "summary", getattr(tuning, "status", "")),
                  tuple(getattr(symbol_or_block, "amp_fallbacks", ())))
