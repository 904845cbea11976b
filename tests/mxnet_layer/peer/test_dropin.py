"""Drop-in for mxnet.contrib.amp: the differences its own test files found, now matched."""
import json

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp.type_inference import infer_dtypes
from peer_oracle import BF16, dtype_str, run_peer  # noqa: F401  (the exec of _CAST_GRAPHS reads BF16)

DTYPES = ["float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [
    lambda d: gluon_amp.init(target_dtype=d, target_precision_ops=["Convolution"], fp32_ops=["Convolution"]),
    lambda d: gluon_amp.init(target_dtype=d, fp32_ops=["Convolutoin"]),
    lambda d: gluon_amp.make_policy(d, conditional_fp32_ops=[("Activatoin", "act_type", ["softrelu"])]),
    lambda d: gluon_amp.convert_symbol(mx.sym.var("x"), target_dtype=d, target_dtype_ops=["nope"]),
])
def test_op_list_mistakes_are_value_errors_and_assertion_errors(make, dtype):
    for kind in (ValueError, AssertionError):
        with pytest.raises(kind) as err:
            make(dtype)
        assert isinstance(err.value, gluon_amp.OpListError)
        assert "Convolution" in str(err.value) or "did you mean" in str(err.value).lower() or \
            "not an operator" in str(err.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_list_type_mistakes_are_type_errors_and_assertion_errors(dtype):
    for kind in (TypeError, AssertionError):
        with pytest.raises(kind, match="fp32_ops must be a list"):
            gluon_amp.make_policy(dtype, fp32_ops="softmax")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_widest_op_may_still_be_forced_to_float32(dtype):
    policy = gluon_amp.make_policy(dtype, fp32_ops=["elemwise_add"])  # the peer refuses; a deliberate extension
    assert policy.table.class_of("elemwise_add").value == "fp32"


def _conv_bn_fc():
    bn = mx.sym.BatchNorm(mx.sym.Convolution(mx.sym.var("data"), num_filter=10, kernel=(2, 3), name="conv"),
                          fix_gamma=False, name="bn")
    fc = mx.sym.FullyConnected(bn, num_hidden=10, name="fc")
    mod = mx.mod.Module(fc, data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", (1, 4, 8, 8))], for_training=False)
    mod.init_params()
    arg, aux = mod.get_params()
    return fc, arg, aux


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast_optional", [False, True])
def test_a_parameter_its_op_requires_in_low_precision_is_stored_so(dtype, cast_optional):
    fc, arg, aux = _conv_bn_fc()
    sym, new_arg, _ = gluon_amp.convert_model(fc, arg, aux, target_dtype=dtype, target_dtype_ops=["Convolution"],
                                              cast_optional_params=cast_optional)
    from gluon_amp_core.dtypes import dtype_name
    assert dtype_name(new_arg["fc_weight"].dtype) == dtype and dtype_name(new_arg["fc_bias"].dtype) == dtype
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    fed = {nodes[n["inputs"][0][0]]["name"] for n in nodes if n["op"] == "amp_cast"}
    assert "fc_weight" not in fed and "fc_bias" not in fed  # no cast on every call of the deployed model
    # the convolution's weight is cast by AMP's decision, not by a type rule: optional
    assert (dtype_name(new_arg["conv_weight"].dtype) == dtype) == cast_optional
    assert infer_dtypes(sym, {"data": "float32"}) is not None
    assert dtype_name(arg["fc_weight"].dtype) == "float32"  # the caller's arrays are untouched


def _stored(sym, dtype, cast_optional):
    out = gluon_amp.convert_symbol(sym, target_dtype=dtype, data_names=[], cast_optional_params=cast_optional)
    types = infer_dtypes(out, {})
    return {n: types[(n, 0)] for n in out.list_inputs()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_optional_params_stores_variables_only_cast_to_low_precision(dtype):
    d = mx.sym.var("data")
    mx_dtype = gluon_amp.mxnet_internals.to_mx_dtype(dtype)
    two_casts = mx.sym.Group([mx.sym.amp_cast(d, dtype=mx_dtype), mx.sym.amp_cast(d, dtype=mx_dtype)])
    assert _stored(two_casts, dtype, True) == {"data": dtype}
    assert _stored(two_casts, dtype, False) == {"data": "float32"}
    from gluon_amp_core.dtypes import DTYPE_CODE
    a, b = mx.sym.var("a"), mx.sym.var("b", attr={"__dtype__": str(DTYPE_CODE[dtype])})
    multi = mx.sym.amp_multicast(a, b, num_outputs=2)
    assert _stored(mx.sym.Group([multi[0], multi[1]]), dtype, True) == {"a": dtype, "b": dtype}
    assert _stored(mx.sym.Group([multi[0], multi[1]]), dtype, False) == {"a": "float32", "b": dtype}
    both = mx.sym.Group([multi[0], multi[1], mx.sym.amp_cast(a, dtype=mx_dtype)])
    assert _stored(both, dtype, True) == {"a": dtype, "b": dtype}
    kept = json.loads(gluon_amp.convert_symbol(both, target_dtype=dtype, data_names=[],
                                               cast_optional_params=True).tojson(remove_amp_cast=False))
    assert [n["op"] for n in kept["nodes"]].count("amp_cast") >= 1  # the user's casts are kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_plain_init_is_a_no_op_as_launchers_expect(dtype):
    first = gluon_amp.init(target_dtype=dtype)  # a wrapper's init ...
    assert gluon_amp.init() is first           # ... then the script's own amp.init()
    assert gluon_amp.current_policy() is first and gluon_amp.is_enabled()
    with pytest.raises(RuntimeError, match="already on"):
        gluon_amp.init(target_dtype=dtype, fp32_ops=["softmax"])  # explicit, different: still an error


# Graphs whose stored dtypes are compared with the peer's: built from this source in both
# processes (the peer's never imports gluon_amp). Each: (symbol, data_names).
_CAST_GRAPHS = """
def cast_graph(name, dtype):
    low = BF16 if dtype == "bfloat16" else np.float16
    a, c, d = mx.sym.var("a", shape=(2, 4)), mx.sym.var("c", shape=(2, 4)), mx.sym.var("data", shape=(2, 4))
    fc = mx.sym.FullyConnected(d, num_hidden=4, no_bias=True, name="fc")
    mc = lambda *xs: mx.sym.amp_multicast(*xs, num_outputs=len(xs))
    graphs = {
        "two_casts": (mx.sym.Group([mx.sym.amp_cast(a, dtype=low), mx.sym.amp_cast(a, dtype=low)]), []),
        "multicast_of_parameters": (mc(a, c), []),
        "cast_and_multicast_of_parameters": (mx.sym.Group([mx.sym.amp_cast(a, dtype=low), mc(a, c)]), []),
        "multicast_with_op_output": (mc(fc, a), ["data"]),
        "multicast_with_op_output_into_add": (mx.sym.elemwise_add(*mc(fc, a)), ["data"]),
        "multicast_with_data": (mc(a, mx.sym.relu(d)), ["data"]),
        "cast_and_multicast_with_op_output": (mx.sym.Group([mx.sym.amp_cast(a, dtype=low), mc(a, fc)]), ["data"]),
    }
    return graphs[name]
"""
exec(_CAST_GRAPHS)  # defines cast_graph here as in the peer's process
CAST_GRAPHS = ("two_casts", "multicast_of_parameters", "cast_and_multicast_of_parameters",
               "multicast_with_op_output", "multicast_with_op_output_into_add", "multicast_with_data",
               "cast_and_multicast_with_op_output")


def _stored_and_outputs(amp, dtype, name, cast_optional):
    sym, data = cast_graph(name, dtype)  # noqa: F821 (exec above)
    out = amp.convert_symbol(sym, target_dtype=dtype, data_names=data, cast_optional_params=cast_optional)
    args, outs, _ = out.infer_type(**{n: np.float32 for n in data})
    stored = {n: dtype_str(t) for n, t in zip(out.list_arguments(), args) if n not in data}
    return stored, [dtype_str(t) for t in outs]


@pytest.fixture(scope="module")
def peer_cast_graphs():
    snippet = _CAST_GRAPHS + f"""
result = {{}}
for dtype in {DTYPES!r}:
    for name in {CAST_GRAPHS!r}:
        for cop in (False, True):
            sym, data = cast_graph(name, dtype)
            out = amp.convert_symbol(sym, target_dtype=dtype, data_names=data, cast_optional_params=cop)
            args, outs, _ = out.infer_type(**{{n: np.float32 for n in data}})
            result[f"{{dtype}}/{{name}}/{{cop}}"] = {{n: dtype_str(t) for n, t in zip(out.list_arguments(), args)
                                                     if n not in data}}
"""
    return run_peer(snippet, timeout=300)


@pytest.mark.parametrize("cast_optional", [False, True])
@pytest.mark.parametrize("name", CAST_GRAPHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_variables_read_by_the_graphs_own_casts_are_stored_as_the_peer_stores_them(
        peer_cast_graphs, dtype, name, cast_optional):
    stored, outputs = _stored_and_outputs(gluon_amp, dtype, name, cast_optional)
    assert stored == peer_cast_graphs[f"{dtype}/{name}/{cast_optional}"]
    assert set(outputs) == {"float32"}  # a multicast narrowed by a stored parameter is cast back
    low = {n for n, t in stored.items() if t == dtype}
    if not cast_optional:
        assert not low  # the graph's casts are optional: the caller did not ask
    elif name in ("two_casts", "multicast_of_parameters", "cast_and_multicast_of_parameters",
                  "cast_and_multicast_with_op_output"):
        assert "a" in low  # read only by casts: stored low, as cast_optional_params asks
    else:
        assert "a" not in low  # next to data or an op's output: storing it low would narrow the multicast
