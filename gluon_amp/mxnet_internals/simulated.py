"""Simulated bfloat16 kernels, for a simulated native-bfloat16 host (tests only).

Under ``GLUON_AMP_SIMULATE_NATIVE_BF16=1`` (:func:`gluon_amp.runtime.simulated`) every
imperative MXNet op that reads a bfloat16 array runs as a float32 kernel: its bfloat16 inputs
are cast to float32 (exactly), the op runs, and each output MXNet's own type rule gives in
bfloat16 is cast back to bfloat16 (rounded). The caller sees the dtypes, arrays and autograd
graph of a native run (the casts are recorded like any op), on a CPU whose oneDNN has no
bfloat16 kernels (AVX2). Graphs are simulated where they are bound
(:func:`gluon_amp.execution.graph_to_run`), not here.

MXNet 1.9.1: every generated ``mx.nd``/``mx.np`` op function calls the name
``_imperative_invoke`` in the globals of ``mxnet/ndarray/register.py`` (its code is ``exec``-ed
there) with the op's handle; replacing that global reaches them all. If MXNet changes it, the
simulated twins fail on AVX2 hosts with MXNet's "could not create a primitive" errors.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import mxnet.ndarray.register as _register
from mxnet.ndarray import NDArray

from .arrays import FLOAT_NAMES
from .registry import _handle_to_name

__all__ = ["install_simulated_kernels", "remove_simulated_kernels", "simulated_kernels_installed"]

#: ops that only move or convert values: they run on bfloat16 on every CPU, as MXNet has them
_AS_THEY_ARE = frozenset({"amp_cast", "amp_multicast", "Cast", "_copyto", "_copy", "reshape",
                          "Reshape", "_zeros", "_ones", "_full", "_empty", "_arange"})

TypeRule = Callable[[str, Mapping[str, str], Tuple[Optional[str], ...]],
                    Optional[Tuple[Tuple[Optional[str], ...], Tuple[Optional[str], ...]]]]

_installed: Dict[str, Any] = {"invoke": None}


def simulated_kernels_installed() -> bool:
    """True while :func:`install_simulated_kernels`' replacement is in MXNet's op functions."""
    return _installed["invoke"] is not None


def install_simulated_kernels(type_rule: TypeRule) -> None:
    """Run every imperative op that reads bfloat16 as a float32 kernel with bfloat16-rounded
    outputs (idempotent). ``type_rule(op, attrs, input dtypes)`` is MXNet's type rule for one
    op (:func:`gluon_amp.type_inference.op_types`): it says which outputs are bfloat16."""
    if _installed["invoke"] is not None:
        return
    original = _register._imperative_invoke
    names = _handle_to_name()
    cast = next(h for h, n in names.items() if n == "amp_cast")

    def to(a: NDArray, dtype: str, is_np: bool, out: Optional[NDArray] = None) -> NDArray:
        return original(cast, [a], ["dtype"], [dtype], out, is_np, False)

    def invoke(handle: int, ndargs: Sequence[Any], keys: Sequence[str], vals: Sequence[Any],
               out: Any, is_np_op: bool, output_is_list: bool) -> Any:
        dtypes = tuple(FLOAT_NAMES.get(a.dtype, str(a.dtype)) if isinstance(a, NDArray) else None for a in ndargs)
        outs = (out,) if isinstance(out, NDArray) else tuple(out or ())
        op = names.get(handle, "")
        # an op that reads no bfloat16 runs as MXNet has it, a bfloat16 ``out=`` included: a
        # sampler writing a bfloat16 parameter fails there as on a bf16 host (no bfloat16 kernel)
        if op in _AS_THEY_ARE or "bfloat16" not in dtypes:
            return original(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
        rule = type_rule(op, {k: str(v) for k, v in zip(keys, vals)}, dtypes)
        if rule is None:  # MXNet rejects these dtypes: its own error, as on a bf16 host
            return original(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
        wide = [to(a, "float32", is_np_op) if t == "bfloat16" else a for a, t in zip(ndargs, dtypes)]
        got: List[NDArray] = original(handle, wide, keys, vals, None, is_np_op, True)
        got = [to(g, "bfloat16", is_np_op) if k < len(rule[1]) and rule[1][k] == "bfloat16"
               and FLOAT_NAMES.get(g.dtype) == "float32" else g for k, g in enumerate(got)]
        if op.endswith("_update"):  # optimizer updates write their (bfloat16) states in place
            for a, w, t in zip(ndargs, wide, dtypes):
                if t == "bfloat16":
                    to(w, "bfloat16", is_np_op, a)
        if outs:
            for o, g in zip(outs, got):
                to(g, FLOAT_NAMES.get(o.dtype, "float32"), is_np_op, o)
            return out
        return got[0] if len(got) == 1 and not output_is_list else got

    _installed["invoke"] = (original, invoke)
    _register._imperative_invoke = invoke


def remove_simulated_kernels() -> None:
    """Put MXNet's ``_imperative_invoke`` back (idempotent)."""
    installed = _installed["invoke"]
    if installed is None:
        return
    original, invoke = installed
    if _register._imperative_invoke is invoke:
        _register._imperative_invoke = original
    _installed["invoke"] = None
