"""Symbol.bind under init takes what plain MXNet takes: arrays by position or by name, and a
dict holding names the symbol lacks (1.9.1 reads a dict by the symbol's names and ignores the
rest). Such a dict used to bypass the rewrite: the patched graph ran as composed, a float16
cast on real float16 kernels (MXNet's CPU has none) and a bfloat16 output returned as is."""
import itertools

import numpy as np
import pytest
import mxnet as mx

import gluon_amp


def _graph():
    data = mx.sym.var("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, name="fc1", num_hidden=16), act_type="tanh")
    h = mx.sym.BatchNorm(h, name="bn", fix_gamma=False)
    return mx.sym.Activation(mx.sym.FullyConnected(h, name="fc2", num_hidden=6), act_type="sigmoid")


def _arrays(sym):
    rs = np.random.RandomState(0)
    arg_shapes, _, aux_shapes = sym.infer_shape(data=(4, 12))
    args = {n: rs.randn(*s).astype("float32") * 0.3 for n, s in zip(sym.list_arguments(), arg_shapes)}
    aux = {n: (np.ones(s) if n.endswith("var") else np.zeros(s)).astype("float32")
           for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return args, aux


#: (how args are given, extra keys in the dict, how aux states are given, gradients)
CASES = list(itertools.product(["list", "dict"], [None, "ndarray", "numpy", "str"], ["list", "dict+extra"],
                               [False, True]))
CASES = [c for c in CASES if not (c[0] == "list" and c[1] is not None)]


def _bind(sym, args, aux, how, extra, aux_how, grads):
    names, aux_names = sym.list_arguments(), sym.list_auxiliary_states()
    nd = {k: mx.nd.array(v) for k, v in args.items()}
    given = [nd[n] for n in names] if how == "list" else dict(nd)
    if extra is not None:
        given["loss_label"] = {"ndarray": mx.nd.ones((4, 6)), "numpy": np.ones((4, 6)), "str": "unused"}[extra]
    aux_nd = [mx.nd.array(aux[n]) for n in aux_names]
    aux_given = aux_nd if aux_how == "list" else {**dict(zip(aux_names, aux_nd)), "other_moving_mean": 0}
    grad = {n: mx.nd.zeros(a.shape) for n, a in nd.items() if n != "data"} if grads else None
    exe = sym.bind(mx.cpu(), given, args_grad=grad, grad_req="write" if grads else "null", aux_states=aux_given)
    out = exe.forward(is_train=grads)[0]
    if grads:
        exe.backward(mx.nd.ones(out.shape))
    return out.dtype, out.asnumpy(), grad["fc1_weight"].asnumpy() if grads else None


@pytest.fixture(params=["float16", "bfloat16"])
def emulated(request):
    return lambda: gluon_amp.init(request.param, emulate=True)


def _check_against_plain(start):
    sym = _graph()
    args, aux = _arrays(sym)
    plain = {c: _bind(sym, args, aux, *c) for c in CASES}
    start()
    try:
        under = {c: _bind(_graph(), args, aux, *c) for c in CASES}  # composed under init: patched ops
    finally:
        gluon_amp.disable()
    for c in CASES:
        (dtype, out, grad), (ref_dtype, ref, ref_grad) = under[c], plain[c]
        assert dtype == ref_dtype == np.float32, c
        assert np.abs(out - ref).max() < 2e-2, c
        if grad is not None:
            assert np.abs(grad - ref_grad).max() < 2e-2 * max(1.0, np.abs(ref_grad).max()), c


def test_bind_takes_what_plain_mxnet_takes_emulated(emulated):
    _check_against_plain(emulated)


def test_bind_takes_what_plain_mxnet_takes_natively(native_host):
    _check_against_plain(lambda: gluon_amp.init("bfloat16", tune=False))
