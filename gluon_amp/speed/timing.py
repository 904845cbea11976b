"""Time one op in isolation, forward (and backward), in given input dtypes.

The probe and the tuner both measure through :func:`time_op`: the op is bound alone as a
one-node graph (a Symbol executor, as a hybridized block runs it), its inputs filled with
values in [0.5, 1.5) (positive, so no NaN from a variance or a log), one run warms up the
oneDNN primitives, and the median of the next runs is the figure.
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import time
from typing import Mapping, Optional, Sequence, Tuple

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

from gluon_amp_core.dtypes import DTYPE_CODE

from .. import mxnet_internals as mxi

#: Runs after the warm-up; fewer when one run is slow, so a big layer costs < ~1 s to time.
RUNS = 5
_SLOW_RUN_S = 0.25


def _graph(op: str, attrs: Mapping[str, str], dtypes: Sequence[str]) -> mx.sym.Symbol:
    n = len(dtypes)
    nodes = [{"op": "null", "name": f"in{k}", "inputs": [], "attrs": {"__dtype__": str(DTYPE_CODE[t])}}
             for k, t in enumerate(dtypes)]
    nodes.append({"op": op, "name": "op", "attrs": {k: str(v) for k, v in attrs.items()},
                  "inputs": [[k, 0, 0] for k in range(n)]})
    graph = {"nodes": nodes, "arg_nodes": list(range(n)), "heads": [[n, 0, 0]],
             "attrs": {"mxnet_version": ["int", 10901]}}
    return mx.sym.load_json(json.dumps(graph))


def _fill(arr: mx.nd.NDArray) -> None:
    values = mx.nd.random.uniform(0.5, 1.5, shape=arr.shape, ctx=arr.context)
    mx.nd.amp_cast(values, dtype=arr.dtype).copyto(arr)


def time_op(op: str, attrs: Mapping[str, str], shapes: Sequence[Tuple[int, ...]],
            dtypes: Sequence[str], train: bool, runs: int = RUNS) -> Optional[float]:
    """Median milliseconds of ``op`` on inputs of these shapes and dtypes, on the CPU.

    ``train``: forward and backward (every float output's gradient all ones), as in a
    training step; else forward only. ``None`` when MXNet cannot run the op so (a missing
    kernel, a shape it rejects): the caller then keeps its plan.
    """
    sym = _graph(op, attrs, dtypes)
    names = sym.list_arguments()
    given = {f"in{k}": s for k, s in enumerate(shapes) if f"in{k}" in names}
    try:
        with autograd.pause(), mxi.unfused_binds():
            # 1.9.1 binds shapes an op rejects into a segmentation fault: ask first (its
            # refusal is printed on stdout, then raised)
            with contextlib.redirect_stdout(io.StringIO()):
                arg_shapes, _, _ = sym.infer_shape(**given)
            if arg_shapes is None or any(not s for s in arg_shapes):
                return None
            exe = sym.simple_bind(mx.cpu(), grad_req="write" if train else "null", **given)
            for arr in [*exe.arg_arrays, *exe.aux_arrays]:
                _fill(arr)
            heads = None

            def once() -> float:
                nonlocal heads
                t0 = time.perf_counter()
                exe.forward(is_train=train)
                if train:
                    if heads is None:
                        heads = [mx.nd.ones(o.shape, dtype=o.dtype) for o in exe.outputs]
                    exe.backward(heads)
                mx.nd.waitall()
                return time.perf_counter() - t0

            first = once()
            n = runs if first < _SLOW_RUN_S else max(1, min(runs, 3))
            return statistics.median(once() for _ in range(n)) * 1e3
    except MXNetError:
        try:
            mx.nd.waitall()
        except MXNetError:
            pass
        return None
