"""Finding inf/NaN in gradients: one pass per context, one host sync per step."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Sequence

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import Parameter

from . import mxnet_internals as mxi


def grads_by_context(params: Sequence[Parameter]) -> Dict[mx.Context, List[mx.nd.NDArray]]:
    """Every dense gradient array of ``params``, grouped by the context it lives on."""
    groups: Dict[mx.Context, List[mx.nd.NDArray]] = OrderedDict()
    for p in params:
        if not mxi.has_grad(p):
            continue
        for g in p.list_grad():
            if g.stype != "default":
                g = g.data  # row_sparse / csr: check the stored values
            groups.setdefault(g.context, []).append(g)
    return groups


def all_finite(params: Sequence[Parameter]) -> bool:
    """True when every gradient on every context is finite.

    ``all_finite`` is chained into one flag per context (it only ever clears the flag),
    so this is one linear pass over the gradients and a single ``asscalar`` sync.
    """
    flags = []
    with autograd.pause():
        for ctx, grads in grads_by_context(params).items():
            flag = mx.nd.ones((1,), ctx=ctx)
            for g in grads:
                mx.nd.all_finite(g, init_output=False, out=flag)
            flags.append(flag if ctx == mx.cpu() else flag.as_in_context(mx.cpu()))
        if not flags:
            return True
        total = flags[0] if len(flags) == 1 else mx.nd.add_n(*flags)
        return float(total.asscalar()) == float(len(flags))


def non_finite_names(params: Sequence[Parameter]) -> List[str]:
    """Names of parameters with a non-finite gradient on any context (slow; diagnostics)."""
    bad = []
    with autograd.pause():
        for p in params:
            if not mxi.has_grad(p):
                continue
            if not all(mx.nd.all_finite(g if g.stype == "default" else g.data).asscalar() == 1
                       for g in p.list_grad()):
                bad.append(p.name)
    return bad
