"""Kernel timings: how fast MXNet 1.9.1's kernels in a low dtype run against float32 with the
casts around them, with the host that timed them.

Data only (types and rules: :mod:`gluon_amp_core.kernel_speed`). What
``python -m gluon_amp.conformance --speed --write`` timed, one generated module per host
(``kernel_speed_measured*.py``, the host in its ``MEASURED_HOST``). Several hosts' timings stand
side by side; an op is ``slow`` where every host that timed it found it so.
Each row: ``(key, dtype, host, case, fp32_ms, low_ms)``.
"""
import importlib
import pkgutil

#: the generated modules, one per host that timed kernels, by name
MEASURED_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(importlib.import_module(__package__).__path__)
                                if m.name.startswith("kernel_speed_measured")))
_MODULES = tuple(importlib.import_module(f"{__package__}.{n}") for n in MEASURED_MODULES)
#: each timing host's ``(key, cpu, flags, MXNet, command)``
MEASURED_HOSTS = tuple(m.MEASURED_HOST for m in _MODULES)
TIMINGS = tuple(row for m in _MODULES for row in m.TIMINGS)
