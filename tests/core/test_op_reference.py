import os

from gluon_amp_core import op_reference

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "op_reference.md")


def test_committed_op_reference_is_current():
    with open(DOC, encoding="utf-8") as f:
        committed = f.read()
    assert committed == op_reference.render(), \
        "docs/op_reference.md is stale: run python -m gluon_amp_core.op_reference > docs/op_reference.md"


def test_reference_lists_every_class_for_both_dtypes():
    text = op_reference.render()
    for dt in ("float16", "bfloat16"):
        assert f"## target dtype `{dt}`" in text
    assert "`Convolution`" in text and "`softrelu`" not in text.split("## target")[0]
