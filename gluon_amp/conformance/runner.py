"""Run one op the ways a plan can: each API, imperative and hybridized, forward and backward,
in FP32, in a low dtype, and with mixed input dtypes; turn what MXNet did into an Observation.

Every run is plain MXNet (AMP off): the harness measures MXNet's kernels, not gluon_amp.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from gluon_amp_core.lists.common import KEEP_FP32_INPUTS
from gluon_amp_core.verdicts import BOUNDS, MODES, Observation, Part

from ..mxnet_internals import error_line, original_function, quiet_stderr, registry, to_mx_dtype
from ..type_inference import op_types
from .cases import Case

APIS = ("legacy", "numpy")
#: MXNet's words when oneDNN has no primitive for the dtype on this CPU's ISA (not a fact about
#: the op: a host with AVX512-BF16 or AMX runs it)
_ISA_WORDS = ("primitive descriptor", "could not create", "mkldnn", "dnnl", "unimplemented")
#: Words of a refusal by type inference, which every device shares. ``default_type_flag``: 1.9.1
#: include/mxnet/operator.h, the InferType of a legacy operator (Crop, MultiBoxPrior) that takes
#: float32 alone, on a GPU too.
_TYPE_WORDS = ("infertype", "infer_type", "incompatible attr", "type inference", "finfertype",
               "default_type_flag")


@functools.lru_cache(maxsize=None)
def _functions() -> Dict[str, Dict[Tuple[str, str], Callable]]:
    """op -> {(api, 'ndarray'|'symbol'): the generated function}."""
    out: Dict[str, Dict[Tuple[str, str], Callable]] = {}
    for module, _attr, fn, op, kind in registry.op_function_sites():
        api = "numpy" if "numpy" in module.__name__ else "legacy"
        if "sparse" in module.__name__:
            continue
        out.setdefault(op, {}).setdefault((api, kind), original_function(fn))
    return out


def apis_of(op: str) -> Tuple[str, ...]:
    """The APIs that have both an imperative and a symbolic function for ``op``."""
    fns = _functions().get(op, {})
    return tuple(a for a in APIS if (a, "ndarray") in fns and (a, "symbol") in fns)


def is_isa_refusal(message: str) -> bool:
    m = message.lower()
    return any(w in m for w in _ISA_WORDS)


def is_type_refusal(message: str) -> bool:
    m = message.lower().replace(" ", "")
    return any(w.replace(" ", "") in m for w in _TYPE_WORDS)


def make_inputs(case: Case, seed: int = 0) -> List[np.ndarray]:
    rng = np.random.RandomState(seed)
    out = []
    for i, shape in enumerate(case.shapes):
        low, high = case.range_of(i)
        if low == "int":
            out.append(rng.randint(0, int(high), size=shape).astype("float32"))
        else:
            out.append(rng.uniform(float(low), high, size=shape).astype("float32"))
    return out


def float_slots(case: Case) -> List[int]:
    return [i for i in range(len(case.shapes)) if case.range_of(i)[0] != "int"]


@dataclass
class Run:
    """The outputs (and input gradients) of one run, as float32 NumPy arrays."""

    outputs: List[np.ndarray]
    grads: Optional[List[np.ndarray]]
    grad_error: Optional[str] = None


def _to_np(x: Any) -> np.ndarray:
    if hasattr(x, "as_nd_ndarray"):
        x = x.as_nd_ndarray()
    if x.dtype in (np.float32, np.float64) or np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        return x.asnumpy().astype("float64")
    return mx.nd.amp_cast(x, dtype="float32").asnumpy().astype("float64")


def _arrays(values: Sequence[np.ndarray], dtypes: Sequence[str], api: str) -> List[Any]:
    out = []
    for v, dt in zip(values, dtypes):
        a = mx.nd.array(v, dtype="float64" if dt == "float64" else "float32")
        if dt not in ("float32", "float64"):
            a = mx.nd.amp_cast(a, dtype=to_mx_dtype(dt))
        out.append(a.as_np_ndarray() if api == "numpy" else a)
    return out


def run(op: str, case: Case, values: Sequence[np.ndarray], dtypes: Sequence[str], api: str,
        hybridize: bool, backward: bool = True, train_mode: bool = False) -> Run:
    """``op`` on ``values`` (each cast to its dtype in ``dtypes``; int inputs stay float32), with
    the backward recorded in ``autograd.record(train_mode=train_mode)``."""
    fns = _functions()[op]
    arrays = _arrays(values, dtypes, api)
    floats = [i for i in float_slots(case)]
    if backward:
        for i in floats:
            arrays[i].attach_grad()
    if hybridize:
        names = [f"in{i}" for i in range(len(arrays))]
        xs = [mx.sym.var(n) for n in names]
        if api == "numpy":
            xs = [x.as_np_ndarray() for x in xs]
        sym = fns[(api, "symbol")](*xs, **case.attrs)
        with mx.util.np_shape(api == "numpy"), mx.util.np_array(api == "numpy"):
            block = gluon.SymbolBlock(sym, xs)
        block.hybridize()
        call: Callable = block
    else:
        fn = fns[(api, "ndarray")]
        call = lambda *a: fn(*a, **case.attrs)  # noqa: E731
    if case.random:
        mx.random.seed(7)
    with mx.util.np_shape(api == "numpy"), mx.util.np_array(api == "numpy"):
        with autograd.record(train_mode=train_mode) if backward else _nothing():
            out = call(*arrays)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        picked = [outs[k] for k in (case.outputs if case.outputs is not None else range(len(outs)))]
        values_out = [_to_np(o) for o in outs]
        grads, grad_error = None, None
        if backward and picked and floats:
            try:
                heads = [mx.nd.array(np.random.RandomState(11 + k).uniform(0.5, 1.5, o.shape), dtype="float32")
                         for k, o in enumerate(picked)]
                heads = [h.astype("float64") if _dtype(o) == "float64"
                         else mx.nd.amp_cast(h, dtype=to_mx_dtype(_dtype(o))) for h, o in zip(heads, picked)]
                if api == "numpy":
                    heads = [h.as_np_ndarray() for h in heads]
                autograd.backward(picked, head_grads=heads)
                grads = [_to_np(arrays[i].grad) for i in floats]
            except mx.base.MXNetError as e:
                grad_error = error_line(e)
    return Run([values_out[k] for k in (case.outputs if case.outputs is not None else range(len(outs)))],
               grads, grad_error)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _dtype(x: Any) -> str:
    from gluon_amp_core.dtypes import dtype_name
    return dtype_name(x.dtype)


def rel_error(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """The largest ``max|got - want| / max|want|`` over the arrays; inf where shapes differ or a
    finite value became NaN or inf."""
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return float("inf")
        finite = np.isfinite(w)
        if (~np.isfinite(g) & finite).any():
            return float("inf")
        if not finite.any():
            continue
        scale = float(np.abs(w[finite]).max())
        diff = float(np.abs(g[finite] - w[finite]).max()) if g.size else 0.0
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def rounded(values: Sequence[np.ndarray], case: Case, dtype: str,
            slots: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """The float inputs (or ``slots``) rounded to ``dtype`` (as float32), the others as they are."""
    out = list(values)
    for i in (float_slots(case) if slots is None else slots):
        out[i] = mx.nd.amp_cast(mx.nd.amp_cast(mx.nd.array(values[i]), dtype=to_mx_dtype(dtype)),
                                dtype="float32").asnumpy()
    return out


@dataclass
class CaseResult:
    """What one case showed in one dtype."""

    observation: Observation
    paths: List[str] = field(default_factory=list)  # the paths that ran in the dtype
    unmeasured: Optional[str] = None  # oneDNN has no kernel for the dtype on this CPU's ISA
    emulated_error: Optional[float] = None


def low_slots(op: str, case: Case) -> List[int]:
    """The float inputs a plan casts: all but those it keeps float32 (normalisation parameters
    and running statistics: gluon_amp_core/lists/common.py's KEEP_FP32_INPUTS)."""
    keep = KEEP_FP32_INPUTS.get(op, ())
    names = registry.op_infos()[op].inputs if op in registry.op_infos() else ()
    return [i for i in float_slots(case) if not (i < len(names) and names[i] in keep)]


def check_case(op: str, case: Case, dtype: str, apis: Sequence[str]) -> CaseResult:
    """Run ``case`` of ``op`` in ``dtype`` every way, in both autograd modes, against FP32 on the
    same rounded inputs; a part beyond the dtype's bound gets its FP32 reference checked
    (:func:`reference_error`) before the dtype is blamed."""
    values = make_inputs(case)
    rvalues = rounded(values, case, dtype, low_slots(op, case))
    n = len(case.shapes)
    low = [dtype if i in low_slots(op, case) else "float32" for i in range(n)]
    f32 = ["float32"] * n
    parts: List[Part] = []
    paths: List[str] = []
    refused, by_types = None, False
    emulated = None
    for api, hyb in itertools.product(apis, (False, True)):
        path = f"{api}/{'hybridized' if hyb else 'imperative'}"
        ran, predict_ref = False, None
        for mode in MODES:
            train = mode == "train"
            try:
                ref = run(op, case, rvalues, f32, api, hyb, train_mode=train)
            except mx.base.MXNetError:
                continue  # this path does not run these inputs even in FP32
            try:
                got = run(op, case, values, low, api, hyb, train_mode=train)
            except mx.base.MXNetError as e:
                msg = error_line(e)
                if is_isa_refusal(msg):
                    return CaseResult(Observation(), paths, unmeasured=f"{path}: {msg}")
                refused, by_types = f"{path}: {msg}", is_type_refusal(msg)
                break
            ran = True
            if not train:  # its outputs are the plain forward's: the emulated run reuses them
                predict_ref = ref
            if case.random:  # values drawn differently per dtype: whether it runs is the fact
                continue
            checked = functools.partial(reference_error, op, case, rvalues, api, hyb, train, ref)
            parts.append(_part(path, "forward", mode, rel_error(got.outputs, ref.outputs), dtype, checked))
            if ref.grads is not None:
                if got.grads is None:
                    if got.grad_error and is_isa_refusal(got.grad_error):
                        return CaseResult(Observation(), paths, unmeasured=f"{path} backward: {got.grad_error}")
                    refused, by_types = f"{path} {mode}-mode backward: {got.grad_error}", False
                    break
                parts.append(_part(path, "backward", mode, rel_error(got.grads, ref.grads), dtype, checked))
        if refused:
            break
        if not ran:
            continue
        paths.append(path)
        if emulated is None and not case.random:
            ref = predict_ref or run(op, case, rvalues, f32, api, hyb, backward=False)
            full = run(op, case, values, f32, api, hyb, backward=False)
            emu = [rounded([np.atleast_1d(o)], Case((np.atleast_1d(o).shape,)), dtype)[0].reshape(o.shape)
                   if o.size else o for o in ref.outputs]
            emulated = rel_error(emu, full.outputs)
    mixed = None if refused else mixed_refusal(op, case, values, dtype, apis[0] if apis else "legacy")
    return CaseResult(Observation(refused, by_types, None, mixed, tuple(parts)), paths, emulated_error=emulated)


def _part(path: str, name: str, mode: str, error: float, dtype: str,
          checked: Callable[[str], float]) -> Part:
    """A compared part; its reference checked only where the dtype would otherwise be blamed."""
    beyond = not error <= BOUNDS[dtype]  # NaN is beyond
    return Part(path, name, mode, error, checked(name) if beyond else None)


def reference_error(op: str, case: Case, values: Sequence[np.ndarray], api: str, hybridize: bool,
                    train_mode: bool, ref: Run, name: str) -> float:
    """How far FP32's ``name`` part (``forward`` outputs or ``backward`` input gradients) of
    ``ref`` is from the same FP32 run again and from MXNet's float64 run (where the op has
    float64): the larger. ``inf`` where the FP32 run does not run again."""
    def part(r: Run) -> Optional[List[np.ndarray]]:
        return r.outputs if name == "forward" else r.grads

    want = part(ref)
    if want is None:
        return float("inf")
    try:
        again = part(run(op, case, values, ["float32"] * len(case.shapes), api, hybridize, train_mode=train_mode))
    except mx.base.MXNetError:
        return float("inf")
    found = [float("inf") if again is None else rel_error(again, want)]
    floats = float_slots(case)
    for f64 in (["float64"] * len(case.shapes),
                ["float64" if i in floats else "float32" for i in range(len(case.shapes))]):
        try:
            wide = part(run(op, case, values, f64, api, hybridize, train_mode=train_mode))
        except mx.base.MXNetError:
            _flush()
            continue
        if wide is not None:
            found.append(rel_error(want, wide))
        break
    return max(found, key=lambda e: (e != e, e))  # NaN counts as the largest


def _flush() -> None:
    """Collect an error MXNet's engine keeps from a refused run, so no later run reports it."""
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


def mixed_refusal(op: str, case: Case, values: Sequence[np.ndarray], dtype: str, api: str) -> Optional[str]:
    """MXNet's message for a mix of ``dtype`` and float32 inputs it refuses where its type
    inference cannot be relied on to say so: it accepts the mix (the op has no type rule for it:
    'missing FInferType'), or cannot give the other inputs the first one's dtype. Else None: a
    cast of the others to the first input's dtype is what MXNet asks, and the plan's neutral path
    does that."""
    slots = low_slots(op, case)
    if len(slots) < 2:
        return None
    combos = [c for c in itertools.product((dtype, "float32"), repeat=len(slots)) if len(set(c)) > 1][:6]
    for combo in combos:
        dts = ["float32"] * len(case.shapes)
        for i, d in zip(slots, combo):
            dts[i] = d
        try:
            run(op, case, values, dts, api, hybridize=False, backward=False)
        except mx.base.MXNetError as e:
            if is_isa_refusal(error_line(e)):
                continue
            names = tuple(("int32" if i not in float_slots(case) else d) for i, d in enumerate(dts))
            first = slots[0]
            free = tuple(d if (i == first or i not in slots) else None for i, d in enumerate(names))
            with quiet_stderr():
                accepted, typed = op_types(op, dict(case.attrs), names), op_types(op, dict(case.attrs), free)
            if accepted is not None or typed is None:
                return f"inputs {'/'.join(combo)}: {error_line(e)}"
    return None
