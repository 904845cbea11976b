"""Every way of calling an op that MXNet's own functions accept works the same under AMP.

MXNet's generated op functions take their inputs first, then their attributes, positionally
or by keyword (a variadic op: ``*inputs`` and keywords), then ``out``/``name``. The wrappers
must see what MXNet sees and pass the call on unchanged. Checked three ways:

1. what MXNet's functions pass to the op (recorded, no kernel runs) against what the
   wrappers read (:class:`gluon_amp.mxnet_internals.Signature`), for every op function;
2. generated calls of every wrapped ``mx.nd`` op, in each convention, patched against
   MXNet's own (same shapes or the same error class; conventions agree to the bit; the
   imperative dtype is the symbolic plan's), ``mx.sym`` alike;
3. the conventions client code uses (GluonNLP's positional ``F.Embedding``, RNN states as
   graph outputs, integer inputs, ``mx.np``) through init, the converter, emulation,
   ``report`` and ``debug.compare``.
"""
import functools
import importlib
import json
import re
import types
import warnings

import numpy as np
import pytest

import gluon_amp
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.base import MXNetError, _Null

from gluon_amp import LossScaler, mxnet_internals as mxi
from gluon_amp.policy_builder import make_policy
from gluon_amp.type_inference import entry_keys, infer_dtypes, op_types
from gluon_amp_core.dtypes import dtype_name
from gluon_amp_core.table import OpClass

MODES = {"bfloat16": dict(target_dtype="bfloat16"),
         "bfloat16-simulated": dict(target_dtype="bfloat16"),
         "float16-emulated": dict(target_dtype="float16", emulate=True),
         "bfloat16-emulated": dict(target_dtype="bfloat16", emulate=True)}
MODE_PARAMS = [pytest.param("bfloat16", marks=pytest.mark.bf16_kernels),
               pytest.param("bfloat16-simulated", marks=pytest.mark.simulated_native),  # on every CPU
               "float16-emulated", "bfloat16-emulated"]


# -- 1. what MXNet's functions pass to the op ------------------------------------------

class _Recorded(Exception):
    pass


def _recording(fn, kind):
    """``fn`` with MXNet's invoke replaced by a recorder: raises _Recorded(inputs, attrs, out/name)."""
    def record(handle, args, *rest):
        if kind == "ndarray":
            keys, vals, out = rest[0], rest[1], rest[2]
            raise _Recorded(list(args), dict(zip(keys, map(str, vals))), out)
        kwargs, keys, vals, name = rest[0], rest[1], rest[2], rest[3]
        raise _Recorded(list(args or []) + list((kwargs or {}).values()), dict(zip(keys, map(str, vals))), name)
    g = dict(fn.__globals__, **{"_imperative_invoke" if kind == "ndarray" else "_symbol_creator": record})
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__)


# attribute values of every kind a caller passes: MXNet writes each as str(value)
_VALUES = [3, 2.5, (1, 2), [1, [2, 3]], None, True, "relu", np.int64(4), ((1, 1), (2, 2)), np.float32(0.5)]
_DTYPES = ["float16", np.float32, None, "int32", np.dtype("int64")]


def _tensor(sig, i):
    if sig.kind == "ndarray":
        return mx.np.zeros((1,)) if sig.np_op else mx.nd.zeros((1,))
    v = mx.sym.var(f"v{i}")
    return v.as_np_ndarray() if sig.np_op else v


def _calls(sig):
    """(convention, args, kwargs) for one op function: every way MXNet's signature allows."""
    names = [p for p in sig.params[sig.n_inputs:] if p in sig.attrs] if not sig.variadic else sorted(sig.attrs)
    attrs = {p: (_DTYPES if p == "dtype" else _VALUES)[j % (len(_DTYPES) if p == "dtype" else len(_VALUES))]
             for j, p in enumerate(names) if p != sig.count_attr}
    if sig.variadic:
        xs = (_tensor(sig, 0), _tensor(sig, 1))
        yield "inputs, keyword attributes", xs, dict(attrs)
        yield "and name", xs, dict(attrs, name="n")
        if sig.count_attr:
            yield "and the count", xs, {**attrs, sig.count_attr: 2}
        return
    xs = tuple(_tensor(sig, i) for i in range(sig.n_inputs))
    half = len(names) // 2
    yield "keyword attributes", xs, dict(attrs)
    yield "keyword inputs", (), {**dict(zip(sig.inputs, xs)), **attrs}
    yield "positional attributes", xs + tuple(attrs[a] for a in names), {}
    yield "half positional", xs + tuple(attrs[a] for a in names[:half]), {a: attrs[a] for a in names[half:]}
    yield "an input None", xs[:1] + (None,) * (len(xs) - 1), dict(attrs)
    options = {"out": _tensor(sig, 9) if sig.kind == "ndarray" else None, "name": "n", "attr": {"__hidden__": "1"}}
    tail = sig.params[sig.n_inputs + len(names):]
    yield "all positional", xs + tuple(attrs[a] for a in names) + tuple(options[o] for o in tail), {}
    yield "unknown keyword", xs, {"not_declared": [1, 2]}


def test_every_op_function_passes_mxnet_what_its_signature_reads():
    """For every op function init may wrap, and every way of calling it, the wrappers'
    reading of the call (inputs, attributes as MXNet writes them, out, name) is what
    MXNet's own function hands to the op."""
    seen, checked, wrong = set(), 0, []
    for module, attr, fn, op, kind in mxi.op_function_sites():
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        sig, probe = mxi.signature_of(fn), _recording(fn, kind)
        for convention, args, kwargs in _calls(sig):
            try:
                probe(*args, **dict(kwargs))
            except _Recorded as r:
                inputs, attrs, extra = r.args
            else:
                raise AssertionError(f"{module.__name__}.{attr} did not reach the op")
            want = {k: v for k, v in attrs.items() if not k.startswith("__")}
            if kind == "ndarray" and sig.count_attr:  # MXNet's C side counts the inputs
                want.setdefault(sig.count_attr, str(len(inputs)))
            seen_inputs = [a for a in sig.input_args(args) if a is not None]
            seen_inputs += [v for v in kwargs.values() if isinstance(v, (mx.nd.NDArray, mx.sym.Symbol))]
            option = sig.option(args, kwargs, "out" if kind == "ndarray" else "name")
            checked += 1
            if (sig.attributes(args, kwargs) != want or sorted(map(id, seen_inputs)) != sorted(map(id, inputs))
                    or (option is not extra if kind == "ndarray" else option not in (None, extra))):
                wrong.append(f"{module.__name__}.{attr} ({convention}): MXNet passes {want}, "
                             f"the wrappers read {sig.attributes(args, kwargs)}")
    assert checked > 10000
    assert not wrong, f"{len(wrong)} calls read differently, e.g. {wrong[:3]}"


def test_a_function_mxnet_did_not_generate_is_refused():
    with pytest.raises(TypeError, match="not an MXNet-generated op function"):
        mxi.signature_of(lambda x: x)


# -- 2. generated op calls, patched against MXNet's own ---------------------------------

_PARAM = re.compile(r"^(\w+) : (.*)$", re.M)


def _required(fn):
    """A value for each required attribute, from the type MXNet's docstring gives it."""
    out = {}
    for name, typ in _PARAM.findall(fn.__doc__ or ""):
        if "required" in typ:
            t = typ.split(",")[0].strip()
            out[name] = (re.findall(r"'([^']*)'", t)[0] if t.startswith("{") else 2 if t.startswith(("int", "long"))
                         else 0.5 if t.startswith(("float", "double")) else (1, 1) if t.startswith("Shape")
                         else True if t.startswith("boolean") else None)
    return out


def _input_shapes(symf, names, attrs, first):
    """Shapes for the op's inputs: ``first`` for its data, the rest as MXNet infers them."""
    try:
        s = symf(*[mx.sym.var(n) for n in names], **attrs)
        args, _, aux = s.infer_shape_partial(**{names[0]: first})
        known = {**dict(zip(s.list_arguments(), args)), **dict(zip(s.list_auxiliary_states(), aux))}
    except MXNetError:
        return [first] * len(names)
    return [tuple(known[n]) if known.get(n) and all(known[n]) else first for n in names]


_RANDOM = ("random", "sample", "Dropout", "shuffle", "multinomial")


def _outcome(fn, args, kwargs):
    """``[(shape, dtype, float32 values)]`` of a call, or its exception's class."""
    try:
        if any(r in fn.__name__ for r in _RANDOM):
            mx.random.seed(0)
        res = fn(*args, **kwargs)
        outs = res if isinstance(res, (list, tuple)) else [res]
        return [(o.shape, dtype_name(o.dtype), mx.nd.amp_cast(o, dtype="float32").asnumpy()
                 if dtype_name(o.dtype) == "bfloat16" else o.asnumpy()) for o in outs]
    except Exception as e:  # noqa: BLE001  the class is what is compared
        return type(e)


def _build(symf, args, kwargs):
    try:
        with mx.name.NameManager():
            return symf(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return type(e)


@functools.lru_cache(maxsize=None)
def _generated_cases():
    """(site, nd function, sym function, signature, input names, input values, attributes)
    for every public mx.nd / mx.nd.contrib op function some mode wraps, with float32
    inputs, each input in turn int32 and int64, and the values of every conditional rule,
    where MXNet itself runs the call."""
    tables = [make_policy(**m).table for m in MODES.values()]
    rules = {}
    for table in tables:
        for op, rule in table.conditions.items():
            rules.setdefault(op, set()).update((rule.attr, v) for v in rule.values)
    sites = {}
    for module, attr, fn, op, kind in mxi.op_function_sites():
        # the ops init wraps: a class with a decision, or several inputs to make agree
        if kind == "ndarray" and not attr.startswith("_") \
                and module.__name__ in ("mxnet.ndarray", "mxnet.ndarray.contrib") \
                and (len(mxi.op_infos()[op].inputs) > 1 or any(t.class_of(op) is not OpClass.NEUTRAL for t in tables)):
            symf = getattr(importlib.import_module(module.__name__.replace("ndarray", "symbol")), attr)
            sites.setdefault(id(fn), (f"{module.__name__}.{attr}", fn, symf, mxi.signature_of(fn)))
    cases = []
    for site, fn, symf, sig in sites.values():
        names = ("a", "b") if sig.variadic else sig.inputs
        for extra in [{}] + [{a: v} for a, v in sorted(rules.get(sig.op, ()))]:
            attrs = {**_required(fn), **extra}
            for first in [(2, 3), (1, 2, 4, 4)]:
                shapes = [first] * 2 if sig.variadic else _input_shapes(symf, names, attrs, first)
                runs = functools.partial(_runs, fn, tuple(sorted(attrs.items())), tuple(shapes))
                found = [runs()]
                if found[0] is not None:
                    found.append(runs(floats="float64"))
                    for k in range(len(names)):  # an index, a condition, a length...
                        found += [runs(k, "int32"), runs(k, "int64")] if runs(k, "int32") is not None else []
                    cases += [(site, fn, symf, sig, names, vals, attrs) for vals in found if vals is not None]
                    break
    return cases


@functools.lru_cache(maxsize=None)
def _runs(fn, attrs, shapes, k=None, ints=None, floats="float32"):
    """The input values (input ``k`` of type ``ints``, the others ``floats``) when MXNet
    runs ``fn`` on them, else None."""
    vals = tuple(np.random.RandomState(i).randint(0, 2, sh).astype(ints) if i == k
                 else np.random.RandomState(i).uniform(0.1, 1, sh).astype(floats) for i, sh in enumerate(shapes))
    ok = not isinstance(_outcome(fn, [mx.nd.array(v, dtype=v.dtype) for v in vals], dict(attrs)), type)
    return vals if ok else None


def _conventions(sig, names, vals, attrs, low, symbolic=False):
    """(convention, args, kwargs) with fresh inputs each (update ops write into theirs)."""
    def xs(dtypes=None):
        dtypes = dtypes or [v.dtype for v in vals]
        if symbolic:
            return tuple(mx.sym.var(n, dtype=d) for n, d in zip(names, dtypes))
        return tuple(mx.nd.array(v, dtype=d) for v, d in zip(vals, dtypes))
    yield "keyword attributes", xs(), dict(attrs)
    if sig.variadic:
        if not symbolic:
            yield "name", xs(), dict(attrs, name="n")
        return
    yield "keyword inputs", (), {**dict(zip(names, xs())), **attrs}
    order = [p for p in sig.params[sig.n_inputs:] if p in sig.attrs]
    last = max([order.index(a) for a in attrs], default=-1)
    yield "positional attributes", xs() + tuple(attrs.get(a, _Null) for a in order[:last + 1]), {}
    optional = next((a for a in order if a not in attrs and a != "dtype"), None)
    if optional:
        yield f"{optional}=None", xs(), {**attrs, optional: None}  # MXNet passes 'None'
    floats = [k for k, v in enumerate(vals) if v.dtype.kind == "f"]
    if not symbolic and low is not None and len(floats) >= 2:  # data in the low dtype, parameters float32
        dts = [v.dtype if k != floats[0] else mxi.BFLOAT16 if low == "bfloat16" else np.float16
               for k, v in enumerate(vals)]
        yield "mixed", xs(dts), dict(attrs)
        yield "mixed, positional", xs(dts) + tuple(attrs.get(a, _Null) for a in order[:last + 1]), {}


def _brief(res):
    return res.__name__ if isinstance(res, type) else [(r[0], r[1]) for r in res]


def _same(a, b):
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    return [(x[0], x[1]) for x in a] == [(y[0], y[1]) for y in b] and all(
        np.array_equal(x[2], y[2], equal_nan=True) for x, y in zip(a, b))


def _heads_dtypes(sym, names, vals):
    typed = infer_dtypes(sym, {n: v.dtype.name for n, v in zip(names, vals)}, partial=True) or {}
    graph = json.loads(sym.tojson(remove_amp_cast=False))
    return [typed.get((graph["nodes"][h[0]]["name"], h[1])) for h in graph["heads"]]


@functools.lru_cache(maxsize=None)
def _mxnet_outcomes():
    """MXNet's own outcome of every generated call (AMP off): {(case, convention): outcome}."""
    out = {}
    for i, (site, fn, symf, sig, names, vals, attrs) in enumerate(_generated_cases()):
        for conv, args, kwargs in _conventions(sig, names, vals, attrs, None):
            out[(i, conv)] = _outcome(fn, args, kwargs)
        first = out[(i, "keyword attributes")]
        if not isinstance(first, type) and len(first) == 1 and first[0][0]:
            args = next(_conventions(sig, names, vals, attrs, None))[1]
            out[(i, "out=")] = _outcome(fn, args, dict(attrs, out=mx.nd.zeros(first[0][0], dtype=first[0][1])))
        for conv, args, kwargs in _conventions(sig, names, vals, attrs, None, symbolic=True):
            built = _build(symf, args, kwargs)
            out[(i, "sym " + conv)] = built if isinstance(built, type) else "built"
    return out


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_generated_op_calls_match_mxnet_in_every_convention(mode):
    """Every wrapped mx.nd op, with float and integer inputs, called with its inputs and
    attributes positional or by keyword, None attributes, ``out=`` and ``name=``:
    patched, it gives MXNet's shapes (or MXNet's error class); every convention gives
    the keyword convention's result to the bit; low-precision data with float32
    parameters gives the same in every convention; ``out=`` gets the result in the
    caller's dtype; the imperative dtype is the one the symbolic plan infers (natively);
    mx.sym builds the same graph in every convention."""
    # data in a low dtype next to float32 parameters: bfloat16 arrays where bfloat16 runs
    low = "float16" if MODES[mode].get("emulate") else MODES[mode]["target_dtype"]
    cases = _generated_cases()
    assert len(cases) > 250
    base = _mxnet_outcomes()
    problems = []
    gluon_amp.init(**MODES[mode])
    for i, (site, fn, symf, sig, names, vals, attrs) in enumerate(cases):
        tag = f"{site}({', '.join(v.dtype.name for v in vals)})"
        got = {conv: _outcome(fn, args, kwargs)
               for conv, args, kwargs in _conventions(sig, names, vals, attrs, low)}
        ref = got["keyword attributes"]
        try:
            mx.nd.waitall()
        except MXNetError as e:  # an error in work no output waited for (a cast, say)
            problems.append(f"{tag}: deferred {str(e).splitlines()[-1]}")
        for conv, res in got.items():
            want = base.get((i, conv))
            if conv.startswith("mixed"):  # MXNet itself rejects mixed dtypes: conventions agree
                if conv != "mixed" and not _same(res, got["mixed"]):
                    problems.append(f"{tag} {conv}: differs from the keyword convention")
            elif isinstance(want, type) or isinstance(res, type):
                if want is not res:
                    problems.append(f"{tag} {conv}: MXNet gives {_brief(want)}, patched {_brief(res)}")
            elif [r[0] for r in res] != [w[0] for w in want]:
                problems.append(f"{tag} {conv}: shapes {[r[0] for r in res]}, MXNet's {[w[0] for w in want]}")
            elif not conv.endswith("=None") and not _same(res, ref):
                problems.append(f"{tag} {conv}: differs from the keyword convention")
        want = base.get((i, "out="))
        if want is not None:  # the caller's array, in the dtype MXNet's own call gives it
            mine = base[(i, "keyword attributes")][0]
            args = next(_conventions(sig, names, vals, attrs, low))[1]
            res = _outcome(fn, args, dict(attrs, out=mx.nd.zeros(mine[0], dtype=mine[1])))
            if isinstance(want, type) or isinstance(res, type):
                if want is not res:
                    problems.append(f"{tag} out=: MXNet gives {_brief(want)}, patched {_brief(res)}")
            elif res[0][1] != mine[1] or not np.array_equal(res[0][2], ref[0][2].astype(mine[1]), equal_nan=True):
                problems.append(f"{tag} out=: not the result in the caller's {mine[1]}")
        symbols = {conv: _build(symf, args, kwargs)
                   for conv, args, kwargs in _conventions(sig, names, vals, attrs, low, symbolic=True)}
        sref = symbols["keyword attributes"]
        for conv, res in symbols.items():
            want = base[(i, "sym " + conv)]
            if isinstance(want, type) or isinstance(res, type):
                if want is not res:
                    problems.append(f"{tag} mx.sym {conv}: MXNet gives {want}, patched {res}")
            elif not conv.endswith("=None") and res.tojson(remove_amp_cast=False) != sref.tojson(remove_amp_cast=False):
                problems.append(f"{tag} mx.sym {conv}: another graph than the keyword convention's")
        if mode == "bfloat16" and not isinstance(ref, type) and not isinstance(sref, type):
            planned = _heads_dtypes(sref, names, vals)[:len(ref)]
            if planned != [r[1] for r in ref]:
                problems.append(f"{tag}: runs in {[r[1] for r in ref]}, its graph in {planned}")
    gluon_amp.disable()
    assert not problems, f"{len(problems)} problems, e.g.\n" + "\n".join(problems[:10])


# -- 3. the conventions client code uses, through every path ----------------------------

class PositionalEmbedding(gluon.HybridBlock):
    """GluonNLP's BERT and Transformer: ``F.Embedding(steps, weight, max_length, units)``."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(10, 4))
            self.dense = gluon.nn.Dense(3, flatten=False, in_units=4)

    def hybrid_forward(self, F, x, weight):
        return self.dense(F.Embedding(x, weight, 10, 4))


class StatesOut(gluon.HybridBlock):
    """A GluonNLP language model's shape: an LSTM whose states are graph outputs, one of
    them read by another op."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.rnn = gluon.rnn.LSTM(8, input_size=4)
            self.dense = gluon.nn.Dense(3, flatten=False, in_units=8)

    def hybrid_forward(self, F, x, states):
        y, (h, c) = self.rnn(x, states)
        return self.dense(y), [h, F.sum(c, axis=2, keepdims=True)]


def _embedding_case():
    return PositionalEmbedding(), (mx.nd.array([[1, 2, 3], [4, 5, 9]]),)


def _states_case():
    rng = np.random.RandomState(0)
    return StatesOut(), (mx.nd.array(rng.uniform(-1, 1, (5, 2, 4))),
                         [mx.nd.array(rng.uniform(-1, 1, (1, 2, 8))), mx.nd.array(rng.uniform(-1, 1, (1, 2, 8)))])


def _flat(x):
    return [z for y in x for z in _flat(y)] if isinstance(x, (list, tuple)) else [x]


def _as_float32(outs):
    return [mx.nd.amp_cast(o, dtype="float32").asnumpy() for o in _flat(outs)]


def _ready(make):
    """A fresh block of ``make`` (same weights every time), hybridized and run once in FP32."""
    net, args = make()
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net, args, _as_float32(net(*args))


@pytest.mark.parametrize("make", [_embedding_case, _states_case], ids=["positional-embedding", "states-out"])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_client_conventions_train_hybridized_under_init(make, mode):
    """Issue 31, defects 3 and 4: under init, hybridized, a positional F.Embedding and an
    LSTM whose states are outputs run forward and backward, close to FP32."""
    _, _, ref = _ready(make)
    gluon_amp.init(**MODES[mode])
    net, args, _ = _ready(make)
    with autograd.record():
        outs = net(*args)
        loss = sum(mx.nd.amp_cast(o, dtype="float32").sum() for o in _flat(outs))
    loss.backward()
    tol = 2e-2 if MODES[mode]["target_dtype"] == "bfloat16" else 2e-3
    for got, want in zip(_as_float32(outs), ref):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert all(np.isfinite(p.grad().astype("float32").asnumpy()).all() for p in net.collect_params().values())


@pytest.mark.parametrize("make", [_embedding_case, _states_case], ids=["positional-embedding", "states-out"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_client_conventions_convert_report_and_compare(make, dtype):
    """The same blocks through convert_hybrid_block (real and emulated), report and
    debug.compare; the converted block is called, and answers, as the block is."""
    net, args, ref = _ready(make)
    tol = 2e-2 if dtype == "bfloat16" else 2e-3
    emulated = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, emulate=True)
    outs = emulated(*args)
    assert [o.shape for o in _flat(outs)] == [r.shape for r in ref]
    assert type(outs) is type(net(*args)) and len(outs) == len(net(*args))
    assert [o.shape for o in _flat(emulated(*_flat(args)))] == [r.shape for r in ref]  # the graph's inputs flat
    for got, want in zip(_as_float32(outs), ref):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    real = gluon_amp.convert_hybrid_block(net, target_dtype=dtype, fuse=False)
    rows = {r.name: r for r in gluon_amp.report(real).rows}
    assert {r.op for r in rows.values()} >= ({"Embedding"} if make is _embedding_case else {"RNN", "sum"})
    assert "?" not in {r.dtype for r in rows.values()}
    assert gluon_amp.report(net, target_dtype=dtype).rows
    rep = gluon_amp.debug.compare(net, *_flat(args), target_dtype=dtype, emulate=True)
    assert rep.rows and all(np.isfinite(r.error) for r in rep.rows)


def test_rnn_state_outputs_are_typed_entries():
    """An op's outputs are named by the op (RNN's state and statecell, BatchNorm's mean and
    var, SliceChannel's output1): every entry gets its dtype, under its node's name."""
    x, p, h, c = (mx.sym.var(n) for n in "xphc")
    rnn = mx.sym.RNN(x, p, h, c, state_size=4, num_layers=1, mode="lstm", state_outputs=True, name="rnn0")
    parts = mx.sym.split(rnn[0], num_outputs=2, axis=0, name="sp")
    bn = mx.sym.BatchNorm(x, name="bn", output_mean_var=True)
    sym = mx.sym.Group([parts[1], rnn[1], rnn[2], bn[2]])
    typed = infer_dtypes(sym, {"x": "float32"}, partial=True)
    for key in [("rnn0", 0), ("rnn0", 1), ("rnn0", 2), ("sp", 1), ("bn", 1), ("bn", 2)]:
        assert typed[key] == "float32", key
    nodes = {n["name"] for n in json.loads(sym.tojson())["nodes"]}
    assert {name for name, _ in entry_keys(sym.get_internals())} <= nodes
    # one op's type rule reports every output, the named ones included
    assert op_types("RNN", {"state_size": "4", "num_layers": "1", "mode": "lstm", "state_outputs": "True"},
                    ("float32",) * 4)[1] == ("float32",) * 3


def test_op_types_says_unknown_for_attributes_mxnet_rejects():
    """A one-op graph MXNet cannot build (a required attribute missing) is "unknown"."""
    assert op_types("Embedding", {}, ("float32", "float32")) is None
    assert op_types("Embedding", {"input_dim": "10", "output_dim": "4"}, ("float32", "float32")) is not None


def test_a_positional_grad_scale_gets_the_loss_scale():
    """SoftmaxOutput(data, label, grad_scale): the loss scale multiplies it where it is."""
    w = gluon.Parameter("w_gs", shape=(2, 3))
    w.initialize(mx.init.Constant(0.1))
    x, y = mx.nd.array([[1.0, 2.0, 3.0]]), mx.nd.array([1.0])

    def grad(*args, **kwargs):
        trainer = gluon.Trainer([w], "sgd", {"learning_rate": 1.0}, update_on_kvstore=False)
        gluon_amp.init_trainer(trainer, LossScaler(init_scale=8.0))
        with autograd.record():
            mx.nd.SoftmaxOutput(mx.nd.dot(x, w.data(), transpose_b=True), y, *args, **kwargs).backward()
        return w.grad().asnumpy()

    with gluon_amp.autocast("float16", emulate=True):
        keyword, positional = grad(grad_scale=2.0), grad(2.0)
    np.testing.assert_array_equal(positional, keyword)
    with autograd.record():
        mx.nd.SoftmaxOutput(mx.nd.dot(x, w.data(), transpose_b=True), y, grad_scale=16.0).backward()
    np.testing.assert_allclose(keyword, w.grad().asnumpy(), rtol=1e-6)


def _lambda_cases():
    """(name, call(F, *inputs) -> output, inputs): ops with integer inputs, positional and
    nested-list attributes, None attributes, as hybridized client code writes them."""
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.uniform(-1, 1, (2, 3, 4)))
    w = mx.nd.array(rng.uniform(-1, 1, (6, 4)))
    ids = {t: mx.nd.array([[0, 2, 5], [1, 3, 4]], dtype=t) for t in ("int32", "int64")}
    img = mx.nd.array(rng.uniform(0, 1, (1, 2, 4, 4)))
    cases = []
    for t, i in ids.items():
        lengths = mx.nd.array([2, 3], dtype=t)
        cond = mx.nd.array(rng.randint(0, 2, (2, 3, 4)), dtype=t)
        cases += [(f"Embedding({t}) positional", lambda F, i, w: F.Embedding(i, w, 6, 4), (i, w)),
                  (f"take({t})", lambda F, w, i: F.take(w, i, 0, "clip"), (w, i)),
                  (f"one_hot({t})", lambda F, i: F.one_hot(i, 6), (i,)),
                  (f"where({t})", lambda F, c, a: F.where(c, a, a * 2), (cond, x)),
                  (f"SequenceMask({t} lengths)", lambda F, a, n: F.SequenceMask(a, n, True, -1.0, 1), (x, lengths)),
                  (f"softmax({t} length)", lambda F, a, n: F.softmax(a, n, axis=1, use_length=True),
                   (x[:, :, 0], lengths)),
                  (f"pick({t})", lambda F, a, n: F.pick(a, n - 2, 1), (x[:, :, 0], lengths))]
    cases += [
        ("Activation softrelu positional", lambda F, a: F.Activation(a, "softrelu"), (x,)),
        ("LeakyReLU elu positional", lambda F, a: F.LeakyReLU(a, None, "elu"), (x,)),
        ("FullyConnected positional", lambda F, a, w: F.FullyConnected(a, w, None, 6, True, False), (x, w)),
        ("sum axis=None", lambda F, a: F.sum(a, axis=None), (x,)),
        ("MultiBoxPrior nested lists", lambda F, a: F.contrib.MultiBoxPrior(a, sizes=[0.5, 0.25], ratios=(1, 2.0),
                                                                           steps=[0.25, 0.25]), (img,)),
        ("Pooling tuples", lambda F, a: F.Pooling(a, (2, 2), "max", False, False, "valid", (2, 2)), (img,)),
        ("Concat variadic", lambda F, a, b: F.Concat(a, b, dim=1), (x, x)),
    ]
    return cases


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_client_op_calls_run_hybridized_and_imperatively_as_mxnet_runs_them(mode):
    """Each call, as an imperative call and in a hybridized block under init: MXNet's
    shapes, finite values, and the hybridized block's plan types every output."""
    problems = []
    cases = _lambda_cases()
    refs = [[o.shape for o in _flat(f(mx.nd, *args))] for _, f, args in cases]
    gluon_amp.init(**MODES[mode])
    for (name, f, args), ref in zip(cases, refs):
        for how in ("imperative", "hybridized"):
            block = gluon.nn.HybridLambda(f)
            if how == "hybridized":
                block.hybridize()
            try:
                outs = _flat(block(*args))
                if [o.shape for o in outs] != ref or not all(np.isfinite(v).all() for v in _as_float32(outs)):
                    problems.append(f"{name} {how}: shapes {[o.shape for o in outs]} (MXNet's {ref}) or not finite")
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name} {how}: {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
                continue
            if how == "hybridized" and "?" in {r.dtype for r in gluon_amp.report(block).rows}:
                problems.append(f"{name}: the plan leaves an output untyped")
    gluon_amp.disable()
    assert not problems, "\n".join(problems)


def _np_calls():
    """mx.np / mx.npx calls that reach the patched _npi/_npx functions, their attributes
    positional or nested as NumPy users write them."""
    from mxnet import np as mnp, npx
    rng = np.random.RandomState(0)
    x = mnp.array(rng.uniform(0.1, 1, (2, 3)).astype("float32"))
    w = mnp.array(rng.uniform(0.1, 1, (4, 3)).astype("float32"))
    idx = {t: mnp.array([[0, 2], [1, 3]], dtype=t) for t in ("int32", "int64")}
    lengths = mnp.array([2, 3], dtype="int32")
    seq = mnp.array(rng.uniform(0.1, 1, (3, 2, 3)).astype("float32"))
    return {
        "npx.fully_connected positional": lambda: npx.fully_connected(x, w, mnp.zeros((4,)), 4),
        "npx.embedding(int32) positional": lambda: npx.embedding(idx["int32"], w, 4, 3),
        "npx.embedding(int64)": lambda: npx.embedding(idx["int64"], w, input_dim=4, output_dim=3),
        "np.take(int64)": lambda: mnp.take(w, idx["int64"], axis=0),
        "npx.one_hot(int32)": lambda: npx.one_hot(idx["int32"], 5),
        "npx.softmax(length)": lambda: npx.softmax(x, length=lengths, axis=-1, use_length=True),
        "npx.sequence_mask": lambda: npx.sequence_mask(seq, lengths, use_sequence_length=True, value=-1.0),
        "npx.activation softrelu": lambda: npx.activation(x, "softrelu"),
        "npx.leaky_relu elu": lambda: npx.leaky_relu(x, act_type="elu"),
        "npx.batch_dot": lambda: npx.batch_dot(seq, seq, transpose_b=True),
        "npx.layer_norm": lambda: npx.layer_norm(x, mnp.ones((3,)), mnp.zeros((3,)), axis=-1),
        "np.where(int32)": lambda: mnp.where(mnp.array([[1, 0, 1], [0, 1, 0]], dtype="int32"), x, x * 2),
        "np.concatenate": lambda: mnp.concatenate([x, x], axis=0),
        "np.einsum": lambda: mnp.einsum("ij,kj->ik", x, w),
        "np.pad nested": lambda: mnp.pad(x, ((1, 1), (2, 2)), mode="constant"),
        "np.sum axis=None": lambda: mnp.sum(x, axis=None),
        "np.cumsum dtype=None": lambda: mnp.cumsum(x, axis=1, dtype=None),
        "ndarray.astype (out=)": lambda: x.astype("float16"),
    }


def _np_outcomes():
    out = {}
    for name, call in _np_calls().items():
        try:
            out[name] = [(o.shape, dtype_name(o.dtype)) for o in _flat(call())]
        except Exception as e:  # noqa: BLE001
            out[name] = type(e)
    return out


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_numpy_front_end_calls_work_as_mxnet_runs_them(mode):
    """mx.np / mx.npx: MXNet's shapes (or error class) under init; emulated, float32."""
    from mxnet import npx
    npx.set_np()
    try:
        ref = _np_outcomes()
        with gluon_amp.autocast(**MODES[mode]):
            got = _np_outcomes()
    finally:
        npx.reset_np()
    emulated = MODES[mode].get("emulate", False)
    wrong = {k: (ref[k], got[k]) for k in ref
             if (ref[k] if isinstance(ref[k], type) else [s for s, _ in ref[k]])
             != (got[k] if isinstance(got[k], type) else [s for s, _ in got[k]])
             or (emulated and not isinstance(got[k], type) and {d for _, d in got[k]} - {"float32", "int32", "int64",
                                                                                        "float16"})}
    assert not isinstance(ref["npx.embedding(int32) positional"], type)
    assert not wrong, wrong


@pytest.fixture(scope="module")
def gluonnlp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("gluonnlp", reason="GluonNLP is a test dependency (make test installs it)")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluonnlp_language_model_and_bert_encoder_hybridized_emulated(gluonnlp, dtype):
    """GluonNLP's own blocks, tiny: StandardRNN (an LSTM LM: states out) and BERTEncoder
    (positional F.Embedding), hybridized under init(emulate=True), forward and backward."""
    rng = np.random.RandomState(0)
    lm = gluonnlp.model.StandardRNN("lstm", 20, 8, 8, 1, dropout=0.0, tie_weights=False)
    enc = gluonnlp.model.BERTEncoder(num_layers=1, units=8, hidden_size=16, max_length=8, num_heads=2, dropout=0.0)
    tokens = mx.nd.array(rng.randint(0, 20, (5, 2)))
    with gluon_amp.autocast(dtype, emulate=True):
        for net in (lm, enc):
            net.initialize(mx.init.Xavier())
            net.hybridize()
        with autograd.record():
            out, states = lm(tokens, lm.begin_state(batch_size=2, func=mx.nd.zeros))
            encoded, _ = enc(mx.nd.array(rng.uniform(-1, 1, (6, 2, 8))), None, mx.nd.array([6, 3]))  # (T, N, C)
            loss = out.sum() + sum(s.sum() for s in _flat(states)) + encoded.sum()
        loss.backward()
    assert out.shape == (5, 2, 20) and encoded.shape == (6, 2, 8)
    assert np.isfinite(loss.asscalar())


def _sym_sites():
    """(name, function, op) of every public mx.sym / mx.sym.contrib op function with declared
    tensor inputs, not variadic."""
    infos = mxi.op_infos()
    sites = {}
    for module, attr, fn, op, kind in mxi.op_function_sites():
        if module.__name__ in ("mxnet.symbol", "mxnet.symbol.contrib") and not attr.startswith("_"):
            info = infos.get(op)
            if info is not None and info.inputs and not info.variadic:
                sites[f"{module.__name__}.{attr}"] = (fn, op)
    return sorted(sites.items())


def _sym_facts(fn, info, given):
    """What MXNet's graph of ``fn`` on variables for its first ``given`` inputs (it creates the
    rest) says: arguments, auxiliary states, outputs and the dtypes inferred from float32 data
    (the names of the variables it created and their non-float dtypes); or the error class."""
    with mx.name.NameManager():
        try:
            sym = fn(*[mx.sym.var(f"in{k}") for k in range(given)], name="op")
            sym = sym[0] if isinstance(sym, list) else sym
            arg_types, _, _ = sym.infer_type_partial(in0="float32")
        except MXNetError:
            return MXNetError
    names = sym.list_arguments()
    fixed = {n: np.dtype(t).name for n, t in zip(names, arg_types or [None] * len(names))
             if t is not None and np.dtype(t).kind != "f"}
    return names, sym.list_auxiliary_states(), sym.list_outputs(), fixed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_sym_op_built_from_some_variables_is_mxnet_s_graph(dtype):
    """Generated: each mx.sym op function called with its first input only (MXNet creates its
    weights, its indices, its auxiliary states) and with every declared input: under ``init``
    the graph has MXNet's arguments, auxiliary states and outputs, and the inputs MXNet types
    as integers stay integers. Found: ``batch_take(data)``'s created indices pinned to float32
    (infer_type failed), ``contrib.quantized_batch_norm(*variables)`` refused ("Mutation target
    can only be Variable": a cast in front of its moving mean)."""
    infos = mxi.op_infos()
    sites = _sym_sites()
    assert len(sites) > 150
    plain = {name: [_sym_facts(fn, infos[op], n) for n in (1, len(infos[op].inputs))]
             for name, (fn, op) in sites}
    gluon_amp.init(dtype, emulate=True)
    fc = mx.sym.FullyConnected(mx.sym.var("d"), num_hidden=2)  # the functions are AMP's now, in place
    assert "amp_cast" in fc.tojson(remove_amp_cast=False)
    problems = []
    for name, (fn, op) in sites:
        for want, n in zip(plain[name], (1, len(infos[op].inputs))):
            got = _sym_facts(fn, infos[op], n)
            if got != want:
                problems.append(f"{name} on {n} input(s): MXNet's {want}, under init {got}")
    assert not problems, f"{len(problems)} problems, e.g.\n" + "\n".join(problems[:10])
