"""Users' casts are theirs: an ``amp_cast``, ``amp_multicast`` or ``Cast`` already in a user's
graph stays in every converter's result and under ``init``, with the dtype it asks for, and
the neutral op that reads it follows it (docs/inference.md). Generated: cast ops x where they
sit x converters. Graph-level (types as MXNet infers them), emulated plans: any CPU."""
import itertools
import json
import warnings

import pytest
import mxnet as mx
from mxnet.gluon import nn

import gluon_amp as amp
from gluon_amp import mxnet_internals as mxi
from gluon_amp.type_inference import infer_dtypes

TARGET = "bfloat16"
#: The user's low dtype: float16, whose CPU kernels run the FP32 model's own forward pass.
USERS = "float16"


class _Net(nn.HybridBlock):
    """``case`` = (cast op, where): the user's cast ``user_cast`` and the op reading it ``user_next``."""

    def __init__(self, cast, where, **kw):
        super().__init__(**kw)
        self.cast, self.where = cast, where
        with self.name_scope():
            self.fc1, self.fc2 = nn.Dense(8, flatten=False, in_units=8), nn.Dense(4, in_units=8)

    def _user_cast(self, F, x, dtype):
        op = F.amp_cast if self.cast == "amp_cast" else F.Cast
        return op(x, dtype=dtype, name="user_cast")

    def hybrid_forward(self, F, x, *more):
        if self.where == "low_before_neutral":  # the user runs relu in float16
            return F.relu(self._user_cast(F, x, USERS), name="user_next")
        if self.where == "fp32_after_low_op":  # the user wants the FC's output back in float32
            return self.fc2(F.Flatten(self._user_cast(F, self.fc1(x), "float32"), name="user_next"))
        (y,) = more
        narrow = self.where == "multicast_narrow"
        a, b = F.amp_multicast(self.fc1(x), y, num_outputs=2, cast_narrow=narrow, name="user_cast")
        return F.elemwise_add(a, b, name="user_next")


#: (cast op, where) -> the dtype the user's cast gives and the op reading it runs in
CASES = {("amp_cast", "low_before_neutral"): USERS, ("Cast", "low_before_neutral"): USERS,
         ("amp_cast", "fp32_after_low_op"): "float32", ("Cast", "fp32_after_low_op"): "float32",
         ("amp_multicast", "multicast_narrow"): TARGET, ("amp_multicast", "multicast_widest"): "float32"}


def _inputs(where):
    return [mx.nd.ones((2, 8))] * (2 if where.startswith("multicast") else 1)


def _fp32_net(cast, where):
    mx.random.seed(0)
    net = _Net(cast, where)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(*_inputs(where))
    return net


def _params(net, sym):
    arrays = {p.name: p.data() for p in net.collect_params().values()}
    return ({k: v for k, v in arrays.items() if k in sym.list_arguments()},
            {k: v for k, v in arrays.items() if k in sym.list_auxiliary_states()})


def _convert_symbol(cast, where):
    sym = mxi.cached_graph(_fp32_net(cast, where), "test")[1]
    return amp.convert_symbol(sym, TARGET, emulate=True)


def _convert_model(cast, where):
    net = _fp32_net(cast, where)
    sym = mxi.cached_graph(net, "test")[1]
    return amp.convert_model(sym, *_params(net, sym), TARGET, emulate=True)[0]


def _convert_hybrid_block(cast, where):
    return amp.convert_hybrid_block(_fp32_net(cast, where), TARGET, emulate=True).deployed_symbol()


def _init(cast, where):
    amp.init(TARGET, emulate=True)
    try:
        net = _Net(cast, where)
        net.initialize(mx.init.Xavier())
        net.hybridize()
        net(*_inputs(where)).wait_to_read()
        return mxi.cached_graph(net, "test")[1]  # the plan the block keeps
    finally:
        amp.disable()


def _init_then_convert_hybrid_block(cast, where):
    """A block traced under ``init`` converted: from its FP32 graph, the plan's casts taken out."""
    amp.init(TARGET, emulate=True)
    try:
        net = _Net(cast, where)
        net.initialize(mx.init.Xavier())
        net.hybridize()
        net(*_inputs(where)).wait_to_read()
        return amp.convert_hybrid_block(net, TARGET, emulate=True).deployed_symbol()
    finally:
        amp.disable()


CONVERTERS = {"convert_symbol": _convert_symbol, "convert_model": _convert_model,
              "convert_hybrid_block": _convert_hybrid_block, "init": _init,
              "init_then_convert_hybrid_block": _init_then_convert_hybrid_block}


def _named(nodes, suffix):
    got = [n for n in nodes if n["name"].endswith(suffix)]
    assert len(got) == 1, f"{suffix}: {[n['name'] for n in nodes]}"
    return got[0]


@pytest.mark.parametrize("converter,case", list(itertools.product(CONVERTERS, CASES)),
                         ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_users_cast_is_kept_with_its_dtype(converter, case):
    cast, where = case
    fp32 = json.loads(mxi.cached_graph(_fp32_net(cast, where), "test")[1].tojson(remove_amp_cast=False))["nodes"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = CONVERTERS[converter](cast, where)
    nodes = json.loads(plan.tojson(remove_amp_cast=False))["nodes"]
    users, theirs = _named(nodes, "user_cast"), _named(fp32, "user_cast")
    assert users["op"] == theirs["op"] and users.get("attrs") == theirs.get("attrs")  # as the user wrote it
    attrs = plan.attr_dict()
    known = {n: "float32" for n in plan.list_inputs() if "__dtype__" not in attrs.get(n, {})}
    typed = infer_dtypes(plan, known)
    assert typed is not None
    want = CASES[case]
    assert typed[(users["name"], 0)] == want
    assert typed[(_named(nodes, "user_next")["name"], 0)] == want


@pytest.mark.bf16_kernels
def test_users_cast_is_kept_by_the_tuner_under_init(monkeypatch):
    """Tuning (on by default, natively) times the plan's low ops; a relu the user cast to
    bfloat16 is the user's, not one of them: its float32 verdict dropped the user's cast.
    (oneDNN's ``Activation``: MXNet's ``relu`` op is a loop timed slow in bfloat16, which the
    table runs float32 whatever the tuner says: gluon_amp_core.kernel_speed.)"""
    monkeypatch.delenv("GLUON_AMP_TUNE", raising=False)  # the suite turns tuning off: the real default here

    class Net(nn.HybridBlock):
        def hybrid_forward(self, F, x):
            return F.Activation(F.amp_cast(x, dtype=mxi.to_mx_dtype("bfloat16"), name="user_cast"),
                                act_type="relu", name="user_next")

    amp.init("bfloat16")
    try:
        net = Net()
        net.hybridize()
        for _ in range(3):
            net(mx.nd.ones((2, 8))).wait_to_read()
        plan = mxi.cached_graph(net, "test")[1]
    finally:
        amp.disable()
    nodes = json.loads(plan.tojson(remove_amp_cast=False))["nodes"]
    typed = infer_dtypes(plan, {"data": "float32"})
    assert typed[(_named(nodes, "user_cast")["name"], 0)] == "bfloat16"
    assert typed[(_named(nodes, "user_next")["name"], 0)] == "bfloat16"
