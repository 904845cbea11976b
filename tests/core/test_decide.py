import pytest

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
    from gluon_amp_core.shape_limits import is_narrower
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


# -- conformance verdicts (gluon_amp_core/verdicts.py, data in lists/verdicts.py): issue 41 items 1-3

from gluon_amp_core.lists import verdicts as verdict_data  # noqa: E402
from gluon_amp_core.table import default_verdicts  # noqa: E402
from gluon_amp_core.verdicts import (BOUNDS, Fact, Verdict, device_verdicts, fact_from_row,  # noqa: E402
                                     plan_verdicts)


def test_every_ruled_out_op_runs_float32_or_uniform_from_low_inputs():
    """Generated over every verdict a plan follows: no op left without a kernel, or with a wrong
    one, in the target dtype, whatever its class; uniform inputs where MXNet needs them."""
    for dt in ("bfloat16", "float16"):
        table = build_table(dt)
        for op, verdict in default_verdicts(dt).items():
            if ":" in op:  # one attribute value: test_decide_names_the_verdict_of_an_attribute_value
                continue
            for given in ([dt], [dt, dt], [dt, "float32"], ["float32", dt]):
                d = decide(op, {}, given, table)
                if verdict is Verdict.NEEDS_UNIFORM_INPUTS:
                    assert d.dtype in (None, "float32", dt), (op, given, d)
                    if len(set(given)) > 1:
                        assert d.dtype == "float32", (op, given, d)
                else:
                    assert d.dtype == "float32", (op, given, d)
                assert d.reason.value in ("no_kernel", "wrong_kernel", "slow_kernel", "uniform_inputs", "fp32",
                                          "widest"), (op, d)


def test_issue41_ops_bfloat16_plan():
    bf = build_table("bfloat16")
    # 1. AdaptiveAvgPooling2D after a bfloat16 conv: neutral before, so it kept bfloat16
    d = decide("_contrib_AdaptiveAvgPooling2D", {"output_size": "1"}, ["bfloat16"], bf)
    assert (d.dtype, d.reason.value) == ("float32", "wrong_kernel")
    # 2. batch_dot / dot of two bfloat16 tensors: widest kept them bfloat16; the CPU has no kernel
    for op in ("batch_dot", "dot"):
        d = decide(op, {}, ["bfloat16", "bfloat16"], bf)
        assert (d.dtype, d.reason.value) == ("float32", "no_kernel")
    # 3. sample_normal(mu bfloat16, sigma float32): one dtype for both
    d = decide("_sample_normal", {}, ["bfloat16", "float32"], bf)
    assert (d.dtype, d.reason.value) == ("float32", "uniform_inputs")
    assert decide("_sample_normal", {}, ["bfloat16", "bfloat16"], bf).dtype == "bfloat16"
    assert decide("_sample_normal", {}, [None, None], bf).dtype is None  # run-time multicast


def test_measured_choice_does_not_override_a_verdict():
    bf = build_table("bfloat16")
    assert decide("batch_dot", {}, ["bfloat16"] * 2, bf, measured="bfloat16").dtype == "float32"


def test_user_lists_keep_their_class_over_a_verdict():
    t = build_table("bfloat16", widest_type_ops=["batch_dot"])
    assert decide("batch_dot", {}, ["bfloat16", "bfloat16"], t).dtype == "bfloat16"
    assert "batch_dot" not in t.verdicts


def test_plan_verdicts_take_the_worst_fact_on_the_target_devices():
    facts = [Fact("a", "bfloat16", Verdict.OK, "cpu", "h1"), Fact("a", "bfloat16", Verdict.WRONG, "cpu", "h2"),
             Fact("b", "float16", Verdict.NO_KERNEL, "cpu", "h1"),  # a CPU fact: float16 plans target GPUs
             Fact("c", "float16", Verdict.NEEDS_UNIFORM_INPUTS, "any", "h1"),
             Fact("d", "bfloat16", Verdict.OK, "cpu", "h1")]
    assert dict(plan_verdicts(facts, "bfloat16")) == {"a": Verdict.WRONG}
    assert dict(plan_verdicts(facts, "float16")) == {"c": Verdict.NEEDS_UNIFORM_INPUTS}


def test_device_verdicts_keep_every_op_run_there_with_its_worst_fact():
    """What a script's own float16 graph can run on a CPU, op by op (execution.kernels_missing)."""
    facts = [Fact("a", "float16", Verdict.OK, "cpu", "h1"), Fact("a", "float16", Verdict.NO_KERNEL, "cpu", "h2"),
             Fact("b", "float16", Verdict.OK, "cpu", "h1"),
             Fact("c", "float16", Verdict.NEEDS_UNIFORM_INPUTS, "any", "h1"),
             Fact("d", "bfloat16", Verdict.NO_KERNEL, "cpu", "h1"),
             Fact("e", "float16", Verdict.NO_KERNEL, "gpu", "h1")]
    assert dict(device_verdicts(facts, "float16", "cpu")) == {
        "a": Verdict.NO_KERNEL, "b": Verdict.OK, "c": Verdict.NEEDS_UNIFORM_INPUTS}
    assert dict(device_verdicts(facts, "bfloat16", "cpu")) == {"d": Verdict.NO_KERNEL}


def test_recorded_facts_are_well_formed_and_name_their_host():
    facts = [fact_from_row(r) for r in verdict_data.FACTS]
    assert facts
    for f in facts:
        assert f.host in verdict_data.HOSTS, f
        assert f.dtype in BOUNDS and f.device in ("any", "cpu"), f
        host = verdict_data.HOSTS[f.host]
        assert len(host) == 4 and all(isinstance(x, str) and x for x in host), f.host
        if f.verdict is Verdict.OK and f.error is not None:
            assert f.error <= BOUNDS[f.dtype], f
        if f.verdict is Verdict.WRONG:
            assert f.error is not None and f.error > BOUNDS[f.dtype], f
    # facts no CI host can produce travel with the host that did
    assert any(f.host == "zen4-issue41" and f.op == "_contrib_AdaptiveAvgPooling2D" for f in facts)


def test_a_verdict_for_one_attribute_value_joins_the_conditional_rule():
    from gluon_amp_core.table import OpClass, apply_verdicts, list_classes
    classes = list_classes("bfloat16")
    conditions = {}
    from gluon_amp_core.table import ConditionalRule
    conditions["Activation"] = ConditionalRule("act_type", frozenset({"softrelu"}))
    applied = apply_verdicts(classes, conditions, {"Activation:act_type=softsign": Verdict.NO_KERNEL,
                                                   "_contrib_AdaptiveAvgPooling2D:output_size=2": Verdict.WRONG,
                                                   "Reshape": Verdict.NEEDS_UNIFORM_INPUTS}, ())
    assert conditions["Activation"].values == {"softrelu", "softsign"}
    assert classes["_contrib_AdaptiveAvgPooling2D"] is OpClass.CONDITIONAL_FP32
    assert classes["Reshape"] is OpClass.WIDEST and len(applied) == 3


def test_decide_names_the_verdict_of_an_attribute_value():
    bf = build_table("bfloat16")
    for key, verdict in default_verdicts("bfloat16").items():
        op, _, cond = key.partition(":")
        if not cond or verdict not in (Verdict.NO_KERNEL, Verdict.WRONG):
            continue
        attr, _, value = cond.partition("=")
        d = decide(op, {attr: value}, ["bfloat16"], bf)
        assert d.dtype == "float32" and d.reason.value in ("no_kernel", "wrong_kernel", "conditional_fp32"), (key, d)


def test_judge_follows_the_bounds():
    from gluon_amp_core.verdicts import Observation, judge
    assert judge(Observation(error=0.01), "bfloat16") == (Verdict.OK, "cpu")
    assert judge(Observation(error=0.01), "float16")[0] is Verdict.WRONG
    assert judge(Observation(error=float("nan")), "bfloat16")[0] is Verdict.WRONG
    assert judge(Observation(refused="x", refused_by_types=True), "float16") == (Verdict.NO_KERNEL, "any")
    assert judge(Observation(error=0.0, mixed_refused="m"), "bfloat16") == (Verdict.NEEDS_UNIFORM_INPUTS, "any")


def test_a_widest_op_with_more_inputs_than_its_kernel_takes_runs_float32():
    """Generated over every input-count limit of both tables and every count around it: in the
    target, float32 above the limit and the target up to it; other dtypes as given."""
    for dt in ("bfloat16", "float16"):
        table = build_table(dt)
        for op, limit in table.fp32_above_inputs.items():
            for n in range(1, 2 * limit + 2):
                d = decide(op, {"num_args": str(n)}, [dt] * n, table)
                want = ("float32", "slow_kernel") if n > limit else (dt, "widest")
                assert (d.dtype, d.reason.value) == want, (dt, op, n, d)
                assert decide(op, {}, ["float32"] * n, table).dtype == "float32"
                assert decide(op, {}, [None] * n, table).dtype is None  # typed where the graph is
                if dt == "bfloat16":  # a GPU's float16 code fed to the bfloat16 table: widest, as before
                    assert decide(op, {}, ["float16"] * n, table).dtype == "float16"
    assert dict(build_table("bfloat16").fp32_above_inputs) == {"add_n": 8}
    assert not build_table("float16").fp32_above_inputs
    # an alias resolves to the op the limit names
    bf = build_table("bfloat16", aliases={"ElementWiseSum": "add_n"})
    assert decide("ElementWiseSum", {}, ["bfloat16"] * 9, bf).dtype == "float32"


def test_an_input_limit_for_an_op_the_table_does_not_list_is_refused(monkeypatch):
    from gluon_amp_core import table as table_module
    data = table_module._load_lists("bfloat16")
    monkeypatch.setattr(data, "FP32_WITH_MORE_INPUTS_THAN", (("_no_such_op", 8),))
    with pytest.raises(ValueError, match="_no_such_op"):
        table_module.build_table("bfloat16")
