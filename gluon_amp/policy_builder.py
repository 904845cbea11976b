"""Build a :class:`~gluon_amp_core.policy.Policy` for this machine and this MXNet.

The pure value and its validation live in :mod:`gluon_amp_core.policy`; this module adds
what only the MXNet layer knows: the machine (resolving ``target_dtype``) and the op registry
(op names are checked against MXNet's).

The peer-compatible signatures (``init``, ``convert_*``, ``report``) are shims over
:func:`as_policy`: they accept a ready ``Policy`` or the classic arguments.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Optional, Sequence

from . import mxnet_internals as mxi, runtime
from gluon_amp_core.policy import FLOAT32, Policy, PolicySpec
from gluon_amp_core.switches import switched_off
from gluon_amp_core.table import ConditionalSpec, OpListError
from gluon_amp_core.tuning.schedule import ENV as TUNE_BUDGET_ENV, TuneBudget, parse_budget


def make_policy(target_dtype: Any = None, *,
                target_precision_ops: Optional[Sequence[str]] = None,
                conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
                fp32_ops: Optional[Sequence[str]] = None,
                widest_type_ops: Optional[Sequence[str]] = None,
                keep_batchnorm_fp32: Optional[bool] = None,
                emulate: Optional[bool] = None,
                excluded_sym_names: Optional[Sequence[str]] = None,
                tune: Optional[bool] = None,
                tune_budget: Any = None) -> Policy:
    """A validated policy: ``target_dtype`` resolved for this machine (``None`` picks;
    see :func:`gluon_amp_core.resolve.resolve_target`), op names checked against MXNet's
    mxi. Where no useful low precision exists the policy is float32 (AMP off) and a
    ``RuntimeWarning`` says why, once per process.

    ``emulate=True`` runs the plan of ``target_dtype`` emulated in float32 on any CPU
    (``None`` then picks float16 with a GPU, else bfloat16); no capability warning.
    ``excluded_sym_names`` keeps those op nodes in float32. ``tune`` times the ops a graph
    runs low on this machine and keeps in float32 those that do not make the whole graph
    faster (:mod:`gluon_amp.tuning.tuner`); ``None`` (the default) tunes unless emulating or
    ``GLUON_AMP_TUNE=0``. ``tune_budget`` bounds what tuning spends per process (see
    :func:`gluon_amp.init`); ``None``: ``$GLUON_AMP_TUNE_BUDGET``, else the default.
    """
    spec = PolicySpec.parse(target_dtype, target_precision_ops=target_precision_ops,
                            conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops,
                            widest_type_ops=widest_type_ops, keep_batchnorm_fp32=keep_batchnorm_fp32,
                            emulate=emulate, excluded_sym_names=excluded_sym_names, tune=tune,
                            tune_budget=tune_budget_default() if tune_budget is None else tune_budget)
    if spec.emulate:
        dtype, reason = runtime.emulated_target(spec.requested), None
    else:
        res = runtime.resolve(spec.requested)
        dtype, reason = res.dtype, (res.warning if res.dtype == FLOAT32 else None)
    default = tune_default() if spec.tune is None else None  # read (and checked) whether or not it applies
    tune_on = default if spec.tune is None and not spec.emulate else bool(spec.tune)
    policy = Policy.from_spec(spec, dtype, tune=tune_on, known_ops=mxi.op_infos().keys(), aliases=mxi.aliases(),
                              reason=reason)
    check_conditional_attrs(spec.conditional_fp32_ops or ())  # after the op names: those errors come first
    return policy


#: Ops whose attributes are whatever the caller passes (the registry declares only some).
_FREE_ATTRS = frozenset({"Custom"})


def check_conditional_attrs(conditional_fp32_ops: Sequence[ConditionalSpec]) -> None:
    """Raise :class:`~gluon_amp_core.table.OpListError` (a ``ValueError``) for an entry
    ``(op, attr, values)`` whose ``attr`` the op does not have in MXNet's registry: such an
    entry could never match a node. Hidden attributes (``__name__``) pass."""
    infos = mxi.op_infos()
    for op, attr, _values in conditional_fp32_ops:
        info = infos.get(op)
        if info is None or info.canonical in _FREE_ATTRS or (attr.startswith("__") and attr.endswith("__")):
            continue
        declared = info.attrs
        if attr in declared:
            continue
        near = difflib.get_close_matches(attr, declared, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        has = f"its attributes are {', '.join(declared)}" if declared else "it has no attributes"
        raise OpListError(f"conditional_fp32_ops entry {(op, attr)!r}: op {op!r} has no attribute {attr!r} "
                          f"in MXNet's registry ({has}), so the entry could never match.{hint} "
                          "Name an attribute the op has, or remove the entry.")


#: Set to ``0`` to make ``tune=None`` mean no tuning (as ``tune=False`` everywhere).
TUNE_ENV = "GLUON_AMP_TUNE"


def tune_default() -> bool:
    """What ``tune=None`` means: tune, unless ``GLUON_AMP_TUNE=0``."""
    return not switched_off(os.environ, TUNE_ENV)


def tune_budget_default() -> TuneBudget:
    """What ``tune_budget=None`` means: ``$GLUON_AMP_TUNE_BUDGET`` if set, else the default
    (:data:`gluon_amp_core.tuning.schedule.DEFAULT_BUDGET`)."""
    text = os.environ.get(TUNE_BUDGET_ENV, "").strip()
    return parse_budget(text or None, f"${TUNE_BUDGET_ENV}")


#: The keyword options of a policy (``make_policy``'s beyond ``target_dtype``).
POLICY_OPTIONS = ("target_precision_ops", "conditional_fp32_ops", "fp32_ops", "widest_type_ops",
                  "keep_batchnorm_fp32", "emulate", "excluded_sym_names", "tune", "tune_budget")


def check_options(caller: str, options: Any) -> None:
    """``TypeError`` naming ``caller`` (``init``, ``autocast``) for a keyword ``options`` has
    that no policy takes: Python's own named ``make_policy``, which the caller never called."""
    unknown = [k for k in options if k not in POLICY_OPTIONS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], POLICY_OPTIONS, n=1)
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; its options are {', '.join(POLICY_OPTIONS)}.")


#: The settings a policy built to follow the one in force inherits where not given.
_INHERITED = ("target_precision_ops", "fp32_ops", "conditional_fp32_ops", "widest_type_ops",
              "keep_batchnorm_fp32", "emulate", "tune")


def following(active: Policy, **given: Any) -> Policy:
    """The policy for a caller that named no ``target_dtype`` while ``active`` is in force
    (``init``, ``python -m gluon_amp.run``): ``active`` itself where ``given`` (settings of
    :data:`_INHERITED`, ``None``: not given) changes nothing, else ``active`` with them."""
    if all(v is None or v == getattr(active, k) for k, v in given.items()):
        return active
    merged = {k: getattr(active, k) for k in _INHERITED}
    merged.update({k: v for k, v in given.items() if v is not None})
    return make_policy(active.target_dtype if active.enabled else None, **merged,
                       excluded_sym_names=active.excluded_sym_names, tune_budget=active.tune_budget)


def as_policy(target_dtype: Any = None, **lists: Any) -> Policy:
    """``target_dtype`` if it is a :class:`Policy` (then no other list may be given),
    else :func:`make_policy` of the arguments."""
    if isinstance(target_dtype, Policy):
        given = sorted(k for k, v in lists.items() if v is not None)
        if given:
            raise ValueError(f"pass either a Policy or op-list arguments, not both (got a Policy and {given}); "
                             "build the Policy with gluon_amp.make_policy(...) including them.")
        return target_dtype
    return make_policy(target_dtype, **lists)
