"""A traced plan's ops whose low-precision kernel is slow, fed float32 once dtypes are known.

``init``'s wrappers trace a graph before any dtype is known, so a widest op whose kernel in the
target dtype is slow (a ``slow`` verdict, :mod:`gluon_amp_core.kernel_speed`, or more inputs than
the kernel takes, ``OpTable.fp32_above_inputs``) is traced as running in
whatever its inputs hold. Where the graph's dtypes would run it in the target, ``decide`` says
float32 (reason ``slow_kernel``): this retypes it so. A hybridized block's hooks apply it at its
first build (:mod:`gluon_amp.patching.hooks`); a Symbol traced under ``init`` gets it where MXNet
binds it (:mod:`gluon_amp.execution`), in what runs only.
"""
from __future__ import annotations

import json
from typing import Collection, Dict, FrozenSet, Mapping, Optional, Tuple

import mxnet as mx
from mxnet.symbol import Symbol

from gluon_amp_core.decide import Reason, slow_in_target
from gluon_amp_core.policy import Policy
from gluon_amp_core.retype import Change, retype
from gluon_amp_core.walk import walk

from . import mxnet_internals as mxi
from .type_inference import infer_dtypes

Key = Tuple[str, int]


def slow_kernels_in_float32(out: Symbol, known: Mapping[str, str], dtypes: Dict[Key, Optional[str]],
                            policy: Policy, users: Collection[str]
                            ) -> Tuple[Symbol, Dict[Key, Optional[str]], FrozenSet[str]]:
    """``out`` (typed ``dtypes`` for inputs ``known``) with each op whose kernel in the target
    is slow fed float32 where it would run in the target, its new typing, and the names of the
    ops retyped. ``out``, ``dtypes`` and no name where there is none, or where MXNet does not
    type the change. ``users``: the casts the user wrote, read from and never around."""
    table = policy.table
    graph = mxi.symbol_graph(out)
    nodes = graph["nodes"]
    if table is None or not any(n["op"] != "null" and slow_in_target(table, table.canonical(n["op"]), len(n["inputs"]))
                                for n in nodes):
        return out, dtypes, frozenset()
    found = walk(nodes, table, lambda e: dtypes.get((nodes[e[0]]["name"], e[1])), policy.excluded)
    changes = {nd.name: Change(nd.decision) for nd in found if nd.reason is Reason.SLOW_KERNEL}
    if not changes:
        return out, dtypes, frozenset()
    op_inputs = {n: i.inputs for n, i in mxi.op_infos().items()}
    new = mx.sym.load_json(json.dumps(retype(graph, changes, dtypes, op_inputs, keep=users)))
    typed = infer_dtypes(new, known, partial=True)
    if not typed:
        return out, dtypes, frozenset()
    return new, dict(typed), frozenset(changes)
