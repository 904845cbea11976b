"""The harness: every candidate op, each low dtype, in worker processes (a kernel that kills
its process is a verdict, not the end of the run); the facts, the data file and the report."""
from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES
from gluon_amp_core.verdicts import (BOUNDS, CONFORMANCE_VERDICTS, MODES, RULES, Observation, Verdict,
                                     backward_by_mode, decisive_error, judge, part_verdict, worst)

from .. import runtime
from ..mxnet_internals import error_line
from . import cases, runner

COMMAND = "python -m gluon_amp.conformance --write"
#: the CPU flags that decide which low-precision kernels a host has
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "f16c")


@dataclass
class DtypeResult:
    """One op in one low dtype on this host."""

    verdict: Optional[str] = None      # None: not measured here (``unmeasured`` says why)
    device: str = "cpu"
    error: Optional[float] = None
    emulated_error: Optional[float] = None
    note: str = ""
    paths: List[str] = field(default_factory=list)
    unmeasured: str = ""
    #: [mode, verdict, error] of the backward per autograd mode (train decides the verdict)
    backward: List[list] = field(default_factory=list)


@dataclass
class OpResult:
    op: str
    excluded: str = ""                 # left out by rule, or no generated input fits (FP32's message)
    cases: int = 0
    results: Dict[str, DtypeResult] = field(default_factory=dict)


def host() -> Tuple[str, str, str, str, str]:
    """(key, cpu, flags that matter, MXNet, command) of this machine."""
    import mxnet as mx
    cap = runtime.capability()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    isa = str(getattr(cap.bf16, "value", cap.bf16)).lower()
    why = str(getattr(cap, "why", "") or "").split(",")[0]
    have = runtime.cpu_flags()
    cpu_flags = " ".join(f for f in _FLAGS if f in have) + ("" if "amx_bf16" in have else " (no AMX)")
    flags = f"{cpu_flags.strip()}; bfloat16 kernels: {isa}" + (f" ({why})" if why else "")
    # AMX that gluon_amp switched on is the host's own kernels, not a cap: "-amx", not "-dnnl-..."
    key = host_key(cpu, isa + "-amx" * runtime.amx_active(), runtime.user_isa_cap())
    return key, cpu, flags, mx.__version__, COMMAND


def host_key(cpu: str, isa: str, capped: Optional[str]) -> str:
    """A host's key: the CPU's first two words and its bfloat16 kernels (``'amd-epyc-native'``),
    and the ``DNNL_MAX_CPU_ISA`` cap where one is set: a simulated host's facts must not replace
    those of the host it imitates."""
    key = "-".join(cpu.lower().replace("(r)", "").split()[:2] + ["no-bf16" if isa == "none" else isa])
    return key + ("-dnnl-" + "".join(c if c.isalnum() else "-" for c in capped.lower()) if capped else "")


def conditional_attr(op: str) -> Optional[str]:
    """The attribute a conditional rule reads for ``op`` in either dtype's lists, or None."""
    for dt in LOW_PRECISION_DTYPES:
        for name, attr, _values in importlib.import_module(f"gluon_amp_core.lists.{dt}").CONDITIONAL_FP32:
            if name == op:
                return attr
    return None


def check_op(op: str, dtypes: Sequence[str]) -> List[OpResult]:
    """Run every case of ``op`` in each dtype (see :mod:`.runner`): one result for the op, or, for
    an op with a conditional attribute, one per value of it (``'Activation:act_type=relu'``)."""
    why = cases.excluded_by_rule(op)
    if why:
        return [OpResult(op, excluded=why)]
    apis = runner.apis_of(op)
    if not apis:
        return [OpResult(op, excluded="no generated op function (mx.nd/mx.sym or mx.np/mx.npx)")]
    todo, from_spec = cases.cases_of(op)
    fitting = [c for c in todo if _fits(op, c, apis)]
    if not from_spec:
        fitting = fitting[:1]
    if not fitting:
        return [OpResult(op, excluded="no generated input fits: " + _fp32_message(op, todo[0], apis))]
    attr = conditional_attr(op)
    groups: Dict[str, List[cases.Case]] = {}
    for c in fitting:
        key = f"{op}:{attr}={c.attrs[attr]}" if attr and attr in c.attrs else op
        groups.setdefault(key, []).append(c)
    return [_check_group(key, op, group, dtypes, apis) for key, group in groups.items()]


def _check_group(key: str, op: str, group: Sequence[cases.Case], dtypes: Sequence[str],
                 apis: Sequence[str]) -> OpResult:
    out = OpResult(key, cases=len(group))
    for dt in dtypes:
        res = DtypeResult()
        found: List[Tuple[Verdict, str, str, Optional[float]]] = []
        by_mode: Dict[str, Tuple[Verdict, float]] = {}
        for c in group:
            r = runner.check_case(op, c, dt, apis)
            if r.unmeasured:
                res.unmeasured = r.unmeasured
                continue
            verdict, device = judge(r.observation, dt)
            error = decisive_error(r.observation)
            found.append((verdict, device, _note(c, r.observation, verdict, dt, error), error))
            for mode, v, e in backward_by_mode(r.observation.parts, dt):
                was_v, was_e = by_mode.get(mode, (Verdict.OK, 0.0))
                by_mode[mode] = (worst((was_v, v)), e if e != e or e > was_e else was_e)
            res.paths = sorted(set(res.paths) | set(r.paths))
            if r.emulated_error is not None:
                res.emulated_error = max(res.emulated_error or 0.0, r.emulated_error)
        if found:
            v = worst(f[0] for f in found)
            first = next(f for f in found if f[0] is v)
            res.verdict, res.device, res.note = v.value, first[1], first[2]
            errors = [f[3] for f in found if f[3] is not None]
            res.error = max(errors) if errors else None
            res.backward = [[m, by_mode[m][0].value, by_mode[m][1]] for m in MODES if m in by_mode]
        out.results[dt] = res
    return out


def _note(c: cases.Case, ob: Observation, verdict: Verdict, dtype: str, error: Optional[float]) -> str:
    """What the row says: MXNet's refusal, the error, or, where FP32 itself is off, what it does."""
    if ob.refused or ob.mixed_refused:
        return ob.refused or ob.mixed_refused or ""
    if verdict is Verdict.FP32_WRONG:
        p = max((p for p in ob.parts if p.decisive and part_verdict(p, dtype) is Verdict.FP32_WRONG),
                key=lambda p: p.reference_error if p.reference_error == p.reference_error else float("inf"))
        return (f"{_attrs(c)}: MXNet's float32 {p.mode}-mode {p.name} is itself off by {p.reference_error:.3g} "
                f"(against float64 or a second run, {p.path}); {dtype} is not blamed (error {p.error:.3g})")
    return f"{_attrs(c)}: error {error:.3g}" if error is not None else _attrs(c)


def _attrs(c: cases.Case) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.attrs.items()) or "default attributes"


def _fits(op: str, case: cases.Case, apis: Sequence[str]) -> bool:
    try:
        runner.run(op, case, runner.make_inputs(case), ["float32"] * len(case.shapes), apis[0], False, False)
        return True
    except Exception:  # noqa: BLE001  any refusal: the layout does not fit this op
        return False


def _fp32_message(op: str, case: cases.Case, apis: Sequence[str]) -> str:
    try:
        runner.run(op, case, runner.make_inputs(case), ["float32"] * len(case.shapes), apis[0], False, False)
        return "(ran)"
    except Exception as e:  # noqa: BLE001
        return error_line(e)[:200]


# -- worker processes


def worker(ops: Sequence[str], dtypes: Sequence[str]) -> None:
    """Print one JSON line per op (the driver reads them; a line missing says the process died)."""
    for op in ops:
        print(json.dumps({"start": op}), flush=True)
        try:
            results = check_op(op, dtypes)
        except Exception as e:  # noqa: BLE001  a harness limit, named in the report, not a verdict
            results = [OpResult(op, excluded=f"the harness could not run it: {type(e).__name__}: {str(e)[:160]}")]
        print(json.dumps({"op": op, "results": [_to_json(r) for r in results]}), flush=True)


def _to_json(r: OpResult) -> dict:
    d = asdict(r)
    return d


def _from_json(d: dict) -> OpResult:
    return OpResult(d["op"], d["excluded"], d["cases"], {k: DtypeResult(**v) for k, v in d["results"].items()})


@dataclass
class WorkerRun:
    """What one worker process printed: op -> its result line, the op it died in (None), and how
    it ended."""

    lines: Dict[str, dict]
    died_in: Optional[str]
    returncode: int
    stderr: str

    @property
    def how(self) -> str:
        """How the process ended, for a report (``exit 1``, ``signal 11``)."""
        return f"signal {-self.returncode}" if self.returncode < 0 else f"exit {self.returncode}"


def run_worker(args: Sequence[str], env: Mapping[str, str]) -> WorkerRun:
    """``python -m gluon_amp.conformance ARGS`` in a process of its own, its JSON lines read:
    a worker prints ``{"start": op}`` before an op and ``{"op": op, ...}`` after it, so a start
    with no result names the op the process died in."""
    p = subprocess.run([sys.executable, "-m", "gluon_amp.conformance", *args], capture_output=True, text=True,
                       env=dict(env))
    lines: Dict[str, dict] = {}
    started = None
    for line in p.stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "start" in d:
            started = d["start"]
        elif "op" in d:
            lines[d["op"]], started = d, None
    return WorkerRun(lines, started, p.returncode, p.stderr)


def run_all(ops: Sequence[str], dtypes: Sequence[str] = LOW_PRECISION_DTYPES, chunk: int = 400,
            log: Optional[callable] = None) -> List[OpResult]:
    """Every op in ``ops``, in worker processes; an op whose process dies gets ``no_kernel``."""
    todo = list(ops)
    done: Dict[str, List[OpResult]] = {}
    env = {**os.environ, "GLUON_AMP_TUNE": "0"}
    while todo:
        batch = todo[:chunk]
        run = run_worker(["--worker", "--dtypes", ",".join(dtypes), *batch], env)
        done.update({op: [_from_json(r) for r in d["results"]] for op, d in run.lines.items()})
        if run.died_in is not None:  # the process died in this op: run it alone, once per dtype
            done[run.died_in] = _alone(run.died_in, dtypes, env)
        elif run.returncode != 0 and not any(o in done for o in batch):
            raise RuntimeError(f"conformance worker failed: {run.stderr[-2000:]}")
        todo = [o for o in todo if o not in done]
        if log is not None:
            log(f"{len(done)} ops done, {len(todo)} to go")
    return [r for o in ops for r in done[o]]


def _alone(op: str, dtypes: Sequence[str], env: Mapping[str, str]) -> List[OpResult]:
    """``op`` in a process of its own per dtype; a dtype whose process dies gets ``no_kernel``."""
    merged: Dict[str, OpResult] = {}
    for dt in dtypes:
        run = run_worker(["--worker", "--dtypes", dt, op], env)
        if op in run.lines:
            got = [_from_json(r) for r in run.lines[op]["results"]]
        else:
            how = f"the process died ({run.how})"
            got = [OpResult(op, cases=1, results={dt: DtypeResult("no_kernel", "cpu", note=how)})]
        for r in got:
            into = merged.setdefault(r.op, OpResult(r.op, r.excluded, r.cases))
            into.results.update(r.results)
    return list(merged.values())


# -- outputs


def facts(results: Iterable[OpResult], host_key: str) -> List[tuple]:
    """The data rows ``(op, dtype, verdict, device, host, error, note[, backward per mode])`` of
    what was measured."""
    rows = []
    for r in results:
        for dt, res in sorted(r.results.items()):
            if res.verdict is None:
                continue
            err = None if res.error is None else float(f"{res.error:.3g}")
            row = (r.op, dt, res.verdict, res.device, host_key, err, res.note[:200])
            if res.backward:
                row += (tuple((m, v, float(f"{e:.3g}")) for m, v, e in res.backward),)
            rows.append(row)
    return rows


def data_module(results: Sequence[OpResult], host_row: Sequence[str],
                model_ops: Optional[Tuple[Mapping[str, Sequence[str]], Mapping[str, str]]] = None) -> str:
    """The text of ``gluon_amp_core/lists/verdicts_measured.py``: the facts, what was left out and
    why, what needs another host, and the paths each op ran."""
    rows = facts(results, host_row[0])
    lines = ["# ruff: noqa: E501", '"""Generated by ``python -m gluon_amp.conformance --write``: do not edit by hand.',
             "",
             "What this host's MXNet kernels did in each low dtype (see gluon_amp_core/lists/verdicts.py).",
             '"""', "", f"MEASURED_HOST = {tuple(host_row)!r}", "",
             "# the harness's rules these facts were judged by (gluon_amp_core.verdicts.RULES)", f"RULES = {RULES}", "",
             f"REGISTRY_SIZE = {cases.registry_size()}", "",
             "# (op, dtype, verdict, device, host, error, note)", "MEASURED = ("]
    lines += [f"    {_py(tuple(r))}," for r in rows]
    lines += [")", "", "# candidate ops not run: (op, why)", "EXCLUDED = ("]
    lines += [f"    {(r.op, r.excluded[:200])!r}," for r in results if r.excluded]
    lines += [")", "", "# (op, dtype, why): oneDNN has no kernel for the dtype on this host's ISA", "UNMEASURED = ("]
    lines += [f"    {(r.op, dt, res.unmeasured[:160])!r}," for r in results for dt, res in sorted(r.results.items())
              if res.verdict is None]
    lines += [")", "", "# registered ops no list names (neutral, so candidates)", "UNLISTED = ("]
    lines += [f"    {op!r}," for op in cases.unlisted()]
    lines += [")", "", "# op -> the ways it ran in a low dtype (API, imperative or hybridized; forward and backward)",
              "PATHS = {"]
    for r in results:
        paths = sorted({p for res in r.results.values() for p in res.paths})
        if paths:
            lines.append(f"    {r.op!r}: {' '.join(paths)!r},")
    lines += ["}", ""]
    found, failed = model_ops or ({}, {})
    lines += ["# model -> the canonical ops of its graph (gluon_amp.conformance.models)", "MODEL_OPS = {"]
    lines += [f"    {m!r}: {' '.join(ops)!r}," for m, ops in sorted(found.items())]
    lines += ["}", "", "# model -> why it was not traced", "MODEL_FAILED = {"]
    lines += [f"    {m!r}: {why!r}," for m, why in sorted(failed.items())]
    lines += ["}", ""]
    return "\n".join(lines)


def _py(value: object) -> str:
    """``repr`` that a Python module can read back, an infinite or NaN error included."""
    if isinstance(value, float) and value != value:
        return 'float("nan")'
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    if isinstance(value, tuple):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def data_path(root: str, host_key: str) -> str:
    """The data module a host's ``--write`` records into: the one that already names this host
    (``MEASURED_HOST``), else ``verdicts_measured_<host>.py`` beside the others, so each host's
    facts stay and a new host's are added (:data:`gluon_amp_core.lists.verdicts.MEASURED_MODULES`)."""
    from gluon_amp_core.lists import verdicts
    lists = os.path.join(root, "gluon_amp_core", "lists")
    for name, key in zip(verdicts.MEASURED_MODULES, (h[0] for h in verdicts.MEASURED_HOSTS)):
        if key == host_key:
            return os.path.join(lists, f"{name}.py")
    return os.path.join(lists, "verdicts_measured_" + "".join(c if c.isalnum() else "_" for c in host_key) + ".py")


def write_data(results: Sequence[OpResult], path: str,
               model_ops: Optional[Tuple[Mapping[str, Sequence[str]], Mapping[str, str]]] = None) -> Tuple[str, ...]:
    h = host()
    with open(path, "w", encoding="utf-8") as f:
        f.write(data_module(results, h, model_ops))
    return h


def summary(results: Sequence[OpResult]) -> Mapping[str, int]:
    """Counts for the report."""
    measured = [r for r in results if not r.excluded]
    out = {"registry": cases.registry_size(), "candidates": len(results), "run": len(measured),
           "excluded": len(results) - len(measured)}
    for dt in LOW_PRECISION_DTYPES:
        for v in CONFORMANCE_VERDICTS:
            out[f"{dt}:{v.value}"] = sum(1 for r in measured if r.results.get(dt) and r.results[dt].verdict == v.value)
        out[f"{dt}:unmeasured"] = sum(1 for r in measured if r.results.get(dt) and r.results[dt].verdict is None)
    return out


def bounds_text() -> str:
    return ", ".join(f"{dt} {b:.3g} (2**{int(round(__import__('math').log2(b)))})" for dt, b in BOUNDS.items())
