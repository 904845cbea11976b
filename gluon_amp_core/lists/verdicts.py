"""Conformance facts: how MXNet 1.9.1's kernels behave in a low dtype, with the host that showed it.

Data only (types and rules: :mod:`gluon_amp_core.verdicts`). Two sources:
- ``RECORDED``: facts from hosts this project's CI does not have (native bfloat16 kernels:
  AVX512-BF16 or AMX), copied from their reports with the host and the command;
- ``MEASURED``: what ``python -m gluon_amp.conformance --write`` measured, one generated module per
  host (``verdicts_measured.py``: the AVX2 CI host, which also keeps the coverage and the model
  graphs; ``verdicts_measured_<host>.py``: each other host, its flags in its ``MEASURED_HOST``).
  Several hosts' facts stand side by side; a plan follows the worst
  (:func:`gluon_amp_core.verdicts.plan_verdicts`).
A test on a bfloat16 host (marker ``bf16_kernels``) checks the bfloat16 facts against its kernels.
Each row: ``(op, dtype, verdict, device, host, error, note[, backward per mode])``.
"""
import importlib
import pkgutil

from . import verdicts_measured as _first
from .verdicts_measured import MEASURED_HOST  # noqa: F401  the CI host (coverage, model graphs)

#: the generated modules, one per measured host: ``verdicts_measured`` first, then the others by name
MEASURED_MODULES = ("verdicts_measured",) + tuple(sorted(
    m.name for m in pkgutil.iter_modules(importlib.import_module(__package__).__path__)
    if m.name.startswith("verdicts_measured_")))
_MODULES = (_first,) + tuple(importlib.import_module(f"{__package__}.{n}") for n in MEASURED_MODULES[1:])
#: each measured host's ``(key, cpu, flags, MXNet, command)``
MEASURED_HOSTS = tuple(m.MEASURED_HOST for m in _MODULES)
MEASURED = tuple(row for m in _MODULES for row in m.MEASURED)
#: measured host -> the harness rules its facts were judged by (``gluon_amp_core.verdicts.RULES``)
RULES_OF = {m.MEASURED_HOST[0]: getattr(m, "RULES", 1) for m in _MODULES}

#: key -> (cpu, CPU flags that matter, MXNet, command that produced its facts)
HOSTS = {
    "zen4-issue41": (
        "AMD EPYC (Zen 4)", "avx512f avx512_bf16 (no AMX)", "1.9.1",
        "issue 41's reproductions at aeec3b5: repro/ops/adaptive_avgpool_bf16.py 16 and 64, "
        "batch_dot_bf16.py gluon_amp, bf16_sample_normal.py gluon_amp (OMP_NUM_THREADS=1, no DNNL_MAX_CPU_ISA)"),
    "xeon-golden": (
        "Intel(R) Xeon(R) Processor", "avx2 avx512f avx512_bf16 avx512_fp16 (oneDNN ISA avx512_core_bf16)", "1.9.1",
        "golden/resnet18_native_bf16_errors.json: gluon_amp.debug.compare(resnet18_v1, x, "
        "target_dtype='bfloat16', emulate=False), each op's local error against FP32"),
    **{h[0]: h[1:] for h in MEASURED_HOSTS},
}

RECORDED = (
    ("_contrib_AdaptiveAvgPooling2D", "bfloat16", "wrong", "cpu", "zen4-issue41", 0.94,
     "output_size=1: 31% off on a 16x16 map, 94% on 64x64 (rounding the input alone: 0.03%)"),
    ("batch_dot", "bfloat16", "no_kernel", "cpu", "zen4-issue41", None,
     "dot only supports float32/float64 for CPU (DANet's conv -> reshape -> batch_dot)"),
    ("dot", "bfloat16", "no_kernel", "cpu", "zen4-issue41", None,
     "dot only supports float32/float64 for CPU"),
    ("_sample_normal", "bfloat16", "needs_uniform_inputs", "any", "zen4-issue41", None,
     "mu bfloat16, sigma float32: Operator _sample_normal is missing FInferType attribute (GluonTS)"),
    ("Convolution", "bfloat16", "ok", "cpu", "xeon-golden", 0.0032, "ResNet-18, 20 nodes"),
    ("BatchNorm", "bfloat16", "ok", "cpu", "xeon-golden", 0.0017, "ResNet-18, 20 nodes"),
    ("Activation:act_type=relu", "bfloat16", "ok", "cpu", "xeon-golden", 0.0017, "ResNet-18, 17 nodes"),
    ("elemwise_add", "bfloat16", "ok", "cpu", "xeon-golden", 0.0025, "ResNet-18, 8 nodes"),
    ("Pooling", "bfloat16", "ok", "cpu", "xeon-golden", 0.0017, "ResNet-18, max and global avg"),
    ("FullyConnected", "bfloat16", "ok", "cpu", "xeon-golden", 0.0026, "ResNet-18, 1 node"),
)

FACTS = RECORDED + MEASURED
