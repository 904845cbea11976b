"""Folding batch norm into convolutions ahead of MXNet's oneDNN fusion."""
import json

import numpy as np
import mxnet as mx
import pytest

from gluon_amp.convert.fold import _identity, fold_batch_norm
from gluon_amp_core.fold import conv_bn_pairs


def _conv_bn(x, name, no_bias=True, **bn):
    c = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), no_bias=no_bias, name=name)
    return mx.sym.BatchNorm(c, name=name + "_bn", **bn)


def _pairs(sym):
    return {p.conv: p for p in conv_bn_pairs(json.loads(sym.tojson()))}


def test_pairs_found_with_their_variables():
    x = mx.sym.var("data")
    out = _conv_bn(_conv_bn(x, "a", eps=1e-5, fix_gamma=False), "b", no_bias=False)
    pairs = _pairs(out)
    assert set(pairs) == {"a", "b"}
    assert (pairs["a"].weight, pairs["a"].bias, pairs["a"].gamma, pairs["a"].var) == (
        "a_weight", None, "a_bn_gamma", "a_bn_moving_var")
    assert pairs["a"].eps == pytest.approx(1e-5) and not pairs["a"].fix_gamma
    assert pairs["b"].bias == "b_bias" and pairs["b"].fix_gamma and pairs["b"].eps == pytest.approx(1e-3)


def test_pairs_that_folding_would_change_elsewhere_are_left():
    x = mx.sym.var("data")
    c = mx.sym.Convolution(x, num_filter=4, kernel=(1, 1), no_bias=True, name="shared_out")
    two_readers = mx.sym.BatchNorm(c, name="bn1") + mx.sym.relu(c)
    w = mx.sym.var("w")
    c1 = mx.sym.Convolution(x, w, num_filter=4, kernel=(1, 1), no_bias=True, name="c1")
    c2 = mx.sym.Convolution(x, w, num_filter=4, kernel=(1, 1), no_bias=True, name="c2")
    shared_weight = mx.sym.BatchNorm(c1, name="bn2") + mx.sym.BatchNorm(c2, name="bn3")
    other_axis = _conv_bn(x, "ax", axis=3)
    not_a_conv = mx.sym.BatchNorm(mx.sym.relu(x), name="bn4")
    for sym in (two_readers, shared_weight, other_axis, not_a_conv):
        assert _pairs(sym) == {}, sym.list_outputs()


@pytest.mark.parametrize("fix_gamma", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 1e-3, 2e-5])
def test_identity_factor_is_one_or_just_above(fix_gamma, eps):
    gamma, var = _identity(eps, fix_gamma)
    factor = (1.0 if fix_gamma else float(gamma)) / np.sqrt(float(var) + eps)  # as MXNet computes it
    assert 1.0 <= np.float32(factor) <= 1.0 + 2.0 ** -22


def _truncate_bf16(a):
    return (np.asarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def _model(seed=0):
    rng = np.random.RandomState(seed)
    x = mx.sym.var("data")
    sym = _conv_bn(mx.sym.relu(_conv_bn(x, "a", eps=1e-5, fix_gamma=False)), "b", no_bias=False)
    arg_shapes, _, aux_shapes = sym.infer_shape(data=(2, 3, 8, 8))
    args = {n: mx.nd.array(rng.uniform(0.5, 1.5, s) if "gamma" in n or "var" in n else rng.uniform(-1, 1, s))
            for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}
    aux = {n: mx.nd.array(rng.uniform(0.5, 1.5, s) if "var" in n else rng.uniform(-.2, .2, s))
           for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return sym, args, aux


def _run(sym, args, aux, x):
    ex = sym.bind(mx.cpu(), {**args, "data": x}, aux_states=aux, grad_req="null")
    return ex.forward(is_train=False)[0].asnumpy()


def test_fold_keeps_the_function_and_the_callers_arrays():
    sym, args, aux = _model()
    before = {k: v.asnumpy().copy() for k, v in {**args, **aux}.items()}
    x = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (2, 3, 8, 8)))
    new_args, new_aux, n = fold_batch_norm(sym, args, aux)
    assert n == 2
    assert all(np.array_equal(v.asnumpy(), before[k]) for k, v in {**args, **aux}.items())
    ref, out = _run(sym, args, aux, x), _run(sym, new_args, new_aux, x)
    # the only rounding added is the folded bias, stored as a bfloat16 value
    assert np.linalg.norm(out - ref) <= 2e-3 * np.linalg.norm(ref)
    assert np.array_equal(new_args["b_bias"].asnumpy(), np.zeros(4, np.float32))


def test_folded_weights_survive_mxnets_truncating_bf16_fold():
    sym, args, aux = _model()
    new_args, new_aux, _ = fold_batch_norm(sym, args, aux)
    for name, fix_gamma, eps in (("a", False, 1e-5), ("b", True, 1e-3)):
        w = _truncate_bf16(new_args[f"{name}_weight"].asnumpy())  # any bfloat16 weight value
        gamma = 1.0 if fix_gamma else new_args[f"{name}_bn_gamma"].asnumpy().astype(np.float64)
        factor = np.float32(gamma / np.sqrt(new_aux[f"{name}_bn_moving_var"].asnumpy() + eps))
        assert np.array_equal(_truncate_bf16(w * factor.reshape(-1, 1, 1, 1)), w)
        beta = new_args[f"{name}_bn_beta"].asnumpy()
        assert np.array_equal(_truncate_bf16(beta), beta)


def test_unusable_statistics_and_non_float32_parameters_are_left_alone():
    sym, args, aux = _model()
    aux["a_bn_moving_var"] = mx.nd.array(-np.ones(4))
    args["b_weight"] = args["b_weight"].astype("float16")
    new_args, new_aux, n = fold_batch_norm(sym, args, aux)
    assert n == 0
    assert all(new_args[k] is args[k] for k in args) and all(new_aux[k] is aux[k] for k in aux)
