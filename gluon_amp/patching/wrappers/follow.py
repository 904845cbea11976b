"""Neutral ops that own parameters: make their float inputs agree, as MXNet requires.

A neutral op runs in the dtype it is given. Some of them also read parameters that must
have the data's dtype (a PReLU slope, a FullyConnected weight when FullyConnected is not
in any list): after a low-precision op their data is low precision while the parameter is
a float32 master copy, and MXNet rejects the pair. Which ops care is not listed by hand:
MXNet's own type inference (:func:`gluon_amp.type_inference.op_types`) is asked.

Imperatively, the call goes to MXNet as it is first: MXNet infers types before it queues
anything, so a call it refuses has done nothing, and only then are the inputs made to agree.
The common call (an optimizer's update, every parameter of every step) reads no dtype.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

from mxnet.base import MXNetError
from mxnet.ndarray import NDArray
from mxnet.symbol import Symbol

from gluon_amp_core.dtypes import FLOAT_DTYPES, dtype_name

from ...mxnet_internals import FLOAT_NAMES, Signature
from ...type_inference import op_types
from .casts import CASTABLE
from .classes import PYTHON_TYPED, built_leaving_aux

_OPTIONS = ("out", "name", "attr")
_CASTABLE = frozenset(CASTABLE.values())


def _name(x: NDArray) -> str:
    name = FLOAT_NAMES.get(x.dtype)  # the common case, on every call of a wrapped op
    if name is not None:
        return name
    try:
        return dtype_name(x.dtype)
    except TypeError:
        return "other"


def _one_dtype(inputs: tuple, kwargs: dict) -> bool:
    """True when the positional inputs that are NDArrays share one dtype and no keyword passes
    an NDArray input: nothing to make agree, and no slot to look up."""
    first = None
    for a in inputs:
        if isinstance(a, NDArray):
            dtype = a.dtype
            if first is None:
                first = dtype
            elif dtype is not first and dtype != first:
                return False
    return not any(isinstance(v, NDArray) and k not in _OPTIONS for k, v in kwargs.items())


def _tensor_slots(args: tuple, kwargs: dict, kind: type, sig: Signature,
                  names: Sequence[str]) -> Optional[List[Tuple[Any, int]]]:
    """``[(key, slot)]`` for the tensor inputs (``names``, the op's declared ones), in their
    order; a key is a positional index or a keyword. None when a keyword is not an input."""
    slots = [(i, i) for i, a in enumerate(sig.input_args(args)) if isinstance(a, kind)]
    for k, v in kwargs.items():
        if isinstance(v, kind) and k not in _OPTIONS:
            if k not in names:
                return None
            slots.append((k, names.index(k)))
    return sorted(slots, key=lambda s: s[1])


def _get(args: list, kwargs: dict, key: Any) -> Any:
    return kwargs[key] if isinstance(key, str) else args[key]


def _put(args: list, kwargs: dict, key: Any, value: Any) -> None:
    if isinstance(key, str):
        kwargs[key] = value
    else:
        args[key] = value


def nd_wrapper(fn: Callable, op: str, sig: Signature, cast: Callable[[NDArray, str], NDArray]) -> Callable:
    """Imperative: when float inputs differ in dtype and MXNet rejects them, cast the
    others to the dtype MXNet infers from the first float input."""
    names = sig.inputs

    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)  # refused before anything is queued: nothing to undo
        except MXNetError:
            if _one_dtype(sig.input_args(args), kwargs):
                raise
            agreed = _agreeing(args, kwargs)
            if agreed is None:
                raise  # MXNet's own error: the dtypes are not what it refuses
        return fn(*agreed[0], **agreed[1])

    def _agreeing(args: tuple, kwargs: dict) -> Optional[Tuple[list, dict]]:
        """The call's arguments with float inputs cast to the dtypes MXNet accepts; None
        when that changes nothing."""
        slots = _tensor_slots(args, kwargs, NDArray, sig, names)
        if not slots or len(slots) < 2:
            return None
        new, kwargs = list(args), dict(kwargs)
        dts = [_name(_get(new, kwargs, key)) for key, _ in slots]
        if len({d for d in dts if d in FLOAT_DTYPES}) < 2:
            return None
        required = _required(op, sig.attributes(args, kwargs), dts)
        if required is None:
            return None
        changed = False
        for (key, _), have, want in zip(slots, dts, required):
            if have in _CASTABLE and want in _CASTABLE and have != want:  # amp_cast passes float64
                _put(new, kwargs, key, cast(_get(new, kwargs, key), want))
                changed = True
        return (new, kwargs) if changed else None

    return amp_op


def _required(op: str, attrs: dict, dts: List[str]) -> Optional[Tuple[Optional[str], ...]]:
    """Input dtypes MXNet accepts: as given, or the first float input's with the rest free."""
    given = tuple(dts)
    if op_types(op, attrs, given) is not None:
        return given
    first = next(k for k, d in enumerate(dts) if d in FLOAT_DTYPES)
    free = tuple(d if (k == first or d not in FLOAT_DTYPES) else None for k, d in enumerate(dts))
    typed = op_types(op, attrs, free)
    return typed[0] if typed is not None else None


def sym_wrapper(fn: Callable, op: str, sig: Signature, target_dtype: str,
                multicast_narrow: Callable[[Sequence[Symbol]], List[Symbol]]) -> Callable:
    """Symbolic: dtypes are known only at run time, so when MXNet would reject low-precision
    data with float32 parameters, an ``amp_multicast(cast_narrow=True)`` in front of the op
    gives all float inputs the narrowest dtype among them when the graph runs."""
    names = sig.inputs

    @functools.wraps(fn)
    def amp_op(*args: Any, **kwargs: Any) -> Any:
        slots = _tensor_slots(args, kwargs, Symbol, sig, names)
        if not slots or len(slots) < 2 or slots[0][1] != 0:
            return fn(*args, **kwargs)
        attrs = sig.attributes(args, kwargs)
        free = op_types(op, attrs, (None,) * len(names)) if op not in PYTHON_TYPED else None
        if free is not None:  # inputs the op types itself (batch_take's int32 indices) are not cast
            slots = [s for s in slots if s[1] >= len(free[0]) or free[0][s[1]] in (None, *FLOAT_DTYPES)]
            if len(slots) < 2:
                return fn(*args, **kwargs)
        hypothesis = [None] * (slots[-1][1] + 1)
        for _, j in slots:
            hypothesis[j] = target_dtype if j == 0 else "float32"
        if op_types(op, attrs, tuple(hypothesis)) is not None:
            return fn(*args, **kwargs)

        def build(aux: frozenset) -> Any:
            """The op on its inputs multicast, those that are its auxiliary states left as given."""
            new, new_kwargs = list(args), dict(kwargs)
            at = [key for key, _ in slots if _get(new, new_kwargs, key).name not in aux
                  or _get(new, new_kwargs, key).get_children() is not None]
            if len(at) > 1:
                cast = multicast_narrow([_get(new, new_kwargs, key) for key in at])
                for key, c in zip(at, cast):
                    _put(new, new_kwargs, key, c)
            return fn(*new, **new_kwargs)

        return built_leaving_aux(build, fn, args, kwargs)

    return amp_op
