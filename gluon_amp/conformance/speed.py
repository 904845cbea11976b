"""Time each op a bfloat16 plan may run in bfloat16 against float32 with the casts around it.

The facts of :mod:`gluon_amp_core.kernel_speed`. Each op runs imperatively (the kernels a graph
runs too) on inputs of a timing size: a generic op's inputs all of :data:`SIZE` (or one data
input and per-channel vectors), an op with a spec (:data:`SPECS`) as given there. The low side
is the op on bfloat16 inputs; the float32 side casts those inputs to float32, runs the op and
casts its float outputs back, as a plan that keeps the op float32 would. The fastest of
:data:`REPEATS` runs of :data:`CALLS` calls each. Ops run in worker processes, a group at a time;
an op whose process dies is timed alone, and one that dies alone is named, not timed.
Convolution and FullyConnected are not timed here: the speed probe and the tuner measure them.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mxnet as mx

from gluon_amp_core.kernel_speed import Timing
from gluon_amp_core.table import OpClass, list_classes

from ..mxnet_internals import to_mx_dtype
from . import cases, harness, runner
from .cases import Case, _c

COMMAND = "python -m gluon_amp.conformance --speed --write"
DTYPE = "bfloat16"
#: a generic op's input shape: 262,144 elements, enough that the kernel, not the call, is timed
SIZE = (64, 64, 64)
CALLS = 10
REPEATS = 5
_IMG = (8, 64, 32, 32)
_INT = ("int", 2.0)
_P = cases.POSITIVE

#: cases at the timing size for ops whose conformance case is a spec (not generic)
SPECS: Dict[str, List[Case]] = {
    "Activation": [_c(SIZE, act_type=a) for a in ("relu", "sigmoid", "tanh", "softsign")],
    "LeakyReLU": [_c(SIZE, act_type="leaky", slope=0.1), _c(SIZE, act_type="gelu")],
    "BatchNorm": [_c(_IMG, (64,), (64,), (64,), (64,), ranges=(cases.SIGNED, _P, cases.SIGNED, cases.SIGNED, _P),
                     fix_gamma=False)],
    "Pooling": [_c(_IMG, kernel=(2, 2), stride=(2, 2), pool_type="max"),
                _c(_IMG, kernel=(2, 2), stride=(2, 2), pool_type="avg"),
                _c(_IMG, kernel=(1, 1), global_pool=True, pool_type="avg")],
    "Concat": [_c(SIZE, SIZE, num_args=2, dim=1)],
    "_npi_concatenate": [_c(SIZE, SIZE, num_args=2, axis=1)],
    "stack": [_c(SIZE, SIZE, num_args=2, axis=0)],
    "_npi_stack": [_c(SIZE, SIZE, num_args=2, axis=0)],
    "add_n": [_c(SIZE, SIZE, SIZE, num_args=3)],
    "where": [_c(SIZE, SIZE, SIZE, ranges=(_INT, cases.SIGNED, cases.SIGNED))],
    "_npi_where": [_c(SIZE, SIZE, SIZE, ranges=(_INT, cases.SIGNED, cases.SIGNED))],
    "Reshape": [_c(SIZE, shape=(0, -1))],
    "Flatten": [_c(SIZE)],
    "expand_dims": [_c(SIZE, axis=1)],
    "slice_axis": [_c(SIZE, axis=1, begin=0, end=32)],
    "SliceChannel": [_c(SIZE, num_outputs=2, axis=1)],
    "broadcast_to": [_c((1, 64, 64), shape=SIZE)],
    "broadcast_like": [_c((1, 64, 64), SIZE)],
    "max": [_c(SIZE, axis=1)],
    "argmax": [_c(SIZE, axis=1)],
    "argmin": [_c(SIZE, axis=1)],
    "min": [_c(SIZE, axis=1)],
    "softmax": [_c(SIZE, axis=-1)],
    "log_softmax": [_c(SIZE, axis=-1)],
    "repeat": [_c(SIZE, repeats=2, axis=1)],
    "tile": [_c(SIZE, reps=(2, 1, 1))],
}


def candidates() -> List[str]:
    """The ops bfloat16's lists let a plan run in bfloat16 (before any verdict, this scan's
    included), but for the low-precision class (the speed probe's and the tuner's) and the ops
    the conformance harness leaves out."""
    classes = list_classes(DTYPE)
    return [op for op, dts in cases.candidates().items()
            if DTYPE in dts and classes.get(op) is not OpClass.LOW_PRECISION
            and cases.excluded_by_rule(op) is None and runner.apis_of(op)]


def _generic(op: str) -> List[Case]:
    """The conformance harness's generic layouts at :data:`SIZE`."""
    out = []
    for c in cases.generic_cases(op):
        shapes = tuple(SIZE if len(s) == 3 else (SIZE[1],) if s == (3,) else (SIZE[0] * SIZE[1] * SIZE[2],)
                       if s == (6,) else (SIZE[0] * SIZE[1], SIZE[2]) for s in c.shapes)
        out.append(Case(shapes, c.attrs, c.ranges, c.random, c.outputs))
    return out


def cases_of(op: str) -> Tuple[List[Case], bool]:
    """The cases to time and whether they all run (a spec's), or are tried until one runs."""
    if op in SPECS:
        return SPECS[op], True
    if op in cases.SPECS:
        return [], True
    return _generic(op), False


def _key(op: str, case: Case) -> str:
    attr = harness.conditional_attr(op)
    if attr is not None and attr in case.attrs:
        return f"{op}:{attr}={case.attrs[attr]}"
    return op


def _best_ms(call: Callable[[], Any]) -> float:
    call()
    mx.nd.waitall()
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        mx.nd.waitall()
        best = min(best, (time.perf_counter() - t0) / CALLS)
    return 1000 * best


def time_case(op: str, case: Case, api: str) -> Tuple[float, float]:
    """(float32 with its casts, bfloat16) milliseconds per call of ``op`` on ``case``."""
    fn = runner._functions()[op][(api, "ndarray")]
    values = runner.make_inputs(case)
    floats = runner.low_slots(op, case)  # normalisation parameters stay float32, as in a plan
    low = runner._arrays(values, [DTYPE if i in floats else "float32" for i in range(len(values))], api)
    low_type, f32_type = to_mx_dtype(DTYPE), to_mx_dtype("float32")

    def cast(x: Any, dtype: Any) -> Any:
        out = mx.nd.amp_cast(x.as_nd_ndarray() if api == "numpy" else x, dtype=dtype)
        return out.as_np_ndarray() if api == "numpy" else out

    def outputs(out: Any) -> List[Any]:
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def low_run() -> None:
        fn(*low, **case.attrs)

    def fp32_run() -> None:
        up = [cast(a, f32_type) if i in floats else a for i, a in enumerate(low)]
        for o in outputs(fn(*up, **case.attrs)):
            if o.dtype == "float32":
                cast(o, low_type)

    with mx.util.np_shape(api == "numpy"), mx.util.np_array(api == "numpy"):
        if case.random:
            mx.random.seed(7)
        return _best_ms(fp32_run), _best_ms(low_run)


def time_op(op: str, host: str) -> Tuple[List[Timing], str]:
    """The timings of ``op``'s cases on this host, and why none where it has none."""
    todo, all_run = cases_of(op)
    if not todo:
        return [], "its conformance case is a spec with no timing case here"
    api = runner.apis_of(op)[0]
    out, why = [], ""
    for case in todo:
        try:
            fp32_ms, low_ms = time_case(op, case, api)
        except mx.base.MXNetError as e:  # FP32 or the low dtype refuses this case: the next one
            why = runner.error_line(e)[:160]
            continue
        shapes = " ".join("x".join(map(str, s)) for s in case.shapes)
        attrs = " ".join(f"{k}={v}" for k, v in sorted(case.attrs.items()))
        out.append(Timing(_key(op, case), DTYPE, host, f"{shapes} {attrs}".strip(), round(fp32_ms, 4),
                          round(low_ms, 4)))
        if not all_run:
            break
    return out, ("" if out else why or "no case ran")


def worker(ops: Sequence[str]) -> None:
    """Print one JSON line per op (the driver reads them; a line missing says the process died)."""
    host = harness.host()[0]
    for op in ops:
        print(json.dumps({"start": op}), flush=True)
        try:
            timings, why = time_op(op, host)
        except Exception as e:  # noqa: BLE001  a harness limit, named in the output, not a timing
            timings, why = [], f"the harness could not run it: {type(e).__name__}: {str(e)[:160]}"
        print(json.dumps({"op": op, "timings": [list(t.__dict__.values()) for t in timings], "why": why}), flush=True)


def run_all(ops: Sequence[str], chunk: int = 60,
            log: Optional[Callable[[str], None]] = None) -> Tuple[List[Timing], Dict[str, str]]:
    """Every op of ``ops`` timed in worker processes: the timings, and op -> why it has none."""
    todo, lines = list(ops), {}
    env = {**os.environ, "GLUON_AMP_TUNE": "0"}
    while todo:
        run = harness.run_worker(["--speed-worker", *todo[:chunk]], env)
        if run.returncode != 0 and not run.lines and run.died_in is None:
            raise RuntimeError(f"kernel speed worker failed: {run.stderr[-2000:]}")
        lines.update(run.lines)
        if run.died_in is not None:  # alone once more; dying alone, it is named, not timed
            alone = harness.run_worker(["--speed-worker", run.died_in], env)
            lines[run.died_in] = alone.lines.get(run.died_in) or {"timings": [],
                                                                  "why": f"the process died ({alone.how})"}
        todo = [o for o in todo if o not in lines]
        if log is not None:
            log(f"{len(ops) - len(todo)} ops timed, {len(todo)} to go")
    timings = [Timing(*row) for op in ops for row in lines[op]["timings"]]
    return timings, {op: lines[op]["why"] for op in ops if lines[op]["why"] and not lines[op]["timings"]}


def data_module(timings: Sequence[Timing], untimed: Dict[str, str], host_row: Sequence[str]) -> str:
    """The text of ``gluon_amp_core/lists/kernel_speed_measured*.py``."""
    lines = ["# ruff: noqa: E501", f'"""Generated by ``{COMMAND}``: do not edit by hand.', "",
             "How fast this host's MXNet kernels ran in a low dtype against float32 with the casts around them",
             "(see gluon_amp_core/lists/kernel_speed.py).", '"""', "",
             f"MEASURED_HOST = {(host_row[0],) + tuple(host_row[1:4]) + (COMMAND,)!r}", "",
             "# (key, dtype, host, case, fp32_ms, low_ms)", "TIMINGS = ("]
    lines += [f"    {(t.key, t.dtype, t.host, t.case, t.fp32_ms, t.low_ms)!r}," for t in timings]
    lines += [")", "", "# candidate ops not timed: op -> why", "UNTIMED = {"]
    lines += [f"    {op!r}: {w!r}," for op, w in sorted(untimed.items())]
    lines += ["}", ""]
    return "\n".join(lines)


def data_path(root: str, host_key: str) -> str:
    """The module a host's timings are written to: the one naming this host, else a new one."""
    from gluon_amp_core.lists import kernel_speed
    lists = os.path.join(root, "gluon_amp_core", "lists")
    for name, row in zip(kernel_speed.MEASURED_MODULES, kernel_speed.MEASURED_HOSTS):
        if row[0] == host_key:
            return os.path.join(lists, f"{name}.py")
    return os.path.join(lists, "kernel_speed_measured_" + "".join(c if c.isalnum() else "_" for c in host_key) + ".py")
