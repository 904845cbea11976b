"""Loss-output ops (``SoftmaxOutput``, the ``*RegressionOutput`` ops) built symbolically under
``init`` (gluon_amp/patching/wrappers/loss_output.py).

Their backward starts from ``grad_scale``, which a hybridized Gluon block's dynamic loss scale
cannot reach: that is said once per build, at the user's line. A Module's symbol (built outside
any block; the Module hook scales it where it binds) and a bfloat16 policy (no loss is scaled)
pass without a word: every Module script of MXNet's examples used to get the warning, naming a
line of gluon_amp.
"""
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import gluon

import gluon_amp

HEADS = ["SoftmaxOutput", "LinearRegressionOutput", "LogisticRegressionOutput", "MAERegressionOutput"]
POLICIES = {"emulated-float16": {"target_dtype": "float16", "emulate": True},
            "emulated-bfloat16": {"target_dtype": "bfloat16", "emulate": True}}


class _Head(gluon.HybridBlock):
    def __init__(self, head):
        super().__init__()
        self.head = head
        with self.name_scope():
            self.fc = gluon.nn.Dense(4)

    def hybrid_forward(self, F, x, y):
        return getattr(F, self.head)(self.fc(x), y)  # the line a warning must name


def _caught(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if "grad_scale" in str(w.message)]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_modules_loss_head_is_built_and_trained_without_a_warning(policy, head):
    gluon_amp.init(**POLICIES[policy])
    try:
        def build_and_fit():
            fc = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=1 if head != "SoftmaxOutput" else 4, name="fc")
            label = mx.sym.var("softmax_label")
            net = getattr(mx.sym, head)(fc, label, name="out")
            rng = np.random.RandomState(0)
            it = mx.io.NDArrayIter(rng.rand(32, 8).astype("float32"), rng.randint(0, 2, 32).astype("float32"),
                                   batch_size=16, label_name="softmax_label")
            mod = mx.mod.Module(net)
            mod.fit(it, num_epoch=1, optimizer_params={"learning_rate": 0.1})
            assert all(np.isfinite(v.asnumpy()).all() for v in mod.get_params()[0].values())
        assert _caught(build_and_fit) == []
    finally:
        gluon_amp.disable()


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_hybridized_blocks_loss_head_is_named_where_its_scale_cannot_reach(policy, head):
    gluon_amp.init(**POLICIES[policy])
    try:
        net = _Head(head)
        net.initialize()
        net.hybridize()
        x, y = mx.nd.ones((2, 8)), mx.nd.ones((2, 4 if head != "SoftmaxOutput" else 1)).reshape((2, -1))
        y = y[:, 0] if head == "SoftmaxOutput" else y
        said = _caught(lambda: net(x, y).wait_to_read())
        again = _caught(lambda: net(x, y).wait_to_read())  # the graph is built once
    finally:
        gluon_amp.disable()
    if policy == "emulated-bfloat16":
        assert said == []  # bfloat16 scales no loss
        return
    assert len(said) == 1 and again == []
    assert said[0].category is RuntimeWarning and said[0].filename == __file__
    assert "getattr(F, self.head)" in open(__file__).read().splitlines()[said[0].lineno - 1]
