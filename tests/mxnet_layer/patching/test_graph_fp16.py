"""float16 at graph level only: MXNet has no float16 GEMM on CPU, so nothing here executes."""
import numpy as np
import mxnet as mx

import gluon_amp
from helpers import import_gluoncv
from helpers import check_graph
from helpers import internal_types, make_net


def _net_symbol(net):
    return net(mx.sym.var("data"))


def test_mixed_net_types_float16():
    table = gluon_amp.init("float16")
    net = make_net()
    sym = _net_symbol(net)
    types = internal_types(sym, data=np.float32)
    conv = [n for n in types if n.endswith("conv0_fwd_output")]
    assert conv and types[conv[0]] == "float16"
    assert [t for n, t in types.items() if n.endswith("dense0_fwd_output")] == ["float16"]
    softmaxes = [n for n in types if "softmax" in n and n.endswith("_output")]
    assert len(softmaxes) == 2 and all(types[n] == "float32" for n in softmaxes)
    plus = [n for n in types if "_plus" in n and n.endswith("_output")]
    assert plus and types[plus[0]] == "float32"  # fp16 relu branch + fp32 softmax branch
    arg_t, _, aux_t = sym.infer_type(data=np.float32)
    assert all(dtype_ok == np.float32 for dtype_ok in aux_t)  # BN statistics
    assert all(t == np.float32 for t in arg_t)                # parameters stay fp32
    problems, counts = check_graph(sym, table, data=np.float32)
    assert not problems, problems
    assert counts["low_precision"] == 3 and counts["fp32"] == 2 and counts["widest"] == 1


def test_excluding_an_op_via_fp32_list():
    gluon_amp.init("float16", fp32_ops=["FullyConnected", "softmax"])
    types = internal_types(_net_symbol(make_net()), data=np.float32)
    dense = [t for n, t in types.items() if n.endswith("dense0_fwd_output")]
    assert dense == ["float32"]


def test_ssd512_graph_float16():
    import_gluoncv()
    from gluoncv.model_zoo import get_model
    table = gluon_amp.init("float16")
    net = get_model("ssd_512_resnet50_v1_coco", pretrained_base=False, norm_layer=mx.gluon.nn.BatchNorm)
    net.initialize()
    with mx.autograd.train_mode():
        sym = mx.sym.Group(list(net(mx.sym.var("data"))))
    types = internal_types(sym, data=np.float32)
    convs = [n for n in types if n.endswith("_fwd_output") and "conv" in n.split("_")[-3]]
    assert len(convs) > 50 and all(types[n] == "float16" for n in convs)
    arg_t, _, aux_t = sym.infer_type(data=np.float32)
    assert all(t == np.float32 for t in aux_t) and all(t == np.float32 for t in arg_t)
    problems, counts = check_graph(sym, table, data=np.float32)
    assert not problems, problems[:5]
    assert counts["low_precision"] > 50 and counts["widest"] > 0
