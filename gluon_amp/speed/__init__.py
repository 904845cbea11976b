"""Measured speed: timing one op or a whole graph (:mod:`.timing`) and the once-per-machine
probe (:mod:`.probe`), MXNet's half of :mod:`gluon_amp_core.speed`."""
