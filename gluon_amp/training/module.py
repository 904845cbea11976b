"""Dynamic loss scaling for ``mx.mod.Module`` and ``BucketingModule``.

A Module's loss heads (``SoftmaxOutput``, ``MakeLoss``, the regression outputs...) start their
backward from their own ``grad_scale``, so a loss scale cannot be multiplied into the loss as
``scale_loss`` does for Gluon. Instead, the graph the executors run (never the module's own
symbol, which ``save_checkpoint`` writes) feeds each head's data input through an exact
identity whose gradient is multiplied by a float32 ``(1,)`` argument
(:mod:`gluon_amp_core.loss_heads`), where a step can be scaled (:func:`_in_graph`). Each
training ``forward`` writes the step's scale into it (no rebind when the scale moves: the
identity broadcasts it in the forward pass), each ``backward`` again, and multiplies
``out_grads`` given for outputs that are not loss heads. Each ``update`` checks every
gradient in one read pass (:func:`gluon_amp.training.overflow.arrays_finite`), skips the step
on inf/NaN (weights, optimizer state and update counts untouched), and otherwise divides the
scale out through the optimizer's ``rescale_grad`` for that update (no extra pass over the
gradients). The scale moves by the same :class:`~gluon_amp_core.loss_scale.LossScaler` a
Gluon trainer uses.

The methods of ``Module`` this needs (``bind``, ``forward``, ``backward``, ``update``,
``init_optimizer``, ``borrow_optimizer``) and ``BucketingModule.bind`` are wrapped while
someone needs them: ``init`` (which then attaches the default scaler to every Module that
initialises its optimizer: scripts run under ``gluon_amp.run`` get scaling unchanged), or an
explicit :func:`init_module`. ``disable`` removes what ``init`` installed; modules given a
scaler explicitly keep it, as Gluon trainers do.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import mxnet as mx
from mxnet import autograd

from gluon_amp_core.dtypes import FLOAT16_SMALLEST_NORMAL, dtype_name
from gluon_amp_core.emulate import ROUND_SUFFIX
from gluon_amp_core.lists.loss_outputs import GRAPH_LOSS_HEADS
from gluon_amp_core.loss_heads import loss_heads, scale_loss_heads
from gluon_amp_core.loss_scale import LossScaler, asks_for, loss_scaler_from

from .. import execution, mxnet_internals as mxi, state
from ..type_inference import infer_dtypes, infer_shapes
from . import checkpoint, distributed, early_update, overflow

mxm = mxi.module
Module, BucketingModule = mxm.Module, mxm.BucketingModule

#: The argument of the bound graph that holds the loss scale.
SCALE_ARG = "gluon_amp_loss_scale"
mxi.note_declared_float32(SCALE_ARG)
_LOW = ("float16", "bfloat16")


class ModuleHook:
    """One scaled module's member token in its :class:`LossScaler` (a BucketingModule's
    buckets share one), and the scale its current step carries."""

    def __init__(self, scaler: LossScaler, auto: bool = False) -> None:
        self.scaler = scaler
        self.auto = auto  # attached by init's default (replaced by an explicit init_trainer)
        #: (compute dtype, scale) of the current step, fixed by its first backward
        self._step: Optional[Tuple[str, float]] = None
        #: whether this step's gradients carry the scale (a loss head or out_grads took it)
        self._carried = False
        #: what the last checked step's gradients are divided by in its update
        self._unscale = 1.0
        self._warned: Set[str] = set()
        #: the early update's plan (:mod:`.early_update`), and the step in flight: (dtype,
        #: whether scaled, the scaler's count of this member before it)
        self._plans: Dict[str, Any] = {}
        self._pending: Optional[Tuple[str, bool, int]] = None
        self._dropped = False
        #: the ``loss_scale`` argument the scaler was made from (``init_trainer`` asked again)
        self.requested: Any = None
        scaler.attach(self)

    def represents(self, obj: Any) -> bool:
        """Whether ``obj`` is a module (a BucketingModule or one of its buckets, those bound
        later too) this hook is attached to (``scaler.stage(module)``)."""
        return is_module(obj) and _hook_of(obj) is self

    def attached(self) -> bool:
        """Whether its scaler's rounds wait for it (False once a failed attachment dropped it)."""
        return not self._dropped

    def decide(self, dtype: str) -> float:
        if self._step is None:
            self._step = (dtype, self.scaler.scale_for(dtype))
        return self._step[1]

    @property
    def loss_scale(self) -> float:
        """The scale of the current step's gradients (before its first backward: the scale
        of the last dtype seen, as the next step will use it)."""
        return self._step[1] if self._step is not None else self.scaler.loss_scale

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            # the user's line: past MXNet's fit/update and gluon_amp's wrappers, however deep
            warnings.warn(message, RuntimeWarning, stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))

    def end_step(self, module: Module) -> bool:
        """Check ``module``'s gradients, record the step; True when it must be skipped."""
        dtype, scale, carried = self._close_step()
        finite = True
        if self.scaler.checks(dtype, self.scaler.scales(dtype)):
            groups: Dict[mx.Context, List[mx.nd.NDArray]] = {}
            for g in mxm.module_grad_arrays(module):
                g = g if g.stype == "default" else g.data
                groups.setdefault(g.ctx, []).append(g)
            finite = overflow.arrays_finite(groups)
            # before the gradients meet (a dist kvstore's push, a Horovod optimizer's allreduce
            # inside the update): every worker skips, or none
            finite = distributed.agree_module_finite(module, scale, finite)
        skip = self.scaler.record_step(self, finite, scaled=carried and self.scaler.scales(dtype))
        return self._after_record(skip, dtype)

    def begin_early(self, module: Module) -> Optional[early_update.Early]:
        """Start a step whose update runs before its verdict (:mod:`.early_update`), or None
        (nothing started) where it must wait: :meth:`end_step` then."""
        dtype = self._step[0] if self._step is not None else "float32"
        if not self.scaler.checks(dtype, self.scaler.scales(dtype)):
            return None  # nothing to wait for: end_step records it unchecked
        early = early_update.begin_module(module, self._plans)
        if early is not None:
            steps = self.scaler.steps_of(self)
            dtype, _, carried = self._close_step()
            self._pending = (dtype, carried, steps)
        return early

    def finish_early(self, early: early_update.Early) -> bool:
        """After the update of a step begun by :meth:`begin_early`: read its verdict, undo a
        skipped step's update, record it; True when it was skipped."""
        dtype, carried, _ = self._pending
        finite = early.finite()
        if not finite:
            early.undo()
        skip = self.scaler.record_step(self, finite, scaled=carried and self.scaler.scales(dtype))  # the commit
        self._pending = None
        return self._after_record(skip, dtype)

    def abort_early(self, early: early_update.Early) -> None:
        """The step begun early raised (a Ctrl-C included): if it was not recorded, it did not
        happen (its update is undone; a shared round does not wait for it)."""
        pending, self._pending = self._pending, None
        if pending is not None and self.scaler.steps_of(self) == pending[2]:
            early.undo()
            self.scaler.abandon(self, pending[2])

    def _close_step(self) -> Tuple[str, float, bool]:
        """The ending step's compute dtype, scale, and whether its gradients carry it; sets
        what its update divides them by."""
        dtype, scale = self._step if self._step is not None else ("float32", 1.0)
        carried = self._carried and scale != 1.0
        self._step, self._carried = None, False
        self._unscale = scale if carried else 1.0
        return dtype, scale, carried

    def _after_record(self, skip: bool, dtype: str) -> bool:
        if skip and dtype != "float16":
            self.warn_once("skip", f"gluon_amp: a Module training step was skipped for inf/NaN gradients while "
                           f"its graph computes in {dtype}, whose exponent range is float32's: the loss scale "
                           "is not the cause. Check the data, the loss and the learning rate. (Said once.)")
        if skip and self.scaler.collapsed():
            raise RuntimeError(
                f"{self.scaler.state.consecutive_skips} Module steps in a row had non-finite gradients "
                f"(loss scale now {self.scaler.scale_for(dtype):g}); this is not an fp16 range problem. "
                "Check the learning rate, the data and the loss, or raise max_consecutive_skips.")
        return skip


# What gluon_amp knows of each Module lives in state (state.module_record, state.process.modules,
# state.process.modules_auto, state.thread.bucket_hook): one home, one reset. Kept here: the
# bookkeeping of the method patches (the saved originals, who holds them, their lock), which
# follows what MXNet's classes hold and must survive a state.reset().


def _record(module: Any) -> Optional[state.ModuleRecord]:
    """``module``'s record if it has one (none is made)."""
    return state.process.modules.get(module)


# -- the graph the executors run --------------------------------------------------------

def _graph_dtype(graph: Dict[str, Any], descs: Any) -> str:
    """float16 where the graph casts to it or holds it (an argument's dtype, a cast's
    target), else bfloat16 likewise, else float32: the dtype whose range the gradients pass."""
    seen = set()
    for node in graph["nodes"]:
        attrs = node.get("attrs") or {}
        if node["op"] in ("amp_cast", "Cast", "cast") and attrs.get("dtype") in _LOW:
            seen.add(attrs["dtype"])
        flag = attrs.get("__dtype__")
        if flag in ("2", "12"):
            seen.add("float16" if flag == "2" else "bfloat16")
    for d in descs or ():
        name = _safe_dtype(getattr(d, "dtype", None))
        if name in _LOW:
            seen.add(name)
    return next((d for d in _LOW if d in seen), "float32")


def _ran_dtype(module: Module, planned: str) -> str:
    """``planned`` (the dtype of the graph the module was bound with), or float32 where its
    executors run a graph with no cast and no rounding at all: ``init``'s per-graph verdict
    bound the plan as its float32 graph (:func:`gluon_amp.execution._bound_verdict`)."""
    graphs = mxm.bound_symbols(module)
    if planned == "float32" or not graphs:
        return planned
    nodes = mxi.symbol_graph(graphs[0])["nodes"]
    if any(n["op"] in ("amp_cast", "amp_multicast", "Cast", "cast") or ROUND_SUFFIX in n["name"] for n in nodes):
        return planned
    return "float32"


def _safe_dtype(dtype: Any) -> Optional[str]:
    try:
        return dtype_name(dtype) if dtype is not None else None
    except (TypeError, ValueError):
        return None


def _descs(shapes: List[Any]) -> List[mx.io.DataDesc]:
    """``bind``'s data and label shapes as the ``DataDesc`` MXNet makes of them: a
    ``(name, shape)`` pair is float32, as Module binds it (toy_nce.py's label iterator gives
    pairs; left out, an Embedding reading that label cannot be typed). An entry MXNet would
    refuse is left to its own bind to refuse."""
    out = []
    for d in shapes:
        if not isinstance(d, mx.io.DataDesc):
            try:
                d = mx.io.DataDesc(*d)
            except (TypeError, ValueError):
                continue
        out.append(d)
    return out


def _in_graph(scaler: Optional[LossScaler], dtype: str, grad_req: Any) -> bool:
    """Whether a bound graph computing in ``dtype`` takes the scale inside it (the scaled
    identity before each loss head). A float16 graph does: its gradients need the scale on
    their way through it. So does one whose gradients accumulate (``grad_req='add'``), or whose
    scaler, known at bind, scales ``dtype``. Elsewhere (the default scaler on a bfloat16 or
    float32 graph) the identity would only cost time (toy_softmax.py's emulated bfloat16 step:
    1.8x FP32's with it, 1.1-1.3x without; benchmarks/module_head.py). Should such a step be
    scaled after all (a scaler attached or changed after bind), its gradients are multiplied
    after the backward pass (:func:`_scale_after`): a power of two, exact in the float32 range
    those graphs have."""
    reqs = grad_req.values() if isinstance(grad_req, dict) else [grad_req] if isinstance(grad_req, str) else grad_req
    return (dtype == "float16" or "add" in list(reqs or ())
            or (scaler if scaler is not None else LossScaler.where_needed()).scales(dtype))


def _scaled_symbol(symbol: mx.sym.Symbol, descs: Any, scaler: Optional[LossScaler] = None,
                   grad_req: Any = "write", cpu: bool = True,
                   unscaled: bool = False) -> Tuple[mx.sym.Symbol, List[str], str, bool]:
    """``symbol`` with its loss heads reachable by the scale argument where :func:`_in_graph`
    says so (never where ``unscaled``); the heads; the dtype; whether the identity is in it.
    On CPUs (``cpu``) the identity multiplies elementwise where it can
    (:mod:`gluon_amp_core.loss_heads`: faster there, for a buffer of the head input's size);
    elsewhere by ``broadcast_mul``."""
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    dtype = _graph_dtype(graph, descs)
    if unscaled or not _in_graph(scaler, dtype, grad_req):
        nodes = graph["nodes"]
        heads = [nodes[i]["name"] for i in loss_heads(graph, GRAPH_LOSS_HEADS) if nodes[i]["inputs"]]
        return symbol, heads, dtype, False
    names = [n["name"] for n in graph["nodes"]]
    shapes = infer_shapes(symbol, {d.name: tuple(d.shape) for d in descs or ()})

    def input_rank(node: int, output: int) -> Optional[int]:
        shape = shapes.get((names[node], output))
        return len(shape) if shape and cpu else None

    input_dtype = None
    if dtype != "float32":  # a head's input may be low precision: the scaled identity casts around it
        known = {d.name: _safe_dtype(d.dtype) for d in descs or () if _safe_dtype(getattr(d, "dtype", None))}
        typed = infer_dtypes(symbol, known, partial=True) or {}

        def input_dtype(node: int, output: int) -> Optional[str]:
            return typed.get((names[node], output))
    new, heads = scale_loss_heads(graph, GRAPH_LOSS_HEADS, SCALE_ARG, input_dtype, input_rank)
    if not heads:
        return symbol, [], dtype, False
    # a converter's graph (emulate=True, say) keeps its converter's policy where it is bound
    return execution.carry_converted(symbol, mx.sym.load_json(json.dumps(new))), heads, dtype, True


# -- the wrapped Module methods -----------------------------------------------------------

def _wrap_bind(original: Callable) -> Callable:
    def bind(self: Module, *args: Any, **kwargs: Any) -> Any:
        a = mxm.call_arguments(original, (self, *args), kwargs)
        before = state.thread.binding_module
        # a bucket binds on its default bucket's memory: what the bind says, it says once for all
        state.thread.binding_module = a["shared_module"] if a["shared_module"] is not None else self
        try:
            return _bind(original, self, a, args, kwargs)
        finally:
            state.thread.binding_module = before
    return bind


def _bind(original: Callable, self: Module, a: Dict[str, Any], args: tuple, kwargs: Dict[str, Any]) -> Any:
    """``Module.bind`` under gluon_amp, its arguments by name ``a``: with the scaled graph where
    the module trains with loss scaling."""
    record = state.module_record(self)
    shared = a["shared_module"]
    if record.hook is None:
        theirs = _record(shared) if shared is not None else None
        inherited = theirs.hook if theirs is not None else None
        record.hook = inherited or state.thread.bucket_hook
    if ((self.binded and not a["force_rebind"]) or not a["for_training"]
            or not (record.hook or state.process.modules_auto)):
        if a["force_rebind"] or not self.binded:
            record.bound_scaled, record.scale_arg = False, None
        return original(self, *args, **kwargs)
    symbol, heads, dtype, inside = _bound_graph(self, record, record.hook, a)
    with mxm.binding_symbol(self, symbol):
        result = original(self, *args, **kwargs)
    record.bound_scaled, record.heads, record.dtype = True, heads, _ran_dtype(self, dtype)
    record.scale_arg = SCALE_ARG if inside else None
    record.forward_scale = None
    if record.scale_arg is not None:
        _write_scale(self, record, 1.0)  # MXNet leaves a new argument uninitialised
    return result


def _bound_graph(module: Module, record: state.ModuleRecord, hook: Optional[ModuleHook],
                 arguments: Dict[str, Any]) -> Tuple[mx.sym.Symbol, List[str], str, bool]:
    """What a training ``bind`` of ``module`` with ``arguments`` (``bind``'s, by name) gives its
    executors under ``hook``: :func:`_scaled_symbol`'s symbol, heads, dtype and whether the
    identity is in it. Marks an SVRGModule and its auxiliary module mixed."""
    descs = _descs(list(arguments["data_shapes"] or []) + list(arguments["label_shapes"] or []))
    for aux in mxm.auxiliary_modules(module):  # bound by this module's own bind, after it
        record.mixed = state.module_record(aux).mixed = True
    return _scaled_symbol(
        mxm.module_symbol(module), descs, hook.scaler if hook is not None else None, arguments["grad_req"],
        cpu=all(c.device_type == "cpu" for c in mxm.module_contexts(module)), unscaled=record.mixed)


def _write_scale(module: Module, record: state.ModuleRecord, value: float) -> None:
    for ex in mxm.module_executors(module):
        arr = ex.arg_dict.get(record.scale_arg)
        if arr is not None:
            arr[:] = value
    record.arg_value = value


def _scale_after(module: Module, scale: float) -> None:
    """Multiply the gradients one backward pass wrote (parameters' and inputs') by ``scale``,
    as if the loss heads had carried it (a graph bound without the scaled identity, whose
    gradients do not accumulate: :func:`_in_graph`)."""
    with autograd.pause():
        for g in mxm.module_grad_arrays(module) + mxm.module_input_grads(module):
            g *= scale


def _wrap_forward(original: Callable) -> Callable:
    def forward(self: Module, data_batch: Any, is_train: Optional[bool] = None) -> Any:
        record = _record(self)
        if record is not None and record.scale_arg is not None and (
                is_train if is_train is not None else self.for_training):
            if record.hook is not None:
                # on CPUs the identity broadcasts the scale in the forward pass: it holds the step's now
                _write_scale(self, record, record.hook.decide(record.dtype))
            record.forward_scale = record.arg_value
        return original(self, data_batch, is_train)
    return forward


def _carried_by(out_grads: Any) -> Optional[float]:
    """The scale ``out_grads`` carry where every one of them is an input gradient a scaled
    module's backward pass wrote (a SequentialModule hands each stage the next one's); else None."""
    grads = out_grads if isinstance(out_grads, (list, tuple)) else [out_grads]
    scales = set()
    for g in grads:
        found = next((s for record in list(state.process.modules.values())
                      for a, s in record.input_grads if a is g), None)
        if found is None:
            return None
        scales.add(found)
    return scales.pop() if len(scales) == 1 else None


def _carrier(out_grads: Any) -> Optional[state.ModuleRecord]:
    """The record of the module whose last backward pass wrote every one of ``out_grads`` as
    its input gradients (a SequentialModule hands each stage the next one's), or None."""
    grads = out_grads if isinstance(out_grads, (list, tuple)) else [out_grads]
    for record in list(state.process.modules.values()):
        if grads and all(any(a is g for a, _ in record.input_grads) for g in grads):
            return record
    return None


def _share_carried_scaler(module: Module, out_grads: Any) -> None:
    """Give a module without a scaler, fed as ``out_grads`` the input gradients of a module with
    one (a SequentialModule's stage before the one holding the loss), that module's scaler: those
    gradients carry its scale, which this module's update must divide out, and a step that
    overflowed under it must be skipped here too. Without it the update was ``scale`` times too
    large. This backward pass is the first place the link shows; it binds nothing (mid-step, a
    bind would drop the forward pass), and where the module would need the scale argument bound
    in (loss heads of its own), it is refused before anything runs."""
    source = _carrier(out_grads)
    if source is None or source.hook is None or not module.for_training:
        return
    if not _attach(module, ModuleHook(source.hook.scaler, auto=True), can_bind=False):
        outputs = ", ".join(module.output_names)
        raise RuntimeError(
            f"gluon_amp: the Module with outputs [{outputs}] has no loss scaler, and backward got out_grads "
            f"carrying another Module's loss scale ({source.hook.loss_scale:g}); it has loss heads of its own, so it "
            "cannot join that scaler in the middle of a step. Before this step, give it the same scaler: "
            "gluon_amp.init_trainer(this_module, gluon_amp.get_scaler(the_module_fed_the_loss)).")


def _times(out_grads: Any, factor: float) -> Any:
    if factor == 1.0:
        return out_grads
    return [g * factor for g in (out_grads if isinstance(out_grads, (list, tuple)) else [out_grads])]


def _wrap_backward(original: Callable) -> Callable:
    def backward(self: Module, out_grads: Any = None) -> Any:
        record = _record(self)
        if out_grads is not None and (record is None or record.hook is None):
            _share_carried_scaler(self, out_grads)
            record = _record(self)
        if record is None or not record.bound_scaled:
            return original(self, out_grads)
        hook = record.hook
        carried_in = _carried_by(out_grads) if out_grads is not None else None
        if hook is not None and hook._step is None:
            if record.scale_arg is not None and record.forward_scale is not None:
                # attached after this step's forward pass: its gradients carry what that pass read
                # (on CPUs the identity broadcast it then; elsewhere the backward reads the same)
                hook._step = (record.dtype, record.forward_scale)
            elif carried_in is not None and not record.heads:
                # out_grads from the next stage carry its scale already: this step carries the same
                hook._step = (record.dtype, carried_in)
        scale = hook.decide(record.dtype) if hook is not None else 1.0
        if record.scale_arg is not None:
            _write_scale(self, record, scale)  # also where no hook: the argument must hold 1
        elif scale != 1.0 and record.heads:  # scaled after all, without the identity: after the pass
            result = original(self, _times(out_grads, 1.0 / carried_in) if carried_in else out_grads)
            _scale_after(self, scale)
            hook._carried = True
            _note_input_grads(self, record, scale)
            return result
        if out_grads is not None:
            out_grads = _times(out_grads, scale / carried_in if carried_in else scale)
        carried = record.scale_arg is not None or out_grads is not None
        if hook is not None:
            hook._carried = hook._carried or carried
            if not carried and scale != 1.0:
                hook.warn_once("heads", f"gluon_amp: this Module's graph has no loss head gluon_amp can scale "
                               f"(outputs of {', '.join(GRAPH_LOSS_HEADS)}) and backward got no out_grads: its "
                               "steps are checked for inf/NaN but not scaled.")
        result = original(self, out_grads)
        _note_input_grads(self, record, scale if carried else 1.0)
        return result
    return backward


def _note_input_grads(module: Module, record: state.ModuleRecord, scale: float) -> None:
    record.input_grads = [(g, scale) for g in mxm.module_input_grads(module)]


def _wrap_get_input_grads(original: Callable) -> Callable:
    def get_input_grads(self: Module, merge_multi_context: bool = True) -> Any:
        result = original(self, merge_multi_context)
        record = _record(self)
        if record is not None and record.input_grads and merge_multi_context:
            scale = record.input_grads[0][1]  # merged copies carry what the arrays carry
            known = {id(a) for a, _ in record.input_grads}
            record.input_grads = record.input_grads + [(g, scale) for g in result if id(g) not in known]
        return result
    return get_input_grads


def _wrap_sequential_init_optimizer(original: Callable) -> Callable:
    def init_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # init's default scaler, one per stage, becomes one shared by the stages: the scale a
        # stage's input gradients carry is the one the stage before it steps with, and an
        # overflow anywhere moves it for all (one round per update of every stage). Only where
        # they do not share one yet: MXNet ignores a later call (every later fit()), and a new
        # scaler there would drop the shared one's state (the scale, its counts, a load_states)
        stages = {m: r.hook.scaler for m in mxm.sequential_modules(self)
                  if (r := _record(m)) is not None and r.hook is not None and r.hook.auto}
        if len({id(s) for s in stages.values()}) > 1:
            shared = LossScaler.where_needed()
            for m in stages:
                _attach(m, ModuleHook(shared, auto=True))
        return result
    return init_optimizer


def _wrap_update(original: Callable) -> Callable:
    def update(self: Module) -> Any:
        record = _record(self)
        hook = record.hook if record is not None else None
        if hook is None:
            return original(self)
        early = hook.begin_early(self)
        if early is None:
            if hook.end_step(self):
                return None  # skipped: nothing of the optimizer runs
            return _unscaled(original, self, hook._unscale)
        try:
            _unscaled(original, self, hook._unscale)
            hook.finish_early(early)
        except BaseException:
            hook.abort_early(early)
            raise
        return None
    return update


def _unscaled(update: Callable, module: Module, unscale: float) -> Any:
    """Run MXNet's ``update`` dividing this step's gradients by ``unscale`` as well: through
    ``rescale_grad``, or, where that would fall below float16's smallest normal value for an
    update MXNet runs in float16 (a float16 weight without a master copy, whose kernels take
    ``rescale_grad`` as a float16 value: 0, every step lost), in the gradients themselves."""
    if unscale == 1.0:
        return update(module)
    opt = mxm.updating_optimizer(mxm.module_optimizer(module))  # not a wrapper's (Horovod's)
    before = opt.rescale_grad
    if before / unscale < FLOAT16_SMALLEST_NORMAL and not getattr(opt, "multi_precision", False):
        found = mxm.module_update_arrays(module)
        if found is not None and any(dtype_name(w.dtype) == "float16" for w in found[0]):
            with autograd.pause():
                for g in found[1]:
                    mx.nd.amp_cast(mx.nd.amp_cast(g, dtype="float32") / unscale, dtype=g.dtype, out=g)
            return update(module)
    opt.rescale_grad = before / unscale
    try:
        return update(module)
    finally:
        opt.rescale_grad = before


def _wrap_init_optimizer(original: Callable) -> Callable:
    def init_optimizer(self: Module, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        record = state.module_record(self)
        if record.hook is not None:
            _refuse_dist(self, record.hook.auto)
        elif state.process.modules_auto and self.optimizer_initialized and self.binded and self.for_training:
            if _refuse_dist(self, auto=True):
                _attach(self, ModuleHook(_checking_only(self) if mxm.auxiliary_modules(self)
                                         else LossScaler.where_needed(), auto=True))
        return result
    return init_optimizer


def _wrap_borrow_optimizer(original: Callable) -> Callable:
    def borrow_optimizer(self: Module, shared_module: Module) -> Any:
        result = original(self, shared_module)
        theirs = _record(shared_module)
        if theirs is not None and theirs.hook is not None and state.module_record(self).hook is not theirs.hook:
            _attach(self, theirs.hook)
        return result
    return borrow_optimizer


def _wrap_bucketing_bind(original: Callable) -> Callable:
    def bind(self: BucketingModule, *args: Any, **kwargs: Any) -> Any:
        record = _record(self)
        state.thread.bucket_hook = record.hook if record is not None else None
        try:
            return original(self, *args, **kwargs)
        finally:
            state.thread.bucket_hook = None
    return bind


def _refuse_dist(module: Module, auto: bool) -> bool:
    """True where ``module``'s kvstore lets it be scaled; else False (auto: with a warning) or
    RuntimeError. On a ``dist_*`` kvstore the workers agree on each skip before they push
    (:func:`~gluon_amp.training.distributed.agree_module_finite`), and the update must run on
    them: an optimizer on the servers is a pickled copy whose ``rescale_grad`` cannot unscale."""
    kv = mxm.module_kvstore(module)
    if kv is None or "dist" not in kv.type:
        return True
    if mxm.optimizer_on_server(module):
        why = ("its optimizer runs on the kvstore's servers (update_on_kvstore), where a step can be neither "
               "skipped nor unscaled; set MXNET_UPDATE_ON_KVSTORE=0 in the environment of every worker "
               "before init_optimizer/fit, so that the workers update (MXNet then pushes and pulls gradients)")
    elif "async" in kv.type:
        why = ("asynchronous workers never meet at a step, so they cannot agree to skip one; use "
               "dist_sync or dist_device_sync")
    elif mxm.module_compression(module):
        why = (f"its gradient compression ({mxm.module_compression(module)!r}) turns the inf/NaN the overflow "
               "check looks for into +-threshold; create the Module's optimizer without compression_params")
    else:
        return True
    message = (f"gluon_amp: loss scaling of a Module on kvstore {kv.type!r} cannot work: {why}. Or use a "
               "Gluon Trainer with gluon_amp.init_trainer.")
    if auto:
        warnings.warn(message + " This Module trains without loss scaling.", RuntimeWarning,
                      stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))
        return False
    raise RuntimeError(message)


def _patch() -> List[mxm.MethodPatch]:
    module = mxm.patch_methods(Module, {"bind": _wrap_bind, "forward": _wrap_forward, "backward": _wrap_backward,
                                        "update": _wrap_update,
                                        "init_optimizer": _wrap_init_optimizer,
                                        "borrow_optimizer": _wrap_borrow_optimizer,
                                        "get_input_grads": _wrap_get_input_grads})
    done = list(module)
    try:
        done += mxm.patch_methods(BucketingModule, {"bind": _wrap_bucketing_bind})
        done += mxm.patch_methods(mxm.SequentialModule, {"init_optimizer": _wrap_sequential_init_optimizer})
        mxi.warning_sites.hold(done)  # MXNet's Module warnings name its caller, not these wrappers
        return done
    except BaseException:  # all or nothing (a Ctrl-C included): else the next init wraps the wrappers
        mxi.warning_sites.release(done)
        mxm.restore_methods(done)
        raise


def _unpatch(patches: List[mxm.MethodPatch]) -> None:
    mxi.warning_sites.release(patches)
    changed = mxm.restore_methods(patches)
    if changed:
        warnings.warn(f"gluon_amp: {', '.join(changed)} were changed by someone else while patched "
                      "and are left as they are now, not restored", RuntimeWarning,
                      stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))


#: Module's and BucketingModule's methods, patched while anyone holds them (``init``, an
#: explicit ``init_trainer(module)``)
_patches = state.Held(_patch, _unpatch)
_install, _release = _patches.hold, _patches.release


def _on_init(policy: Any) -> None:
    _install("init")
    state.process.modules_auto = True


def _on_disable() -> None:
    state.process.modules_auto = False
    with state.lock:
        for module, record in list(state.process.modules.items()):
            if record.hook is not None and record.hook.auto:
                record.hook = None  # init's default scaler goes with init; explicit ones stay
            if record.hook is None and record.scale_arg is not None:
                _write_scale(module, record, 1.0)  # unpatched backward: gradients as MXNet's
    _release("init")


def _forget() -> None:
    """Release the patches explicit scalers and ``init`` needed (test isolation: :func:`state.reset`
    has dropped every module's record, and so its scaler; a ``disable`` an exception cut short
    leaves no policy to turn off, and Module's methods must come back all the same)."""
    _release("explicit")
    _release("init")


state.register_extension(state.Extension(_on_init, _on_disable, _forget))


# -- the public side -------------------------------------------------------------------------

def is_module(obj: Any) -> bool:
    return isinstance(obj, (Module, BucketingModule))


def _attach(module: Module, hook: ModuleHook, shared_module: Optional[Module] = None, can_bind: bool = True) -> bool:
    """Give ``module`` the hook; bind it again (on ``shared_module``'s memory, a bucket) only
    where the graph its executors need differs from the one they run: one with the scale
    argument. Elsewhere (no loss head, a graph bound as the user's under this scaler, an
    SVRGModule, which MXNet 1.9.1 cannot bind again) nothing is bound. If the bind raises,
    ``module`` keeps the hook it had; without ``can_bind``, where it would need one, nothing
    changes and False is returned."""
    record = state.module_record(module)
    if module.binded and module.for_training and not record.bound_scaled:
        _, heads, dtype, inside = _bound_graph(module, record, hook, mxm.bind_arguments(module))
        if inside and not can_bind:
            return False
        if inside:
            before, record.hook = record.hook, hook  # the bind reads it
            try:
                mxm.rebind(module, shared_module=shared_module)
            except BaseException:
                record.hook = before
                raise
            return True
        # the executors run what a bind would give them: record it as one
        record.bound_scaled, record.heads, record.dtype = True, heads, _ran_dtype(module, dtype)
        record.scale_arg, record.forward_scale = None, None
    record.hook = hook
    return True


def init_module(module: Union[Module, BucketingModule],
                loss_scale: Union[str, float, LossScaler, None] = "dynamic") -> LossScaler:
    """Attach dynamic loss scaling to a ``Module`` or ``BucketingModule``; return its scaler.

    Call it before or after ``bind``/``init_optimizer``/``fit`` (a bound module is bound
    again, keeping its weights and optimizer). ``loss_scale`` as for
    :func:`gluon_amp.init_trainer`: ``'dynamic'`` scales float16 graphs (real or emulated)
    and checks and skips inf/NaN steps in any dtype.
    """
    if not is_module(module):
        raise TypeError(f"init_module expects a mxnet.mod.Module or BucketingModule, got {type(module).__name__}")
    scaler = loss_scaler_from(loss_scale)  # first: a bad argument is a ValueError, attached or not
    existing = attached_scaler(module)
    if existing is not None and not _hook_of(module).auto:
        had = _hook_of(module)
        if asks_for(existing, had.requested, loss_scale):
            return existing  # asked again as before: the scaler it has, its scale kept
        raise RuntimeError(f"this Module already has a loss scaler (from loss_scale={had.requested!r}), and "
                           f"loss_scale={loss_scale!r} asks for another; use gluon_amp.get_scaler(module) to "
                           "read or change the one it has")
    if mxm.auxiliary_modules(module):
        if isinstance(loss_scale, str) and loss_scale == "dynamic":
            scaler = _checking_only(module)
        elif scaler.enabled and scaler.scaled_dtypes != frozenset():
            raise ValueError(
                f"init_trainer: {type(module).__name__} mixes the gradients of its auxiliary module (taken at "
                f"other steps) into its own, so a loss scale cannot be divided out of them; got loss_scale="
                f"{loss_scale!r}. Pass 'dynamic' (checks and skips inf/NaN steps, scales none) or None.")
    for mod in _modules_of(module):  # before anything is attached: a refused module is left as it was
        if mxm.module_kvstore(mod) is not None:
            _refuse_dist(mod, auto=False)
    hook = ModuleHook(scaler)
    hook.requested = loss_scale
    _install("explicit")
    # all or nothing: if a bind raises (a Ctrl-C included), every module keeps the hook it had
    owners = [module, *_modules_of(module)] if isinstance(module, BucketingModule) else [module]
    before = [(record, record.hook) for record in map(state.module_record, owners)]
    try:
        if isinstance(module, BucketingModule):
            state.module_record(module).hook = hook
            default, buckets = mxm.bucket_modules(module)
            if default in buckets:
                _attach(buckets[default], hook)
            for key, mod in buckets.items():
                if key != default:
                    _attach(mod, hook, shared_module=buckets[default])
        else:
            _attach(module, hook)
    except BaseException:
        hook._dropped = True
        for record, had in before:
            record.hook = had
        if not any(r.hook is not None and not r.hook.auto for r in list(state.process.modules.values())):
            _release("explicit")
        raise
    return scaler


def _checking_only(module: Module) -> LossScaler:
    """The default scaler of a module that mixes another module's gradients into its own (an
    SVRGModule): checks and skips float16 steps on inf/NaN, scales none (one scale cannot be divided out
    of gradients taken at other steps, at other scales). Said once where it costs range."""
    if state.module_record(module).dtype == "float16":
        warnings.warn(
            f"gluon_amp: {type(module).__name__} mixes the gradients of its auxiliary module into its own, "
            "so its float16 steps are not loss-scaled (small gradients may flush to zero); they are still "
            "checked, and skipped on inf/NaN.", RuntimeWarning, stacklevel=state.outside_level((mxi.MXNET_PACKAGE,)))
    return LossScaler(scaled_dtypes=())


def _modules_of(module: Union[Module, BucketingModule]) -> List[Module]:
    if isinstance(module, BucketingModule):
        return list(mxm.bucket_modules(module)[1].values())
    return [module]


def _hook_of(module: Union[Module, BucketingModule]) -> Optional[ModuleHook]:
    if isinstance(module, BucketingModule):
        record = _record(module)
        if record is not None and record.hook is not None:
            return record.hook
    for mod in _modules_of(module):
        record = _record(mod)
        if record is not None and record.hook is not None:
            return record.hook
    return None


def attached_scaler(module: Any) -> Optional[LossScaler]:
    hook = _hook_of(module) if is_module(module) else None
    return hook.scaler if hook is not None else None


def _checked_hook(module: Any, caller: str) -> ModuleHook:
    hook = _hook_of(module)
    if hook is None:
        raise RuntimeError(f"{caller}: this Module has no loss scaler; call gluon_amp.init_trainer(module) first.")
    return hook


def _optimizer_module(module: Union[Module, BucketingModule], caller: str) -> Module:
    mods = [m for m in _modules_of(module) if m.optimizer_initialized]
    if not mods:
        raise RuntimeError(f"{caller}: the Module's optimizer is not initialised yet; call init_optimizer "
                           "(or fit) first.")
    return mods[0]


def save_states(module: Union[Module, BucketingModule], fname: str) -> None:
    """Save the module's optimizer state, its optimizer's settings and update counts, and its
    loss scaler, to one file (the format of :func:`gluon_amp.save_states`). With
    ``Module.save_checkpoint`` (the weights) it resumes bit for bit."""
    hook = _checked_hook(module, "save_states")
    mod = _optimizer_module(module, "save_states")
    policy = state.current_policy()
    mode = {"target_dtype": policy.target_dtype if policy else None, "emulate": bool(policy and policy.emulate),
            "master_weights": None, "opt_level": None, "module": True}
    states = mxi.updater_states(mxm.module_updater(mod))
    names = mxm.module_state_names(mod)
    if names is not None:  # states by name (several devices, updated in the kvstore): by index in the file
        position = {name: i for i, name in enumerate(names)}
        held = [k for k, v in states.items() if k not in position and v is not None]
        if held:
            raise RuntimeError(
                f"save_states: the Module's kvstore holds optimizer state under {held}, which are not its "
                f"parameters ({names}); gluon_amp cannot tell what they belong to, so it cannot save them. "
                "Save with Module.save_optimizer_states instead (no loss scaler), or update outside the "
                "kvstore (one context).")
        # other keys hold no state (an SVRGModule's '<param>_full': nothing to save)
        states = {position[k]: v for k, v in states.items() if k in position}
    checkpoint.write(fname, {"scaler": hook.scaler.state_dict(), "mode": mode}, states, mxm.module_optimizer(mod),
                     mxm.module_param_specs(mod) if mxm.module_devices(mod) == 1 or names is not None else None)


def load_states(module: Union[Module, BucketingModule], fname: str) -> None:
    """Load what :func:`save_states` wrote into ``module`` (after ``init_optimizer``) and its scaler."""
    hook = _checked_hook(module, "load_states")
    mod = _optimizer_module(module, "load_states")
    # All or nothing, as a Trainer's load: everything is checked before anything changes.
    ck = checkpoint.read(fname)
    if not (ck.meta.get("mode") or {}).get("module"):
        raise checkpoint.CheckpointError(
            f"{fname!r} holds a Gluon Trainer's optimizer state; a Module cannot load it: load it into "
            "the Trainer, or a checkpoint saved from a Module (gluon_amp.save_states(module, ...))")
    scaler = checkpoint.checked_scaler_state(hook.scaler, ck.meta["scaler"], fname)
    names = mxm.module_state_names(mod)
    checkpoint.check_params(ck, fname, mxm.module_param_specs(mod), owner="Module",
                            per_index=1 if names is not None else mxm.module_devices(mod))
    opt = mxm.module_optimizer(mod)
    fields = checkpoint.check_optimizer(opt, ck.meta["optimizer"], fname)
    fields["optimizer"].update(ck.optimizer_arrays(mx.cpu()))
    states = ck.states(mx.cpu())
    updater = mxm.module_updater(mod)
    if names is not None:  # the updater keys its states by name (check_params saw every index in range)
        states = {names[i]: v for i, v in states.items()}
        # keys that are not parameters hold no state (an SVRGModule's '<param>_full'): kept as they are
        states.update((k, v) for k, v in mxi.updater_states(updater).items() if k not in names and v is None)
    undo = checkpoint.Undo(opt, hook.scaler, [])
    before = updater.states, updater.states_synced
    try:
        checkpoint.restore_optimizer(opt, fields)
        mxm.set_module_updater_states(mod, states)
        vars(hook.scaler).update(scaler)
    except BaseException:
        undo(None)
        vars(updater).update(states=before[0], states_synced=before[1])
        raise
