"""The conformance harness (gluon_amp/conformance/): its verdicts against the recorded data.

Quick: ops whose kernels run outside oneDNN, so every host gives the same verdict, against what
gluon_amp_core/lists/verdicts_measured.py recorded. Slow: every candidate op. bf16 host: the
facts recorded from hosts with native bfloat16 kernels, against this host's kernels."""
import pytest

from gluon_amp.conformance import cases, harness
from gluon_amp_core.lists import verdicts as data
from gluon_amp_core.verdicts import SEVERITY, Verdict, fact_from_row

MEASURED = {(r[0], r[1]): fact_from_row(r) for r in data.MEASURED}

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
    """Every candidate op, in worker processes (minutes on 2 cores)."""
    results = harness.run_all(list(cases.candidates()))
    here = harness.host()[0]
    same_host = here == data.MEASURED_HOST[0]
    wrong = []
    for r in results:
        for dt, res in r.results.items():
            rec = MEASURED.get((r.op, dt))
            if res.verdict is None or rec is None:
                continue
            # on another kind of CPU, only the facts this kind recorded outside ok must hold
            if same_host or rec.verdict is not Verdict.OK:
                if res.verdict != rec.verdict.value:
                    wrong.append((r.op, dt, res.verdict, rec.verdict.value, res.note[:120]))
    assert not wrong, wrong[:20]


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
