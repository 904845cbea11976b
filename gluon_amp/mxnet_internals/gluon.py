"""Gluon blocks, symbols and their hooks (MXNet 1.9.1)."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple, Union

import mxnet as mx
from mxnet.gluon import Block, HybridBlock, Parameter
from mxnet.gluon.parameter import DeferredInitializationError
from mxnet.symbol import Symbol

from . import warning_sites
from .forward_only import ForwardOnly, Make
from .padded_inputs import peek_pads, take_pads, with_padded_inputs
from .graph_reads import shared_reads


# -- gluon blocks --------------------------------------------------------------------

#: The graph a block runs where the block hooks rewrote one it was given (a SymbolBlock's,
#: see :func:`install_block_hooks`). The block keeps its own: MXNet composes that one into a
#: parent's graph, which the hooks then rewrite as a whole.
_RUN_GRAPHS: "weakref.WeakKeyDictionary[HybridBlock, Tuple[Sequence[Symbol], Symbol]]" = \
    weakref.WeakKeyDictionary()


def cached_graph(block: HybridBlock, caller: str) -> Tuple[Sequence[Symbol], Symbol]:
    """``(input symbols, output symbol)`` a hybridized block runs: the one it recorded on its
    first call, or the one the block hooks rewrote from the graph it was given.

    1.9.1: ``HybridBlock._cached_graph`` is ``()`` until the first call, then that pair.
    If renamed, converting or reporting a block raises the RuntimeError below.
    """
    cached = _RUN_GRAPHS.get(block) or getattr(block, "_cached_graph", ())
    if not cached:
        raise RuntimeError(f"{caller}: the block has no cached graph: call block.hybridize() and run "
                           "one forward pass (e.g. block(x)) first.")
    return cached[0], cached[1]


def recorded_graph(block: HybridBlock) -> Optional[Symbol]:
    """The output symbol a hybridized block recorded on its first call or was given when
    constructed (a SymbolBlock), not what the block hooks rewrote it to; None before either."""
    cached = getattr(block, "_cached_graph", ())
    return cached[1] if cached else None


def has_cached_graph(block: Any) -> bool:
    """True for a hybridized block that already recorded its graph (see :func:`cached_graph`)."""
    return isinstance(block, HybridBlock) and bool(getattr(block, "_cached_graph", ()))


def call_formats(block: HybridBlock) -> Tuple[Any, Any]:
    """How a block's call nests its inputs and its outputs (an RNN's state lists), as Gluon
    recorded them at its first hybridized call: nested lists of ``0`` (an array) and ``-1``
    (None); ``None`` where not recorded.

    1.9.1: ``HybridBlock._in_format`` / ``_out_format`` (SymbolBlock sets both at init)."""
    return getattr(block, "_in_format", None), getattr(block, "_out_format", None)


def regroup(items: Sequence[Any], fmt: Any) -> Any:
    """``items`` (flat, as :func:`call_arrays` gives them) nested as ``fmt`` of
    :func:`call_formats` says. ValueError when they do not fill it exactly."""
    rest = list(items)

    def take(f: Any) -> Any:
        if isinstance(f, (list, tuple)):
            return [take(g) for g in f]
        if f == -1:
            return None
        if not rest:
            raise ValueError(f"{len(items)} arrays do not fill the call format {fmt}")
        return rest.pop(0)

    grouped = take(fmt)
    if rest:
        raise ValueError(f"{len(items)} arrays do not fill the call format {fmt}")
    return grouped


def call_arrays(args: Any) -> list:
    """A block call's inputs, flattened as Gluon flattens them for the graph (1.9.1
    ``_flatten``; ``None`` dropped): in the order of the graph's input symbols."""
    if isinstance(args, (list, tuple)):
        return [x for a in args for x in call_arrays(a)]
    return [] if args is None else [args]


def call_inputs(block: HybridBlock, args: tuple, inputs: Sequence[Symbol]
                ) -> Tuple[Dict[str, str], Dict[str, Tuple[int, ...]]]:
    """The dtypes and shapes of a block's graph inputs at this call: data from the call's
    arrays, parameters' dtypes as stored (their shapes may still be deferred)."""
    dtypes: Dict[str, str] = {}
    for var, a in zip(inputs, call_arrays(args)):
        if isinstance(a, mx.nd.NDArray):
            dtypes[var.name] = _array_dtype(a.dtype)
    for name, dtype in param_dtypes(block).items():
        dtypes.setdefault(name, dtype)
    return dtypes, call_shapes(args, inputs)


def call_shapes(args: tuple, inputs: Sequence[Symbol]) -> Dict[str, Tuple[int, ...]]:
    """The shapes of a block's data inputs at this call, by graph input name (what
    :func:`call_inputs` gives without the parameters' dtypes, whose collection is slow)."""
    return {var.name: a.shape for var, a in zip(inputs, call_arrays(args)) if isinstance(a, mx.nd.NDArray)}


def param_dtypes(block: HybridBlock) -> Dict[str, str]:
    """Graph input name -> dtype of ``block``'s parameters as stored (what its CachedOp binds,
    whatever ``__dtype__`` its graph declares: ``cast``, O2 and the converters change it)."""
    return {p.name: _array_dtype(p.dtype) for p in block.collect_params().values() if p.dtype is not None}


# -- symbols -------------------------------------------------------------------------

#: 1.9.1: the numpy-frontend Symbol class; amp_cast is a legacy op, so np symbols are
#: converted through ``as_nd_ndarray``. If moved, importing gluon_amp fails here.
NP_SYMBOL = mx.sym.np._Symbol


def like_frontend(like: Symbol, sym: Symbol) -> Symbol:
    """``sym`` in the frontend of ``like``: a numpy-frontend Symbol where ``like`` is one.

    1.9.1 mxnet/_ctypes/ndarray.py: a ``CachedOp`` built from a numpy-frontend Symbol returns
    ``mx.np.ndarray`` outputs, from a legacy one ``mx.nd.NDArray``, which Gluon refuses in numpy
    mode (``npx.set_np()``). A graph gluon_amp rebuilds (``mx.sym.load_json``) is legacy:
    ``Symbol.as_np_ndarray`` shares its graph under the numpy class."""
    if isinstance(like, NP_SYMBOL) and not isinstance(sym, NP_SYMBOL):
        return sym.as_np_ndarray()
    return sym


def legacy_arrays() -> ContextManager[Any]:
    """Inside, Gluon makes and expects legacy ``mx.nd`` arrays, in numpy mode too
    (``npx.set_np()``): gluon_amp's own measuring blocks are built from legacy symbols and fed
    legacy arrays. 1.9.1: ``mx.util.np_array(False)``, a per-thread scope that Gluon's blocks,
    parameters and output check read; NumPy shape semantics are left as the user set them
    (turning them off while numpy arrays are on is refused)."""
    return mx.util.np_array(False)


def _name_manager() -> Any:
    """The calling thread's ``NameManager`` (Gluon's name scope inside a block). 1.9.1:
    ``NameManager._current.value``, what ``NameManager.current`` returns after its
    DeprecationWarning, which every op of a block's trace would otherwise show the user."""
    local = getattr(mx.name.NameManager, "_current", None)
    if local is None:
        return mx.name.NameManager.current  # another layout: the public way, warning and all
    if not hasattr(local, "value"):
        local.value = mx.name.NameManager()
    return local.value


def auto_names_mark() -> Callable[[], None]:
    """A function that puts MXNet's automatic naming back as it is now: the names symbols built
    meanwhile took (``fullyconnected3``) are handed out again, as if they had not been built.

    1.9.1: the thread's ``NameManager`` (Gluon's name scopes are its ``Prefix`` subclass) counts
    each hint in its ``_counter`` dict; without it, the function does nothing.
    """
    counter = getattr(_name_manager(), "_counter", None)
    saved = dict(counter) if isinstance(counter, dict) else None

    def restore() -> None:
        if saved is not None:
            counter.clear()
            counter.update(saved)
    return restore


#: names of the variables :func:`pin_float32` declared (not the program): a float64 graph
#: retypes those only (:func:`decided_types`)
_PINNED: Set[str] = set()


def note_declared_float32(name: str) -> None:
    """A variable gluon_amp adds to graphs declared float32 (the Module's loss-scale input):
    retyped as :func:`pin_float32`'s are in a float64 graph."""
    _PINNED.add(name)


def pin_float32(var: Symbol) -> None:
    """Declare a variable float32 (``__dtype__='0'``). 1.9.1: ``Symbol._set_attr``; the
    public ``var(dtype=)`` cannot change an existing variable."""
    var._set_attr(__dtype__="0")
    _PINNED.add(var.name)


def symbol_of_class(cls: type, sym: Symbol) -> Symbol:
    """A new ``cls`` (a subclass of Symbol that may carry Python attributes) holding a copy of
    ``sym``'s graph. 1.9.1: ``Symbol.__setstate__({'handle': json})`` (pickle's way in) makes
    the handle from the JSON; ``Symbol(handle)`` would share ``sym``'s handle and free it twice."""
    out = cls.__new__(cls)
    out.__setstate__({"handle": sym.tojson(remove_amp_cast=False)})
    return out


def rebuild_op(built: Any, inputs: List[Symbol]) -> Any:
    """The op node ``built`` (what an op function returned) applied to new ``inputs`` under
    the same name and attributes, in the same API form: a numpy-frontend Symbol where
    ``built`` is one, and a list of outputs where it is a list.

    1.9.1: ``Symbol._gen_atomic_symbol`` makes an unbound copy of the head op, always a legacy
    Symbol; a numpy-mode op function (``npx.rnn``, mxnet/_ctypes/symbol.py ``_symbol_creator``)
    returns the numpy class, and a list of its outputs where the op has more than one. Used
    when MXNet created an op's weights itself and casts must be wired in after the fact.
    """
    head = op_head(built)
    out = head._gen_atomic_symbol()(*inputs, name=head.name)
    if isinstance(head, NP_SYMBOL):
        out = out.as_np_ndarray()
    if isinstance(built, (list, tuple)):
        return [out[i] for i in range(out.num_outputs)] if out.num_outputs > 1 else [out]
    return out


def op_head(built: Any) -> Symbol:
    """The Symbol whose head node is the op that made ``built`` (an op function's result: a
    Symbol, or in numpy mode a list of one op's outputs)."""
    return built[0] if isinstance(built, (list, tuple)) else built


def drop_cached_graph(block: Any) -> None:
    """Forget a hybridized block's recorded graph (1.9.1: ``_clear_cached_op``; also what
    ``HybridBlock.cast`` calls). The next call traces it again."""
    if isinstance(block, HybridBlock):
        block._clear_cached_op()


def block_backend(block: HybridBlock) -> Tuple[Optional[str], Dict[str, Any]]:
    """The subgraph backend the block's next graph build partitions with, and its options:
    what its last ``hybridize(backend=..., **options)`` set (1.9.1: ``_backend`` and
    ``_backend_opts``, read by ``_build_cache``). If renamed, exporting a converted block
    fails here (test_export fails)."""
    return block._backend, dict(block._backend_opts)


def auto_name(hint: str) -> str:
    """The next name MXNet's current name manager gives a node with ``hint`` (``hint0``,
    ``hint1``, ... per manager), without the scope's prefix, which MXNet adds when the node is
    created. 1.9.1: ``NameManager.get`` counts per hint; ``Prefix.get`` adds the prefix."""
    return mx.name.NameManager.get(_name_manager(), None, hint)


def run_unpartitioned(block: HybridBlock, graph: Symbol, backend: Optional[str] = None) -> None:
    """Make a SymbolBlock run ``graph`` at its next call, partitioned by ``backend`` (None:
    not at all), with the ``hybridize`` flags it has (``static_alloc``, ...).

    1.9.1: ``_build_cache`` replaces ``_cached_graph`` with the partitioned graph, and
    ``SymbolBlock._clear_cached_op`` keeps it; ``hybridize`` without flags resets ``_flags``.
    """
    flags = dict(block._flags)
    HybridBlock.hybridize(block, True, backend=backend, **flags)
    block._cached_graph = (block._cached_graph[0], graph)


def cached_op_flags(block: HybridBlock) -> Dict[str, Any]:
    """The CachedOp flags the block's next graph build uses (``static_alloc``, ``static_shape``, ...):
    what its last ``hybridize(**flags)`` set (1.9.1: ``_flags``, a list of pairs, read by
    ``_build_cache``). If renamed, the converter's fusion tests fail here."""
    return dict(block._flags)


def bucketing_module_options(mod: Any) -> Dict[str, Any]:
    """Constructor options a ``BucketingModule`` keeps only privately (1.9.1: ``_sym_gen``,
    ``_default_bucket_key``, ``_context``, ...), to build an equivalent module. If renamed,
    convert_bucketing_module fails with AttributeError (the bucketing tests fail)."""
    return {"sym_gen": mod._sym_gen, "default_bucket_key": mod._default_bucket_key,
            "context": mod._context, "work_load_list": mod._work_load_list,
            "fixed_param_names": mod._fixed_param_names, "state_names": mod._state_names,
            "group2ctxs": mod._group2ctxs, "compression_params": mod._compression_params}


def bucketing_buckets(mod: Any) -> Dict[Any, Any]:
    """Bucket key -> bound Module (1.9.1: ``BucketingModule._buckets``)."""
    return mod._buckets


# -- block hooks ---------------------------------------------------------------------
# 1.9.1 mxnet/gluon/block.py: ``HybridBlock._get_graph(*args)`` builds the block's graph
# once (``self._cached_graph = (inputs, out)``) and returns it; ``_build_cache``,
# ``infer_shape`` and ``export`` read it from there. ``_call_cached_op(*args)`` runs every
# hybridized call. Rewriting the graph on its first build changes what the CachedOp runs.
# If either method is renamed, init fails here.

_GET_GRAPH = HybridBlock._get_graph
_CALL_CACHED_OP = HybridBlock._call_cached_op


class _ThreadDepth(threading.local):
    """How deep the current thread is inside a scope (0: outside); read on hot paths."""

    depth = 0

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


_paused = _ThreadDepth()


def inside_block_call() -> bool:
    """Whether this thread is inside a Gluon block's call (a hybridized block traces its graph
    there), as the hook on ``Block.__call__`` counts them; False where no such hook is installed."""
    return _calls.depth > 0


def hooks_paused() -> ContextManager[None]:
    """Blocks built and run inside (gluon_amp's own measurements) bypass the hooks."""
    return _paused.inside()


@dataclass(frozen=True)
class BlockHooks:
    """The methods :func:`install_block_hooks` put on HybridBlock (and on Block: ``call``,
    None where no ``returned`` was given)."""

    get_graph: Callable
    call_cached_op: Callable
    call: Optional[Callable] = None
    #: block -> the ``current()`` the hooks built its graph under
    made_under: "weakref.WeakKeyDictionary[HybridBlock, object]" = field(default_factory=weakref.WeakKeyDictionary)
    #: block -> its plans for other input dtypes, put aside (see :func:`install_block_hooks`)
    aside: "weakref.WeakKeyDictionary[HybridBlock, List[_PlanAside]]" = field(
        default_factory=weakref.WeakKeyDictionary)


@dataclass(frozen=True)
class _PlanAside:
    """What a hybridized block runs for one set of input dtypes (1.9.1: the three fields
    ``_clear_cached_op`` resets), and the ``current()`` it was built under."""

    graph: tuple
    cached_op: Any
    op_args: list
    dtypes: Optional[tuple]
    under: object


#: plans a block keeps aside, per set of input dtypes, besides the one it runs
_PLANS_ASIDE = 3


#: 1.9.1 mxnet/gluon/block.py: ``Block.__call__(self, *args)`` runs the forward hooks and
#: ``forward``; HybridBlock and the recurrent cells reach it (the cells through ``super()``).
_BLOCK_CALL = Block.__call__
#: how deep the current thread is in Block calls (0: a call from outside any block)
_calls = _ThreadDepth()


def install_block_hooks(rewrite: Callable[[HybridBlock, tuple, Sequence[Symbol], Symbol], Symbol],
                        stale: Callable[[HybridBlock], None],
                        reshaped: Optional[Callable[[HybridBlock, tuple, Sequence[Symbol], Symbol], bool]] = None,
                        watch: Optional[Callable[[HybridBlock], bool]] = None,
                        called: Optional[Callable[[HybridBlock, tuple], bool]] = None,
                        returned: Optional[Callable[[Block, tuple, Any], Any]] = None,
                        current: Optional[Callable[[], object]] = None) -> BlockHooks:
    """Until :func:`remove_block_hooks`: every HybridBlock's freshly built graph passes
    through ``rewrite(block, args, inputs, out)``, as does, before its first run, a graph
    a block was given (a SymbolBlock's: the block runs the result and keeps its own, see
    :func:`cached_graph`); a block that runs a graph it recorded without the hooks is
    passed to ``stale`` once, as is one built here while ``current()`` named nothing, at its first
    call where it names something. A block whose graph was built here and that ``watch(block)``
    names, called with other input shapes than the call that built it (or the last one
    checked), is passed to ``reshaped(block, args, inputs, out)``; if it returns True, the
    graph is dropped and built again, through ``rewrite``, for this call. Every call of a
    block whose graph the hooks built passes to ``called(block, args)`` before it runs
    (the tuner's turn); True drops the graph and builds it again the same way. Blocks built
    and run inside :func:`hooks_paused` pass untouched. Costs a set lookup per call, and the
    input shapes for watched blocks (a few microseconds), whatever the size of the heap.
    What a block called from outside any block (hybridized or not) returns passes through
    ``returned(block, args, out)``, whose result the caller gets. ``current()`` names what
    ``rewrite`` does for the calling thread (its policy's rules, or None: nothing); each graph
    the hooks built where it named one gives way to its FP32 graph in :func:`remove_block_hooks`,
    and its block builds its CachedOp from that at its next call. A given
    graph (a SymbolBlock's) is the user's and stays: one built under ``init`` holds that
    policy's casts itself, and runs as it ran."""
    built: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()
    given: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()  # blocks whose graph was given, rewritten
    seen: "weakref.WeakKeyDictionary[HybridBlock, tuple]" = weakref.WeakKeyDictionary()
    made_under: "weakref.WeakKeyDictionary[HybridBlock, object]" = weakref.WeakKeyDictionary()
    plain_said: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()  # built with AMP off, passed to ``stale``
    #: block -> the dtypes of the call its graph was built for (the plan's casts follow them)
    typed_for: "weakref.WeakKeyDictionary[HybridBlock, tuple]" = weakref.WeakKeyDictionary()
    aside: "weakref.WeakKeyDictionary[HybridBlock, List[_PlanAside]]" = weakref.WeakKeyDictionary()
    #: blocks traced again for other input dtypes (their plans aside stay valid)
    retyping: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()

    def _get_graph(self: HybridBlock, *args: Any) -> Any:
        run = _RUN_GRAPHS.get(self)
        if run is not None:
            return run
        fresh = not self._cached_graph
        inputs, out = _GET_GRAPH(self, *args)
        if _paused.depth:
            return inputs, out
        if fresh:
            if self in retyping:
                retyping.discard(self)
            else:  # dropped by anything else (hybridize, cast, the tuner): so are the plans aside
                aside.pop(self, None)
            under = current() if current is not None else None
            self._cached_graph = (inputs, like_frontend(out, rewrite(self, args, inputs, out)))
            built.add(self)
            if current is not None:  # typed for these inputs: a plan's casts follow them
                typed_for[self] = _dtypes(args)
                made_under[self] = under
            if reshaped is not None and watch is not None and watch(self):
                seen[self] = _shapes(args)
        return self._cached_graph

    def _call_cached_op(self: HybridBlock, *args: Any) -> Any:
        if self._cached_graph and not _paused.depth:
            if self not in built and self in _RESTORED:
                _RESTORED.discard(self)
                self._clear_cached_op()  # an FP32 graph a removal put back: traced again, under these hooks
            elif self not in built:
                built.add(self)  # once per block
                if self._cached_op is None:
                    # A graph that never went through _get_graph and has not run yet: a
                    # SymbolBlock is given its graph when constructed (GluonCV's feature
                    # extractors build theirs from symbols, under init's patched mx.sym).
                    given.add(self)
                    _rewrite_given(self, args)
                stale(self)
            else:
                typed, dtypes = typed_for.get(self), _dtypes(args)
                plain = current is not None and made_under.get(self, self) is None  # built with AMP off
                if plain and self in aside and _aside_for(self, dtypes, current()) is not None:
                    _retype(self, typed, dtypes)  # AMP on again, and a plan for these inputs kept aside
                elif plain and self not in plain_said and current() is not None:
                    # built here while AMP was off for its thread (outside any autocast region):
                    # it keeps that float32 graph under AMP too, which ``stale`` says, once
                    plain_said.add(self)
                    stale(self)
                if not plain and typed is not None and typed != dtypes:
                    # other input dtypes than the plan was typed for: its casts were chosen for
                    # those (a float16-fed plan has none before a concat that now gets float32)
                    _retype(self, typed, dtypes)
                elif self in seen:  # watched, and its graph went through rewrite
                    shapes = _shapes(args)
                    if seen.get(self) != shapes:
                        seen[self] = shapes
                        if reshaped(self, args, *self._cached_graph):
                            _drop(self)  # rebuilt below, through _get_graph
                if called is not None and called(self, args):
                    _drop(self)  # rebuilt below, through _get_graph (a SymbolBlock keeps its graph)
                    if self in given:
                        _rewrite_given(self, args)
        return _CALL_CACHED_OP(self, *args)

    def _aside_for(self: HybridBlock, dtypes: tuple, under: object) -> Optional[_PlanAside]:
        return next((p for p in aside.get(self, ()) if p.dtypes == dtypes and p.under == under), None)

    def _retype(self: HybridBlock, typed: Optional[tuple], dtypes: tuple) -> None:
        """Put the block's graph aside and run its plan for ``dtypes``: one kept aside under the
        same ``current()``, or one traced at this call. A program that alternates input dtypes
        (a decoder fed float16, then float32) traced each call again (about 40x the call).
        Not for a block the shape rules watch: a plan kept aside would miss ops they keep in
        float32 since it was built."""
        under = current() if current is not None else None
        plan = _aside_for(self, dtypes, under)
        if watch is not None and watch(self):
            _drop(self)
            return
        mine = (typed, made_under.get(self))
        kept = [p for p in aside.get(self, ()) if p is not plan and (p.dtypes, p.under) != mine]
        kept.append(_PlanAside(self._cached_graph, self._cached_op, self._cached_op_args, *mine))
        aside[self] = kept[-_PLANS_ASIDE:]
        if plan is not None:
            self._cached_graph, self._cached_op, self._cached_op_args = plan.graph, plan.cached_op, plan.op_args
            typed_for[self] = dtypes
            made_under[self] = plan.under
            return
        retyping.add(self)
        self._clear_cached_op()  # traced again below, through _get_graph

    def _drop(self: HybridBlock) -> None:
        """The block's graph, and its plans aside, built again: the choices they hold changed."""
        aside.pop(self, None)
        retyping.discard(self)
        self._clear_cached_op()

    def _rewrite_given(self: HybridBlock, args: tuple) -> None:
        inputs, out = self._cached_graph
        rewritten = rewrite(self, args, inputs, out)
        if rewritten is not out:
            rewritten = like_frontend(out, rewritten)
            _RUN_GRAPHS[self] = (inputs, rewritten)
        else:
            _RUN_GRAPHS.pop(self, None)

    call = None
    if returned is not None:
        def __call__(self: Block, *args: Any) -> Any:
            depth = _calls.depth
            try:  # set inside the try: a Ctrl-C anywhere leaves the thread's depth as it was
                _calls.depth = depth + 1
                out = _BLOCK_CALL(self, *args)
            finally:
                _calls.depth = depth
            return returned(self, args, out) if not depth and not _paused.depth else out

        __call__.__doc__, __call__.__wrapped__ = _BLOCK_CALL.__doc__, _BLOCK_CALL  # type: ignore[attr-defined]
        # a caller's wrong keyword is named as MXNet's own method names it ("Block.__call__() got an
        # unexpected keyword argument"), not after this hook (CPython 3.11+ reads co_qualname)
        __call__.__qualname__ = _BLOCK_CALL.__qualname__
        __call__.__code__ = __call__.__code__.replace(co_qualname=_BLOCK_CALL.__qualname__)
        Block.__call__ = call = __call__
    HybridBlock._get_graph, HybridBlock._call_cached_op = _get_graph, _call_cached_op
    hooks = BlockHooks(_get_graph, _call_cached_op, call, made_under, aside)
    warning_sites.hold(hooks)
    return hooks


def _dtypes(args: Any) -> Any:
    """The dtypes of a call's arrays, nested as the call's arguments."""
    if isinstance(args, (list, tuple)):
        return tuple(_dtypes(a) for a in args)
    return getattr(args, "dtype", None)


def _shapes(args: Any) -> Any:
    """The shapes of a call's arrays, nested as the call's arguments."""
    if isinstance(args, (list, tuple)):
        return tuple(_shapes(a) for a in args)
    return getattr(args, "shape", None)


def remove_block_hooks(hooks: BlockHooks,
                       fp32_of: Optional[Callable[[HybridBlock, Symbol], Optional[Symbol]]] = None) -> None:
    """Put MXNet's methods back, where ``hooks`` are still the ones in place. Each graph they
    built under a policy gives way to its FP32 graph, ``fp32_of(block, graph)`` (None where not
    known: the block traces again), from which the block's next call builds its CachedOp."""
    if HybridBlock.__dict__.get("_get_graph") is hooks.get_graph:
        HybridBlock._get_graph = _GET_GRAPH
    if HybridBlock.__dict__.get("_call_cached_op") is hooks.call_cached_op:
        HybridBlock._call_cached_op = _CALL_CACHED_OP
    if hooks.call is not None and Block.__dict__.get("__call__") is hooks.call:
        Block.__call__ = _BLOCK_CALL
    warning_sites.release(hooks)
    for block, under in list(hooks.made_under.items()):
        if under is None or not block._cached_graph:
            continue
        inputs, kept = block._cached_graph
        plain = fp32_of(block, kept) if fp32_of is not None else None
        args = block._cached_op_args
        block._clear_cached_op()
        if plain is not None:  # kept, so that converters and export still find a graph
            block._cached_graph = (inputs, like_frontend(kept, plain))
            # 1.9.1 ``export`` saves the parameters it finds in _cached_op_args (the next
            # call's _build_cache makes it afresh): emptied, export wrote an empty .params file
            block._cached_op_args = args
            _RESTORED.add(block)
    hooks.made_under.clear()
    hooks.aside.clear()


#: blocks whose FP32 graph :func:`remove_block_hooks` put back: hooks installed later trace
#: them again at their first call (a graph a block is given would be run as it is)
_RESTORED: "weakref.WeakSet[HybridBlock]" = weakref.WeakSet()


# -- shape inference without the hooks -------------------------------------------------
# 1.9.1 mxnet/gluon/block.py: ``HybridBlock._infer_attrs(infer_fn, attr, *args)`` is where
# ``infer_shape``/``infer_type`` (and so a block's deferred initialization,
# ``_deferred_infer_shape``) trace the block's graph (``_get_graph``, which caches it) and read
# MXNet's shape or type inference. If renamed, init fails here.

_INFER_ATTRS = HybridBlock._infer_attrs


@dataclass(frozen=True)
class MethodHook:
    """A method of MXNet's put in place on its class until :func:`remove_method_hook`."""

    owner: type
    name: str
    original: Callable
    replacement: Callable


def _install_method(owner: type, name: str, original: Callable, replacement: Callable) -> MethodHook:
    replacement.__doc__ = original.__doc__
    setattr(owner, name, replacement)
    return MethodHook(owner, name, original, replacement)


def remove_method_hook(hook: MethodHook) -> None:
    """Put MXNet's method back, where ``hook``'s is still the one in place (checked by identity)."""
    if hook.owner.__dict__.get(hook.name) is hook.replacement:
        setattr(hook.owner, hook.name, hook.original)


def install_infer_hook() -> MethodHook:
    """Until :func:`remove_method_hook`: shape and type inference of a block with no graph yet
    (deferred initialization; ``net.infer_shape(x)``) trace it with the block hooks paused,
    and the graph is not kept: building a plan needs no check that this machine can run it
    (nothing runs). The block's first run builds its graph again, through the hooks."""
    def _infer_attrs(self: HybridBlock, infer_fn: str, attr: str, *args: Any) -> Any:
        if self._cached_graph or _paused.depth:
            return _INFER_ATTRS(self, infer_fn, attr, *args)
        try:
            with hooks_paused():
                return _INFER_ATTRS(self, infer_fn, attr, *args)
        finally:
            self._cached_graph = ()  # a plain trace: the hooks see a fresh build when it runs

    return _install_method(HybridBlock, "_infer_attrs", _INFER_ATTRS, _infer_attrs)


# -- Parameter._reduce hook -----------------------------------------------------------
# 1.9.1 mxnet/gluon/parameter.py: ``Parameter._reduce()`` averages a parameter's copies on
# several contexts onto the CPU (``save_parameters``, ``Block.save``, ``_check_and_get``'s
# callers) with ``add_n`` and ``/``: MXNet's bookkeeping, through op functions AMP patches (the
# table runs ``_div_scalar`` in float32, so bfloat16 weights were saved float32). If renamed,
# init fails here.
_REDUCE = Parameter._reduce


def install_reduce_hook(plain_ops: Callable[[], ContextManager[Any]]) -> MethodHook:
    """Until :func:`remove_method_hook`: ``Parameter._reduce`` runs inside ``plain_ops()`` (a
    region where the op functions run as MXNet's own)."""
    def _reduce(self: Parameter) -> Any:
        with plain_ops():
            return _REDUCE(self)

    return _install_method(Parameter, "_reduce", _REDUCE, _reduce)


#: The symbolic control-flow ops and how many of their leading arguments are subgraphs (1.9.1
#: mxnet/symbol/contrib.py: ``_foreach(g, *inputs)``, ``_while_loop(cond_g, func_g, *inputs)``,
#: ``_cond(cond_g, then_g, else_g, *inputs)``): graphs the op holds, not data to cast.
SUBGRAPH_ARGS = {"_foreach": 1, "_while_loop": 2, "_cond": 3}


def building_subgraph() -> bool:
    """True while MXNet traces the body of a symbolic control-flow op in this thread. 1.9.1
    mxnet/symbol/contrib.py: ``foreach``, ``while_loop`` and ``cond`` call the body inside
    ``AttrScope(__subgraph_name__=...)`` (every symbol made there carries the attribute, and
    the subgraph is cut by it). If renamed, False: the body's ops get the policy's casts, and
    MXNet's type inference refuses the loop's float32 states coming back low."""
    scope = getattr(getattr(mx.attribute.AttrScope, "_current", None), "value", None)
    return bool(getattr(scope, "_attr", {}).get("__subgraph_name__"))


def constructing_block() -> Optional[Any]:
    """The block whose ``with self.name_scope():`` is open in this thread (a block being
    built: Gluon creates children and parameters there), else None. 1.9.1: ``name_scope()``
    sets ``_BlockScope._current.value`` to the block's scope, whose ``_block`` is the block
    (forwards, imperative or traced, run outside it, but for a symbolic trace's own scope).
    If renamed, None: a forward during construction is treated as any other."""
    scope = getattr(getattr(getattr(mx.gluon.block, "_BlockScope", None), "_current", None), "value", None)
    return getattr(scope, "_block", None)


def full_op_name(name: Any) -> Optional[str]:
    """The node name an op built now with ``name=`` gets (Gluon's prefix applied), or
    ``None`` when MXNet will make one up. 1.9.1: ``NameManager.current.get(name, hint)``
    returns ``name`` (prefixed under ``Prefix``) without side effects when ``name`` is set."""
    if not name or not isinstance(name, str):
        return None
    return _name_manager().get(name, None)


# -- Parameter.cast hook -------------------------------------------------------------
# 1.9.1 mxnet/gluon/parameter.py: ``Parameter.cast(dtype)`` is where every cast of a
# parameter ends: ``Block.cast`` calls it per parameter (after ``HybridBlock.cast`` dropped the
# cached graph), as do the ``Parameter.dtype`` setter and ``ParameterDict.setattr('dtype', ..)``.
# It sets ``_dtype`` and replaces ``_data``/``_grad`` by ``astype`` copies. ``Parameter._load_init(data,
# ctx, cast_dtype, dtype_source)`` (``load_parameters``, ``SymbolBlock.imports``) sets the dtype
# through that setter before the parameter has arrays, then makes them from ``data`` as saved.
# If either is renamed, init fails here.

_PARAM_CAST = Parameter.cast
_PARAM_LOAD_INIT = Parameter._load_init
_own_casts = _ThreadDepth()


@dataclass(frozen=True)
class CastHook:
    """The ``Parameter.cast`` :func:`install_param_cast_hook` put in place."""

    cast: Callable
    load_init: Callable


def own_casts() -> ContextManager[None]:
    """Parameter casts gluon_amp itself makes inside (O2/O3 weights) bypass the cast hook."""
    return _own_casts.inside()


def install_param_cast_hook(rule: Callable[[Parameter, Any, Callable[[Any], None]], None]) -> CastHook:
    """Until :func:`remove_param_cast_hook`: ``Parameter.cast(dtype)`` (from any caller but
    :func:`own_casts`) calls ``rule(param, dtype, cast)``; ``cast(d)`` is MXNet's own cast of
    ``param`` to ``d``."""
    def cast(self: Parameter, dtype: Any) -> None:
        if _own_casts.depth:
            return _PARAM_CAST(self, dtype)
        return rule(self, dtype, lambda d: _PARAM_CAST(self, d))

    def load_init(self: Parameter, data: Any, ctx: Any, cast_dtype: bool = False,
                  dtype_source: str = "current") -> None:
        low = _HELD_LOW.get(self)
        if low is not None and self._dtype is not None and _array_dtype(data.dtype) == low:
            # a parameter the rule holds float32 for a cast to ``low`` (GPU code: cast, then load a
            # file in that dtype): the file's dtype is the one the code cast to, as MXNet checks it
            data = data.astype(self._dtype)
        _PARAM_LOAD_INIT(self, data, ctx, cast_dtype, dtype_source)
        held = _array_dtype(self._dtype) if self._dtype is not None else None
        if held is not None and any(_array_dtype(a.dtype) != held for a in param_arrays(self)):
            # the rule held the saved dtype's cast (a float16 file loaded where float16 has no
            # kernels): the arrays follow, as a cast of an initialized parameter's would
            _PARAM_CAST(self, self._dtype)

    cast.__doc__ = _PARAM_CAST.__doc__
    load_init.__doc__ = _PARAM_LOAD_INIT.__doc__
    Parameter.cast = cast
    Parameter._load_init = load_init
    return CastHook(cast, load_init)


#: parameters the cast rule holds float32 for a cast to a low dtype -> that dtype
_HELD_LOW: "weakref.WeakKeyDictionary[Parameter, str]" = weakref.WeakKeyDictionary()


def note_held_low(param: Parameter, low: Optional[str]) -> None:
    """Remember that the cast rule holds ``param`` float32 for a cast to ``low`` (None: it
    does not), so that a file saved in ``low`` loads into it as into the cast parameter."""
    if low is None:
        _HELD_LOW.pop(param, None)
    else:
        _HELD_LOW[param] = low


def _array_dtype(dtype: Any) -> str:
    """A NumPy dtype (or MXNet's bfloat16 stand-in) by its name."""
    from gluon_amp_core.dtypes import dtype_name
    from .arrays import FLOAT_NAMES
    return FLOAT_NAMES.get(dtype) or dtype_name(dtype)


def remove_param_cast_hook(hook: CastHook) -> None:
    """Put MXNet's ``Parameter.cast`` back, where ``hook`` is still the one in place."""
    if Parameter.__dict__.get("cast") is hook.cast:
        Parameter.cast = _PARAM_CAST
    if Parameter.__dict__.get("_load_init") is hook.load_init:
        Parameter._load_init = _PARAM_LOAD_INIT


def param_contexts(param: Parameter) -> List[Any]:
    """The contexts ``param`` lives (or will live, deferred) on. 1.9.1: ``_ctx_list``, set
    by ``initialize``; before that, the current default context."""
    return list(getattr(param, "_ctx_list", None) or [mx.context.current_context()])


def param_arrays(param: Parameter) -> List[mx.nd.NDArray]:
    """``param``'s data, one array per context; ``[]`` while its initialization is deferred
    (1.9.1: ``_data`` is None until the shapes are known)."""
    return list(getattr(param, "_data", None) or [])


# -- execution hooks -----------------------------------------------------------------
# Where MXNet 1.9.1 hands a graph to an executor:
# - mxnet/gluon/block.py ``HybridBlock._build_cache(*args)``: ``data, out = self._get_graph(*args)``,
#   deferred shape inference (``infer_shape`` reads ``self._cached_graph``), an optional
#   ``optimize_for`` partition (written back to ``_cached_graph``), then ``CachedOp(out, flags)``;
# - mxnet/symbol/symbol.py ``Symbol.simple_bind(ctx, grad_req, type_dict, stype_dict, group2ctx,
#   shared_arg_names, shared_exec, shared_buffer, **shapes)`` (Module's executor group calls it)
#   and ``Symbol.bind(ctx, args, args_grad, grad_req, aux_states, group2ctx, shared_exec)``; both
#   make ``Executor(handle, self, ...)``, which keeps a copy of the bound symbol.
# If any is renamed, init fails here.

_BUILD_CACHE = HybridBlock._build_cache
_SIMPLE_BIND = Symbol.simple_bind
_BIND = Symbol.bind
_INFER_TYPE = Symbol.infer_type
#: 1.9.1 symbol.py: ``Symbol._infer_type_impl(partial, *args, **kwargs)`` is what ``infer_type``
#: and ``infer_type_partial`` call (``infer_type`` warns where it returns ``None``s); if moved,
#: init fails here
_INFER_TYPE_IMPL = Symbol._infer_type_impl
#: blocks whose CachedOp runs another graph than their plan -> that graph
_EXECUTED: "weakref.WeakKeyDictionary[HybridBlock, Symbol]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ExecutionHooks:
    """The methods and the ``Parameter.grad_req`` property :func:`install_execution_hooks` put in place."""

    build_cache: Callable
    simple_bind: Callable
    bind: Callable
    infer_type: Callable
    grad_req: property


@dataclass(frozen=True)
class RefusedRun:
    """What a ``for_symbol`` hook returns for a graph this machine cannot run: ``graph`` binds
    (so its shapes and types can be read), and the executor's ``forward`` raises ``error``."""

    graph: Symbol
    error: Exception


def _refusing(executor: Any, error: Exception) -> Any:
    """``executor`` with ``forward`` raising a copy of ``error``, and its ``reshape`` results alike
    (1.9.1: ``Executor.forward``/``reshape`` are plain methods; Module's executor group calls
    ``exec_.forward(is_train=...)`` and ``exec_.reshape(...)``)."""
    reshape = executor.reshape

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise type(error)(*error.args)

    def reshaped(*args: Any, **kwargs: Any) -> Any:
        return _refusing(reshape(*args, **kwargs), error)

    executor.forward, executor.reshape = forward, reshaped
    return executor


def is_rnn_layer(block: Any) -> bool:
    """Whether ``block`` is a fused recurrent layer (``rnn.LSTM``/``GRU``/``RNN``). 1.9.1:
    ``_RNNLayer.__call__`` makes the begin states outside the graph when they are not given."""
    return isinstance(block, mx.gluon.rnn.rnn_layer._RNNLayer)


def symbol_address(sym: Symbol) -> int:
    """The address of ``sym``'s C handle (1.9.1: ``Symbol.handle``, a ctypes pointer): one
    per live Symbol object's graph; Symbols take no weak references (``__slots__``)."""
    return int(sym.handle.value or 0)


def executed_graph(block: HybridBlock) -> Optional[Symbol]:
    """What ``block``'s CachedOp runs where it is not the block's own graph, else None."""
    return _EXECUTED.get(block)


def decided_types(sym: Symbol, bound: Symbol, type_dict: Any) -> Any:
    """``type_dict`` for ``bound.simple_bind``, plus a dtype for each argument that MXNet's type
    inference cannot decide there: what it infers for ``sym`` without its ``amp_cast`` nodes
    (what the program gives without AMP). ``type_dict`` itself where nothing is missing.

    A cast's input is not inferred from its output, so a weight the user declared as a
    ``Variable`` and the patched op function cast (``FullyConnected(x, weight=w)``, every
    ``mx.rnn`` cell) is left undecided, and ``Module.bind`` failed: "InferType pass cannot
    decide dtypes". The caller's dict is not changed.

    A weight an op created itself is declared float32 (``pin_float32``), the master copy of a
    float32 graph; fed float64 data, MXNet types it float64 and the declaration conflicts.
    Where ``bound`` cannot be typed at all, each argument gets what the graph without casts
    and without float32 declarations gives it, as the program without AMP types it."""
    given = dict(type_dict or {})
    names = bound.list_arguments()
    try:
        types, _, _ = _INFER_TYPE_IMPL(bound, True, **{k: v for k, v in given.items() if k in names})
    except mx.base.MXNetError:
        types, unpin = None, True
    else:
        unpin = False
    try:
        missing = set(names) - set(given) if types is None else {n for n, t in zip(names, types) if t is None}
        if not missing:
            return type_dict
        plain = _without_float32_declarations(sym) if unpin else mx.sym.load_json(sym.tojson())
        plain_names = plain.list_arguments()
        plain_types, _, _ = _INFER_TYPE_IMPL(plain, True, **{k: v for k, v in given.items() if k in plain_names})
    except mx.base.MXNetError:
        return type_dict  # MXNet's own bind says what is wrong
    found = {n: t for n, t in zip(plain_names, plain_types) if n in missing and t is not None}
    return {**given, **found} if found else type_dict


def _without_float32_declarations(sym: Symbol) -> Symbol:
    """``sym`` without its ``amp_cast`` nodes (1.9.1: ``tojson()`` leaves them out) and without
    the float32 declarations :func:`pin_float32` made (the program's own stay: MXNet refuses a
    float32 weight the program declared for float64 data, and so does this)."""
    graph = json.loads(sym.tojson())
    for node in graph["nodes"]:
        if node["op"] == "null" and node["name"] in _PINNED and node.get("attrs", {}).get("__dtype__") == "0":
            node["attrs"] = {k: v for k, v in node["attrs"].items() if k != "__dtype__"}
    return mx.sym.load_json(json.dumps(graph))


def _names_of(given: Any, names: Sequence[str]) -> Any:
    """A bind argument given as a list in the order of ``names`` as a dict; others as they are."""
    if isinstance(given, (list, tuple)):
        return dict(zip(names, given))
    return given


def _by_name(given: Any, names: Sequence[str]) -> Dict[str, Any]:
    """A bind's arrays (a list in the order of ``names``, a dict, or None) by name, for ``names`` only."""
    named = _names_of(given, names)
    if not isinstance(named, dict):
        return {}
    wanted = set(names)
    return {k: v for k, v in named.items() if k in wanted}


def _accumulating(grad_req: Any, names: Sequence[str]) -> FrozenSet[str]:
    """The names among ``names`` whose gradients ``grad_req`` (a bind's: one string, a list in
    the order of ``names`` or a dict) accumulates (``'add'``)."""
    given = _names_of(grad_req, names)
    if isinstance(given, str):
        return frozenset(names) if given == "add" else frozenset()
    if isinstance(given, dict):
        return frozenset(n for n, r in given.items() if r == "add")
    return frozenset()


def _with_gradients(grad_req: Any, names: Sequence[str]) -> bool:
    """True when ``grad_req`` (a bind's, as :func:`_accumulating` reads it) gives some argument a
    gradient. 1.9.1: a name a dict leaves out gets none."""
    given = _names_of(grad_req, names)
    if isinstance(given, str):
        return given != "null"
    if isinstance(given, dict):
        return any(r != "null" for r in given.values())
    return True  # not one MXNet takes: as if it trains (the plan as it is)


def partitioned_when_bound(devices: Any, trains: bool) -> bool:
    """True when MXNet partitions what an executor bound on ``devices`` runs with its oneDNN
    fusion (a convolution and its batch norm become one ``_sg_mkldnn_conv``, which folds the
    batch norm into the weight it reads at each call where that weight is new).

    1.9.1: ``GraphExecutor`` partitions a graph bound without gradients with the backend named by
    ``MXNET_SUBGRAPH_BACKEND``, ``MKLDNN`` where unset on a CPU build; ``NONE`` turns it off.
    """
    backend = os.environ.get("MXNET_SUBGRAPH_BACKEND", "MKLDNN")
    return not trains and "cpu" in set(devices) and backend.upper() not in ("", "NONE")


#: block -> its parameters' names, recorded when its CachedOp is built: a parameter's
#: ``grad_req`` changed to or from ``'add'`` later rebuilds it
_ACCUMULATION: "weakref.WeakKeyDictionary[HybridBlock, FrozenSet[str]]" = weakref.WeakKeyDictionary()
_GRAD_REQ = Parameter.__dict__["grad_req"]


def accumulating_params(block: HybridBlock) -> FrozenSet[str]:
    """The names of ``block``'s parameters whose gradients accumulate (``grad_req='add'``)."""
    return frozenset(name for name, p in block.collect_params().items() if p.grad_req == "add")


def _set_grad_req(self: Parameter, req: Any) -> None:
    before = self.grad_req
    _GRAD_REQ.fset(self, req)
    if before != self.grad_req and "add" in (before, self.grad_req):
        # the CachedOps built for the other grad_req cast this parameter for it: build again
        for block, names in list(_ACCUMULATION.items()):
            if self.name in names:
                block._clear_cached_op()
                _ACCUMULATION.pop(block, None)


def install_execution_hooks(for_block: Callable[[HybridBlock, tuple, Symbol, Sequence[Symbol]], Symbol],
                            for_symbol: Callable[[Symbol, Any, Dict[str, Any], Dict[str, tuple], Any,
                                                  FrozenSet[str], bool], Union[Symbol, RefusedRun]],
                            forward_only: Optional[Callable[[HybridBlock], Optional[Make]]] = None
                            ) -> ExecutionHooks:
    """Until :func:`remove_execution_hooks`: a hybridized block's CachedOp is built from
    ``for_block(block, args, graph, inputs)`` (the block's cached graph stays its own), and
    ``Symbol.bind``/``simple_bind`` bind ``for_symbol(sym, ctx, dtypes, shapes, group2ctx, accumulating,
    trains)`` (the Symbol itself is left as it is; a :class:`RefusedRun` binds it and refuses its
    forward), ``accumulating`` being the arguments whose ``grad_req`` is ``'add'``, ``trains``
    whether any argument gets a gradient (:func:`partitioned_when_bound`). Either
    returns its graph to run it unchanged. A parameter's ``grad_req`` set to or from ``'add'``
    rebuilds the CachedOps of the blocks that hold it.
    Blocks built inside :func:`hooks_paused` pass untouched. Where ``forward_only(block)``,
    asked once ``for_block`` returned, gives a ``make`` (:class:`ForwardOnly`), the block's calls
    that record nothing run on the graph it makes, with parameter casts made once (a block
    hybridized with a backend: that graph partitioned by it too)."""

    def _build_cache(self: HybridBlock, *args: Any) -> Any:
        if _paused.depth:
            return _BUILD_CACHE(self, *args)
        take_pads(self)  # a build that failed may have left its own
        with shared_reads():  # the graph the trace's rewrite gave is the one for_block reads
            inputs, graph = self._get_graph(*args)
            _ACCUMULATION[self] = frozenset(self.collect_params().keys())
            run = for_block(self, args, graph, inputs)
        if run is graph:
            _EXECUTED.pop(self, None)
            return _forward_only_too(self, _BUILD_CACHE(self, *args), inputs)
        run = like_frontend(graph, run)  # the CachedOp returns what the block's own graph would
        if peek_pads(self):  # its inputs' shapes differ from the call's: shapes from the block's own graph
            _finish_deferred_init(self, args, run.list_inputs())
        given = _RUN_GRAPHS.get(self)
        saved = self._cached_graph
        if given is not None:
            _RUN_GRAPHS[self] = (given[0], run)
        else:
            self._cached_graph = (inputs, run)
        try:
            built = _BUILD_CACHE(self, *args)
        finally:  # the block keeps its graph (a partition MXNet wrote back is of the copy)
            if given is not None:
                _RUN_GRAPHS[self] = given
            self._cached_graph = saved
            _EXECUTED[self] = run
        with_padded_inputs(self, inputs)  # before the calls that record nothing wrap it
        return _forward_only_too(self, built, inputs)

    def _finish_deferred_init(block: HybridBlock, args: tuple, order: Sequence[str]) -> None:
        # 1.9.1 _build_cache: parameters whose shapes wait for a call get them from the cached
        # graph, initialized in the order of the graph's inputs (the random draws as without us)
        params = {p.name: p for p in block.collect_params().values()}
        named = [params[n] for n in order if n in params]
        try:
            for p in named:
                p.data()
        except DeferredInitializationError:
            block._deferred_infer_shape(*args)
            for p in named:
                p._finish_deferred_init()

    def _forward_only_too(block: HybridBlock, built: Any, inputs: Sequence[Symbol]) -> Any:
        make = forward_only(block) if forward_only is not None else None
        if make is not None:  # the CachedOp's inputs, by the roles _build_cache gave them
            names = [inputs[k].name if is_data else k.name for is_data, k in block._cached_op_args]
            block._cached_op = ForwardOnly(block._cached_op, block, names, make)
        return built

    def simple_bind(self: Symbol, ctx: Any, grad_req: Any = "write", type_dict: Any = None,
                    stype_dict: Any = None, group2ctx: Any = None, shared_arg_names: Any = None,
                    shared_exec: Any = None, shared_buffer: Any = None, **kwargs: Any) -> Any:
        shapes = {k: tuple(v) for k, v in kwargs.items() if isinstance(v, tuple)}
        names = self.list_arguments()
        run = for_symbol(self, ctx, dict(decided_types(self, self, type_dict) or {}), shapes, group2ctx,
                         _accumulating(grad_req, names), _with_gradients(grad_req, names))
        if isinstance(run, RefusedRun):
            return _refusing(_SIMPLE_BIND(self, ctx, grad_req, decided_types(self, self, type_dict), stype_dict,
                                          group2ctx, shared_arg_names, shared_exec, shared_buffer, **kwargs),
                             run.error)
        if run is not self:
            grad_req = _names_of(grad_req, self.list_arguments())
        return _SIMPLE_BIND(run, ctx, grad_req, decided_types(self, run, type_dict), stype_dict, group2ctx,
                            shared_arg_names, shared_exec, shared_buffer, **kwargs)

    def bind(self: Symbol, ctx: Any, args: Any, args_grad: Any = None, grad_req: Any = "write",
             aux_states: Any = None, group2ctx: Any = None, shared_exec: Any = None) -> Any:
        arg_names, aux_names = self.list_arguments(), self.list_auxiliary_states()
        # 1.9.1 reads a dict by the symbol's names: other keys (a label the graph lacks) are ignored
        arrays = {**_by_name(args, arg_names), **_by_name(aux_states, aux_names)}
        if not all(isinstance(a, mx.nd.NDArray) for a in arrays.values()):  # MXNet raises its TypeError
            return _BIND(self, ctx, args, args_grad, grad_req, aux_states, group2ctx, shared_exec)
        run = for_symbol(self, ctx, {k: a.dtype for k, a in arrays.items()},
                         {k: a.shape for k, a in arrays.items()}, group2ctx, _accumulating(grad_req, arg_names),
                         args_grad is not None and _with_gradients(grad_req, arg_names))
        if isinstance(run, RefusedRun):
            return _refusing(_BIND(self, ctx, args, args_grad, grad_req, aux_states, group2ctx, shared_exec),
                             run.error)
        if run is self:
            return _BIND(self, ctx, args, args_grad, grad_req, aux_states, group2ctx, shared_exec)
        # the copy may list its variables in another order: pass them by name
        return _BIND(run, ctx, _names_of(args, arg_names), _names_of(args_grad, arg_names),
                     _names_of(grad_req, arg_names), _names_of(aux_states, aux_names), group2ctx, shared_exec)

    def infer_type(self: Symbol, *args: Any, **kwargs: Any) -> Any:
        # the arguments MXNet cannot type through a cast's input get what bind gives them
        # (decided_types): mx.model.FeedForward asserts a full answer before it binds
        try:
            try:
                found = _INFER_TYPE_IMPL(self, False, *args, **kwargs)
            except mx.base.MXNetError:
                found = (None, None, None)  # perhaps a float64 graph meeting float32 declarations
            if found[1] is not None:  # complete: what MXNet's infer_type returns
                return found
            given = dict(zip(self.list_arguments(), args)) if args else kwargs
            given = {k: v for k, v in given.items() if v is not None}
            # nothing given: MXNet decides nothing (it types the graph from what it is given)
            decided = decided_types(self, self, given) if given else None
        except (mx.base.MXNetError, TypeError, ValueError, KeyError):
            decided = None  # MXNet's own call says what is wrong
        if decided is None or decided is given or decided == given:
            return _INFER_TYPE(self, *args, **kwargs)
        return _INFER_TYPE(self, **decided)

    simple_bind.__doc__, bind.__doc__ = _SIMPLE_BIND.__doc__, _BIND.__doc__
    infer_type.__doc__ = _INFER_TYPE.__doc__
    HybridBlock._build_cache = _build_cache
    Symbol.simple_bind, Symbol.bind, Symbol.infer_type = simple_bind, bind, infer_type
    grad_req = property(_GRAD_REQ.fget, _set_grad_req, doc=_GRAD_REQ.__doc__)
    Parameter.grad_req = grad_req
    hooks = ExecutionHooks(_build_cache, simple_bind, bind, infer_type, grad_req)
    warning_sites.hold(hooks)
    return hooks


def remove_execution_hooks(hooks: ExecutionHooks) -> None:
    """Put MXNet's methods back, where ``hooks`` are still the ones in place."""
    if HybridBlock.__dict__.get("_build_cache") is hooks.build_cache:
        HybridBlock._build_cache = _BUILD_CACHE
    if Symbol.__dict__.get("simple_bind") is hooks.simple_bind:
        Symbol.simple_bind = _SIMPLE_BIND
    if Symbol.__dict__.get("bind") is hooks.bind:
        Symbol.bind = _BIND
    if Symbol.__dict__.get("infer_type") is hooks.infer_type:
        Symbol.infer_type = _INFER_TYPE
    if Parameter.__dict__.get("grad_req") is hooks.grad_req:
        Parameter.grad_req = _GRAD_REQ
    warning_sites.release(hooks)
