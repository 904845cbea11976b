"""A hybridized block's calls that record no gradient, run on parameter casts made once.

Under ``init`` a block's CachedOp casts each low-precision parameter at every call: the cast
is part of the graph that training differentiates. A call that does not record (inference,
validation) needs only the cast's value, which changes only when the parameter is written.
:class:`ForwardOnly` stands where MXNet 1.9.1's ``HybridBlock._build_cache`` put the block's
``CachedOp`` (``block._cached_op``, called by ``_call_cached_op`` with the graph's inputs in
``list_inputs()`` order): recording calls, and calls with keywords, go to that CachedOp;
others to a second one, built at the first such call, whose graph reads those parameters in
their low dtype, fed from :class:`StoredCasts`, which casts a parameter again once its array
was written (:func:`.versions.write_count`) or replaced.

A converter's result that reads float32 parameters through casts (a numpy-mode block's
default: 1.9.1's ``mx.np`` has no bfloat16; or ``cast_optional_params=False``) runs so too; where
it is fused, that graph is partitioned by the block's backend on the stored casts, so a fused
op keeps the weights it prepared between calls.

Only until the block's first call that records: from then on every call runs on the training
CachedOp, as without this. A block that trains holds that CachedOp's memory already, and a
second graph's (its own activations and the stored casts) would add to its peak (ResNet-50,
batch 8, 112x112, bfloat16: 659 to 741 MB) for 3% less time per inference call; an
inference-only block holds its casts in either graph's memory, and saves 17-20% at batch 1.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.gluon import HybridBlock
from mxnet.symbol import Symbol

from .arrays import cast_array
from .versions import readable, write_count

__all__ = ["ForwardOnly", "Made", "StoredCasts", "cast", "casts_storable"]


class Made(NamedTuple):
    """What a block's calls that record nothing run."""

    #: the graph, its inputs those of the training graph, in order
    graph: Symbol
    #: the parameters it reads stored low: graph input name -> dtype
    low: Dict[str, str]
    #: ``cast(parameter's array, dtype)``: what is fed for such a parameter
    cast: Callable[[mx.nd.NDArray, str], mx.nd.NDArray]


#: ``make()``: what the calls that record nothing run, or None to run them on the CachedOp
Make = Callable[[], Optional[Made]]


def cast(source: mx.nd.NDArray, dtype: str) -> mx.nd.NDArray:
    """``source`` cast to ``dtype`` by MXNet's ``amp_cast``."""
    return cast_array(source, dtype)


def casts_storable() -> bool:
    """Whether this process can tell when a parameter was written (so a stored cast is stale)."""
    return readable()


class StoredCasts:
    """Casts of parameters, each made again only once its source array was written since, or
    is another array. One per position and device, held until the next cast replaces it."""

    def __init__(self, cast: Callable[[mx.nd.NDArray, str], mx.nd.NDArray]) -> None:
        self._cast = cast
        self._held: Dict[Tuple[int, Any], Tuple[mx.nd.NDArray, Optional[int], mx.nd.NDArray]] = {}

    def get(self, position: int, source: mx.nd.NDArray, dtype: str) -> mx.nd.NDArray:
        """``source`` cast to ``dtype``: the one stored for ``position`` where still current."""
        count = write_count(source)
        key = (position, source.ctx)
        held = self._held.get(key)
        if held is not None and held[0] is source and count is not None and held[1] == count:
            return held[2]
        made = self._cast(source, dtype)
        self._held[key] = (source, count, made)
        return made

    def __len__(self) -> int:
        return len(self._held)


class ForwardOnly:
    """``block._cached_op`` for a block whose low-precision parameters can be cast once for
    the calls that record nothing (see the module's docstring). Attributes other than the
    call are the training CachedOp's (``_register_op_hook``, ``handle``)."""

    def __init__(self, training: Any, block: HybridBlock, names: Sequence[str], make: Make) -> None:
        self.training = training
        self._block = weakref.ref(block)
        self._names = list(names)
        self._make: Optional[Make] = make
        self._run: Optional[Callable[[tuple], Any]] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["training"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if mx.autograd.is_recording():  # from now on as before: one graph, one pool of memory
            self._make = self._run = None
            return self.training(*args, **kwargs)
        if kwargs:
            return self.training(*args, **kwargs)
        block = self._block()
        if block is None or block._callback:  # a monitor sees the ops of the graph it hooked
            return self.training(*args)
        if self._make is not None:
            make, self._make = self._make, None
            try:
                made = make()
            except (mx.base.MXNetError, ValueError, TypeError, RuntimeError) as error:
                # the training graph gives the same values, casting at every call
                warnings.warn(f"gluon_amp: block {block.name!r} casts its parameters at every call that records "
                              f"nothing: its graph for such calls could not be made ({error}); "
                              f"GLUON_AMP_STORED_CASTS=0 skips trying", RuntimeWarning, stacklevel=3)
                made = None
            self._run = _forward_run(block, self._names, made, args)
        if self._run is None:
            return self.training(*args)
        return self._run(args)

    @property
    def stored(self) -> int:
        """How many parameter casts are held (0 before the first call that records nothing)."""
        run = self._run
        return len(run.casts) if isinstance(run, _ForwardRun) else 0


class _ForwardRun:
    """The graph for calls that record nothing: its input ``j`` is the training CachedOp's
    input ``order[j]``; ``positions`` ``(j, dtype)`` are fed stored casts (keyed by ``order[j]``)."""

    def __init__(self, op: Any, order: List[int], positions: List[Tuple[int, str]], casts: StoredCasts) -> None:
        self.op, self.order, self.positions, self.casts = op, order, positions, casts

    def __call__(self, args: tuple) -> Any:
        fed = [args[k] for k in self.order]
        for j, dtype in self.positions:
            fed[j] = self.casts.get(self.order[j], fed[j], dtype)
        return self.op(*fed)


def _forward_run(block: HybridBlock, names: List[str], made: Optional[Made], args: tuple) -> Optional[_ForwardRun]:
    """The CachedOp of ``made``'s graph with the block's flags, where the training CachedOp's
    inputs are ``names`` in order (1.9.1 ``_build_cache``: ``data_indices`` and ``param_indices``
    by ``block._cached_op_args``) and ``args`` its first call's, else None. A block hybridized
    with a backend gets that graph partitioned by it, as ``_build_cache`` partitions its own,
    on the stored casts: a fused op then keeps the weights it prepared between calls."""
    if made is None:
        return None
    graph, low, make_cast = made
    roles = block._cached_op_args
    if len(roles) != len(names) or len(args) != len(names) or sorted(graph.list_inputs()) != sorted(names):
        return None
    index = {n: k for k, n in enumerate(names)}
    casts = StoredCasts(make_cast)

    def fed(name: str) -> Any:
        k = index[name]
        return casts.get(k, args[k], low[name]) if name in low and not roles[k][0] else args[k]

    if block._backend:
        arrays = [a for a in args if isinstance(a, mx.nd.NDArray)]
        graph = graph.optimize_for(block._backend, {n: fed(n) for n in graph.list_arguments()},
                                   {n: fed(n) for n in graph.list_auxiliary_states()},
                                   arrays[0].ctx if arrays else None, **block._backend_opts)
        if mx.util.is_np_array():  # as _build_cache: the CachedOp returns mx.np arrays
            graph = graph.as_np_ndarray()
    own = graph.list_inputs()
    if any(n not in index for n in own):  # the backend added an input: not the training graph's
        return None
    order = [index[n] for n in own]
    positions = [(j, low[n]) for j, n in enumerate(own) if n in low and not roles[order[j]][0]]
    if not positions:
        return None
    flags = [("data_indices", [j for j, k in enumerate(order) if roles[k][0]]),
             ("param_indices", [j for j, k in enumerate(order) if not roles[k][0]])] + list(block._flags)
    return _ForwardRun(mx.nd.CachedOp(graph, flags), order, positions, casts)
