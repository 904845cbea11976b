"""``compare``: where a low-precision network leaves FP32, op by op."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.base import MXNetError
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.emulate import rounding_node
from gluon_amp_core.policy import Policy

from .. import execution, mxnet_internals as mxi, runtime
from ..convert.api import _convert_model
from ..emulation import round_nd
from ..policy_builder import make_policy
from ..type_inference import infer_dtypes
from .capture import Key, Model, as_float32, feed, model_of, relative_error, run_internals

#: The largest finite value of each low-precision dtype.
TARGET_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


@dataclass(frozen=True)
class OpCompare:
    """One op of the plan against FP32 (its first output)."""

    index: int
    name: str
    op: str
    dtype: str
    reason: str
    error: float          # relative L2 of the output vs FP32, errors of earlier ops included
    local_error: float    # this op alone in low precision, on FP32 inputs
    max_abs_error: float
    nonfinite: int        # inf/NaN in the low-precision output
    overflow: int         # FP32 values beyond the target's largest finite value
    underflow: float      # fraction of nonzero FP32 values the target flushes to 0
    new_nonfinite: bool = False  # inf/NaN made here from finite inputs, where FP32 is finite
    #: local error above the tolerance, and the op run again as FP32 ran it (float32, FP32's own
    #: inputs) gives another output: its kernel is random or leaves part of its output unwritten
    unreproducible: bool = False


@dataclass(frozen=True)
class GradCompare:
    """One parameter's gradient (unscaled) against FP32's."""

    name: str
    error: float
    max_abs_fp32: float


@dataclass
class CompareReport:
    """What :func:`compare` found. ``str()`` is a table; see ``to_json`` and ``plot``."""

    target_dtype: str
    emulated: bool
    tolerance: float
    rows: List[OpCompare]
    output_error: float
    first_divergence: Optional[OpCompare]
    notes: List[str] = field(default_factory=list)
    gradients: List[GradCompare] = field(default_factory=list)
    loss_scale_headroom: Optional[float] = None
    headroom_limited_by: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-ready data (``first_divergence`` by name)."""
        return {"target_dtype": self.target_dtype, "emulated": self.emulated, "tolerance": self.tolerance,
                "output_error": self.output_error, "notes": self.notes,
                "first_divergence": self.first_divergence.name if self.first_divergence else None,
                "rows": [asdict(r) for r in self.rows], "gradients": [asdict(g) for g in self.gradients],
                "loss_scale_headroom": self.loss_scale_headroom, "headroom_limited_by": self.headroom_limited_by}

    def to_json(self, path: str) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def __str__(self) -> str:
        w = max([len(r.name) for r in self.rows] + [4])
        head = (f"{'#':>4} {'node':<{w}} {'op':<18} {'dtype':<9} {'reason':<20} {'error':>9} {'local':>9} "
                f"{'max abs':>9} {'inf/nan':>7} {'overfl':>6} {'underfl':>7}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            mark = ("  <- first divergence" if r is self.first_divergence
                    else "  <- not reproducible in float32" if r.unreproducible else "")
            lines.append(f"{r.index:>4} {r.name:<{w}} {r.op[:18]:<18} {r.dtype:<9} {r.reason[:20]:<20} "
                         f"{r.error:>9.2e} {r.local_error:>9.2e} {r.max_abs_error:>9.2e} {r.nonfinite:>7} "
                         f"{r.overflow:>6} {r.underflow:>7.1%}{mark}")
        how = "emulated in float32" if self.emulated else "native kernels"
        lines += ["", f"target {self.target_dtype} ({how}), tolerance {self.tolerance:g}: output error "
                      f"{self.output_error:.3e}; first divergence: "
                      f"{self.first_divergence.name if self.first_divergence else 'none'}"]
        if self.gradients:
            worst = max(self.gradients, key=lambda g: g.error)
            lines.append(f"gradients: worst {worst.name} {worst.error:.3e}; loss-scale headroom "
                         f"{self.loss_scale_headroom:g} (limited by {self.headroom_limited_by})")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def plot(self, path: str) -> None:
        """A PNG of error against depth; inf/NaN and the first divergence marked."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = list(range(len(self.rows)))
        finite = [r.error if math.isfinite(r.error) else np.nan for r in self.rows]
        ax.semilogy(xs, [max(e, 1e-12) for e in finite], ".-", label="error (propagated)")
        ax.semilogy(xs, [max(r.local_error, 1e-12) if math.isfinite(r.local_error) else np.nan
                         for r in self.rows], "x", alpha=0.6, label="local error")
        top = max([e for e in finite if e == e] + [self.tolerance]) * 10
        bad = [i for i, r in enumerate(self.rows) if r.nonfinite]
        ax.scatter(bad, [top] * len(bad), color="red", marker="^", label="inf/NaN")
        ax.axhline(self.tolerance, color="gray", ls=":", label="tolerance")
        if self.first_divergence is not None:
            ax.axvline(self.rows.index(self.first_divergence), color="red", ls="--", label="first divergence")
        ax.set_xlabel("op (graph order)")
        ax.set_ylabel("relative L2 error vs FP32")
        ax.set_title(f"{self.target_dtype}{' (emulated)' if self.emulated else ''}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def resolve_policy(target_dtype: Any, emulate: Optional[bool], device: str,
                   excluded: Optional[Sequence[str]] = None) -> Policy:
    """The policy to debug: ``emulate=None`` emulates where the target cannot run natively."""
    if isinstance(target_dtype, Policy):
        if emulate is not None or excluded:
            raise ValueError("pass either a Policy or target_dtype/emulate/excluded_sym_names, not both")
        return target_dtype
    if emulate is None:
        if target_dtype is None:
            res = runtime.resolve(None, warn=False)
            target_dtype = res.dtype if res.dtype != "float32" else runtime.emulated_target(None)
        emulate = not runtime.executable(runtime.emulated_target(target_dtype), device)
    return make_policy(target_dtype, emulate=emulate, excluded_sym_names=excluded)


def low_precision(model: Model, policy: Policy) -> Tuple[Symbol, Dict[str, mx.nd.NDArray],
                                                         Dict[str, mx.nd.NDArray], Any]:
    """The converted model (emulated if the policy says so, unfused) and the pass's result."""
    sym, args, aux, result = _convert_model(model.sym, model.args, model.aux, policy, None, False,
                                            data_dtypes=model.data_dtypes)
    if policy.emulate:  # the converter gives the plan; this runs what binding it emulated runs
        known = {**{n: "float32" for n in model.data_names}, **model.data_dtypes}
        sym = execution.emulated(sym, infer_dtypes(sym, known, partial=True) or {})
    return sym, args, aux, result


def _round_np(x: np.ndarray, dtype: Optional[str]) -> np.ndarray:
    if dtype not in LOW_PRECISION_DTYPES:
        return x
    return round_nd(mx.nd.array(x, dtype="float32"), dtype).asnumpy()


#: Below this magnitude MXNet's float32->bfloat16 cast gives 0 (float32 subnormals are flushed).
_BF16_FLUSH = 2.0 ** -126


def _underflow(fp32: np.ndarray, dtype: str) -> float:
    """The fraction of nonzero values of ``fp32`` that ``dtype`` holds as 0: float16 rounds
    to nearest (subnormals kept, as MXNet's cast); bfloat16 as MXNet's cast, which flushes
    float32 subnormals (emulation rounds those, see docs/emulation.md)."""
    nonzero = fp32 != 0
    if not nonzero.any():
        return 0.0
    if dtype == "float16":
        with np.errstate(over="ignore"):
            zero = fp32.astype(np.float16) == 0
    else:
        zero = np.abs(fp32) < _BF16_FLUSH
    return float((zero & nonzero).sum() / nonzero.sum())


def _local(model: Model, node: dict, plan_inputs: List[Optional[str]], out_dtype: Optional[str],
           fp32: Dict[Key, np.ndarray]) -> np.ndarray:
    """``node`` alone: FP32 inputs rounded as the plan holds them, float32 compute, rounded output."""
    nodes = model.graph["nodes"]
    n = len(node["inputs"])
    if n == 0:  # a source (an unrolled cell's zero begin state: shape (0, 5), its batch known in the graph only)
        return _round_np(fp32[(node["name"], 0)], out_dtype)
    attrs = {k: v for k, v in node.get("attrs", {}).items() if not k.startswith("__")}
    graph = {"nodes": [{"op": "null", "name": f"in{k}", "inputs": []} for k in range(n)]
             + [{"op": node["op"], "name": node["name"], "attrs": attrs,
                 "inputs": [[k, 0, 0] for k in range(n)]}],
             "arg_nodes": list(range(n)), "heads": [[n, 0, 0]], "attrs": {"mxnet_version": ["int", 10901]}}
    sym = mx.sym.load_json(json.dumps(graph))
    held = [_round_np(fp32[(nodes[e[0]]["name"], e[1])], plan_inputs[k]) for k, e in enumerate(node["inputs"])]
    values = {f"in{k}": mx.nd.array(v, ctx=model.ctx, dtype=v.dtype) for k, v in enumerate(held)}
    with mxi.unfused_binds():
        ex = sym.bind(model.ctx, {k: values[k] for k in sym.list_arguments()},
                      aux_states={k: values[k] for k in sym.list_auxiliary_states()}, grad_req="null")
    return _round_np(as_float32(ex.forward(is_train=False)[0]), out_dtype)


_CASTS = ("amp_cast", "amp_multicast")


def _stored_dtype(nodes: List[dict], dtypes: Dict[Key, Optional[str]], entry: list) -> Optional[str]:
    """The low dtype an input of the plan went through on its way from its producer (the
    plan's own casts followed back), or None: what the consumer's input really holds."""
    node = nodes[entry[0]]
    dtype = dtypes.get((node["name"], entry[1]))
    if dtype in LOW_PRECISION_DTYPES:
        return dtype
    if node["op"] in _CASTS:
        src = node["inputs"][entry[1] if node["op"] == "amp_multicast" else 0]
        return _stored_dtype(nodes, dtypes, src)
    return None


def _rows(model: Model, policy: Policy, result: Any, low_graph: dict, fp32: Dict[Key, np.ndarray],
          low: Dict[Key, np.ndarray], tolerance: float) -> List[OpCompare]:
    """One row per op the pass decided, in graph order, from the captured values."""
    nodes = model.graph["nodes"]
    plan_nodes = result.graph["nodes"]
    plan = {n["name"]: n for n in plan_nodes}
    run = {n["name"]: n for n in low_graph["nodes"]}
    rows = []
    for nd in result.decisions:
        if nd.name not in run or nd.name not in plan:
            continue  # a cast of the model's own the pass removed (it changed no dtype): nothing runs
        name, dtype = nd.name, result.dtypes.get((nd.name, 0)) or "?"
        ref = fp32[(name, 0)]
        key = (rounding_node(name), 0) if policy.emulate and (rounding_node(name), 0) in low else (name, 0)
        got = low[key]
        plan_in = [_stored_dtype(plan_nodes, result.dtypes, e) for e in plan[name]["inputs"]]
        local = _local(model, nodes[nd.index], plan_in, dtype, fp32)
        is_low = dtype in LOW_PRECISION_DTYPES
        nonfinite = int((~np.isfinite(got)).sum())
        inputs_finite = all(np.isfinite(low[(low_graph["nodes"][e[0]]["name"], e[1])]).all()
                            for e in run[name]["inputs"])
        local_error = relative_error(local, ref)
        # A divergence candidate runs once more as FP32 ran it (float32, FP32's own inputs):
        # a different output there is the kernel's (random, or memory it leaves unwritten).
        unreproducible = local_error > tolerance and not relative_error(
            _local(model, nodes[nd.index], [None] * len(plan_in), None, fp32), ref) <= _REPRODUCIBLE
        rows.append(OpCompare(
            len(rows), name, nd.op, dtype, nd.reason.value, relative_error(got, ref),
            local_error, _max_abs_error(got, ref), nonfinite,
            int((np.abs(ref) > TARGET_MAX[policy.target_dtype]).sum()) if is_low else 0,
            _underflow(ref, dtype) if is_low else 0.0,
            bool(nonfinite and inputs_finite and np.isfinite(ref).all()),
            bool(unreproducible)))
    return rows


#: Relative L2 difference below which an op run twice in float32 on the same inputs counts
#: as the same result (float32 rounding in another summation order is ~1e-7).
_REPRODUCIBLE = 1e-5


def _unreproducible_note(rows: List[OpCompare]) -> Optional[str]:
    bad = [r for r in rows if r.unreproducible]
    if not bad:
        return None
    named = ", ".join(f"{r.name} ({r.op}, local error {r.local_error:.2e})" for r in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (f"not reproducible in float32: {named}{more} gave another output when run again as FP32 "
            "ran it (float32, on FP32's own inputs). The kernel is random or leaves part "
            "of its output unwritten (MXNet 1.9.1's CPU ROIAlign does, for rois whose batch index is "
            "below 0), so the FP32 reference itself changes from run to run: no precision problem, "
            "keeping ops in float32 cannot fix it, and the errors of the ops reading its values are not the "
            "target dtype's: none of them is the first divergence")


def _max_abs_error(low: np.ndarray, ref: np.ndarray) -> float:
    """The largest absolute difference; inf where one side is inf or NaN and the other differs."""
    if not low.size:
        return 0.0
    low64, ref64 = low.astype(np.float64), ref.astype(np.float64)
    same = (low64 == ref64) | (np.isnan(low64) & np.isnan(ref64))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(low64 - ref64))
    return float(np.where(np.isnan(diff), np.inf, diff).max())


def _downstream(graph: dict, names: Set[str]) -> Set[str]:
    """``names`` and every node that reads, directly or not, a value of one of them."""
    nodes = graph["nodes"]
    hit = set(names)
    for node in nodes:  # topological order
        if any(nodes[e[0]]["name"] in hit for e in node["inputs"]):
            hit.add(node["name"])
    return hit


def _first_divergence(rows: List[OpCompare], tolerance: float, graph: dict) -> Optional[OpCompare]:
    """The first row over the tolerance (or making inf/NaN) whose FP32 reference can be trusted:
    not an unreproducible op, nor one reading its values (FP32's own garbage, not precision)."""
    untrusted = _downstream(graph, {r.name for r in rows if r.unreproducible})
    return next((r for r in rows if r.name not in untrusted and (r.local_error > tolerance or r.new_nonfinite)),
                None)


def _probed(graph: dict, entries: Sequence[Key]) -> Tuple[Symbol, Dict[str, Key]]:
    """``graph`` with a zero variable added to each of ``entries``, and {variable: entry}.

    The gradient of such a variable is the gradient of its entry, and no value changes
    (x + 0 is x): how the FP32 backward's activation gradients are read."""
    wanted: Dict[str, List[int]] = {}
    for name, k in entries:
        wanted.setdefault(name, []).append(k)
    nodes: List[dict] = []
    moved: Dict[int, int] = {}
    probed: Dict[Tuple[int, int], int] = {}
    probes: Dict[str, Key] = {}

    def entry(e: list) -> list:
        add = probed.get((e[0], e[1]))
        return [add, 0, 0] if add is not None else [moved[e[0]], e[1], 0]

    for i, node in enumerate(graph["nodes"]):
        nodes.append(dict(node, inputs=[entry(e) for e in node["inputs"]]))
        moved[i] = len(nodes) - 1
        if node["op"] == "null":
            continue
        for k in sorted(wanted.get(node["name"], [])):
            probe = f"{node['name']}_amp_probe{k}"
            nodes.append({"op": "null", "name": probe, "inputs": []})
            nodes.append({"op": "elemwise_add", "name": f"{probe}_add",
                          "inputs": [[moved[i], k, 0], [len(nodes) - 1, 0, 0]]})
            probed[(i, k)] = len(nodes) - 1
            probes[probe] = (node["name"], k)
    out = {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
           "heads": [entry(h) for h in graph["heads"]], "attrs": graph.get("attrs", {})}
    return mx.sym.load_json(json.dumps(out)), probes


def _gradients(model: Model, low_model: tuple, data: Dict[str, mx.nd.NDArray], loss_fn: Any,
               labels: Any, target: str, low_entries: Dict[Key, np.ndarray]
               ) -> Tuple[List[GradCompare], float, str]:
    """Parameter gradients (unscaled) against FP32's, and the loss-scale headroom: the
    largest power of two that keeps every FP32 gradient of a parameter, and of each entry
    the plan holds in low precision (``low_entries``: FP32 values by entry), finite in the
    target."""
    numpy = mx.util.is_np_array()  # numpy mode: Gluon refuses a legacy block's outputs, loss_fn takes mx.np

    def grads(sym: Symbol, args: dict, aux: dict, extra: Dict[str, mx.nd.NDArray]) -> Dict[str, np.ndarray]:
        inputs = [mx.sym.var(n) for n in model.data_names]
        if numpy:
            sym, inputs = sym.as_np_ndarray(), [i.as_np_ndarray() for i in inputs]
        with warnings.catch_warnings():  # "Cannot decide type for ... data": the data comes below
            warnings.simplefilter("ignore", UserWarning)
            block = gluon.SymbolBlock(sym, inputs)
        block.collect_params().load_dict({**args, **aux, **extra}, ctx=model.ctx, cast_dtype=True,
                                         dtype_source="saved")
        with autograd.record():
            out = block(*[data[n] for n in model.data_names])
            loss = loss_fn(*(list(out) if isinstance(out, (list, tuple)) else [out]), labels)
        loss.backward()
        return {p.name: as_float32(p.grad()) for p in block.collect_params().values() if p.grad_req != "null"}

    probed, probes = _probed(model.graph, list(low_entries))
    zeros = {p: mx.nd.zeros(low_entries[e].shape, ctx=model.ctx) for p, e in probes.items()}
    ref = grads(probed, model.args, model.aux, zeros)
    got = grads(*low_model, {})
    rows = [GradCompare(n, relative_error(got[n], ref[n]), float(np.abs(ref[n]).max()))
            for n in model.args if n in ref and n in got]
    peaks = {n: float(np.abs(g).max()) if g.size else 0.0 for n, g in ref.items()}
    named = {p: f"gradient of {e[0]}" + (f" output {e[1]}" if e[1] else "") for p, e in probes.items()}
    worst = max(peaks, key=lambda n: peaks[n])
    peak = max(peaks[worst], 1e-30)
    return rows, 2.0 ** math.floor(math.log2(TARGET_MAX[target] / peak)), named.get(worst, worst)


def compare(block: Any, *inputs: mx.nd.NDArray, target_dtype: Any = None, emulate: Optional[bool] = None,
            tolerance: float = 1e-2, loss_fn: Any = None, labels: Any = None,
            excluded_sym_names: Optional[Sequence[str]] = None) -> CompareReport:
    """Every op of ``block``'s mixed-precision plan against FP32, in graph order.

    Parameters
    ----------
    block : HybridBlock
        An FP32 block (hybridized or not, parameters initialized); neither it nor its
        parameters change.
    *inputs : NDArray, or (nested) lists of NDArrays
        One batch, as the block takes it (``lm, ids, [h, c]``): nested lists are flattened
        as Gluon flattens a call's inputs, ``None`` dropped. Float inputs run as float32;
        integer inputs (token ids, lengths) keep their dtype.
    target_dtype, emulate :
        As for :func:`gluon_amp.init`. ``emulate=None`` emulates where the target has no
        kernels on the block's device (always on a CPU without AVX-512), and then
        ``target_dtype=None`` is :func:`gluon_amp.runtime.emulated_target`'s. A Policy works too.
    tolerance : float
        The local error above which an op is the first divergence.
    loss_fn, labels : optional
        Also compare the parameter gradients (unscaled) of ``loss_fn(outputs..., labels)``
        and report the loss-scale headroom: the largest power of two by which the loss can
        be scaled before a gradient of FP32's size (of a parameter, or of an entry the plan
        holds in low precision) overflows the target.
    excluded_sym_names : list of str, optional
        Op nodes to keep in float32, as for the converters (e.g. a :func:`bisect` result).

    Returns
    -------
    CompareReport
        One :class:`OpCompare` row per op; ``str()`` is a table.
    """
    return _compare(block, inputs, target_dtype, emulate, tolerance, loss_fn, labels, excluded_sym_names,
                    "gluon_amp.debug.compare")[0]


@dataclass
class Run:
    """What one :func:`compare` computed, for :func:`bisect` to go on from."""

    model: Model
    policy: Policy
    data: Dict[str, mx.nd.NDArray]
    fp32_outputs: List[np.ndarray]
    low_outputs: List[np.ndarray]


def _read_keys(graph: dict, result: Any) -> Set[Key]:
    """The entries of the low-precision graph a report reads: each decided op's output, its
    rounded value, its inputs, and the graph's outputs (not the steps of each rounding)."""
    nodes = graph["nodes"]
    by_name = {n["name"]: n for n in nodes}
    keys = {(nodes[h[0]]["name"], h[1]) for h in graph["heads"]}
    for nd in result.decisions:
        if nd.name not in by_name:
            continue  # removed by the pass (a cast of the model's own that changed no dtype)
        keys |= {(nd.name, 0), (rounding_node(nd.name), 0)}
        keys |= {(nodes[e[0]]["name"], e[1]) for e in by_name[nd.name]["inputs"]}
    return keys


def _heads(graph: dict, values: Dict[Key, np.ndarray]) -> List[np.ndarray]:
    return [values[(graph["nodes"][h[0]]["name"], h[1])] for h in graph["heads"]]


def _compare(block: Any, inputs: Sequence[mx.nd.NDArray], target_dtype: Any, emulate: Optional[bool],
             tolerance: float, loss_fn: Any, labels: Any, excluded_sym_names: Optional[Sequence[str]],
             caller: str) -> Tuple[CompareReport, Run]:
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number (a relative L2 error, e.g. 1e-2), got {tolerance!r}")
    if (loss_fn is None) != (labels is None):
        raise ValueError("pass loss_fn and labels together (to compare gradients), or neither")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs..., labels), got {type(loss_fn).__name__}")
    model = model_of(block, inputs, caller)
    policy = resolve_policy(target_dtype, emulate, model.ctx.device_type, excluded_sym_names)
    if policy.excluded_sym_names and model.renamed:  # a name excludes every node of that name
        wanted = set(policy.excluded_sym_names)
        policy = replace(policy, excluded_sym_names=tuple(sorted(
            wanted | {new for new, old in model.renamed.items() if old in wanted})))
    if not policy.enabled:
        raise RuntimeError(f"{caller}: nothing to compare, the policy is float32 ({policy.reason}); "
                           "pass target_dtype='float16' or 'bfloat16' (emulated where it cannot run)")
    data = feed(model, inputs)
    sym, args, aux, result = low_precision(model, policy)
    low_graph = json.loads(sym.tojson(remove_amp_cast=False))
    try:
        fp32 = run_internals(model.sym, data, model.args, model.aux, model.ctx)
    except MXNetError as exc:
        given = ", ".join(f"{n}: {model.data_dtypes[n]} {tuple(x.shape)}" for n, x in data.items())
        raise RuntimeError(f"{caller}: the FP32 graph does not run on these inputs ({given}): "
                           f"{str(exc).strip().splitlines()[-1]}. Pass the arrays the block takes, in their "
                           "dtypes (token ids and lengths as integers where its ops need them)") from None
    low = run_internals(sym, data, args, aux, model.ctx, keys=_read_keys(low_graph, result))
    rows = _rows(model, policy, result, low_graph, fp32, low, tolerance)
    fp32_out, low_out = _heads(model.graph, fp32), _heads(low_graph, low)
    out_error = max(relative_error(a, b) for a, b in zip(low_out, fp32_out))
    notes = ["values read by one executor over every internal output of the unfused graph (the same ops "
             "and values; without the oneDNN fusion deployment may add); local errors are computed emulated"]
    unreproducible = _unreproducible_note(rows)
    if unreproducible:
        notes.append(unreproducible)
    report = CompareReport(policy.target_dtype, policy.emulate, float(tolerance), rows, out_error,
                           _first_divergence(rows, tolerance, model.graph), notes)
    if loss_fn is not None:
        names = {n["name"] for n in model.graph["nodes"] if n["op"] != "null"}
        low_entries = {k: fp32[k] for k, t in result.dtypes.items()
                       if t in LOW_PRECISION_DTYPES and k[0] in names and k in fp32}
        report.gradients, report.loss_scale_headroom, report.headroom_limited_by = _gradients(
            model, (sym, args, aux), data, loss_fn, labels, policy.target_dtype, low_entries)
    return report, Run(model, policy, data, fp32_out, low_out)
