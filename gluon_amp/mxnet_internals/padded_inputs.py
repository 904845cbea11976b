"""A block's CachedOp fed some data inputs with zero channels more, in a low dtype.

:class:`PaddedInputs` stands where MXNet 1.9.1's ``HybridBlock._build_cache`` put the block's
``CachedOp`` (``block._cached_op``, called by ``_call_cached_op`` with the graph's inputs in
``list_inputs()`` order; data first, by ``block._cached_op_args``), for a graph that reads an
image as a map of one channel more (:mod:`gluon_amp_core.padded_inputs`): each call's array
there is padded with zeros and cast before the CachedOp runs. The same stand-in feeds an
emulated graph the inputs it reads rounded (:func:`record_rounded`): the caller rounds them, as
a recorded op, so that the graph's first ops read a graph input (no data gradient where the
array needs none: :func:`gluon_amp_core.emulate.lift_input_roundings`). Attributes other than the
call are the CachedOp's (``_register_op_hook``, ``handle``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple, Union

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from .arrays import cast_array

__all__ = ["PaddedInputs", "peek_pads", "record_pads", "record_rounded", "take_pads", "with_padded_inputs"]

#: What a call's array becomes before the CachedOp reads it: (channels, dtype) to pad and cast,
#: or a function of the array (a rounding)
Feed = Union[Tuple[int, str], Callable[[Any], Any]]
#: block -> (graph input name -> (channels, dtype)), from its graph's binding to its CachedOp's build
_PADS: "weakref.WeakKeyDictionary[HybridBlock, Dict[str, Tuple[int, str]]]" = weakref.WeakKeyDictionary()
#: block -> (graph input name -> how its array is rounded), as _PADS
_ROUNDED: "weakref.WeakKeyDictionary[HybridBlock, Dict[str, Callable[[Any], Any]]]" = weakref.WeakKeyDictionary()


def record_pads(block: HybridBlock, pads: Mapping[str, Tuple[int, str]]) -> None:
    """The CachedOp about to be built for ``block`` reads these inputs padded and cast."""
    _PADS[block] = dict(pads)


def record_rounded(block: HybridBlock, rounded: Mapping[str, Callable[[Any], Any]]) -> None:
    """The CachedOp about to be built for ``block`` reads these inputs as each function gives
    the call's array (the same shape)."""
    _ROUNDED[block] = dict(rounded)


def peek_pads(block: HybridBlock) -> bool:
    """Whether :func:`record_pads` said something for ``block``'s CachedOp being built."""
    return bool(_PADS.get(block))


def take_pads(block: HybridBlock) -> Dict[str, Feed]:
    """What :func:`record_pads` and :func:`record_rounded` said for ``block``'s CachedOp being
    built, once."""
    return {**_ROUNDED.pop(block, {}), **_PADS.pop(block, {})}


def pad(array: Any, channels: int, dtype: str) -> Any:
    """``array`` (N, C, H, W) with zero channels up to ``channels``, cast to ``dtype``. Recorded
    like any op: an image with a gradient attached (saliency, adversarial training) gets it
    through the pad and the cast; one without gets none, and costs the graph none."""
    if not isinstance(array, mx.nd.NDArray) or array.ndim != 4 or array.shape[1] > channels:
        return array
    if array.shape[1] < channels:
        n, c, h, w = array.shape
        zeros = mx.nd.zeros((n, channels - c, h, w), ctx=array.ctx, dtype=array.dtype)
        array = mx.nd.concat(array, zeros, dim=1)
    return cast_array(array, dtype)


class PaddedInputs:
    """``block._cached_op`` for a graph that reads some inputs padded (module docstring)."""

    def __init__(self, op: Any, positions: Mapping[int, Feed]) -> None:
        self.op = op
        self.positions = dict(positions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["op"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fed = list(args)
        for k, feed in self.positions.items():
            if k < len(fed):
                fed[k] = feed(fed[k]) if callable(feed) else pad(fed[k], *feed)
        return self.op(*fed, **kwargs)


def with_padded_inputs(block: HybridBlock, inputs: Sequence[Symbol]) -> None:
    """Wrap ``block``'s CachedOp, just built, in :class:`PaddedInputs` where its graph's binding
    recorded pads (:func:`record_pads`); ``inputs``: the block's data inputs, in the order
    ``block._cached_op_args`` indexes them."""
    pads = take_pads(block)
    if not pads or block._cached_op is None:
        return
    positions = {k: pads[inputs[i].name] for k, (is_data, i) in enumerate(block._cached_op_args)
                 if is_data and inputs[i].name in pads}
    if positions:
        block._cached_op = PaddedInputs(block._cached_op, positions)
