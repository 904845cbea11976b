"""Imported first by every benchmark that loads MXNet: runs gluon_amp/_numpy_shim.py by path.

On numpy >= 1.24 (Python 3.12 has nothing older) it restores the numpy aliases MXNet 1.9.1 and
GluonCV 0.10 use, before anything imports MXNet (docs/python.md). By path, not imported from
gluon_amp: the peer's worker processes must stay free of gluon_amp, and a benchmark's parent
process loads MXNet only when it needs to.
"""
import os
import runpy

RESTORED = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       "gluon_amp", "_numpy_shim.py"))["restore_numpy_aliases"]()
