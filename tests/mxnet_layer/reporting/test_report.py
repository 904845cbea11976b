import mxnet as mx
import pytest

import gluon_amp
from helpers import make_net


def test_report_of_training_graph_under_init():
    gluon_amp.init("bfloat16")
    net = make_net()
    rep = gluon_amp.report(net(mx.sym.var("data")))  # the graph hybridize would cache
    by_op = {r.op: r for r in rep.rows}
    assert by_op["Convolution"].dtype == "bfloat16" and by_op["Convolution"].reason == "low_precision"
    assert by_op["softmax"].dtype == "float32" and by_op["softmax"].reason == "fp32"
    assert by_op["elemwise_add"].reason == "widest" and by_op["elemwise_add"].dtype == "float32"
    assert rep.casts > 0 and sum(rep.totals_by_dtype.values()) == len(rep.rows)
    text = str(rep)
    assert "ops by dtype" in text and "casts:" in text


def test_report_of_converted_graph_marks_exclusions():
    data = mx.sym.var("data")
    fc1 = mx.sym.FullyConnected(data, num_hidden=8, name="fc1")
    fc2 = mx.sym.FullyConnected(mx.sym.relu(fc1), num_hidden=4, name="fc2")
    sym = gluon_amp.convert_symbol(fc2, "bfloat16", excluded_sym_names=["fc2"], data_names=["data"])
    rep = gluon_amp.report(sym, target_dtype="bfloat16")
    reasons = {r.name: (r.dtype, r.reason) for r in rep.rows}
    assert reasons["fc1"] == ("bfloat16", "low_precision")
    assert reasons["fc2"] == ("float32", "excluded")
    assert rep.to_dict()["totals_by_reason"]["excluded"] == 1


def test_report_labels_a_float16_graph_float16():
    """With no AMP on and no target given, the label comes from the graph (or its converter)."""
    data = mx.sym.var("data")
    fc = mx.sym.FullyConnected(data, num_hidden=4, name="fc")
    sym = gluon_amp.convert_symbol(fc, "float16", data_names=["data"])
    assert gluon_amp.current_policy() is None
    rep = gluon_amp.report(sym)
    assert rep.target_dtype == "float16" and "target dtype float16" in str(rep)
    net = make_net()
    net(mx.nd.ones((1, 3, 8, 8)))
    block = gluon_amp.convert_hybrid_block(net, "float16")
    assert gluon_amp.report(block).target_dtype == "float16"


def test_report_errors():
    with pytest.raises(TypeError):
        gluon_amp.report(42)
    with pytest.raises(RuntimeError, match="hybridize"):
        gluon_amp.report(make_net(hybridize=False))
    fc = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2)
    for bad, error in (("", ValueError), ("float17", ValueError), (3, TypeError)):  # NumPy's words came first
        with pytest.raises(error, match=f"report: data={bad!r} is not a dtype MXNet has"):
            gluon_amp.report(fc, "bfloat16", data=bad)


def test_report_takes_a_bfloat16_data_input():
    """MXNet's infer_type drops bfloat16 keyword dtypes; the report must not."""
    data = mx.sym.var("data")
    sym = mx.sym.relu(mx.sym.FullyConnected(data, num_hidden=4, name="fc"), name="r")
    rep = gluon_amp.report(sym, target_dtype="float16", data="bfloat16", fc_weight="bfloat16",
                           fc_bias="bfloat16")
    assert {r.name: r.dtype for r in rep.rows}["r"] == "bfloat16"


class _Scale(mx.gluon.HybridBlock):
    """``x * scale``: a parameter op that runs in float16 on every CPU."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.scale = self.params.get("scale", shape=(1, 4), init=mx.init.One())

    def hybrid_forward(self, F, x, scale):
        return F.broadcast_mul(x, scale)


def test_report_types_a_block_with_its_parameters_as_stored(capsys):
    """A cast after the first call (``net.cast``, O2's weights) leaves the graph declaring
    float32 parameters: the report reads the dtypes the block binds, never MXNet's raw error."""
    net = _Scale()
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((2, 4)))
    net.cast("float16")
    net(mx.nd.ones((2, 4), dtype="float16"))
    rows = gluon_amp.report(net, data="float16").rows
    assert [(r.op, r.dtype) for r in rows] == [("broadcast_mul", "float16")]
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"inputs as \{data=float32, .*scale=float16\}.*report\(sym, data="):
        gluon_amp.report(net)  # data taken as float32: MXNet rejects the pair, said as gluon_amp's error
    assert "infer_type error" not in capsys.readouterr().out
