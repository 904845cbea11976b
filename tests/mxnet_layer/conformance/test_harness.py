"""The conformance harness (gluon_amp/conformance/): its verdicts against the recorded data.

Quick: ops whose kernels run outside oneDNN, so every host gives the same verdict, against what
gluon_amp_core/lists/verdicts_measured.py recorded. Slow: every candidate op. bf16 host: the
facts recorded from hosts with native bfloat16 kernels, against this host's kernels."""
import math

import pytest

from gluon_amp.conformance import cases, harness
from gluon_amp_core.lists import verdicts as data
from gluon_amp_core.verdicts import RULES, SEVERITY, Verdict, fact_from_row, judge

#: (op, dtype) -> the CI host's fact (``verdicts_measured``: the AVX2 host)
MEASURED = {(r[0], r[1]): fact_from_row(r) for r in data.MEASURED if r[4] == data.MEASURED_HOST[0]}

#: kernels outside oneDNN: the same verdict on every CPU
QUICK = ("_contrib_AdaptiveAvgPooling2D", "batch_dot", "dot", "_sample_normal", "take", "Activation", "Reshape")


def _results(ops, dtypes=("bfloat16", "float16")):
    return {r.op: r for op in ops for r in harness.check_op(op, dtypes)}


def test_quick_subset_matches_the_recorded_facts():
    got = _results(QUICK)
    checked = 0
    for key, r in got.items():
        assert not r.excluded, (key, r.excluded)
        for dt, res in r.results.items():
            if res.verdict is None:  # oneDNN refused the dtype here; another host measures it
                assert res.unmeasured
                continue
            recorded = MEASURED.get((key, dt))
            if recorded is None:  # a host with bfloat16 kernels measures what the recording host could not
                assert res.verdict in ("ok", "wrong", "no_kernel", "needs_uniform_inputs")
                continue
            assert res.verdict == recorded.verdict.value, (key, dt, res, recorded)
            checked += 1
    assert checked >= 10
    # the three defects of issue 41, as the harness finds them
    assert got["_contrib_AdaptiveAvgPooling2D"].results["bfloat16"].verdict == "wrong"
    assert got["batch_dot"].results["bfloat16"].verdict == "no_kernel"
    assert got["_sample_normal"].results["bfloat16"].verdict == "needs_uniform_inputs"
    assert got["Activation:act_type=softsign"].results["bfloat16"].verdict == "no_kernel"


def test_every_refusal_by_type_inference_holds_on_every_device():
    """A refusal by type inference (a legacy operator's InferType takes float32 alone: Crop,
    MultiBoxPrior) holds on a GPU too, so a float16 plan, which follows only such facts, keeps
    the op float32. Recorded as a CPU fact, Crop stayed float16 in FCN-xs's emulated float16
    plan, and MXNet refused to bind it. Every recorded fact, each host's."""
    from gluon_amp.conformance.runner import is_type_refusal
    assert is_type_refusal("Check failed: in_type->at(i) == mshadow: :default_type_flag || in_type->at(i) == -1")
    assert not is_type_refusal("MXNetError: Unknown type enum 12")
    refusals = [f for f in (fact_from_row(r) for r in data.MEASURED) if f.verdict is Verdict.NO_KERNEL]
    by_types = [f for f in refusals if is_type_refusal(f.note or "")]
    assert {f.op for f in by_types} >= {"Crop", "_contrib_MultiBoxPrior"}
    assert [(f.op, f.dtype, f.host) for f in by_types if f.device != "any"] == []


def test_every_candidate_is_run_or_named_with_why():
    cands = cases.candidates()
    assert "_contrib_AdaptiveAvgPooling2D" in cands and "Convolution" in cands
    from gluon_amp_core.lists import verdicts_measured as vm
    excluded = dict(vm.EXCLUDED)
    measured_ops = {k.partition(":")[0] for k, _ in MEASURED} | {op.partition(":")[0] for op, _, _ in vm.UNMEASURED}
    missing = [op for op in cands if op not in excluded and op not in measured_ops]
    assert not missing, f"candidates neither run nor excluded in the recorded data: {missing[:20]}"
    assert all(why for why in excluded.values())
    assert vm.REGISTRY_SIZE == cases.registry_size()


@pytest.mark.slow
def test_full_harness_matches_the_recorded_facts():
    """Every candidate op, in worker processes (about a minute on 2 cores): each measured host's
    facts judged by the current rules (``RULES``) hold here, all of them where this is that host,
    those outside ok on another kind of CPU."""
    results = harness.run_all(list(cases.candidates()))
    here = harness.host()[0]
    current = [fact_from_row(r) for r in data.MEASURED if data.RULES_OF[r[4]] == RULES]
    assert current, "no measured host's facts are judged by the current rules"
    got = {(r.op, dt): res for r in results for dt, res in r.results.items()}
    wrong = []
    for rec in current:
        res = got.get((rec.op, rec.dtype))
        if res is None or res.verdict is None:
            continue
        if (rec.host == here or rec.verdict is not Verdict.OK) and res.verdict != rec.verdict.value:
            wrong.append((rec.op, rec.dtype, rec.host, res.verdict, rec.verdict.value, res.note[:120]))
    assert not wrong, wrong[:20]


def test_reference_check_keeps_mxnet_float32_max_pooling_off_the_low_dtype():
    """MXNet 1.9.1's FP32 max-pooling backward under ``autograd.record(train_mode=False)`` is off
    (against float64 and from run to run); the harness records it for the predict-mode backward
    and does not blame the dtype. float16's CPU kernels run on every CPU: this runs anywhere."""
    res = _results(["Pooling"], ("float16",))["Pooling"].results["float16"]
    assert res.verdict == "ok", res
    modes = {m: (v, e) for m, v, e in res.backward}
    assert modes["train"][0] == "ok" and modes["predict"][0] == "fp32_wrong", modes
    assert not modes["predict"][1] <= 2.0 ** -8  # the gradients MXNet's FP32 gives are off


def test_a_wrong_kernel_stays_wrong_with_its_reference_checked():
    """The reference check is not a way out: float32's adaptive average pooling agrees with float64,
    so the bfloat16 kernel's error (a long bfloat16 accumulation, outside oneDNN) is the kernel's."""
    from gluon_amp.conformance import runner
    op = "_contrib_AdaptiveAvgPooling2D"
    seen = runner.check_case(op, cases.SPECS[op][0], "bfloat16", runner.apis_of(op)).observation
    beyond = [p for p in seen.parts if p.reference_error is not None]
    assert beyond and all(p.reference_error <= 2.0 ** -10 for p in beyond), beyond
    assert judge(seen, "bfloat16")[0] is Verdict.WRONG


def test_a_host_writes_its_own_facts_module_beside_the_others(tmp_path):
    root = str(tmp_path)
    assert harness.host_key("AMD EPYC 9654 96-Core Processor", "native", None) == "amd-epyc-native"
    # a simulated AVX2 host (a Zen 4 under DNNL_MAX_CPU_ISA) is a host of its own
    simulated = harness.host_key("AMD EPYC 9654 96-Core Processor", "none", "AVX2")
    assert simulated == "amd-epyc-no-bf16-dnnl-avx2"
    assert harness.data_path(root, simulated).endswith("verdicts_measured_amd_epyc_no_bf16_dnnl_avx2.py")
    assert harness.data_path(root, "amd-epyc-no-bf16").endswith("gluon_amp_core/lists/verdicts_measured.py")
    assert harness.data_path(root, "amd-epyc-native").endswith("lists/verdicts_measured_amd_epyc_native.py")
    assert harness.data_path(root, "intel-xeon-native").endswith("lists/verdicts_measured_intel_xeon_native.py")
    # AMX kernels are a host of their own; gluon_amp's own AVX512_CORE_AMX is not a user's cap
    assert harness.host_key("Intel(R) Xeon(R) Processor", "native-amx", None) == "intel-xeon-native-amx"
    res = harness.DtypeResult("wrong", error=math.inf, note="n", backward=[["train", "wrong", math.inf]])
    text = harness.data_module([harness.OpResult("x", cases=1, results={"bfloat16": res})], ("h", "c", "f", "m", "x"))
    ns: dict = {}
    exec(compile(text, "verdicts_measured_h.py", "exec"), ns)  # an infinite error reads back
    assert ns["MEASURED"] == (("x", "bfloat16", "wrong", "cpu", "h", math.inf, "n", (("train", "wrong", math.inf),)),)
    assert ns["RULES"] == RULES


@pytest.mark.bf16_kernels
def test_recorded_native_bfloat16_facts_hold_on_this_host():
    """The facts recorded from hosts with bfloat16 kernels (issue 41's Zen 4, the golden Xeon):
    this host's kernels give the same verdict, or a stricter one (never a better one than a
    recorded non-ok)."""
    recorded = [fact_from_row(r) for r in data.RECORDED if r[1] == "bfloat16"]
    ops = sorted({f.op.partition(":")[0] for f in recorded})
    got = _results(ops, ("bfloat16",))
    for f in recorded:
        r = got.get(f.op)
        assert r is not None and not r.excluded, f.op
        res = r.results["bfloat16"]
        assert res.verdict is not None, (f.op, res.unmeasured)
        if f.verdict is Verdict.OK:
            assert res.verdict == "ok", (f.op, res)
        else:
            assert SEVERITY[Verdict(res.verdict)] >= SEVERITY[f.verdict], (f.op, res, f)
