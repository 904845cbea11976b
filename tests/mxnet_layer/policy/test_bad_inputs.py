"""Issue 42 item 15: bad arguments to the public API get a clear error.

Generated: every public function x each of its arguments x bad values of that argument's kind
(wrong types, out-of-range numbers, unknown names). Each must raise ``ValueError``, ``TypeError``
or ``RuntimeError`` (never MXNet's raw ``MXNetError``, never a bare ``AssertionError``) whose
message names the bad value, and leave AMP off. Plus the three cases the issue names. Costs: about
10 s in all on 2 shared cores (most calls fail before any MXNet work).
"""
import math

import pytest
import mxnet as mx
from mxnet import gluon

import gluon_amp


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque-42>"


NOT_A_NAME = ["Convolutoin", 42, None.__class__, _Opaque()]
BAD_DTYPE = ["float8", "int32", 16, 1.5, _Opaque()]
BAD_BOOL = ["yes", 2, _Opaque()]
BAD_NAME_LIST = ["Convolution", ["Convolutoin"], [42], 42, _Opaque()]
BAD_CONDITIONAL = [[("Activation", "act_tpye", ["softrelu"])], [("Actvation", "act_type", ["softrelu"])],
                   [("Activation", "act_type")], [("Activation", "act_type", "softrelu")], "Activation", 42]
BAD_SCALE = [-1.0, 0.0, math.nan, math.inf, "huge", _Opaque()]


def _net(hybridized: bool = True) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.Dense(2, in_units=4))
    net.initialize()
    if hybridized:
        net.hybridize()
        net(mx.nd.ones((2, 3)))
    return net


def _trainer():
    return gluon.Trainer(_net(False).collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)


def _sym():
    return mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2, name="fc")


_LISTS = {"fp32_ops": BAD_NAME_LIST, "conditional_fp32_ops": BAD_CONDITIONAL, "emulate": BAD_BOOL}
_POLICY_ARGS = {"target_dtype": BAD_DTYPE, "target_precision_ops": BAD_NAME_LIST, "widest_type_ops": BAD_NAME_LIST,
                "excluded_sym_names": ["fc", [42], 42], "keep_batchnorm_fp32": BAD_BOOL, "tune": BAD_BOOL, **_LISTS}

# function -> (valid arguments (a factory), {argument: bad values})
SIGNATURES = {
    "make_policy": (lambda: dict(target_dtype="bfloat16", emulate=True), _POLICY_ARGS),
    "init": (lambda: dict(target_dtype="bfloat16", emulate=True), _POLICY_ARGS),
    "install_as_contrib_amp": (lambda: dict(target_dtype="bfloat16", emulate=True),
                               {"target_dtype": BAD_DTYPE, **_LISTS}),
    "list_lp16_ops": (lambda: {}, {"target_dtype": BAD_DTYPE}),
    "list_fp32_ops": (lambda: {}, {"target_dtype": BAD_DTYPE}),
    "list_conditional_fp32_ops": (lambda: {}, {"target_dtype": BAD_DTYPE}),
    "list_widest_type_cast": (lambda: {}, {"target_dtype": BAD_DTYPE}),
    "convert_symbol": (lambda: dict(sym=_sym(), target_dtype="bfloat16", emulate=True),
                       {"sym": ["fc", _Opaque()], "target_dtype": BAD_DTYPE, "data_names": [42, ["nodata"]], **_LISTS}),
    "convert_hybrid_block": (lambda: dict(block=_net(), target_dtype="bfloat16", emulate=True),
                             {"block": [_Opaque(), "net"], "ctx": ["cpu", [], ["cpu"], [mx.cpu(), mx.gpu()], _Opaque()],
                              "target_dtype": BAD_DTYPE, "fuse": BAD_BOOL, "input_shapes": [42, {"data": "big"}],
                              **_LISTS}),
    "report": (lambda: dict(symbol_or_block=_sym(), target_dtype="bfloat16"),
               {"symbol_or_block": [_Opaque(), 42], "target_dtype": BAD_DTYPE}),
    "init_trainer": (lambda: dict(trainer=_trainer()), {"trainer": [_Opaque(), "sgd"], "loss_scale": BAD_SCALE}),
    "get_scaler": (lambda: dict(trainer=_trainer()), {"trainer": [_Opaque(), 42]}),
    "clip_global_norm": (lambda: dict(trainer=_trainer(), max_norm=1.0),
                         {"trainer": [_Opaque()], "max_norm": [-1.0, math.nan, "one", _Opaque()]}),
    "initialize": (lambda: dict(net=_net(False), opt_level="O1", target_dtype="bfloat16", emulate=True),
                   {"net": [_Opaque(), 42], "opt_level": ["O4", 1, "o1x"], "target_dtype": BAD_DTYPE,
                    "loss_scale": BAD_SCALE, "master_weights": BAD_BOOL, "emulate": BAD_BOOL}),
}


def _cases():
    for fn, (_valid, bad) in SIGNATURES.items():
        for arg, values in bad.items():
            for i, v in enumerate(values):
                yield pytest.param(fn, arg, v, id=f"{fn}-{arg}-{i}")


def _names_it(message: str, value) -> bool:
    shown = {repr(value), str(value), type(value).__name__}
    if isinstance(value, (list, tuple)):
        for item in value:
            shown |= {repr(item), str(item)} if not isinstance(item, (list, tuple)) else {repr(x) for x in item}
    if isinstance(value, float) and math.isnan(value):
        shown.add("nan")
    if isinstance(value, dict):
        shown |= {repr(v) for v in value.values()}
    return any(s and s in message for s in shown)


@pytest.mark.parametrize("fn, arg, value", list(_cases()))
def test_a_bad_argument_gets_a_clear_error_naming_it(fn, arg, value):
    valid, _bad = SIGNATURES[fn]
    kwargs = {**valid(), arg: value}
    with pytest.raises((ValueError, TypeError, RuntimeError)) as err:
        getattr(gluon_amp, fn)(**kwargs)
    assert not isinstance(err.value, mx.base.MXNetError), err.value
    assert _names_it(str(err.value), value), f"{type(err.value).__name__}: {err.value}"
    assert not gluon_amp.is_enabled()
    gluon_amp.uninstall_contrib_amp()


# ---------------------------------------------------------------- the three of item 15

def test_convert_hybrid_block_takes_a_list_of_contexts_as_mxnet_does():
    net = _net()
    x = mx.nd.random.uniform(shape=(2, 3))
    one = gluon_amp.convert_hybrid_block(net, "bfloat16", emulate=True, ctx=mx.cpu())
    for ctx in ([mx.cpu()], (mx.cpu(0),), [mx.cpu(0), mx.cpu(1)]):
        out = gluon_amp.convert_hybrid_block(net, "bfloat16", emulate=True, ctx=ctx)
        assert {c for p in out.collect_params().values() for c in p.list_ctx()} == set(ctx)
        assert (out(x).asnumpy() == one(x).asnumpy()).all()


def test_a_conditional_entry_naming_an_attribute_the_op_lacks_is_refused():
    with pytest.raises(ValueError, match="act_tpye") as err:
        gluon_amp.make_policy("bfloat16", emulate=True, conditional_fp32_ops=[("Activation", "act_tpye", ["softrelu"])])
    assert "act_type" in str(err.value)  # what the op has
    with pytest.raises(ValueError, match="'axis'"):
        gluon_amp.init("bfloat16", emulate=True, conditional_fp32_ops=[("relu", "axis", ["1"])])
    assert not gluon_amp.is_enabled()
    # every attribute the registry declares is accepted, for every op of the default conditional lists
    from gluon_amp import mxnet_internals as mxi
    for op in ("Activation", "LeakyReLU", "softmax", "Convolution"):
        for attr in mxi.op_infos()[op].attrs:
            gluon_amp.make_policy("bfloat16", emulate=True, conditional_fp32_ops=[(op, attr, ["x"])])


@pytest.mark.parametrize("dtype", ["float64", "int32"])
@pytest.mark.parametrize("how", ["init", "convert"])
def test_float64_or_int_input_under_emulation_runs_or_fails_as_plain_mxnet(dtype, how):
    """A float32 net fed float64/int: plain MXNet refuses with its type error, and so must emulation
    (never a failure inside gluon_amp's rounding op); an Embedding fed int indices runs."""
    emb = gluon.nn.HybridSequential()
    emb.add(gluon.nn.Embedding(10, 3), gluon.nn.Dense(2, flatten=True))
    emb.initialize()
    emb.hybridize()
    idx = mx.nd.array([[1, 2, 3], [4, 5, 6]], dtype=dtype)
    want = emb(idx).asnumpy()
    if how == "init":
        gluon_amp.init("bfloat16", emulate=True)
        got = emb(idx).asnumpy()
    else:
        got = gluon_amp.convert_hybrid_block(emb, "bfloat16", emulate=True)(idx).asnumpy()
    assert got.shape == want.shape and abs(got - want).max() < 0.05 * (abs(want).max() + 1)


@pytest.mark.parametrize("call", ["init", "autocast"])
def test_an_unknown_option_names_the_function_called_and_the_options(call):
    """``init(emulat=True)`` said "make_policy() got an unexpected keyword argument": a function
    the caller never called, and no list of what it takes."""
    with pytest.raises(TypeError, match=rf"^{call}\(\) got an unexpected keyword argument 'emulat' "
                                        r"\(did you mean 'emulate'\?\); its options are .*tune_budget"):
        getattr(gluon_amp, call)("bfloat16", emulat=True)
    assert not gluon_amp.is_enabled()
