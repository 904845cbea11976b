"""The op conformance harness (issue 41): every op a plan can place in a low dtype, run the
ways a plan can (legacy and numpy APIs, imperative and hybridized, forward and backward, uniform
and mixed input dtypes) natively in the dtype, emulated and in FP32, with one verdict per op per
dtype (:mod:`gluon_amp_core.verdicts`). ``python -m gluon_amp.conformance --write`` records this
host's facts in its own ``gluon_amp_core/lists/verdicts_measured*.py`` (beside other hosts') and
renders ``docs/op_conformance.md``.
"""
