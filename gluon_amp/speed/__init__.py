"""Measured speed: timing one op, the once-per-machine probe, and the per-layer tuner."""
