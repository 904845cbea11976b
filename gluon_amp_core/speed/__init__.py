"""Measured speed, the pure half: the speed probe's items, figures and verdict
(:mod:`.probe`). MXNet's half, which times them, is :mod:`gluon_amp.speed`."""
