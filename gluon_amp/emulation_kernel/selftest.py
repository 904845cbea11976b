"""Check a built kernel in a fresh process before any other process loads it.

    python -m gluon_amp.emulation_kernel.selftest LIBRARY

Loads ``LIBRARY`` into MXNet's process and checks, for float16 and bfloat16:

- values, to the bit, against :func:`gluon_amp_core.emulate.round_bits` (edge values and
  random bit patterns), imperatively;
- the pair ``(data, weight) -> (data, weight rounded)``, forward and backward, to the bit: the
  data and its gradient pass as they are, the weight's gradient is float16's rounding (or
  passes, for bfloat16);
- a small training graph (convolution, batch norm, the rounding in place on oneDNN's layout,
  ``static_alloc``) forward and backward against the same graph rounded by MXNet's ops;
- that float16 rounds the gradient and bfloat16 passes it through;
- a gradient of a gradient through MXNet's ``amp_cast`` and ``amp_multicast``;
- that the library's errors (a bad ``dtype``, a float64 input, imperatively and when a graph is
  typed) reach MXNet's handler as an ``MXNetError`` naming the problem. A C++ exception thrown
  from a library of one toolchain must unwind through libmxnet's frames of another: where it
  cannot, a bad call would crash the user's process, so that build is refused.

Prints one JSON line, ``{"ok": true}`` or ``{"ok": false, "error": ...}``; exit status 0 when
it passed. A crash (a wrong build can take MXNet's process down) is a failure too.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Tuple

import gluon_amp  # noqa: F401  first: its numpy shim runs before MXNet loads
import mxnet as mx
import numpy as np

from gluon_amp_core.emulate import emulate_graph, round_bits

from .. import mxnet_internals as mxi
from . import OP_NAME, PAIR_OP_NAME

DTYPES = ("float16", "bfloat16")


def edge_bits() -> np.ndarray:
    """Bit patterns where roundings go wrong: zeros, subnormals, ties, the ends of each range."""
    values = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x007F8000,
              0x00800000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FF000, 0x387FEFFF,
              0x3F800000, 0x3F808000, 0x3F818000, 0x3F801000, 0x3F803000, 0x477FE000, 0x477FEFFF,
              0x477FF000, 0x477FFFFF, 0x47800000, 0x7F000000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,
              0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF]
    return np.array(values, dtype=np.uint32)


def reference(bits: np.ndarray, dtype: str) -> np.ndarray:
    """:func:`round_bits` over an array of bit patterns."""
    return np.array([round_bits(int(b), dtype) for b in bits], dtype=np.uint32)


def same_bits(got: np.ndarray, want_bits: np.ndarray) -> np.ndarray:
    """Elementwise: the same bits, or both NaN."""
    g = got.view(np.uint32)
    nan = np.isnan(got) & np.isnan(want_bits.view(np.float32))
    return (g == want_bits) | nan


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    """``|a - b| / |b|`` (L2 norms)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def same_numerics(a: np.ndarray, b: np.ndarray, unrounded: np.ndarray) -> bool:
    """``a`` and ``b`` (two runs that round alike) are 4 times closer to each other than ``a``
    is to ``unrounded`` (the run without rounding). They need not be equal: where one run's
    op sums in another order (oneDNN's layout or a plain one), a value may land one rounding
    step apart (a float16 step on 0.1% of the values is 1/16 of float16's error), and float32
    gradients differ in their last bits. Rounding nothing, or to another dtype, is 1 or more."""
    return bool(np.isfinite(a).all()) and relative_l2(a, b) <= 0.25 * relative_l2(a, unrounded)


def check_values(fn, bits: np.ndarray) -> List[str]:
    errors = []
    for dtype in DTYPES:
        got = fn(mx.nd.array(bits.view(np.float32), dtype="float32"), dtype=dtype).asnumpy()
        ok = same_bits(got, reference(bits, dtype))
        if not ok.all():
            k = int(np.argmin(ok))
            errors.append(f"{dtype}: {int((~ok).sum())} values differ from round_bits, e.g. "
                          f"0x{int(bits[k]):08x} -> 0x{int(got.view(np.uint32)[k]):08x}")
    return errors


def check_pair(fn, bits: np.ndarray) -> List[str]:
    errors = []
    values = bits.view(np.float32)
    finite = values[np.isfinite(values)]
    for dtype in DTYPES:
        data, weight = mx.nd.array(finite[::-1].copy()), mx.nd.array(values)
        out = fn(data, weight, dtype=dtype)
        if not (same_bits(out[0].asnumpy(), finite[::-1].view(np.uint32)).all()
                and same_bits(out[1].asnumpy(), reference(bits, dtype)).all()):
            errors.append(f"{dtype}: the pair's outputs are not its data and its weight rounded")
        data, weight = mx.nd.zeros(finite.shape), mx.nd.zeros(finite.shape)
        data.attach_grad()
        weight.attach_grad()
        with mx.autograd.record():
            out = fn(data, weight, dtype=dtype)
        mx.autograd.backward(list(out), [mx.nd.array(finite[::-1].copy()), mx.nd.array(finite)])
        want = reference(finite.view(np.uint32), dtype) if dtype == "float16" else finite.view(np.uint32)
        if not (same_bits(data.grad.asnumpy(), finite[::-1].view(np.uint32)).all()
                and same_bits(weight.grad.asnumpy(), want).all()):
            errors.append(f"{dtype}: the pair's gradients are not the data's as it is and the weight's "
                          + ("rounded" if dtype == "float16" else "as it is"))
    return errors


def _training_graph(dtype: str, rounding: str) -> mx.sym.Symbol:
    """conv -> rounding -> batch norm -> relu -> conv (its weight rounded: float16's pair) ->
    rounding, as the emulation rewrite builds it (``rounding``: ``'kernel'``, ``'fallback'``
    (MXNet's ops) or ``'none'``)."""
    data = mx.sym.var("data")
    c1 = mx.sym.Convolution(data, num_filter=16, kernel=(3, 3), pad=(1, 1), no_bias=True, name="c1")
    b1 = mx.sym.BatchNorm(c1, name="b1")
    w2 = mx.sym.var("c2_weight")
    if rounding != "none":
        w2 = mx.sym.amp_cast(w2, dtype=mxi.to_mx_dtype(dtype), name="w2")
    c2 = mx.sym.Convolution(mx.sym.relu(b1, name="r1"), w2, num_filter=8, kernel=(3, 3), pad=(1, 1),
                            no_bias=True, name="c2")
    out = mx.sym.identity(c2, name="out")
    if rounding == "none":
        return out
    dtypes = {("c1", 0): dtype, ("c2", 0): dtype, ("w2", 0): dtype}
    graph = emulate_graph(json.loads(out.tojson()), dtypes, kernel=OP_NAME if rounding == "kernel" else None)
    return mx.sym.load_json(json.dumps(graph.graph))


def training_runs(dtype: str, build: Any) -> Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``{rounding: (output, input gradient, the parameters' gradients)}`` after two steps of
    ``build(rounding)`` (a block), under ``static_alloc``, from the same weights and data."""
    x = mx.nd.random.normal(shape=(2, 8, 12, 12), dtype="float32")
    runs = {}
    for rounding in ("kernel", "fallback", "none"):
        mx.random.seed(3)
        net = build(rounding)
        net.hybridize(static_alloc=True, static_shape=True)
        xg = x.copy()
        xg.attach_grad()
        for _ in range(2):
            with mx.autograd.record():
                y = net(xg)
            y.backward(mx.nd.ones_like(y) * 1.00012)  # float16 rounds it to 1; bfloat16 passes it
        grads = [p.grad().asnumpy().ravel() for p in net.collect_params().values() if p.grad_req != "null"]
        runs[rounding] = (y.asnumpy(), xg.grad.asnumpy(), np.concatenate(grads))
    return runs


def check_training(dtype: str) -> List[str]:
    def build(rounding: str) -> mx.gluon.HybridBlock:
        net = mx.gluon.SymbolBlock(_training_graph(dtype, rounding), [mx.sym.var("data")])
        net.initialize(mx.init.Normal(0.5))
        return net

    runs = training_runs(dtype, build)
    errors = []
    for k, what in enumerate(("output", "input gradient", "parameters' gradients")):
        if not same_numerics(runs["kernel"][k], runs["fallback"][k], runs["none"][k]):
            errors.append(f"{dtype}: the training graph's {what} is not the one MXNet's ops give")
    return errors


def check_cast_gradients() -> List[str]:
    """A gradient of a gradient through MXNet's ``amp_cast`` and ``amp_multicast`` (the library
    gives their backward ops a gradient): ``t = tanh(x cast down and back)``, its input gradient
    ``1 - t**2`` squared and summed, differentiated again: ``-4 t (1 - t**2)**2``, within the
    rounding of ``x``. The multicast's other input is a constant, whose gradient nobody asks
    for; it runs in bfloat16 (MXNet's CPU multicast goes to oneDNN, which has no float16)."""
    errors = []
    x0 = np.array([0.5, -1.25, 0.75, 0.25], dtype=np.float32)
    t = np.tanh(x0)
    want = -4 * t * (1 - t ** 2) ** 2
    casts = [(f"amp_cast to {d}", lambda x, d=d: mx.nd.amp_cast(mx.nd.amp_cast(x, dtype=mxi.to_mx_dtype(d)),
                                                               dtype="float32"))
             for d in DTYPES]
    casts.append(("amp_multicast", lambda x: mx.nd.amp_multicast(
        mx.nd.amp_cast(x, dtype=mxi.to_mx_dtype("bfloat16")), mx.nd.ones_like(x), num_outputs=2)[0]))
    for name, cast in casts:
        x = mx.nd.array(x0)
        x.attach_grad()
        with mx.autograd.record():
            y = mx.nd.tanh(cast(x))
            g = mx.autograd.grad(y, [x], head_grads=mx.nd.ones_like(y), create_graph=True, retain_graph=True)[0]
            penalty = (g * g).sum()
        penalty.backward()
        got = x.grad.asnumpy()
        if x.grad.dtype != np.float32 or not np.allclose(got, want, rtol=2e-2):
            errors.append(f"{name}: a gradient of a gradient gives {got.tolist()}, not {want.tolist()}")
    return errors


#: Calls that must fail, and the words MXNet's error must hold where the op is called
#: imperatively: the kernel never throws (rounding.cc, rule 3); its inference functions refuse,
#: and libmxnet raises, quoting the node's attributes or naming the check that refused.
BAD_CALLS = (
    ("a bad dtype", {"dtype": "float64"}, "float32", "dtype : float64"),
    ("a float64 input", {"dtype": "float16"}, "float64", "FInferType"),
)


def _one_op_graph(attrs: Dict[str, str], op: str = OP_NAME, names: Tuple[str, ...] = ("x",)) -> mx.sym.Symbol:
    """``names -> op(*names, **attrs)``, every output a head, as MXNet loads a saved graph (a
    registered op that ``mx.sym`` lacks: it was loaded after MXNet's import)."""
    n = len(names)
    nodes = [{"op": "null", "name": name, "inputs": []} for name in names]
    nodes.append({"op": op, "name": "rounded", "attrs": dict(attrs), "inputs": [[k, 0, 0] for k in range(n)]})
    return mx.sym.load_json(json.dumps({"nodes": nodes, "arg_nodes": list(range(n)),
                                        "heads": [[n, k, 0] for k in range(n)],
                                        "attrs": {"mxnet_version": ["int", 10901]}}))


def check_errors(fn) -> List[str]:
    """Each of :data:`BAD_CALLS` raises MXNet's error: imperatively, naming it, and bound as a
    graph (``simple_bind`` gives it as a ``RuntimeError``). A crash here ends the process: the
    parent reports its exit status."""
    errors = []
    for what, attrs, dtype, words in BAD_CALLS:
        calls = (("imperatively", words,
                  lambda a=attrs, d=dtype: fn(mx.nd.ones((2,), dtype=d), **a).asnumpy()),
                 ("bound in a graph", "",
                  lambda a=attrs, d=dtype: _one_op_graph(a).simple_bind(mx.cpu(), x=(2,), type_dict={"x": d})))
        for where, says, call in calls:
            print(f"selftest: {what} {where} must raise MXNetError", file=sys.stderr, flush=True)
            try:
                call()
            except (mx.base.MXNetError, RuntimeError) as exc:  # simple_bind raises RuntimeError
                if says not in str(exc):
                    errors.append(f"{what} {where}: the error does not say {says!r}: {exc}")
            else:
                errors.append(f"{what} {where}: no error was raised")
    return errors


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"ok": False, "error": "usage: selftest LIBRARY"}))
        return 2
    try:
        lib = mxi.load_op_library(argv[0])
        version = int(lib.gluon_amp_kernel_version())
        for name in (OP_NAME, PAIR_OP_NAME):
            if not mxi.op_registered(name):
                raise RuntimeError(f"{name} is not registered after loading the library")
        fn = mxi.ndarray_function(OP_NAME)
        rng = np.random.default_rng(0)
        bits = np.concatenate([edge_bits(), rng.integers(0, 2 ** 32, 20_000, dtype=np.uint64).astype(np.uint32)])
        errors = check_values(fn, bits) + check_pair(mxi.ndarray_function(PAIR_OP_NAME), bits)
        for dtype in DTYPES:
            errors += check_training(dtype)
        mx.nd.waitall()
        errors += check_cast_gradients()
        errors += check_errors(fn)
    except Exception as exc:  # noqa: BLE001  reported, not raised: the parent falls back
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"ok": not errors, "version": version, "error": "; ".join(errors) or None}))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
