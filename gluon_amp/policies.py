"""Build a :class:`~gluon_amp.policy.Policy` for this machine and this MXNet.

The peer-compatible signatures (``init``, ``convert_*``, ``report``) are shims over
:func:`as_policy`: they accept a ready ``Policy`` or the classic arguments.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from . import mxnet_internals as registry, runtime
from gluon_amp_core.policy import FLOAT32, Policy
from gluon_amp_core.table import ConditionalSpec


def make_policy(target_dtype: Any = None,
                target_precision_ops: Optional[Sequence[str]] = None,
                conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
                fp32_ops: Optional[Sequence[str]] = None, *,
                widest_type_ops: Optional[Sequence[str]] = None,
                keep_batchnorm_fp32: Optional[bool] = None) -> Policy:
    """A validated policy: ``target_dtype`` resolved for this machine (``None`` picks;
    see :func:`gluon_amp.capability.resolve_target`), op names checked against MXNet's
    registry. Where no useful low precision exists the policy is float32 (AMP off) and a
    ``RuntimeWarning`` says why, once per process."""
    res = runtime.resolve(target_dtype)
    return Policy.create(res.dtype, target_precision_ops, fp32_ops, conditional_fp32_ops,
                         widest_type_ops, keep_batchnorm_fp32, known_ops=registry.op_infos().keys(),
                         aliases=registry.aliases(),
                         reason=res.warning if res.dtype == FLOAT32 else None)


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
