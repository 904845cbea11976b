"""Apex-style opt levels: ``initialize(net, trainer, opt_level)`` for O0-O3.

| level | weights      | op patching | batch norm                  | master weights | loss scale |
|-------|--------------|-------------|-----------------------------|----------------|------------|
| O0    | float32      | off         | float32                     | no             | 1 (static) |
| O1    | float32      | ``init()``  | by the op table             | no             | dynamic    |
| O2    | target dtype | ``init()``  | float32 params and stats    | yes            | dynamic    |
| O3    | target dtype | ``init()``  | computes in the target dtype| no             | 1 (static) |

At O2/O3 the trainable weights are stored in the target dtype, so they are not cast again
every step and their gradients are half the size. MXNet's BatchNorm kernels take float16
and bfloat16 data only with float32 gamma/beta/statistics, so normalisation parameters
stay float32 at every level; ``keep_batchnorm_fp32=True`` makes batch norm compute on
float32 data as well. O2/O3 still run ``init()``'s op table: with the weights already in
the target dtype its casts in front of convolutions are no-ops, and it keeps the ops that
have no usable low-precision kernel in MXNet 1.9 (``transpose`` on bfloat16 corrupts the
heap, ``softmax``...) in float32.
"""
from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Tuple, Union

import mxnet as mx
from mxnet.gluon import Block, Parameter, SymbolBlock, Trainer
from mxnet.gluon.parameter import DeferredInitializationError

from gluon_amp_core.dtypes import FLOAT_DTYPES, LOW_PRECISION_DTYPES, dtype_name
from gluon_amp_core.loss_scale import LossScaler, loss_scaler_from
from gluon_amp_core.policy import Policy

from . import mxnet_internals as mxi, patching, state
from .mxnet_internals import NP_SYMBOL, own_casts, to_mx_dtype, updates_on_kvstore
from .policy_builder import following, make_policy
from .training import master_weights as master_weights_mod, trainer as trainer_mod

__all__ = ["OptLevel", "OPT_LEVELS", "properties", "initialize"]

LossScale = Union[str, float, LossScaler]


@dataclass(frozen=True)
class OptLevel:
    """What one opt level does (after overrides). Immutable; built by :func:`properties`.

    Attributes
    ----------
    name : str
        ``'O0'`` .. ``'O3'``.
    cast_weights : bool
        Trainable weights (outside normalisation layers) are stored in the target dtype,
        inputs are cast to it at the net's entry and outputs back to float32.
    patch_ops : bool
        Run :func:`gluon_amp.init` with the op table.
    keep_batchnorm_fp32 : bool or None
        ``True``: batch norm computes in float32; ``False``: on target-dtype data (with
        float32 parameters); ``None``: as the op table says.
    master_weights : bool
        Keep float32 master copies of the low-precision weights in the optimizer.
    loss_scale : 'dynamic', float or LossScaler
    """

    name: str
    cast_weights: bool
    patch_ops: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: LossScale


OPT_LEVELS = {
    "O0": OptLevel("O0", cast_weights=False, patch_ops=False, keep_batchnorm_fp32=None,
                   master_weights=False, loss_scale=1.0),
    "O1": OptLevel("O1", cast_weights=False, patch_ops=True, keep_batchnorm_fp32=None,
                   master_weights=False, loss_scale="dynamic"),
    "O2": OptLevel("O2", cast_weights=True, patch_ops=True, keep_batchnorm_fp32=None,
                   master_weights=True, loss_scale="dynamic"),
    "O3": OptLevel("O3", cast_weights=True, patch_ops=True, keep_batchnorm_fp32=False,
                   master_weights=False, loss_scale=1.0),
}


def _check_level(opt_level: Any) -> OptLevel:
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return OPT_LEVELS[opt_level]
    hint = ""
    if isinstance(opt_level, str) and opt_level.upper().replace("0", "O", 1) in OPT_LEVELS:
        hint = f" Did you mean {opt_level.upper().replace('0', 'O', 1)!r} (capital letter O)?"
    raise ValueError(f"opt_level={opt_level!r} is not an opt level; choose one of "
                     f"{', '.join(repr(k) for k in OPT_LEVELS)}.{hint}")


def _check_flag(name: str, value: Any) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None (the level's default), got {value!r}")
    return value


def _check_loss_scale(value: Any) -> Optional[LossScale]:
    """``value`` checked by the one parser (:func:`loss_scaler_from`); ``None`` is the level's default."""
    if value is None:
        return None
    try:
        loss_scaler_from(value)
    except ValueError as exc:
        raise ValueError(f"{exc} At an opt level, None means the level's default.") from None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def properties(opt_level: str = "O1", *, keep_batchnorm_fp32: Optional[bool] = None,
               loss_scale: Optional[LossScale] = None,
               master_weights: Optional[bool] = None) -> OptLevel:
    """The :class:`OptLevel` for ``opt_level`` with the given overrides (``None``: default).

    Raises ``ValueError`` for an unknown level, a bad loss scale, or an override that
    contradicts the level (master weights without low-precision weights, batch norm
    settings at O0) and ``TypeError`` for a non-bool flag.
    """
    level = _check_level(opt_level)
    kbn = _check_flag("keep_batchnorm_fp32", keep_batchnorm_fp32)
    mw = _check_flag("master_weights", master_weights)
    scale = _check_loss_scale(loss_scale)
    if kbn is not None and not level.patch_ops:
        raise ValueError(f"keep_batchnorm_fp32={kbn} has no effect at {level.name} (pure float32); "
                         "leave it None, or pick O1-O3.")
    if mw and not level.cast_weights:
        raise ValueError(f"master_weights=True needs low-precision weights (O2 or O3); at "
                         f"{level.name} the weights are float32 already.")
    return replace(level,
                   keep_batchnorm_fp32=level.keep_batchnorm_fp32 if kbn is None else kbn,
                   master_weights=level.master_weights if mw is None else mw,
                   loss_scale=level.loss_scale if scale is None else scale)

_LOW = frozenset(LOW_PRECISION_DTYPES)
_NORM_SUFFIXES = ("gamma", "beta", "running_mean", "running_var", "moving_mean", "moving_var")



def _is_norm_param(param: Parameter) -> bool:
    # The names Gluon's and GluonCV's normalisation layers (and symbols imported into a
    # SymbolBlock) give their parameters; MXNet's own SymbolBlock.cast keys on them too.
    return param.name.endswith(_NORM_SUFFIXES)


def _uninitialized(params: dict, need_shapes: bool) -> list:
    bad = []
    for name, p in params.items():
        if mxi.stored_sparse(p):  # list_data() refuses row_sparse storage, initialized or not
            ready = mxi.sparse_initialized(p)
            if ready is False or (ready is None and need_shapes):
                bad.append(name)
            continue
        try:
            p.list_data()
        except DeferredInitializationError:
            if need_shapes:
                bad.append(name)
        except RuntimeError:
            bad.append(name)
    return bad


def _check_trainer(trainer: Optional[Trainer]) -> None:
    if trainer is None:
        return
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a mxnet.gluon.Trainer or None, got {type(trainer).__name__}")
    if state.trainer_record(trainer).opt_level_done:
        raise RuntimeError("gluon_amp.initialize was already called with this Trainer; call it "
                           "once, with the net and trainer together.")
    if updates_on_kvstore(trainer):
        raise ValueError("initialize needs the update on the worker: create the Trainer with "
                         "update_on_kvstore=False (got update_on_kvstore=True).")
    if mxi.has_optimizer_state(trainer):
        raise RuntimeError("gluon_amp.initialize must come before the first trainer.step() (and "
                           "before trainer.load_states); this Trainer already has optimizer state. "
                           "Build a new Trainer, initialize, then load states.")
    if trainer_mod.attached_scaler(trainer) is not None:
        raise RuntimeError("this Trainer already has a loss scaler from gluon_amp.init_trainer; "
                           "initialize attaches one itself (use its loss_scale argument).")


def _check_net(net: Block, level: OptLevel) -> None:
    if not isinstance(net, Block):
        raise TypeError(f"net must be a mxnet.gluon.Block, got {type(net).__name__}")
    if net in state.process.done:
        raise RuntimeError("gluon_amp.initialize was already called with this net; call it once.")
    bad = _uninitialized(net.collect_params(), need_shapes=level.cast_weights)
    if bad:
        shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise RuntimeError(
            f"{len(bad)} parameter(s) of the net are not initialized yet: {shown}. Call "
            "net.initialize() first" + (" and, for shapes inferred from data (deferred "
            "initialization), run one forward pass or give in_units/in_channels, so the "
            f"weights exist to be cast at {level.name}." if level.cast_weights else "."))


def _to_cast(net: Block, dtype: str) -> List[Parameter]:
    """The parameters the level stores in ``dtype``: trainable, not normalisation, float32."""
    return [p for p in net.collect_params().values()
            if p.grad_req != "null" and not _is_norm_param(p) and dtype_name(p.dtype) == "float32"]


def _check_storable(net: Block, level: OptLevel, dtype: str) -> None:
    """MXNet 1.9.1 holds no bfloat16 in numpy-mode (``mx.np``) arrays nor in sparse ones: casting
    such weights failed half-way with MXNet's ``KeyError: <class 'numpy.void'>``, AMP on and some
    weights cast. Say so before anything changes."""
    if dtype != "bfloat16":
        return
    params = _to_cast(net, dtype)
    numpy_mode = [p.name for p in params if any(isinstance(a, mx.np.ndarray) for a in p.list_data())]
    if numpy_mode:
        raise ValueError(
            f"{level.name} with bfloat16 stores the weights in bfloat16, and MXNet 1.9.1's numpy-mode arrays "
            f"(npx.set_np()) have no bfloat16: {', '.join(numpy_mode[:3])}{' ...' if len(numpy_mode) > 3 else ''} "
            "are mx.np arrays. Use opt_level 'O1' (float32 weights, bfloat16 ops), or build the net "
            "outside numpy mode.")
    sparse = [p.name for p in params
              if any(a.stype != "default" for a in p.list_data() + (p.list_grad() if p.grad_req != "null" else []))]
    if sparse:
        raise ValueError(
            f"{level.name} with bfloat16 stores the weights in bfloat16, and MXNet 1.9.1 has no bfloat16 sparse "
            f"arrays: {', '.join(sparse)} {'has' if len(sparse) == 1 else 'have'} sparse storage or gradients "
            "(e.g. Embedding(sparse_grad=True)). Use opt_level 'O1', or give those layers dense gradients.")


def _cast_tree(x: Any, dtype: str, sources: frozenset) -> Any:
    """Cast every NDArray in ``x`` (nested lists/tuples) whose dtype is in ``sources`` to
    ``dtype``; Symbols (dtype unknown while tracing) always get a cast node."""
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_tree(v, dtype, sources) for v in x)
    if isinstance(x, mx.nd.NDArray):
        name = dtype_name(mxi.legacy(x).dtype)
        if name not in sources or name == dtype:
            return x
        if name == "float64" and dtype in _LOW:  # oneDNN's amp_cast has no float64 ("unknown type for MKLDNN")
            x = x.astype("float32")
        return mxi.cast_array(x, dtype)
    if isinstance(x, mx.sym.Symbol):  # traced inside a parent's hybridized graph
        is_np = isinstance(x, NP_SYMBOL)
        out = mx.sym.amp_cast(x.as_nd_ndarray() if is_np else x, dtype=to_mx_dtype(dtype))
        return out.as_np_ndarray() if is_np else out
    return x


#: the integers each low dtype holds exactly: up to 2 ** (its significand's bits)
_EXACT_INTEGERS = {"bfloat16": 2.0 ** 8, "float16": 2.0 ** 11}


def _entry_cast(x: Any, dtype: str) -> Any:
    """``x`` (the net's arguments, nested) with its float inputs in ``dtype``, except float32
    arrays of integers ``dtype`` cannot hold (:func:`_holds_inexact_integers`)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_entry_cast(v, dtype) for v in x)
    if isinstance(x, mx.nd.NDArray) and _holds_inexact_integers(x, dtype):
        return x
    return _cast_tree(x, dtype, FLOAT_DTYPES)


def _holds_inexact_integers(x: mx.nd.NDArray, dtype: str) -> bool:
    """Whether float32 ``x`` holds only integers, some beyond what ``dtype`` holds exactly:
    token ids, sequence lengths, positions. MXNet code feeds them as float32 (``nd.array``'s
    default); cast to bfloat16, ``valid_length`` 257 became 256 and 259 became 260, and an
    unrolled LSTM masked the wrong steps. The ops that read them cast them as the op table says."""
    limit = _EXACT_INTEGERS.get(dtype)
    a = mxi.legacy(x)
    if limit is None or dtype_name(a.dtype) != "float32" or a.size == 0:
        return False
    with mx.autograd.pause():
        if float(mx.nd.max(mx.nd.abs(a)).asscalar()) <= limit:
            return False
        return bool(mx.nd.min(a == mx.nd.round(a)).asscalar())


def _boundary_forward(forward: Callable, dtype: str) -> Callable:
    """Float inputs to ``dtype`` at the entry (integers it cannot hold left float32),
    low-precision outputs back to float32."""
    def amp_boundary_forward(self: Block, *args: Any) -> Any:
        out = forward(*_entry_cast(args, dtype))
        return _cast_tree(out, "float32", _LOW)
    return amp_boundary_forward


def _cast_weights(net: Block, dtype: str) -> int:
    """Cast the net's trainable, non-normalisation parameters to ``dtype``; return how many."""
    n = 0
    with own_casts():  # the level's own storage, not a script's GPU-only cast (patching/low_cast.py)
        for p in _to_cast(net, dtype):
            # MXNet 1.9.1: astype of a weight held in a oneDNN layout (after a forward pass) to
            # another dtype fails, or corrupts the heap under the threaded engine. A float32
            # copy first brings it back to the default layout.
            p.cast("float32")
            p.cast(to_mx_dtype(dtype))
            n += 1
    return n


def _warn_frozen_graphs(net: Block) -> None:
    """O1 patches op functions: a SymbolBlock's graph was composed before, and stays float32."""
    frozen: list = []
    net.apply(lambda b: frozen.append(b.name) if isinstance(b, SymbolBlock) else None)
    if frozen:
        shown = ", ".join(frozen[:5]) + (" ..." if len(frozen) > 5 else "")
        warnings.warn(
            f"O1: {len(frozen)} SymbolBlock(s) in the net ({shown}) composed their graph before "
            "gluon_amp.initialize and will run in float32 (GluonCV's SSD backbone is one). Call "
            "gluon_amp.init() before building the net, or use O2, whose low-precision weights "
            "carry such graphs along.", RuntimeWarning, stacklevel=3)


def _policy(level: OptLevel, target_dtype: Any, emulate: Optional[bool]) -> Optional[Policy]:
    """The policy O1-O3 patch with (resolved for this machine); ``None`` at O0.

    A ready :class:`Policy` is used as it is; its batch-norm rule must agree with the level's."""
    if not level.patch_ops:
        if target_dtype is not None or emulate:
            raise ValueError(f"target_dtype={target_dtype!r}, emulate={emulate!r} have no effect at O0 "
                             "(pure float32); leave them unset, or pick O1-O3.")
        return None
    # the process's (init, the launcher), not a region's: initialize sets the process up for good
    active = state.process.policy if target_dtype is None else None
    if (emulate or (emulate is None and active is not None and active.emulate)) and level.cast_weights:
        given = "emulate=True" if emulate else "the emulated policy in force (init(..., emulate=True) or --emulate)"
        raise ValueError(f"{given} supports opt_level 'O1' (op patching); {level.name} stores the "
                         "weights in the target dtype, which emulation does not model. Use O1 with "
                         "emulate=True for a numerics check.")
    if isinstance(target_dtype, Policy):
        if emulate is not None and emulate != target_dtype.emulate:
            raise ValueError(f"emulate={emulate!r} disagrees with the Policy passed as target_dtype "
                             f"(emulate={target_dtype.emulate}); build the Policy with make_policy(emulate=...).")
        if target_dtype.enabled and target_dtype.keep_batchnorm_fp32 != level.keep_batchnorm_fp32:
            raise ValueError(f"the Policy's keep_batchnorm_fp32={target_dtype.keep_batchnorm_fp32!r} "
                             f"disagrees with {level.name}'s {level.keep_batchnorm_fp32!r}; pass the same "
                             "value to make_policy and initialize.")
        return target_dtype
    if active is not None:  # init (or the launcher) chose already: the level follows it, as converters do
        return following(active, keep_batchnorm_fp32=level.keep_batchnorm_fp32, emulate=emulate)
    return make_policy(target_dtype, keep_batchnorm_fp32=level.keep_batchnorm_fp32, emulate=emulate)


def initialize(net: Block, trainer: Optional[Trainer] = None, opt_level: str = "O1", *,
               target_dtype: Any = None, keep_batchnorm_fp32: Optional[bool] = None,
               loss_scale: Optional[LossScale] = None,
               master_weights: Optional[bool] = None,
               emulate: Optional[bool] = None) -> Tuple[Block, Optional[Trainer]]:
    """Set up ``net`` and ``trainer`` for mixed precision at an Apex opt level.

    Call it once, after building and initializing the net and the trainer, before the
    first ``trainer.step``. Then train as usual with ``gluon_amp.scale_loss(loss, trainer)``
    (at every level, O0 included). ``net`` and ``trainer`` are changed in place and returned.

    Parameters
    ----------
    net : mxnet.gluon.Block
        Its parameters must be initialized; at O2/O3 their shapes must be known (run one
        forward pass after a deferred ``net.initialize()``).
    trainer : mxnet.gluon.Trainer, optional
        Built with ``update_on_kvstore=False``. It gets a loss scaler (see
        :func:`gluon_amp.get_scaler`) and, at O2, float32 master weights.
    opt_level : {'O0', 'O1', 'O2', 'O3'}
        See the module table.
    target_dtype : {'float16', 'bfloat16', None} or Policy
        ``None`` follows the process's policy (``init``, ``python -m gluon_amp.run``; not an
        ``autocast`` region's), else
        picks for this machine as :func:`gluon_amp.init` does; where it picks float32 (no
        usable low precision) every level behaves as O0. A :class:`Policy`
        (from :func:`gluon_amp.make_policy`) is used as it is.
    emulate : bool, optional
        O1 only: run the plan emulated in float32 on any CPU (see :func:`gluon_amp.init`).
    keep_batchnorm_fp32, loss_scale, master_weights : optional
        Override the level's default, as in Apex. ``loss_scale`` is ``'dynamic'``, a number
        (static scale) or a :class:`LossScaler`.

    Returns
    -------
    (net, trainer)
    """
    level = properties(opt_level, keep_batchnorm_fp32=keep_batchnorm_fp32,
                       loss_scale=loss_scale, master_weights=master_weights)
    _check_net(net, level)
    _check_trainer(trainer)
    policy = _policy(level, target_dtype, emulate)
    if policy is not None and not policy.enabled:  # no useful low precision here (warned): O0
        level = replace(OPT_LEVELS["O0"], loss_scale=level.loss_scale if loss_scale is not None else 1.0)
    dtype = policy.target_dtype if policy is not None else "float32"
    if level.cast_weights:
        _check_storable(net, level, dtype)  # before anything changes: AMP, the weights, the trainer
    # A graph cached before (e.g. by the forward pass that finished deferred init, maybe in
    # inference mode) is rebuilt at the next call, under this level's precision.
    net.apply(mxi.drop_cached_graph)
    if level.patch_ops:
        patching.init(policy)
        if not level.cast_weights:
            _warn_frozen_graphs(net)
    if level.cast_weights:
        _cast_weights(net, dtype)
        net.forward = types.MethodType(_boundary_forward(net.forward, dtype), net)
    if trainer is not None:
        if level.cast_weights:
            master_weights_mod.install(trainer, dtype, keep_master=level.master_weights)
        trainer_mod.init_trainer(trainer, level.loss_scale)
        trainer_mod.record_opt_level(trainer, level.name, chose_scale=loss_scale is None)
        state.trainer_record(trainer).opt_level_done = True
    state.process.done.add(net)
    return net, trainer
