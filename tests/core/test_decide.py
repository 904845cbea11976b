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
