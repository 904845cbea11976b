"""Drop-in proof: every public function of ``mxnet.contrib.amp``, called the same way on
gluon_amp, compared with the peer run in subprocesses (it cannot be undone in-process).

Everything is graph level (``infer_type``, cast positions, parameter dtypes): nothing runs
float16 conv/FC. Three peer processes start once per module, in parallel: one for the
converters and lists, one per dtype under ``amp.init`` (training graphs; the trainer API
in the float16 one, on ops that are float32 either way).

Differences by design, tested as our documented behaviour instead of the peer's:

* Op tables differ (ours classifies every registered op, and in bfloat16 keeps data
  movement neutral where the peer forces float32): a node whose op is in another class
  in the two tables is checked against our table only (:func:`_check_ours`).
* ``list_*`` accept ``'bfloat16'`` (the peer needs its structured NumPy dtype) and list
  canonical op names only (the peer repeats aliases).
* ``list_lp16_use_fp32_params('float16')`` returns the mapping (the peer: ``None``):
  our float16 table keeps normalisation parameters float32 too.
* Bad input: ``TypeError``/``ValueError`` (the peer: ``AssertionError``); op-list
  mistakes raise ``OpListError``/``OpListTypeError``, which are ``AssertionError`` too.
* ``convert_hybrid_block`` without ``ctx`` works on CPU (the peer defaults to ``gpu(0)``).
* ``convert_bucketing_module`` also converts buckets created after the conversion (the
  peer's new buckets come from the original FP32 ``sym_gen``).
"""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import gluon_amp
from peer_oracle import (BF16, GRAPHS, bucket_summaries, bucketing_module, block_summary, canonical,
                         fp32_params, param_dtypes, run_gluon_net, softmax_output_step, start_peer, summarize,
                         training_graph)

DTYPES = ("float16", "bfloat16")
LISTS = ("list_lp16_ops", "list_fp32_ops", "list_lp16_fp32_ops", "list_widest_type_cast",
         "list_loss_output_functions")
CLASS_LISTS = {"list_lp16_ops": "lp", "list_fp32_ops": "fp32", "list_lp16_fp32_ops": "neutral",
               "list_widest_type_cast": "widest"}

_PEER_CONVERT = '''
def err(fn):
    try:
        fn()
        return None
    except Exception as exc:
        return type(exc).__name__

result = {"lists": {}, "model": {}, "symbol": {}, "block": {}, "bucket": {}, "errors": {}}
for d, key in (("float16", "float16"), ("bfloat16", BF16)):
    lists = {f: getattr(amp, f)(key) for f in ("list_lp16_ops", "list_fp32_ops", "list_lp16_fp32_ops",
             "list_widest_type_cast", "list_loss_output_functions", "list_lp16_use_fp32_params")}
    lists["list_conditional_fp32_ops"] = [[a, b, list(c)] for a, b, c in amp.list_conditional_fp32_ops(key)]
    result["lists"][d] = lists
    for name, (build, shapes, kw) in GRAPHS.items():
        sym = build()
        args, aux = fp32_params(sym, shapes)
        data = {n: np.float32 for n in shapes}
        s = amp.convert_symbol(sym, target_dtype=d, data_names=list(shapes), **kw)
        result["symbol"][f"{d}/{name}"] = summarize(s, data)
        for cop in (False, True):
            s, a, x = amp.convert_model(sym, dict(args), dict(aux), target_dtype=d, cast_optional_params=cop, **kw)
            types = {**data, **{k: v.dtype for k, v in {**a, **x}.items()}}
            result["model"][f"{d}/{name}/{cop}"] = {"graph": summarize(s, types), "params": param_dtypes({**a, **x})}
    for kind in ("cbrfs", "prelu"):
        net = run_gluon_net(kind)
        result["block"][f"{d}/{kind}"] = block_summary(amp.convert_hybrid_block(net, target_dtype=d, ctx=mx.cpu()))
    for cop in (False, True):
        new = amp.amp.convert_bucketing_module(bucketing_module(), target_dtype=d, cast_optional_params=cop)
        result["bucket"][f"{d}/{cop}"] = bucket_summaries(new)
result["errors"]["convert_symbol_not_symbol"] = err(lambda: amp.convert_symbol("x", target_dtype="float16"))
result["errors"]["list_str_bfloat16"] = err(lambda: amp.list_lp16_ops("bfloat16"))
result["errors"]["block_default_ctx"] = err(lambda: amp.convert_hybrid_block(run_gluon_net("cbrfs"), "bfloat16"))
result["errors"]["bucket_not_module"] = err(lambda: amp.amp.convert_bucketing_module("x"))
result["fp16_use_fp32_params"] = amp.list_lp16_use_fp32_params("float16")
result["canonical"] = {n: canonical(n) for f in ("list_lp16_ops", "list_fp32_ops", "list_lp16_fp32_ops",
                       "list_widest_type_cast") for d in result["lists"] for n in result["lists"][d][f]}
'''

_PEER_INIT = '''
amp.init(target_dtype={dtype!r})
result = {{"graphs": {{name: training_graph(build) for name, (build, _, kw) in GRAPHS.items() if not kw}}}}
net = gluon_net("cbrfs")
result["gluon"] = training_graph(lambda: net(mx.sym.var("data")))
if {trainer}:
    from mxnet import autograd, gluon
    w = gluon.Parameter("w", shape=(3,))
    w.initialize(mx.init.Constant(0.5))
    trainer = gluon.Trainer([w], "sgd", {{"learning_rate": 0.1}}, update_on_kvstore=False)
    amp.init_trainer(optimizer_or_trainer=trainer)
    x = mx.nd.array([1.0, 2.0, 3.0])
    with autograd.record():
        loss = (x * w.data()).sum()
        with amp.scale_loss(loss, optimizer_or_trainer=trainer) as scaled:
            autograd.backward(scaled)
    out = {{"scaled": float(scaled.asscalar()), "grad_scaled": w.grad().asnumpy().tolist()}}
    amp.unscale(optimizer_or_trainer=trainer)
    out["grad"] = w.grad().asnumpy().tolist()
    trainer.step(1)
    out["w"] = w.data().asnumpy().tolist()
    result["trainer"] = out
    result["loss_output"] = softmax_output_step(amp)
'''


@pytest.fixture(scope="module")
def peer():
    """The peer's results: {'convert': ..., 'float16': ..., 'bfloat16': ...} (three processes)."""
    runs = {"convert": start_peer(_PEER_CONVERT, timeout=240)}
    for d in DTYPES:
        runs[d] = start_peer(_PEER_INIT.format(dtype=d, trainer=d == "float16"), timeout=240)
    return {k: r.result() for k, r in runs.items()}


# ---------------------------------------------------------------- helpers

def _peer_classes(peer, dtype):
    """Canonical op name -> class in the peer's tables for ``dtype``.

    An op listed by its registered name keeps that class; an alias only fills a gap (the
    peer lists e.g. ``_sparse_FullyConnected`` as neutral next to FullyConnected as lp16).
    """
    lists, canon = peer["convert"]["lists"][dtype], peer["convert"]["canonical"]
    out, via_alias = {}, {}
    for f, cls in CLASS_LISTS.items():
        for n in lists[f]:
            c = canon.get(n) or n
            (out if c == n else via_alias)[c] = cls
    for n, attr, values in lists["list_conditional_fp32_ops"]:
        out[n] = ("conditional", attr, tuple(sorted(values)))
    return {**via_alias, **out}


def _our_classes(dtype):
    out = {n: cls for f, cls in CLASS_LISTS.items() for n in getattr(gluon_amp, f)(dtype)}
    # a conditional rule is its class *and* its values: ours adds LeakyReLU prelu/rrelu for
    # bfloat16, which MXNet 1.9.1 cannot run in bfloat16 on a CPU
    out.update({n: ("conditional", attr, tuple(sorted(values)))
                for n, attr, values in gluon_amp.list_conditional_fp32_ops(dtype)})
    return out


def _check_ours(node, dtype, ours_cls):
    """A node whose op the two tables classify differently: it must follow OUR table."""
    cls = ours_cls.get(node["op"], "neutral")
    floats = [t for t in node["in"] if t in ("float16", "bfloat16", "float32", "float64")]
    if node["op"] in ("Cast", "amp_cast"):
        return  # its output dtype is its attribute; inference checks it
    want = {"lp": dtype, "fp32": "float32"}.get(cls)
    if cls == "neutral" and floats:
        want = floats[0]  # neutral ops follow their (first) data input
    if want is not None:
        assert node["out"][0] == want, f"{node} should output {want} ({cls} in our table)"


def _compare(ours, theirs, dtype, peer):
    """Same dtypes as the peer on every node both tables treat alike; ours follows our table
    on the others. When the tables agree on the whole graph, the same casts on the data
    path (no-op casts aside: the peer casts slice_like's float16 output to float16 again)
    and every variable read in the same dtypes (where it is cast may differ)."""
    assert ours.get("typed"), f"ours does not type-check: {ours.get('error')}"
    if not theirs.get("typed"):
        return
    ours_cls, peer_cls = _our_classes(dtype), _peer_classes(peer, dtype)
    assert set(ours["ops"]) == set(theirs["ops"]), "op nodes were added or dropped"
    differ = False
    for name, node in ours["ops"].items():
        op = node["op"]
        if ours_cls.get(op, "neutral") == peer_cls.get(op, "unlisted"):
            assert node == theirs["ops"][name], f"{name}: ours {node} peer {theirs['ops'][name]}"
        else:
            differ = True
            _check_ours(node, dtype, ours_cls)
    if not differ:
        data_path = lambda casts: [c[:4] for c in casts if c[4] == "op" and not c[5]]  # noqa: E731
        assert data_path(ours["casts"]) == data_path(theirs["casts"])
        assert ours["reads"] == theirs["reads"]


def _check_params(ours, theirs, cast_optional_params, dtype):
    """Stored parameter dtypes are the peer's: with cast_optional_params, and without it for
    the parameters an op's type rule requires in low precision. Except the documented
    difference: bfloat16 LeakyReLU prelu runs in float32 here, so its slope stays float32."""
    exempt = {k for k in ours if dtype == "bfloat16" and k.endswith("_alpha")}
    assert {k: v for k, v in ours.items() if k not in exempt} == \
        {k: v for k, v in theirs.items() if k not in exempt}, (cast_optional_params, ours, theirs)
    assert all(ours[k] == "float32" for k in exempt)


def _types(shapes, params=None):
    return {**{n: np.float32 for n in shapes}, **{k: v.dtype for k, v in (params or {}).items()}}


# ---------------------------------------------------------------- converters

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_convert_symbol_matches_peer(peer, graph, dtype):
    build, shapes, kw = GRAPHS[graph]
    out = gluon_amp.convert_symbol(build(), target_dtype=dtype, data_names=list(shapes), **kw)
    _compare(summarize(out, _types(shapes)), peer["convert"]["symbol"][f"{dtype}/{graph}"], dtype, peer)


@pytest.mark.parametrize("cast_optional_params", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_convert_model_matches_peer(peer, graph, dtype, cast_optional_params):
    build, shapes, kw = GRAPHS[graph]
    sym = build()
    args, aux = fp32_params(sym, shapes)
    before = {k: v.asnumpy().copy() for k, v in {**args, **aux}.items()}
    s, a, x = gluon_amp.convert_model(sym, args, aux, target_dtype=dtype,
                                      cast_optional_params=cast_optional_params, **kw)
    theirs = peer["convert"]["model"][f"{dtype}/{graph}/{cast_optional_params}"]
    _compare(summarize(s, _types(shapes, {**a, **x})), theirs["graph"], dtype, peer)
    ours_cls, peer_cls = _our_classes(dtype), _peer_classes(peer, dtype)
    if all(ours_cls.get(n["op"], "neutral") == peer_cls.get(n["op"]) for n in theirs["graph"]["ops"].values()):
        _check_params(param_dtypes({**a, **x}), theirs["params"], cast_optional_params, dtype)
    # unlike the peer, the caller's dicts and arrays are left alone
    assert all(np.array_equal(v.asnumpy(), before[k]) for k, v in {**args, **aux}.items())
    assert all(v.dtype == np.float32 for v in {**args, **aux}.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["cbrfs", "prelu"])
def test_convert_hybrid_block_matches_peer(peer, kind, dtype):
    # the peer's default keeps float32 weights; ours stores them low where it fuses (docs/speed.md)
    out = gluon_amp.convert_hybrid_block(run_gluon_net(kind), target_dtype=dtype, ctx=mx.cpu(),
                                         cast_optional_params=False)
    ours, theirs = block_summary(out), peer["convert"]["block"][f"{dtype}/{kind}"]
    _compare(ours["graph"], theirs["graph"], dtype, peer)
    _check_params(ours["params"], theirs["params"], False, dtype)


def test_convert_hybrid_block_default_ctx_is_the_blocks(peer):
    assert peer["convert"]["errors"]["block_default_ctx"] is not None  # the peer wants gpu(0)
    out = gluon_amp.convert_hybrid_block(run_gluon_net("cbrfs"), target_dtype="bfloat16")
    assert {c for p in out.collect_params().values() for c in p.list_ctx()} == {mx.cpu()}


@pytest.mark.parametrize("cast_optional_params", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_convert_bucketing_module_matches_peer(peer, dtype, cast_optional_params):
    mod = bucketing_module()
    before = {k: v.dtype for k, v in mod.get_params()[0].items()}
    new = gluon_amp.convert_bucketing_module(mod, target_dtype=dtype, cast_optional_params=cast_optional_params)
    ours, theirs = bucket_summaries(new), peer["convert"]["bucket"][f"{dtype}/{cast_optional_params}"]
    assert sorted(ours["buckets"]) == sorted(theirs["buckets"]) == ["3", "5"]
    for key in ours["buckets"]:
        _compare(ours["buckets"][key], theirs["buckets"][key], dtype, peer)
    _check_params(ours["params"], theirs["params"], cast_optional_params, dtype)
    assert isinstance(new, mx.mod.BucketingModule) and new is not mod
    assert {k: v.dtype for k, v in mod.get_params()[0].items()} == before


def test_convert_bucketing_module_converts_new_buckets():
    new = gluon_amp.convert_bucketing_module(bucketing_module(), target_dtype="bfloat16")
    new.bind(data_shapes=[("data", (2, 5, 4))], label_shapes=[("softmax_label", (2,))], for_training=False)
    new.switch_bucket(7, [("data", (2, 7, 4))], [("softmax_label", (2,))])
    nodes = json.loads(new._buckets[7].symbol.tojson(remove_amp_cast=False))["nodes"]
    casts = [n for n in nodes if n["op"] == "amp_cast"]
    assert casts, "a bucket created after conversion must be converted too"
    summary = summarize(new._buckets[7].symbol, {"data": np.float32, "softmax_label": np.float32})
    assert summary["ops"]["fc1"]["out"] == ["bfloat16"]


def test_convert_bucketing_module_rejects_bad_input(peer):
    assert peer["convert"]["errors"]["bucket_not_module"] == "AssertionError"
    with pytest.raises(TypeError, match="BucketingModule"):
        gluon_amp.convert_bucketing_module("x")
    unbound = mx.mod.BucketingModule(lambda k: (mx.sym.var("data") * 2, ("data",), ()), default_bucket_key=1)
    with pytest.raises(ValueError, match="bind"):
        gluon_amp.convert_bucketing_module(unbound)


def test_convert_symbol_rejects_non_symbol(peer):
    assert peer["convert"]["errors"]["convert_symbol_not_symbol"] == "AssertionError"
    with pytest.raises(TypeError, match="str"):
        gluon_amp.convert_symbol("x", target_dtype="float16")


# ---------------------------------------------------------------- init (training graphs)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("graph", sorted(n for n, g in GRAPHS.items() if not g[2]))
def test_init_training_graph_matches_peer(peer, graph, dtype):
    with gluon_amp.autocast(dtype):
        ours = training_graph(GRAPHS[graph][0])
    _compare(ours, peer[dtype]["graphs"][graph], dtype, peer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_init_gluon_training_graph_matches_peer(peer, dtype):
    from peer_oracle import gluon_net
    with gluon_amp.autocast(dtype):
        net = gluon_net("cbrfs")
        ours = training_graph(lambda: net(mx.sym.var("data")))
    _compare(ours, peer[dtype]["gluon"], dtype, peer)


# ---------------------------------------------------------------- trainer API

def _train_step(keyword: bool):
    """The peer's trainer sequence, on ops that run in float32 under float16 AMP."""
    w = gluon.Parameter("w", shape=(3,))
    w.initialize(mx.init.Constant(0.5))
    trainer = gluon.Trainer([w], "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    kw = (lambda t: {"optimizer_or_trainer": t}) if keyword else (lambda t: {})
    pos = (lambda t: ()) if keyword else (lambda t: (t,))
    gluon_amp.init_trainer(*pos(trainer), **kw(trainer))
    x = mx.nd.array([1.0, 2.0, 3.0])
    with autograd.record():
        loss = (x * w.data()).sum()
        with gluon_amp.scale_loss(loss, *pos(trainer), **kw(trainer)) as scaled:
            autograd.backward(scaled)
    out = {"scaled": float(scaled.asscalar()), "grad_scaled": w.grad().asnumpy().tolist()}
    gluon_amp.unscale(*pos(trainer), **kw(trainer))
    out["grad"] = w.grad().asnumpy().tolist()
    trainer.step(1)
    out["w"] = w.data().asnumpy().tolist()
    mx.nd.waitall()
    return out


def test_loss_output_op_trains_like_fp32(peer):
    """SoftmaxOutput's backward ignores the scaled head gradient and starts from grad_scale:
    under AMP the loss scale must reach it there (list_loss_output_functions), or the step
    is divided by a scale that was never applied. The peer does it; so must we."""
    fp32 = softmax_output_step(None)
    np.testing.assert_allclose(peer["float16"]["loss_output"], fp32, rtol=1e-5)
    with gluon_amp.autocast("float16"):
        ours = softmax_output_step(gluon_amp)
    np.testing.assert_allclose(ours, fp32, rtol=1e-5)


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "optimizer_or_trainer="])
def test_trainer_api_matches_peer(peer, keyword):
    with gluon_amp.autocast("float16"):
        ours = _train_step(keyword)
    theirs = peer["float16"]["trainer"]
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, err_msg=k)


# ---------------------------------------------------------------- lists

def _canon(peer, names):
    return {peer["convert"]["canonical"].get(n) or n for n in names}


@pytest.mark.parametrize("dtype", DTYPES)
def test_lists_shape_and_shared_classes(peer, dtype):
    theirs = peer["convert"]["lists"][dtype]
    for f in LISTS:
        got = getattr(gluon_amp, f)(dtype)
        assert isinstance(got, list) and all(isinstance(n, str) for n in got), f
        assert len(got) == len(set(got)), f"{f} repeats names"
    # the classes that decide numerics agree: low precision and conditional lists are the peer's
    assert set(gluon_amp.list_lp16_ops(dtype)) == _canon(peer, theirs["list_lp16_ops"])
    # ... except the documented addition: bfloat16 LeakyReLU prelu/rrelu run in float32 here
    ours_cond = [list(map(_listify, c)) for c in gluon_amp.list_conditional_fp32_ops(dtype)]
    extra = {"bfloat16": {"LeakyReLU": {"prelu", "rrelu"}}}.get(dtype, {})
    # ... and the attribute values a conformance verdict adds (docs/op_conformance.md)
    from gluon_amp_core.table import default_table, split_key
    for key in default_table(dtype).verdicts:
        op, cond = split_key(key)
        if cond is not None:
            extra = {**extra, op: extra.get(op, set()) | {cond[1]}}
    assert [[n, a, sorted(set(v) - extra.get(n, set()))] for n, a, v in ours_cond] == \
        theirs["list_conditional_fp32_ops"]
    assert gluon_amp.list_loss_output_functions(dtype) == theirs["list_loss_output_functions"]
    # nothing the peer keeps in float32 runs in low precision here (by registered name: the
    # peer's bfloat16 list has the alias _sparse_FullyConnected in float32, FullyConnected not)
    lp = set(gluon_amp.list_lp16_ops(dtype))
    registered = {n for n in theirs["list_fp32_ops"] if peer["convert"]["canonical"].get(n) == n}
    assert registered and not registered & lp


def _listify(x):
    return list(x) if isinstance(x, (tuple, list)) else x


def test_float16_fp32_list_covers_the_peers(peer):
    """In float16 every op the peer forces to float32 (overflow risk) is float32 here too."""
    theirs = _canon(peer, peer["convert"]["lists"]["float16"]["list_fp32_ops"])
    ours = set(gluon_amp.list_fp32_ops("float16"))
    registered = {n for n in theirs if canonical(n)}
    assert registered - ours == set()


def test_lists_accept_every_bfloat16_spelling(peer):
    assert peer["convert"]["errors"]["list_str_bfloat16"] == "AssertionError"
    for f in LISTS + ("list_conditional_fp32_ops", "list_lp16_use_fp32_params"):
        fn = getattr(gluon_amp, f)
        assert fn("bfloat16") == fn(BF16) == fn("bf16"), f
    with pytest.raises(ValueError, match="float16"):
        gluon_amp.list_lp16_ops("int8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_lp16_use_fp32_params_covers_the_peers(peer, dtype):
    ours = gluon_amp.list_lp16_use_fp32_params(dtype)
    assert isinstance(ours, dict) and ours
    theirs = peer["convert"]["lists"]["bfloat16"]["list_lp16_use_fp32_params"]  # None for float16
    for op, names in theirs.items():
        name = canonical(op) or canonical("_contrib_" + op)  # the peer names one op by a stale name
        assert ours[name] == names, op
    # the table really keeps those inputs float32: converted BatchNorm reads float32 gamma/beta
    sym = mx.sym.BatchNorm(mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=4, name="fc"), name="bn")
    args, aux = fp32_params(sym, {"data": (2, 3)})
    _, a, x = gluon_amp.convert_model(sym, args, aux, target_dtype=dtype, cast_optional_params=True)
    kept = [n for n in ours["BatchNorm"] if n]
    assert {f"bn_{n}": "float32" for n in kept} == {k: v for k, v in param_dtypes({**a, **x}).items()
                                                   if k.startswith("bn_")}


def test_fp16_use_fp32_params_is_a_mapping_not_none(peer):
    assert peer["convert"]["fp16_use_fp32_params"] is None
    assert gluon_amp.list_lp16_use_fp32_params("float16") == gluon_amp.list_lp16_use_fp32_params("bfloat16")


def test_convert_bucketing_module_takes_the_options_every_converter_takes():
    """``widest_type_ops``, ``keep_batchnorm_fp32`` and ``emulate`` (docs/inference.md: every
    converter) were a ``TypeError`` here; they reach the buckets there are and those made later."""
    new = gluon_amp.convert_bucketing_module(bucketing_module(), target_dtype="bfloat16",
                                             widest_type_ops=["FullyConnected"], keep_batchnorm_fp32=True)
    new.bind(data_shapes=[("data", (2, 5, 4))], label_shapes=[("softmax_label", (2,))], for_training=False)
    new.switch_bucket(7, [("data", (2, 7, 4))], [("softmax_label", (2,))])
    for key in (5, 7):
        summary = summarize(new._buckets[key].symbol, {"data": np.float32, "softmax_label": np.float32})
        assert summary["ops"]["fc1"]["out"] == ["float32"], key  # widest of its float32 inputs
    emulated = gluon_amp.convert_bucketing_module(bucketing_module(), target_dtype="float16", emulate=True)
    emulated.bind(data_shapes=[("data", (2, 5, 4))], label_shapes=[("softmax_label", (2,))], for_training=False)
    emulated.forward(mx.io.DataBatch([mx.nd.ones((2, 5, 4))], [mx.nd.zeros((2,))], bucket_key=5), is_train=False)
    out = emulated.get_outputs()[0].asnumpy()  # float16 runs emulated on any CPU
    assert out.shape == (2, 3) and np.isfinite(out).all()
