import types

import pytest

from gluon_amp_core import table as table_mod
from gluon_amp_core.policy import Policy
from gluon_amp_core.table import OpClass, build_table


def test_default_tables_build_for_both_dtypes():
    for dt in ("float16", "bfloat16"):
        t = build_table(dt)
        assert t.class_of("Convolution") is OpClass.LOW_PRECISION
        assert t.class_of("softmax") is OpClass.FP32
        assert t.class_of("Activation") is OpClass.CONDITIONAL_FP32
        assert t.class_of("elemwise_add") is OpClass.WIDEST


@pytest.mark.parametrize("bad", ["float32", "int8", "fp8", 3, None])
def test_bad_target_dtype_lists_choices(bad):
    with pytest.raises(ValueError) as e:
        build_table(bad)
    assert "'float16'" in str(e.value) and "'bfloat16'" in str(e.value)


def test_unknown_op_suggests_nearest():
    with pytest.raises(ValueError) as e:
        build_table("float16", fp32_ops=["softmx"])
    assert "'softmx'" in str(e.value) and "'softmax'" in str(e.value)


@pytest.mark.parametrize("arg", ["target_precision_ops", "fp32_ops", "widest_type_ops"])
def test_unknown_op_in_each_list(arg):
    with pytest.raises(ValueError, match="Convolutoin"):
        build_table("bfloat16", **{arg: ["Convolutoin"]})


def test_unknown_op_in_conditional_list():
    with pytest.raises(ValueError, match="Activatoin"):
        build_table("bfloat16", conditional_fp32_ops=[("Activatoin", "act_type", ["softrelu"])])


@pytest.mark.parametrize("known_ops", [None, ["Convolution", "softmax", "Activation"]])
def test_op_lists_are_checked_where_amp_is_off_too(known_ops):
    """A float32 policy (AMP off on this machine) builds no table; a misspelt op is still an
    error, as it is where low precision runs, and valid lists pass."""
    with pytest.raises(ValueError, match="Convolutoin"):
        Policy.create("float32", fp32_ops=["Convolutoin"], known_ops=known_ops)
    with pytest.raises(ValueError, match="Activatoin"):
        Policy.create("float32", conditional_fp32_ops=[("Activatoin", "act_type", ["softrelu"])], known_ops=known_ops)
    with pytest.raises(ValueError, match="in both"):
        Policy.create("float32", target_precision_ops=["Convolution"], fp32_ops=["Convolution"], known_ops=known_ops)
    assert Policy.create("float32", fp32_ops=["Convolution"], known_ops=known_ops).fp32_ops == ("Convolution",)


def test_op_in_two_lists_rejected():
    with pytest.raises(ValueError, match="'Convolution' is in both"):
        build_table("float16", target_precision_ops=["Convolution"], fp32_ops=["Convolution"])


def test_alias_and_canonical_in_two_lists_rejected():
    with pytest.raises(ValueError, match="in both"):
        build_table("float16", target_precision_ops=["Concat"], fp32_ops=["concat"],
                    aliases={"concat": "Concat"})


def test_overlap_in_data_rejected_when_built(monkeypatch):
    real = table_mod._load_lists("float16")
    fake = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if k.isupper()})
    fake.FP32 = list(real.FP32) + ["Convolution"]
    monkeypatch.setattr(table_mod, "_load_lists", lambda dt: fake)
    with pytest.raises(ValueError, match="'Convolution' as both"):
        build_table("float16")


def test_override_replaces_class_list():
    t = build_table("bfloat16", target_precision_ops=["FullyConnected"])
    assert t.class_of("FullyConnected") is OpClass.LOW_PRECISION
    assert t.class_of("Convolution") is OpClass.NEUTRAL  # dropped from the replaced list
    t = build_table("bfloat16", fp32_ops=["Convolution"])
    assert t.class_of("Convolution") is OpClass.FP32
    assert t.class_of("softmax") is OpClass.NEUTRAL


def test_conditional_override_and_type_errors():
    t = build_table("float16", conditional_fp32_ops=[("LeakyReLU", "act_type", ["gelu"])])
    assert t.conditions["LeakyReLU"].values == frozenset({"gelu"})
    assert t.class_of("Activation") is OpClass.NEUTRAL
    # argument types are validated where the policy is built
    with pytest.raises(TypeError):
        Policy.create("float16", conditional_fp32_ops=[("Activation", "act_type", "softrelu")])
    with pytest.raises(TypeError):
        Policy.create("float16", fp32_ops="softmax")


def test_keep_batchnorm_fp32():
    assert build_table("float16", keep_batchnorm_fp32=True).class_of("BatchNorm") is OpClass.FP32
    t = build_table("bfloat16", keep_batchnorm_fp32=False)
    assert t.class_of("BatchNorm") is OpClass.LOW_PRECISION
    assert "gamma" in t.keep_fp32_inputs["BatchNorm"]
    with pytest.raises(TypeError):
        Policy.create("bfloat16", keep_batchnorm_fp32="yes")


def test_table_is_immutable():
    t = build_table("float16")
    with pytest.raises(TypeError):
        t.classes["Convolution"] = OpClass.FP32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kwargs, needle", [
    ({"fp32_ops": ["softmx"]}, "'softmx'"),                                      # unknown op
    ({"target_precision_ops": ["Convolution"], "fp32_ops": ["Convolution"]}, "in both"),
    ({"target_precision_ops": ["concat"], "widest_type_ops": ["Concat"]}, "in both"),  # alias + name
    ({"conditional_fp32_ops": [("Activatoin", "act_type", ["softrelu"])]}, "'Activatoin'"),
    ({"fp32_ops": ["softmax"], "conditional_fp32_ops": [("softmax", "axis", ["0"])]}, "in both"),
])
def test_op_list_mistakes_are_both_value_and_assertion_errors(dtype, kwargs, needle):
    # code written for mxnet.contrib.amp catches AssertionError, ours ValueError: both work
    aliases = {"concat": "Concat"}
    for caught in (ValueError, AssertionError, table_mod.OpListError):
        with pytest.raises(caught) as e:
            build_table(dtype, aliases=aliases, **kwargs)
        assert type(e.value) is table_mod.OpListError and needle in str(e.value)


@pytest.mark.parametrize("bad", ["softmax", [3], {"softmax": 1}])
def test_op_lists_of_the_wrong_type_are_both_type_and_assertion_errors(bad):
    for caught in (TypeError, AssertionError):
        with pytest.raises(caught, match="fp32_ops must"):
            table_mod.check_name_list("fp32_ops", bad)
    with pytest.raises(AssertionError, match="conditional_fp32_ops"):
        table_mod.check_conditional([("Activation", "act_type", "softrelu")])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_widest_op_may_be_forced_to_float32(dtype):
    # the peer refuses this; a deliberate extension: the add then runs in float32
    assert build_table(dtype).class_of("elemwise_add") is OpClass.WIDEST
    assert build_table(dtype, fp32_ops=["elemwise_add"]).class_of("elemwise_add") is OpClass.FP32
