"""``Block.cast``/``Parameter.cast`` to a low dtype the context cannot execute, while gluon_amp
owns precision (``init`` on, or ``install_as_contrib_amp``/``gluon_amp.run`` for the process).

Scripts written for a GPU cast the whole network (GluonCV's ``train_faster_rcnn.py --amp``:
``net.cast('float16')``, then batch norm back to float32). On a CPU that is GPU-only code: no
float16 kernels exist (nor bfloat16 ones below AVX-512), and the first mixed float16/float32
op fails deep in MXNet. While gluon_amp owns precision, such a cast instead:

- under emulation: keeps float32 storage holding values rounded to the cast's dtype; the
  emulated plan gives each op its dtype;
- with AMP on natively: changes nothing (float32 master weights); AMP's plan gives each op
  its dtype;
- with AMP off (the float32 fallback of ``gluon_amp.run``): raises a RuntimeError naming
  ``--emulate`` / ``init(..., emulate=True)``, before anything is cast.

The first two say so once per process (a ``RuntimeWarning``). Casts the context can execute
(float32, float64, bfloat16 on a CPU that has it, anything on a GPU) are MXNet's own.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

from gluon_amp_core.dtypes import dtype_name

import mxnet as mx

from .. import mxnet_internals as mxi, runtime, state

#: the Parameter.cast hook, installed while anyone holds it (``init``, the launcher)
_hook = state.Held(lambda: mxi.install_param_cast_hook(_rule), mxi.remove_param_cast_hook)


def acquire(owner: str) -> None:
    """Install the rule (once) on behalf of ``owner``; it stays until every owner released it."""
    _hook.hold(owner)


def release(owner: str) -> None:
    """``owner`` no longer needs the rule; the last one out puts MXNet's cast back."""
    _hook.release(owner)


def active() -> bool:
    return _hook.installed is not None


def _low(dtype: Any) -> Optional[str]:
    try:
        name = dtype_name(dtype)
    except (TypeError, ValueError):
        return None  # not a dtype gluon_amp knows: MXNet's cast says what it makes of it
    return name if name in ("float16", "bfloat16") else None


def _rule(param: Any, dtype: Any, cast: Callable[[Any], None]) -> None:
    low = _low(dtype)
    contexts = mxi.param_contexts(param)
    if low is None or all(runtime.executable(low, c.device_type) for c in contexts):
        mxi.note_held_low(param, None)
        return cast(dtype)
    policy = state.current_policy()
    if policy is None and _hook.holders <= {"init"}:
        # Held only because the op functions stay patched after a region (no init, no launcher):
        # outside every region gluon_amp is not there, and MXNet's own cast runs.
        mxi.note_held_low(param, None)
        return cast(dtype)
    where = ", ".join(str(c) for c in contexts)
    if policy is None:
        raise RuntimeError(
            f"gluon_amp: parameter {param.name!r} is being cast to {low} on {where}, where {low} has no "
            f"convolution/GEMM kernels "
            f"({runtime.capability().why if low == 'bfloat16' else 'float16 runs on a GPU only'}), "
            f"and mixed precision is off here, so the network could not run after it: this cast is GPU-only "
            f"code. Run it emulated (float32 kernels, {low} rounding): python -m gluon_amp.run --emulate "
            f"--target-dtype {low} SCRIPT ..., or gluon_amp.init(target_dtype='{low}', emulate=True) before the "
            "cast; or leave the cast out on this machine.")
    if dtype_name(param.dtype) != "float32":
        cast("float32")
    mxi.note_held_low(param, low)
    if policy.emulate:
        from ..emulation import round_nd
        with mx.autograd.pause():
            for arr in mxi.param_arrays(param):
                arr[:] = round_nd(arr, low)
        _say_once(f"gluon_amp: a cast of parameters to {low} on {where} (GPU-only code) keeps them float32 "
                  f"holding {low}-rounded values; the emulated {policy.target_dtype} plan gives each op its "
                  "dtype (parameters whose initialization is deferred are not rounded).")
    else:
        _say_once(f"gluon_amp: a cast of parameters to {low} on {where} (GPU-only code) is left to AMP: "
                  f"they stay float32 master weights and each op runs in the dtype the {policy.target_dtype} "
                  "plan gives it.")


def _say_once(message: str) -> None:
    state.say_once(message, stacklevel=_caller_level())


_SKIPPED = tuple(os.path.dirname(m.__file__) + os.sep for m in (mx, sys.modules["gluon_amp"]))


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside MXNet and gluon_amp: the script's cast."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level
