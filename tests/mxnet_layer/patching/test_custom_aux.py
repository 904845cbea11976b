"""A Custom op whose prop declares auxiliary states, given them as variables (MXNet 1.9.1's
example/restricted-boltzmann-machine does): the op mutates them, MXNet refuses a cast in front
of one ("Mutation target can only be Variable"), so the symbolic wrapper leaves them as given
and still casts the op's other inputs."""
import json

import numpy as np
import pytest

import gluon_amp
import mxnet as mx


class _Remember(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        aux[0][:] = in_data[0]  # the last input seen
        self.assign(out_data[0], req[0], in_data[0] * in_data[1])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0] * in_data[1])
        self.assign(in_grad[1], req[1], (out_grad[0] * aux[0]).sum(axis=0))


@mx.operator.register("gluon_amp_test_remember")
class _RememberProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=True)

    def list_arguments(self):
        return ["data", "weight"]

    def list_outputs(self):
        return ["output"]

    def list_auxiliary_states(self):
        return ["seen"]

    def infer_shape(self, s):
        return [s[0], (s[0][1],)], [s[0]], [s[0]]

    def infer_type(self, t):
        return [t[0], t[0]], [t[0]], [t[0]]

    def create_operator(self, ctx, shapes, dtypes):
        return _Remember()


def _symbol(keyword: bool):
    fc = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=8, name="fc")
    w, seen = mx.sym.var("remember_weight"), mx.sym.var("remember_seen")
    if keyword:
        out = mx.sym.Custom(data=fc, weight=w, seen=seen, op_type="gluon_amp_test_remember", name="remember")
    else:
        out = mx.sym.Custom(fc, w, seen, op_type="gluon_amp_test_remember", name="remember")
    return mx.sym.MakeLoss(mx.sym.mean(mx.sym.square(out)))


def _train(keyword: bool):
    rng = np.random.RandomState(0)
    mod = mx.mod.Module(_symbol(keyword), data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", (4, 16))])
    mod.init_params(arg_params={"fc_weight": mx.nd.array(rng.uniform(-0.3, 0.3, (8, 16))),
                                "fc_bias": mx.nd.zeros(8), "remember_weight": mx.nd.ones(8)},
                    aux_params={"remember_seen": mx.nd.zeros((4, 8))})
    mod.init_optimizer(optimizer_params={"learning_rate": 0.1})
    batch = mx.io.DataBatch([mx.nd.array(rng.uniform(0, 1, (4, 16)))])
    losses = []
    for _ in range(3):
        mod.forward(batch)
        mod.backward()
        mod.update()
        losses.append(float(mod.get_outputs()[0].asscalar()))
    args, aux = mod.get_params()
    return losses, args, aux


def _modes():
    return [pytest.param(("float16", True), id="emulated-float16"),
            pytest.param(("bfloat16", True), id="emulated-bfloat16"),
            pytest.param(("bfloat16", None), id="native")]


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("mode", _modes())
def test_a_custom_ops_auxiliary_state_is_left_as_given_and_updated(mode, keyword, native_host):
    expect_losses, expect_args, expect_aux = _train(keyword)
    dtype, emulate = mode
    gluon_amp.init(dtype, emulate=emulate, tune=False)
    sym = _symbol(keyword)
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    custom = next(n for n in nodes if n["op"] == "Custom")
    fed = [nodes[i]["op"] for i, _, _ in custom["inputs"]]
    assert fed[2] == "null" and nodes[custom["inputs"][2][0]]["name"] == "remember_seen"
    assert any(op in ("amp_cast", "amp_multicast") for op in fed[:2]), fed  # its other inputs are cast
    assert "remember_seen" in sym.list_auxiliary_states()
    losses, args, aux = _train(keyword)
    np.testing.assert_allclose(losses, expect_losses, rtol=0.05)
    # the op wrote the FullyConnected's output into the user's state: the last step's, in float32
    assert aux["remember_seen"].dtype == np.float32
    np.testing.assert_allclose(aux["remember_seen"].asnumpy(), expect_aux["remember_seen"].asnumpy(),
                               rtol=0.05, atol=0.02)
    assert np.abs(aux["remember_seen"].asnumpy()).sum() > 0


def test_an_error_that_is_not_about_auxiliary_states_is_mxnets_own():
    """The retry is for a mutated input only: any other error MXNet raises at composition passes
    through unchanged."""
    gluon_amp.init("bfloat16", emulate=True, tune=False)
    with pytest.raises(mx.base.MXNetError) as err:
        mx.sym.Custom(mx.sym.var("a"), op_type="gluon_amp_test_no_such_op")
    gluon_amp.disable()
    with pytest.raises(mx.base.MXNetError) as plain:
        mx.sym.Custom(mx.sym.var("a"), op_type="gluon_amp_test_no_such_op")
    assert str(err.value).splitlines()[0] == str(plain.value).splitlines()[0]


@pytest.mark.parametrize("mode", _modes())
def test_the_retried_op_takes_the_name_plain_mxnet_gives(mode, native_host):
    """The first attempt and the op built to read its auxiliary states take automatic names;
    they are handed back, so the op (and what follows it) is named as plain MXNet names it."""
    def names():
        with mx.name.NameManager():
            x = mx.sym.var("x")
            out = mx.sym.Custom(mx.sym.relu(x), mx.sym.var("w"), mx.sym.var("s"), op_type="gluon_amp_test_remember")
            out = mx.sym.FullyConnected(out, num_hidden=2)
            return [n["name"] for n in json.loads(out.tojson(remove_amp_cast=False))["nodes"]
                    if n["op"] in ("Custom", "FullyConnected")]

    expect = names()
    dtype, emulate = mode
    gluon_amp.init(dtype, emulate=emulate, tune=False)
    assert names() == expect == ["custom0", "fullyconnected0"]
