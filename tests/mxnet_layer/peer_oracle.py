"""Run ``mxnet.contrib.amp`` (the peer) as an oracle in a subprocess; shared graph summaries.

This module never imports gluon_amp, so the subprocess that imports it next to the peer
is a clean peer process. Both sides build the test graphs with the functions below and
summarise results with :func:`summarize`, so they compare like for like.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = np.dtype([("bfloat16", np.uint16)])
CASTS = ("amp_cast", "amp_multicast")
_MARK = "@@PEER_RESULT@@"


def dtype_str(t: Any) -> str:
    if isinstance(t, np.dtype) and t.names == ("bfloat16",):
        return "bfloat16"
    return np.dtype(t).name


# ---------------------------------------------------------------- test graphs

def g_conv_bn_relu_fc_softmax() -> mx.sym.Symbol:
    x = mx.sym.var("data")
    x = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name="conv")
    x = mx.sym.BatchNorm(x, name="bn")
    x = mx.sym.Activation(x, act_type="relu", name="relu")
    x = mx.sym.FullyConnected(x, num_hidden=5, name="fc")
    return mx.sym.softmax(x, name="softmax")


def g_conv_prelu() -> mx.sym.Symbol:
    x = mx.sym.Convolution(mx.sym.var("data"), num_filter=4, kernel=(3, 3), name="conv")
    x = mx.sym.LeakyReLU(x, act_type="prelu", gamma=mx.sym.var("prelu_gamma"), name="prelu")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc")


def g_conv_fc() -> mx.sym.Symbol:
    """Used with target_dtype_ops=['Convolution']: the FC follows its input's dtype."""
    x = mx.sym.Convolution(mx.sym.var("data"), num_filter=4, kernel=(3, 3), name="conv")
    x = mx.sym.Activation(x, act_type="relu", name="relu")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc")


def g_slice_like() -> mx.sym.Symbol:
    data = mx.sym.var("data")
    x = mx.sym.Convolution(data, num_filter=3, kernel=(1, 1), name="conv")
    x = mx.sym.slice_like(x, data, axes=(2, 3), name="crop")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc")


def g_gather_nd() -> mx.sym.Symbol:
    x = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=6, name="fc1")
    x = mx.sym.gather_nd(x, mx.sym.var("indices"), name="gather")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc2")


def g_explicit_cast() -> mx.sym.Symbol:
    x = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=6, name="fc1")
    x = mx.sym.Cast(x, dtype="float32", name="to_fp32")
    x = mx.sym.Activation(x, act_type="relu", name="relu")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc2")


def g_user_amp_cast() -> mx.sym.Symbol:
    x = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=6, name="fc1")
    x = mx.sym.amp_cast(x, dtype="float32", name="user_cast")
    x = mx.sym.Activation(x, act_type="relu", name="relu")
    return mx.sym.FullyConnected(x, num_hidden=3, name="fc2")


GRAPHS = {
    "conv_bn_relu_fc_softmax": (g_conv_bn_relu_fc_softmax, {"data": (2, 4, 8, 8)}, {}),
    "conv_prelu": (g_conv_prelu, {"data": (2, 4, 8, 8)}, {}),
    "conv_fc_conv_only": (g_conv_fc, {"data": (2, 4, 8, 8)}, {"target_dtype_ops": ["Convolution"]}),
    "slice_like": (g_slice_like, {"data": (2, 4, 8, 8)}, {}),
    "gather_nd": (g_gather_nd, {"data": (4, 5), "indices": (1, 2)}, {}),
    "explicit_cast": (g_explicit_cast, {"data": (2, 5)}, {}),
    "user_amp_cast": (g_user_amp_cast, {"data": (2, 5)}, {}),
}


def fp32_params(sym: mx.sym.Symbol, data_shapes: Dict[str, Tuple[int, ...]]) -> Tuple[Dict, Dict]:
    """Deterministic FP32 arg/aux params for ``sym`` (data inputs excluded)."""
    arg_shapes, _, aux_shapes = sym.infer_shape(**data_shapes)
    rng = np.random.RandomState(0)
    args = {n: mx.nd.array(rng.uniform(0.1, 1, s)) for n, s in zip(sym.list_arguments(), arg_shapes)
            if n not in data_shapes}
    aux = {n: mx.nd.array(rng.uniform(0.1, 1, s)) for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return args, aux


def bucket_sym_gen(seq_len: int):
    """A small ``sym_gen`` for a BucketingModule (weights shared across buckets)."""
    data, label = mx.sym.var("data"), mx.sym.var("softmax_label")
    x = mx.sym.FullyConnected(data, num_hidden=8, flatten=False, name="fc1")
    x = mx.sym.BatchNorm(x, axis=2, name="bn")
    x = mx.sym.sum(x, axis=1, name="pool")
    x = mx.sym.FullyConnected(x, num_hidden=3, name="fc2")
    return mx.sym.SoftmaxOutput(x, label, name="softmax"), ("data",), ("softmax_label",)


def bucketing_module(keys: Sequence[int] = (5, 3)) -> "mx.mod.BucketingModule":
    """Bound BucketingModule with buckets ``keys`` and deterministic parameters."""
    mod = mx.mod.BucketingModule(bucket_sym_gen, default_bucket_key=keys[0], context=mx.cpu())
    mod.bind(data_shapes=[("data", (2, keys[0], 4))], label_shapes=[("softmax_label", (2,))])
    sym = bucket_sym_gen(keys[0])[0]
    args, aux = fp32_params(sym, {"data": (2, keys[0], 4), "softmax_label": (2,)})
    args.pop("softmax_label", None)
    mod.init_params(arg_params=args, aux_params=aux)
    for k in keys[1:]:
        mod.switch_bucket(k, [("data", (2, k, 4))], [("softmax_label", (2,))])
    mod.switch_bucket(keys[0], [("data", (2, keys[0], 4))], [("softmax_label", (2,))])
    return mod


def bucket_summaries(mod: Any) -> Dict[str, Any]:
    """Per bucket key: the summary of its symbol; plus the module's parameter dtypes."""
    args, aux = mod._curr_module._arg_params, mod._curr_module._aux_params
    types = {"data": np.float32, "softmax_label": np.float32,
             **{k: v.dtype for k, v in {**args, **aux}.items()}}
    return {"buckets": {str(k): summarize(m.symbol, types) for k, m in sorted(mod._buckets.items())},
            "params": param_dtypes({**args, **aux})}


def gluon_net(kind: str) -> "mx.gluon.HybridBlock":
    """Deterministically named Gluon nets: 'cbrfs' (conv-bn-relu-dense-softmax), 'prelu'."""
    from mxnet.gluon import nn
    net = nn.HybridSequential(prefix=f"{kind}_")
    with net.name_scope():
        net.add(nn.Conv2D(4, 3, padding=1))
        if kind == "cbrfs":
            net.add(nn.BatchNorm(), nn.Activation("relu"), nn.Dense(5), nn.HybridLambda("softmax"))
        else:
            net.add(nn.PReLU(), nn.Dense(3))
    return net


def run_gluon_net(kind: str) -> "mx.gluon.HybridBlock":
    """``gluon_net(kind)`` initialized, hybridized and run once in FP32 (cached graph)."""
    mx.random.seed(0)
    net = gluon_net(kind)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.ones((2, 4, 8, 8)))
    mx.nd.waitall()
    return net


def block_summary(block: Any) -> Dict[str, Any]:
    """Summary of a converted SymbolBlock's graph with its own parameter dtypes."""
    params = {p.name: p.data() for p in block.collect_params().values()}
    inputs, sym = block._cached_graph
    types = {**{i.name: np.float32 for i in inputs}, **{k: v.dtype for k, v in params.items()}}
    return {"graph": summarize(sym, types), "params": param_dtypes(params)}


def training_graph(build: Any) -> Dict[str, Any]:
    """Summary of a graph built by ``build()`` (under AMP), all inputs float32 (master weights)."""
    sym = build()
    return summarize(sym, {n: np.float32 for n in sym.list_inputs()})


def softmax_output_step(amp: Any) -> List[List[float]]:
    """One SGD step through ``SoftmaxOutput`` with loss scaling by ``amp`` (None: plain FP32).

    Only float32-or-widest ops run (``dot``), so it executes under float16 AMP on a CPU.
    Returns the updated weights.
    """
    from mxnet import autograd, gluon
    w = gluon.Parameter("w_lossout", shape=(2, 3))
    w.initialize(mx.init.Constant(0.1))
    trainer = gluon.Trainer([w], "sgd", {"learning_rate": 1.0}, update_on_kvstore=False)
    if amp is not None:
        amp.init_trainer(trainer)
    x, y = mx.nd.array([[1.0, 2.0, 3.0]]), mx.nd.array([1.0])
    with autograd.record():
        out = mx.nd.SoftmaxOutput(mx.nd.dot(x, w.data(), transpose_b=True), y)
        if amp is None:
            out.backward()
        else:
            with amp.scale_loss(out, trainer) as scaled:
                autograd.backward(scaled)
    trainer.step(1)
    return w.data().asnumpy().tolist()


def canonical(name: str) -> Optional[str]:
    """The registered op name behind ``name`` (an alias or itself); None if not registered."""
    import ctypes
    from mxnet.base import _LIB, OpHandle, c_str, mx_uint
    handle = OpHandle()
    if _LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)) != 0 or not handle.value:
        return None
    real, desc, key_var, ret = (ctypes.c_char_p() for _ in range(4))
    num_args = mx_uint()
    names, types, descs = (ctypes.POINTER(ctypes.c_char_p)() for _ in range(3))
    _LIB.MXSymbolGetAtomicSymbolInfo(handle, ctypes.byref(real), ctypes.byref(desc), ctypes.byref(num_args),
                                     ctypes.byref(names), ctypes.byref(types), ctypes.byref(descs),
                                     ctypes.byref(key_var), ctypes.byref(ret))
    return real.value.decode() if real.value else None


# ---------------------------------------------------------------- summaries

def summarize(sym: mx.sym.Symbol, input_types: Dict[str, Any]) -> Dict[str, Any]:
    """What a converted graph does, independent of cast node names.

    ``ops``: op node name -> {'op', 'in': dtypes its inputs arrive in, 'out': output dtypes};
    cast nodes are not listed. ``casts``: sorted ``[consumer, input index, cast op, dtype,
    'var'|'op']`` for every cast output feeding a non-cast node (consumer ``'<output>'``
    for a graph output; the last field says whether a variable or an op output is cast).
    ``reads``: variable name -> the dtypes ops read it in (after casts). ``typed``: False
    when infer_type could not type the graph.
    """
    internals = sym.get_internals()
    names = set(internals.list_inputs())
    given = {k: v for k, v in input_types.items() if k in names}
    try:
        _, types, _ = internals.infer_type(**given)
    except mx.base.MXNetError as exc:
        return {"typed": False, "error": str(exc).splitlines()[0][:300]}
    if types is None or any(t is None for t in types):
        return {"typed": False, "error": "untyped outputs"}
    out_t = dict(zip(internals.list_outputs(), (dtype_str(t) for t in types)))
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    nodes = graph["nodes"]

    def entry_type(e: Sequence[int]) -> str:
        node = nodes[e[0]]
        if node["op"] == "null":
            return out_t[node["name"]]
        key = f"{node['name']}_output" if f"{node['name']}_output" in out_t else f"{node['name']}_output{e[1]}"
        return out_t[key]

    def origin(e: Sequence[int]) -> Dict[str, Any]:
        """The node an input entry comes from, looking through cast nodes."""
        node = nodes[e[0]]
        while node["op"] in CASTS:
            e = node["inputs"][e[1] if node["op"] == "amp_multicast" else 0]
            node = nodes[e[0]]
        return node

    def cast_is_noop(e: Sequence[int]) -> bool:
        cast = nodes[e[0]]
        src = cast["inputs"][e[1] if cast["op"] == "amp_multicast" else 0]
        return entry_type(src) == entry_type(e)

    ops, casts, reads = {}, [], {}
    for node in nodes:
        if node["op"] == "null" or node["op"] in CASTS:
            continue
        ins = [entry_type(e) for e in node["inputs"]]
        outs = [t for n, t in out_t.items() if n == node["name"] + "_output"
                or (n.startswith(node["name"] + "_output") and n[len(node["name"]) + 7:].isdigit())]
        ops[node["name"]] = {"op": node["op"], "in": ins, "out": outs}
        for j, e in enumerate(node["inputs"]):
            src = origin(e)
            if src["op"] == "null":
                reads.setdefault(src["name"], set()).add(entry_type(e))
            if nodes[e[0]]["op"] in CASTS:
                casts.append([node["name"], j, nodes[e[0]]["op"], entry_type(e),
                              "var" if src["op"] == "null" else "op", cast_is_noop(e)])
    for e in graph["heads"]:
        if nodes[e[0]]["op"] in CASTS:
            casts.append(["<output>", 0, nodes[e[0]]["op"], entry_type(e), "op", cast_is_noop(e)])
    return {"typed": True, "ops": ops, "casts": sorted(casts),
            "reads": {k: sorted(v) for k, v in sorted(reads.items())}}


def param_dtypes(params: Dict[str, mx.nd.NDArray]) -> Dict[str, str]:
    return {k: dtype_str(v.dtype) for k, v in sorted(params.items())}


# ---------------------------------------------------------------- subprocess runner

def run_peer(snippet: str, timeout: float = 120, env: Optional[Dict[str, str]] = None) -> Any:
    """Run ``snippet`` in a fresh Python next to ``mxnet.contrib.amp``; return its ``result``.

    The snippet runs after ``import mxnet as mx``, ``from mxnet.contrib import amp``,
    ``import numpy as np`` and ``from peer_oracle import *``, and must assign a
    JSON-serialisable ``result``. A peer exception inside the snippet is the snippet's to
    catch; an uncaught one raises ``RuntimeError`` here with the subprocess's stderr.
    """
    code = textwrap.dedent("""
        import json, sys, warnings
        sys.path.insert(0, {here!r})
        warnings.simplefilter("ignore")
        import runpy  # the numpy shim by path: this process never imports gluon_amp
        runpy.run_path({shim!r})["restore_numpy_aliases"]()
        import mxnet as mx
        import numpy as np
        from mxnet.contrib import amp
        from peer_oracle import *
        result = None
    """).format(here=HERE, shim=os.path.join(os.path.dirname(os.path.dirname(HERE)), "gluon_amp", "_numpy_shim.py"))
    code += textwrap.dedent(snippet) + f"\nprint({_MARK!r} + json.dumps(result))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"peer subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def start_peer(snippet: str, timeout: float = 120) -> "PeerRun":
    """Like :func:`run_peer`, in the background: ``start_peer(s).result()``."""
    return PeerRun(snippet, timeout)


class PeerRun:
    """A peer subprocess running in the background (several start at once to hide startup)."""

    def __init__(self, snippet: str, timeout: float) -> None:
        import concurrent.futures
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._future = self._pool.submit(run_peer, snippet, timeout)

    def result(self) -> Any:
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=False)
