from gluon_amp_core.decide import decide
from gluon_amp_core.table import build_table

BF = build_table("bfloat16")
FP = build_table("float16")


def test_low_precision_and_fp32():
    assert decide("Convolution", {}, ["float32", "float32"], FP).dtype == "float16"
    assert decide("Convolution", {}, [None], BF).dtype == "bfloat16"
    assert decide("softmax", {}, ["float16"], FP).dtype == "float32"


def test_conditional_on_attribute():
    assert decide("Activation", {"act_type": "softrelu"}, ["float16"], FP).reason == "conditional_fp32"
    d = decide("Activation", {"act_type": "relu"}, ["float16"], FP)
    assert d.dtype is None and d.reason == "conditional_neutral"
    assert decide("Activation", {}, ["float16"], FP).dtype is None


def test_widest():
    assert decide("elemwise_add", {}, ["float16", "float32"], FP).dtype == "float32"
    assert decide("elemwise_add", {}, ["float16", "float16"], FP).dtype == "float16"
    assert decide("elemwise_add", {}, ["bfloat16", "float16"], FP).dtype == "float32"
    assert decide("elemwise_add", {}, [None, "float16"], FP).dtype is None  # run-time multicast
    assert decide("where", {}, ["int32", "float16", "float32"], FP).dtype == "float32"


def test_neutral_excluded_and_keep_fp32():
    assert decide("Reshape", {}, ["float16"], FP).reason == "neutral"
    assert decide("Convolution", {}, ["float32"], FP, excluded=True).dtype == "float32"
    t = build_table("bfloat16", keep_batchnorm_fp32=False)
    assert decide("BatchNorm", {}, ["float32"] * 5, t).keep_fp32 >= {"gamma", "moving_var"}


def test_unknown_op_is_neutral_not_an_error():
    # ops from a newer MXNet than the table must not break a running graph
    assert decide("_made_up_op", {}, ["float32"], FP).reason == "neutral"


def test_narrow_input_keeps_a_low_precision_op_in_float32():
    # oneDNN 2.4's bf16 weight gradient reads unwritten memory when the width < the stride
    conv = {"stride": "(2, 2)", "kernel": "(3, 3)", "pad": "(1, 1)"}
    d = decide("Convolution", conv, [None, None], BF, input_shapes=[(1, 16, 1, 1), (16, 16, 3, 3)])
    assert (d.dtype, d.reason) == ("float32", "narrow_input")
    for shape in [(1, 16, 2, 2), (1, 16, 1, 2), None]:  # as wide as the stride, or unknown
        assert decide("Convolution", conv, [None], BF, input_shapes=[shape]).dtype == "bfloat16"
    assert decide("Convolution", conv, [None], BF).dtype == "bfloat16"  # no shapes: a traced graph
    assert decide("Convolution", {}, [None], BF, input_shapes=[(1, 16, 1, 1)]).dtype == "bfloat16"  # stride 1
    assert decide("Convolution", conv, [None], FP, input_shapes=[(1, 16, 1, 1)]).dtype == "float16"  # no fp16 rule
    assert decide("Convolution", conv, [None], BF, excluded=True,
                  input_shapes=[(1, 16, 1, 1)]).reason == "excluded"


def test_is_narrower_reads_attributes_as_mxnet_and_python_write_them():
    from gluon_amp_core.decide import is_narrower
    from gluon_amp_core.table import NarrowRule
    rule = NarrowRule("stride")
    assert is_narrower((1, 8, 1, 1), {"stride": (2, 2)}, rule)
    assert is_narrower((1, 8, 5, 2), {"stride": "(1, 3)"}, rule)  # the width's stride counts
    assert not is_narrower((1, 8, 1, 5), {"stride": "(3, 1)"}, rule)
    assert is_narrower((1, 8, 1), {"stride": "2"}, rule)  # 1-d
    assert is_narrower((1, 9, 1, 8), {"stride": "(2, 2)", "layout": "NHWC"}, rule)  # width is axis -2
    assert not is_narrower((1, 1, 9, 8), {"stride": "(2, 2)", "layout": "NHWC"}, rule)
    assert not is_narrower((1, 8), {"stride": "2"}, rule)  # no spatial axis
    assert not is_narrower((1, 8, 1, 1), {"stride": "()"}, rule)
