"""Weights a program declares itself (``mx.sym.Variable``) under native bfloat16, bound by Module.

MXNet 1.9.1's ``example/`` ctc, multivariate_time_series (LSTNet), cnn_text_classification and
nce-loss ``lstm_word`` failed at ``Module.bind`` in native bfloat16 only: "InferType pass cannot
decide dtypes" for every weight they pass to an op by hand (each ``mx.rnn`` cell does). The
patched op casts the weight to bfloat16, and MXNet does not infer a cast's input from its output;
plain MXNet infers it from the data. ``mxnet_internals.gluon.decided_types`` gives such an
argument what MXNet infers for the graph without its casts. The peer fails the same way.

The simulated native host runs a float32 rewrite of the graph, where every dtype is inferred: its
twin passes with or without the fix. The graph-level cases below run on every CPU."""
import itertools
import warnings

import mxnet as mx
import numpy as np
import pytest

import gluon_amp
from gluon_amp import mxnet_internals as mxi


def _cast(s, dtype="bfloat16"):
    return mx.sym.amp_cast(s, dtype=mxi.to_mx_dtype(dtype))


def _graph(op, weight_dtype):
    """``op`` over user-declared weights, as a patched op function builds it: each input cast to
    bfloat16 (``weight_dtype``: what the weight Variable declares, or None)."""
    kw = {} if weight_dtype is None else {"dtype": weight_dtype}
    w = mx.sym.Variable("w", **kw)
    data = mx.sym.Variable("data")
    if op == "FullyConnected":
        b = mx.sym.Variable("b", **kw)
        out = mx.sym.FullyConnected(_cast(data), weight=_cast(w), bias=_cast(b), num_hidden=4)
    elif op == "Convolution":
        out = mx.sym.Convolution(_cast(data), weight=_cast(w), no_bias=True, kernel=(1, 1), num_filter=4)
    else:  # two FullyConnected sharing one weight, as an unrolled cell does
        steps = mx.sym.SliceChannel(data, num_outputs=2, squeeze_axis=1)
        out = mx.sym.Concat(*[mx.sym.FullyConnected(_cast(s), weight=_cast(w), no_bias=True, num_hidden=4)
                              for s in steps], dim=0)
    return mx.sym.MakeLoss(mx.sym.sum(_cast(out, "float32")))


# a float32-declared weight with float16 data does not type in plain MXNet either: left out
CASES = [c for c in itertools.product(["FullyConnected", "Convolution", "shared"], [None, "float32"],
                                      [np.float32, np.float16]) if not (c[1] == "float32" and c[2] == np.float16)]


@pytest.mark.parametrize("op, weight_dtype, data_dtype", CASES)
def test_an_argument_a_cast_leaves_undecided_gets_what_mxnet_infers_without_the_casts(op, weight_dtype, data_dtype):
    sym = _graph(op, weight_dtype)
    given = {"data": data_dtype}
    decided = mxi.gluon.decided_types(sym, sym, given)
    assert given == {"data": data_dtype}  # the caller's dict is not changed
    plain = mx.sym.load_json(sym.tojson())  # the graph without its casts
    want = dict(zip(plain.list_arguments(), plain.infer_type(data=data_dtype)[0]))
    types = dict(zip(sym.list_arguments(), sym.infer_type_partial(**decided)[0]))
    assert None not in types.values(), types
    assert types == want


def test_a_graph_mxnet_types_whole_keeps_the_callers_dict():
    sym = mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=4)  # no cast
    given = {"data": np.float32}
    assert mxi.gluon.decided_types(sym, sym, given) is given


def _lstm_module():
    """An unrolled ``mx.rnn.LSTMCell`` and a FullyConnected head, weights declared by the program."""
    cell = mx.rnn.LSTMCell(8, prefix="l0_")
    outputs, _ = cell.unroll(3, inputs=mx.sym.Variable("data"), merge_outputs=True, layout="NTC")
    pred = mx.sym.FullyConnected(mx.sym.flatten(outputs), num_hidden=5,
                                 weight=mx.sym.Variable("cls_weight"), bias=mx.sym.Variable("cls_bias"))
    return mx.sym.SoftmaxOutput(pred, label=mx.sym.Variable("softmax_label"))


def _two_steps(sym, batch, data_shapes, label_shapes):
    """Two SGD steps of a Module of ``sym`` on ``batch``: its outputs after them and its parameters."""
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    for _ in range(2):
        mod.forward_backward(batch)
        mod.update()
    mod.forward(batch, is_train=False)
    return mod.get_outputs()[0].asnumpy(), {n: a.asnumpy() for n, a in mod.get_params()[0].items()}


def _train(init):
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.randn(4, 3, 6))], [mx.nd.array(rng.randint(0, 5, (4,)))])
    if init:
        gluon_amp.init(target_dtype="bfloat16", tune=False)
    try:
        return _two_steps(_lstm_module(), batch, [("data", (4, 3, 6))], [("softmax_label", (4,))])
    finally:
        gluon_amp.disable()


def test_module_binds_and_trains_declared_weights_in_native_bfloat16(native_host):
    out, params = _train(init=True)
    ref_out, ref_params = _train(init=False)
    assert set(params) == set(ref_params) and all(p.dtype == np.float32 for p in params.values())
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=0.03)  # bfloat16's 8 bits over 2 steps
    for name, p in params.items():
        np.testing.assert_allclose(p, ref_params[name], rtol=0, atol=0.02, err_msg=name)


def _declared_fc():
    data = mx.sym.Variable("data")
    fc = mx.sym.FullyConnected(data, weight=mx.sym.Variable("fc_weight"), bias=mx.sym.Variable("fc_bias"),
                               num_hidden=4, name="fc")
    return mx.sym.SoftmaxOutput(fc, name="softmax")


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
@pytest.mark.parametrize("build", ["fc", "lstm"])
def test_infer_type_of_declared_weights_under_init_answers_as_without_amp(target, build):
    """``Symbol.infer_type`` of a graph built under ``init`` whose weights the program declares:
    it returned ``(None, None, None)``, and ``mx.model.FeedForward.fit`` (MXNet 1.9.1's
    ``example/rnn/old/lstm_bucketing.py``) stopped at its bare ``assert arg_dtypes is not None``.
    A graph MXNet types whole answers as MXNet does. (1.9.1's positional form fails in MXNet
    itself, with or without gluon_amp, where any type is left ``None``.)"""
    make = _declared_fc if build == "fc" else _lstm_module
    plain = make()
    want = plain.infer_type(data="float32")
    gluon_amp.init(target_dtype=target, emulate=True)
    try:
        sym = make()
        assert sym.infer_type(data="float32")[0] == want[0]
        if build == "fc":  # nothing given: nothing filled (an unrolled LSTM, which MXNet types
            # from its own zeros states, is then left undecided: noted in docs/compatibility.md)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert sym.infer_type() == plain.infer_type() == (None, None, None)
        whole = mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=4)
        assert whole.infer_type(data="float32") == mxi.gluon._INFER_TYPE(whole, data="float32")
        with pytest.raises(mx.base.MXNetError):  # what MXNet says of a bad dtype is MXNet's
            sym.infer_type(data="float32", softmax_label="int8", fc_weight="float16")
    finally:
        gluon_amp.disable()
    assert mx.sym.Symbol.infer_type is mxi.gluon._INFER_TYPE  # put back by identity


def test_feedforward_fits_declared_weights_under_emulation():
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 5).astype(np.float32), rng.randint(0, 4, (16,)).astype(np.float32)

    def fit():
        mx.random.seed(0)
        model = mx.model.FeedForward(_declared_fc(), ctx=mx.cpu(), num_epoch=2, learning_rate=0.1,
                                     initializer=mx.init.Xavier())
        model.fit(X=mx.io.NDArrayIter(x, y, batch_size=4))
        return model.predict(mx.io.NDArrayIter(x, batch_size=4))

    ref = fit()
    gluon_amp.init(target_dtype="float16", emulate=True)
    try:
        out = fit()
    finally:
        gluon_amp.disable()
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=0, atol=0.02)


def _float64_mlp():
    """Declared weights for the first layer, weights the second op creates itself (which the
    patched op declares float32: the master copy of a float32 graph)."""
    data = mx.sym.Variable("data")
    h = mx.sym.FullyConnected(data, weight=mx.sym.Variable("fc1_weight"), bias=mx.sym.Variable("fc1_bias"),
                              num_hidden=4, name="fc1")
    h = mx.sym.FullyConnected(mx.sym.Activation(h, act_type="tanh"), num_hidden=3, name="fc2")
    return mx.sym.SoftmaxOutput(h, name="softmax")


def _fit_float64(mode):
    """Two Module steps of :func:`_float64_mlp` fed float64 data, built under ``mode``."""
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.randn(4, 5), dtype="float64")],
                            [mx.nd.array(rng.randint(0, 3, (4,)), dtype="float64")])
    if mode is not None:
        gluon_amp.init(**mode)
    try:
        sym = _float64_mlp()
        types = sym.infer_type(data="float64")
        return (types, *_two_steps(sym, batch, [mx.io.DataDesc("data", (4, 5), "float64")],
                                   [mx.io.DataDesc("softmax_label", (4,), "float64")]))
    finally:
        gluon_amp.disable()


@pytest.mark.parametrize("mode", [{"target_dtype": "float16", "emulate": True},
                                  {"target_dtype": "bfloat16", "emulate": True}, "native"],
                         ids=["float16-emulated", "bfloat16-emulated", "native"])
def test_a_float64_graph_types_binds_and_trains_in_float64_as_without_amp(mode):
    """A float64 graph built under ``init``: the weights an op made itself were declared float32
    and met float64 data, so ``infer_type``, ``simple_bind`` and ``Module.bind`` failed in MXNet
    ("Incompatible attr in node fc2"), where the program without AMP runs float64. AMP, as
    PyTorch's autocast and MXNet's ``amp_cast``, leaves float64 alone: the same numbers."""
    if mode == "native":
        with gluon_amp.runtime.simulate_native_bf16():
            got = _fit_float64({"target_dtype": "bfloat16"})
    else:
        got = _fit_float64(mode)
    want = _fit_float64(None)
    assert got[0] == want[0] and want[0][1] == [np.float64]
    assert got[1].dtype == np.float64
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name, p in got[2].items():
        assert p.dtype == np.float64, name
        np.testing.assert_array_equal(p, want[2][name], err_msg=name)


def test_a_float32_weight_the_program_declares_for_float64_data_is_refused_as_mxnet_refuses_it():
    """Only the declarations gluon_amp made are retyped for float64 data: a weight the program
    declared float32 met float64 data, which MXNet refuses, and under init it was typed float64
    (helper BB)."""
    def build():  # a name no op of another test makes itself: those are known by name (compatibility.md)
        w = mx.sym.Variable("declared_by_the_program", dtype="float32")
        return mx.sym.FullyConnected(mx.sym.Variable("data"), weight=w, no_bias=True, num_hidden=3,
                                     name="declared_fc")

    with pytest.raises(mx.base.MXNetError):
        build().infer_type(data="float64")
    gluon_amp.init(target_dtype="float16", emulate=True)
    try:
        sym = build()
        with pytest.raises(mx.base.MXNetError):
            sym.infer_type(data="float64")
        with pytest.raises((mx.base.MXNetError, RuntimeError)):
            sym.simple_bind(mx.cpu(), data=(2, 4), type_dict={"data": "float64"})
        assert sym.infer_type(data="float32")[0] == [np.float32, np.float32]  # float32 data: as MXNet
    finally:
        gluon_amp.disable()
