"""The wrappers :func:`gluon_amp.init` puts around MXNet's op functions, and their order.

For one op function ``f``, innermost first:

1. :mod:`.loss_output`: loss-output ops only (``SoftmaxOutput``, ``*RegressionOutput``).
   Imperative calls multiply ``grad_scale`` by the attached scalers' loss scale
   (:class:`~.loss_output.ScalerRegistry`); symbolic calls warn.
2. :mod:`.follow`: ops that may run neutral and have several inputs. The neutral path
   makes their float inputs agree, as MXNet's type rule requires.
3. :mod:`.classes`: ops with a decision (low precision, fp32, conditional, widest). Inputs
   are cast (emulated: rounded) as :func:`gluon_amp_core.decide.decide` says; then (2) runs
   when the decision leaves the op neutral, else (1) or ``f``.

:func:`wrapper_for` composes them for one function; :mod:`.casts` holds the casts they insert.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from gluon_amp_core.decide import CAST_OPS
from gluon_amp_core.lists.loss_outputs import LOSS_OUTPUT_FUNCTIONS
from gluon_amp_core.policy import Policy
from gluon_amp_core.table import OpClass

from ... import mxnet_internals as mxi, runtime
from . import classes, follow, loss_output
from .casts import cast_nd, multicast_sym
from .loss_output import ScalerRegistry

__all__ = ["wrapper_for", "ScalerRegistry"]


def wrapper_for(fn: Callable, op: str, kind: str, policy: Policy, info: mxi.OpInfo,
                scalers: ScalerRegistry) -> Optional[Callable]:
    """The composed wrapper ``op`` needs under ``policy``; None when it runs as it is. A
    symbolic one leaves the body of a control-flow op (``foreach``, ``while_loop``, ``cond``)
    as traced: that op runs float32 (the op table), and so does its body."""
    wrapper = _wrapper_for(fn, op, kind, policy, info, scalers)
    if wrapper is None or kind == "ndarray":
        return wrapper

    def outside_subgraphs(*args: Any, **kwargs: Any) -> Any:
        return (fn if mxi.building_subgraph() else wrapper)(*args, **kwargs)

    return outside_subgraphs


def _wrapper_for(fn: Callable, op: str, kind: str, policy: Policy, info: mxi.OpInfo,
                 scalers: ScalerRegistry) -> Optional[Callable]:
    """The composed wrapper, whatever the scope it is called in.

    Where the op may run neutral (its class, or a conditional rule that does not apply)
    and has several inputs, the neutral path makes them agree (:mod:`.follow`).
    """
    table = policy.table
    sig = mxi.signature_of(fn)  # once per function: which arguments are inputs, which attributes
    if op in LOSS_OUTPUT_FUNCTIONS and kind == "ndarray":
        fn = loss_output.nd_wrapper(fn, op, sig, scalers.scale)
    elif op in LOSS_OUTPUT_FUNCTIONS and table.target_dtype == "float16":  # the dtype losses are scaled for
        fn = loss_output.sym_wrapper(fn, op)
    op_class = table.classes.get(op, OpClass.NEUTRAL)
    neutral = None
    kept = table.keep_fp32_inputs.get(op, frozenset())
    if op_class in (OpClass.NEUTRAL, OpClass.CONDITIONAL_FP32) and not (
            op in CAST_OPS or info.variadic or len(info.inputs) < 2
            or set(info.inputs[1:]) <= kept):  # normalisation: its parameters stay float32
        neutral = (follow.nd_wrapper(fn, op, sig, cast_nd) if kind == "ndarray" else
                   follow.sym_wrapper(fn, op, sig, table.target_dtype,
                                      lambda xs: multicast_sym(xs, narrow=True)))
    if op_class is OpClass.NEUTRAL:
        return neutral or (fn if op in LOSS_OUTPUT_FUNCTIONS else None)
    if kind == "symbol" and op in mxi.SUBGRAPH_ARGS and op_class is OpClass.FP32:
        return classes.control_flow_sym_wrapper(fn, mxi.SUBGRAPH_ARGS[op])
    if kind == "ndarray":
        return classes.nd_wrapper(fn, op, table, sig, neutral, emulate=policy.emulate,
                           runs_on_cpu=runtime.executable(table.target_dtype, "cpu"))
    return classes.sym_wrapper(fn, op, table, info, sig, neutral, policy.excluded)
