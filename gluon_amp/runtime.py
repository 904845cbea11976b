"""CPU feature detection and the AMX fast path for bfloat16 on oneDNN.

oneDNN only uses AMX tiles when (a) Linux has granted the process permission to use the
XTILEDATA state, which it does on request through ``arch_prctl``, and (b) the CPU ISA it
is allowed to use includes AMX. Asking for (b) without (a) kills the process with
SIGILL, so we ask the kernel first and only then widen the ISA, before the first oneDNN
primitive is created (it reads ``DNNL_MAX_CPU_ISA`` once).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
import time
import warnings
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

from gluon_amp_core.capability import Bf16, Capability, amx_hint, classify
from gluon_amp_core.resolve import Resolution, resolve_target
from gluon_amp_core.dtypes import LOW_PRECISION_DTYPES, parse_target_dtype
from gluon_amp_core.speed.probe import OpTiming, SpeedVerdict, timings_to_records
from gluon_amp_core.timing_cache import TimingCache
from gluon_amp_core.threads import ThreadUse, thread_use as threads_for
from gluon_amp_core.switches import switched_on

from . import state

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AMX_ISA = "AVX512_CORE_AMX"

#: bfloat16 over float32 speed of one dense layer (128 x 1024 by 1024) from which oneDNN is taken to
#: run AMX. Measured with MXNet 1.9.1's oneDNN 2.4.4 on a 2-core Xeon (KVM) with AMX: 3.1-3.9 with
#: AMX, 0.62-0.81 on its AVX512-BF16 kernels; AVX512-BF16's dot product peaks at 2x float32's FMA.
AMX_SPEEDUP = 2.0

_state: Dict[str, Any] = {"amx_permission": None, "isa_set_by": None, "error": None, "isa_cap": None,
                          "mxnet_first": False, "onednn_first": False}


def cpu_flags() -> FrozenSet[str]:
    """Flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _request_amx_permission() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        _state["error"] = f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed: errno {ctypes.get_errno()}"
    return rc == 0


def enable_amx() -> bool:
    """Let oneDNN use AMX when the CPU has it and the kernel grants it. Idempotent.

    Never raises: on any other CPU or OS, or if the user already chose
    ``DNNL_MAX_CPU_ISA``, it leaves things as they are and returns False.
    Set ``GLUON_AMP_DISABLE_AMX=1`` (or ``true``, ``yes``, ``on``) to skip it; a value that is
    neither on nor off is warned about, and skips it.
    """
    if _state["amx_permission"] is not None:
        return bool(_state["amx_permission"])
    _state["mxnet_first"] = "mxnet" in sys.modules  # it may have run oneDNN before this: settle_isa checks
    ok = False
    try:
        disabled = switched_on(os.environ, "GLUON_AMP_DISABLE_AMX")
    except ValueError as exc:  # at import: said, and the safe side taken
        warnings.warn(f"gluon_amp: {exc} AMX is left off meanwhile.", RuntimeWarning, stacklevel=2)
        disabled = True
    try:
        if (not disabled and platform.system() == "Linux"
                and platform.machine() in ("x86_64", "AMD64")
                and {"amx_bf16", "amx_tile"} <= cpu_flags()):
            ok = _request_amx_permission()
            if ok and not os.environ.get("DNNL_MAX_CPU_ISA"):  # an empty value chooses nothing either
                os.environ["DNNL_MAX_CPU_ISA"] = _AMX_ISA
                _state["isa_set_by"] = "gluon_amp"
            elif "DNNL_MAX_CPU_ISA" in os.environ:
                _state["isa_set_by"] = _state["isa_set_by"] or "user"
    except Exception as exc:  # pragma: no cover - depends on the platform
        _state["error"] = repr(exc)
        ok = False
    _state["amx_permission"] = ok
    _state["isa_cap"] = os.environ.get("DNNL_MAX_CPU_ISA")
    return ok


def isa_cap() -> Optional[str]:
    """The ``DNNL_MAX_CPU_ISA`` value oneDNN runs under in this process (``None``: none set)."""
    enable_amx()
    return _state["isa_cap"]


def user_isa_cap() -> Optional[str]:
    """The ``DNNL_MAX_CPU_ISA`` the user chose: :func:`isa_cap`, less the one gluon_amp set."""
    return None if _state["isa_set_by"] == "gluon_amp" else isa_cap()


def amx_active() -> bool:
    """True when oneDNN may use AMX in this process (permission granted, ISA cap allows it)."""
    return enable_amx() and isa_cap() == _AMX_ISA  # oneDNN matches the name exactly


def settle_isa() -> None:
    """Have oneDNN read the ISA cap :func:`enable_amx` set, then take it back out of the
    environment. oneDNN reads ``DNNL_MAX_CPU_ISA`` once, at its first primitive. The tile
    permission is not passed on by ``exec``: a program this process starts that runs MXNet
    without gluon_amp (a serving script, a worker) would inherit ``AVX512_CORE_AMX`` without
    the permission, and die of SIGILL at its first AMX kernel. Called once MXNet is imported.

    Where MXNet was imported before gluon_amp, it may have run an operator already, and oneDNN
    read no cap then (every ISA but AMX, for the whole process): nothing in MXNet says which,
    so the speed of one bfloat16 dense layer does (:func:`_amx_runs`). Without AMX the cap is
    recorded as the one oneDNN read, so :func:`amx_active`, the capability and the timing cache
    say what runs, and one ``RuntimeWarning`` says what to change."""
    if _state["isa_set_by"] != "gluon_amp" or os.environ.get("DNNL_MAX_CPU_ISA") != _AMX_ISA:
        return
    import mxnet as mx
    from .mxnet_internals import legacy_arrays, original_function
    conv, ones = original_function(mx.nd.Convolution), original_function(mx.nd.ones)
    try:
        with legacy_arrays():
            conv(ones((1, 1, 1, 1)), ones((1, 1, 1, 1)), kernel=(1, 1), num_filter=1, no_bias=True).wait_to_read()
    except Exception as exc:  # noqa: BLE001  never fail the import: the variable then stays, as before
        _state["error"] = f"oneDNN did not read DNNL_MAX_CPU_ISA at import: {exc!r}"
        return
    del os.environ["DNNL_MAX_CPU_ISA"]
    if _state["mxnet_first"] and not _amx_runs():
        _state.update(isa_cap=None, isa_set_by=None, onednn_first=True)
        hint = amx_hint(cpu_flags(), True, None, onednn_first=True)
        warnings.warn(f"gluon_amp: {hint}.", RuntimeWarning, stacklevel=3)  # the import statement


def _amx_runs() -> bool:
    """Whether oneDNN runs AMX in this process: one dense layer in bfloat16 at least
    :data:`AMX_SPEEDUP` times as fast as in float32 (best of 5 calls each, about 30 ms).
    False where the bfloat16 layer cannot run."""
    import mxnet as mx
    from .mxnet_internals import BFLOAT16, legacy_arrays, original_function
    dense, cast, ones = (original_function(f) for f in (mx.nd.FullyConnected, mx.nd.amp_cast, mx.nd.ones))

    def best(x: Any, w: Any) -> float:
        times = []
        for _ in range(6):  # the first call creates the primitive
            start = time.perf_counter()
            dense(x, w, num_hidden=1024, no_bias=True).wait_to_read()
            times.append(time.perf_counter() - start)
        return min(times[1:])
    try:
        with legacy_arrays():
            x, w = ones((128, 1024)), ones((1024, 1024))
            return best(x, w) >= AMX_SPEEDUP * best(cast(x, dtype=BFLOAT16), cast(w, dtype=BFLOAT16))
    except Exception as exc:  # noqa: BLE001  never fail the import
        _state["error"] = f"the bfloat16 dense layer that tells AMX apart failed: {exc!r}"
        return False


def _probe_bf16() -> Optional[str]:
    """Run a tiny bfloat16 convolution and dense layer; ``None`` if they ran, else the error.

    MXNet reports a missing kernel when the op runs, and logs it on stderr from C++ too:
    fd 2 is silenced while probing, and the engine's pending error is drained so it cannot
    surface in the caller's next op. The probe calls MXNet's own op functions, with the
    block hooks paused, whatever :func:`gluon_amp.init` patched when it first runs (an
    emulated init would otherwise run it in float32 and call bfloat16 executable), in legacy
    arrays (numpy mode too).
    """
    from .mxnet_internals import hooks_paused, legacy_arrays, quiet_stderr
    with quiet_stderr(), hooks_paused(), legacy_arrays():  # legacy arrays in numpy mode too
        return _run_probe()


def _run_probe() -> Optional[str]:
    import mxnet as mx
    from .mxnet_internals import BFLOAT16, error_line, original_function
    amp_cast, ones = original_function(mx.nd.amp_cast), original_function(mx.nd.ones)
    conv, dense = original_function(mx.nd.Convolution), original_function(mx.nd.FullyConnected)
    try:
        x = amp_cast(ones((1, 4, 4, 4), ctx=mx.cpu()), dtype=BFLOAT16)
        w = amp_cast(ones((4, 4, 1, 1), ctx=mx.cpu()), dtype=BFLOAT16)
        y = conv(x, w, kernel=(1, 1), num_filter=4, no_bias=True)
        v = amp_cast(ones((2, 64), ctx=mx.cpu()), dtype=BFLOAT16)
        f = dense(y.reshape((1, -1)), v, num_hidden=2, no_bias=True)
        amp_cast(f, dtype="float32").asnumpy()
        return None
    except mx.base.MXNetError as exc:
        try:
            mx.nd.waitall()
        except mx.base.MXNetError:
            pass
        return error_line(exc).replace("MXNetError: ", "")


# -- a simulated native-bfloat16 host (tests only) --------------------------------------

#: ``1``: this process is a simulated native-bfloat16 host, for tests (tests/README.md).
SIMULATE_ENV = "GLUON_AMP_SIMULATE_NATIVE_BF16"

#: The probe's figures a simulated host reads where its timing cache holds none: the ratios
#: this project's probe measured on an AMD Zen 4 (tests/core/data/probe_hosts.json, amd_zen4).
SIMULATED_PROBE = (OpTiming("ResNet basic block, 64 channels at 56x56, batch 2", "basic_block", 29.8, 16.2),
                   OpTiming("ResNet bottleneck block, 256 channels at 28x28, batch 2", "bottleneck_block", 11.7, 8.3),
                   OpTiming("FullyConnected 2048->1000, batch 16", "dense", 3.7, 4.1))


def simulated() -> bool:
    """True in a simulated native-bfloat16 host (``GLUON_AMP_SIMULATE_NATIVE_BF16=1``): the
    capability says native, the speed probe reads planted figures, and what runs bfloat16
    kernels runs float32 ones whose bfloat16 outputs are rounded (imperative ops:
    :mod:`gluon_amp.mxnet_internals.simulated`; bound graphs: their emulated copy,
    :func:`gluon_amp.execution.graph_to_run`). Dtypes, casts, graphs and reports are the
    native ones. For tests of every decision a bf16 host takes, on any CPU; not for users."""
    return os.environ.get(SIMULATE_ENV) == "1"


#: (start, stop) of what a simulated host needs beyond this module (the execution hooks:
#: :mod:`gluon_amp.execution` registers them, importing this module, not the other way)
_simulation_parts: List[Tuple[Callable[[], None], Callable[[], None]]] = []


def on_simulation(start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Run ``start`` when this process becomes a simulated native host, ``stop`` when it stops."""
    _simulation_parts.append((start, stop))


def _start_simulation() -> None:
    from . import mxnet_internals as mxi
    from .type_inference import op_types
    mxi.install_simulated_kernels(op_types)
    for start, _ in _simulation_parts:
        start()


def _forget_machine() -> None:
    from .speed import probe
    for cached in _MACHINE_CACHES:  # the functions themselves, whatever a test monkeypatched over them
        cached.cache_clear()
    probe.forget()


@contextlib.contextmanager
def simulate_native_bf16() -> Iterator[Capability]:
    """This process as a simulated native-bfloat16 host (:func:`simulated`) inside the block,
    the machine as it is again after it: the environment variable, the cached capability,
    timing cache and probe figures, the simulated kernels and the hooks they hold. Tests only
    (the ``native_host`` fixture); subprocesses inherit it through the environment."""
    from . import emulation_kernel, mxnet_internals as mxi
    before = os.environ.get(SIMULATE_ENV)
    os.environ[SIMULATE_ENV] = "1"
    _forget_machine()
    emulation_kernel.active()  # built now (seconds, once), not in the first graph a test's tuner times
    try:
        yield capability()
    finally:
        if before is None:
            os.environ.pop(SIMULATE_ENV, None)
        else:
            os.environ[SIMULATE_ENV] = before
        mxi.remove_simulated_kernels()
        for _, stop in _simulation_parts:
            stop()
        _forget_machine()


@functools.lru_cache(maxsize=None)
def capability() -> Capability:
    """What this process can execute: GPUs, and bfloat16 from the CPU flags, the
    ``DNNL_MAX_CPU_ISA`` cap and a probe that runs one tiny bf16 op. Cached: the ISA
    oneDNN uses is fixed for the life of the process. Native bfloat16 where
    :func:`simulated`."""
    import mxnet as mx
    if simulated():
        _start_simulation()
        return Capability(mx.context.num_gpus(), Bf16.NATIVE, "AVX512_CORE_BF16",
                          f"simulated native bfloat16 ({SIMULATE_ENV}=1, tests only): float32 kernels, "
                          "bfloat16 outputs rounded")
    return classify(cpu_flags(), bool(_state["amx_permission"]), isa_cap(),
                    gpus=mx.context.num_gpus(), probe_error=_probe_bf16(), onednn_first=_state["onednn_first"])


def _say_once(message: str, warn: bool) -> None:
    state.say_once(message, warn)  # at the user's line, whichever API call resolved the dtype


@functools.lru_cache(maxsize=None)
def timing_cache() -> TimingCache:
    """This machine's timing cache (probe figures and the tuner's per-op times)."""
    from .speed import probe  # imports MXNet: this module must not, before enable_amx
    cap = capability()
    key = probe.machine_key(cpu_flags(), amx_active(), cap.isa, isa_cap())
    if simulated():  # planted figures must never reach this machine's own cache
        key["simulated_native_bf16"] = True
    return probe.open_cache(key)


_MACHINE_CACHES = (capability, timing_cache)


def speed(target: Optional[str], warn: bool = True) -> Optional[SpeedVerdict]:
    """The speed probe's verdict where it decides: bfloat16 (asked for, or ``None``) on a
    CPU that runs it natively. ``None`` elsewhere (nothing to time, or a GPU, whose float16
    is taken as fast), and where ``GLUON_AMP_SPEED_PROBE=0`` turned it off (said once)."""
    from .speed import probe
    cap = capability()
    if cap.gpus > 0 or cap.bf16 is not Bf16.NATIVE or target not in (None, "bfloat16"):
        return None
    if probe.disabled():
        _say_once(f"gluon_amp: {probe.ENV}=0: the speed probe is off, so bfloat16 is chosen from the CPU "
                  "flags alone (on with native bfloat16), whatever its speed here. Unset it to measure.", warn)
        return None
    if simulated():  # a simulated host's figures are planted, never measured on emulated kernels
        cache = timing_cache()
        if probe._entry("bfloat16") not in cache.load().entries:
            try:
                cache.store({probe._entry("bfloat16"): timings_to_records(SIMULATED_PROBE)})
            except OSError:  # a cache folder it cannot write: the planted figures, kept in memory
                return probe.planted_verdict("bfloat16", SIMULATED_PROBE)
    return probe.verdict("bfloat16", timing_cache())


def resolve(target_dtype: Any, warn: bool = True) -> Resolution:
    """Resolve ``target_dtype`` for this machine (capability and measured speed); warn
    (once per message) as it says.

    ``warn=False`` is for callers that print the message themselves (CLI, benchmarks); it
    still counts as said, so a later :func:`gluon_amp.init` does not repeat it.
    """
    requested = target_dtype if target_dtype in (None, *LOW_PRECISION_DTYPES) else parse_target_dtype(target_dtype)
    res = resolve_target(requested, capability(), speed(requested, warn))
    if res.warning:
        _say_once(res.warning, warn)
    return res


def emulated_target(target_dtype: Any) -> str:
    """The dtype ``emulate=True`` runs: ``target_dtype``, or for ``None`` what real AMP
    would use on the fast hardware of this kind: float16 with a GPU, else bfloat16."""
    if target_dtype is None:
        return "float16" if capability().gpus > 0 else "bfloat16"
    return target_dtype if target_dtype in LOW_PRECISION_DTYPES else parse_target_dtype(target_dtype)


def executable(dtype: str, device_type: str) -> bool:
    """True when ``dtype``'s convolution and GEMM kernels run on ``device_type`` here."""
    if dtype not in ("float16", "bfloat16"):
        return True
    if device_type == "cpu":
        return dtype == "bfloat16" and capability().bf16 is not Bf16.NONE
    return True  # a GPU: MXNet decides


@functools.lru_cache(maxsize=None)
def has_onednn() -> bool:
    """True when this MXNet build has oneDNN (the CPU builds do): its fusion backend exists."""
    import mxnet as mx
    return mx.runtime.Features().is_enabled("MKLDNN")


def _threads_per_core() -> Optional[int]:
    """Hardware threads per core of the first CPU this process may run on, from sysfs; None
    where the OS does not say."""
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return None
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            count += int(hi or lo) - int(lo) + 1
        except ValueError:
            return None
    return count or None


def thread_use() -> ThreadUse:
    """The OpenMP threads MXNet's CPU operators run on here, and a note where cores stay idle
    (:mod:`gluon_amp_core.threads`)."""
    from . import mxnet_internals as mxi
    from .speed.timing import cpus
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return threads_for(os.environ, cpus(), _threads_per_core(), mxi.omp_threads(), x86)
