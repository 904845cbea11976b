import os

from gluon_amp_core import conformance_report

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "op_conformance.md")


def test_committed_op_conformance_is_current():
    with open(DOC, encoding="utf-8") as f:
        committed = f.read()
    assert committed == conformance_report.render(), (
        "docs/op_conformance.md is stale: run python -m gluon_amp_core.conformance_report > docs/op_conformance.md "
        "(or python -m gluon_amp.conformance --write to measure again)")


def test_report_names_every_host_and_both_dtypes():
    from gluon_amp_core.lists import verdicts
    text = conformance_report.render()
    for key in verdicts.HOSTS:
        assert f"`{key}`" in text
    assert "| op | bfloat16 | float16 | ran as |" in text and "## Not run" in text
