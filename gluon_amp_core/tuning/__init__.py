"""Precision per op by measured speed, the pure half: what to time and the choice
(:mod:`.problem`), the budget, its ledger and when a choice is re-checked (:mod:`.schedule`).
MXNet's half, which measures and applies, is :mod:`gluon_amp.tuning`."""
