"""Precision per op by measured speed, MXNet's half of :mod:`gluon_amp_core.tuning`: the tuner
(:mod:`.tuner`: measures what the core asks, applies the choices) and when it runs, within the
process's budget (:mod:`.schedule`: during training, and at once for the converters)."""
