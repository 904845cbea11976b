"""Run by ``gluon_amp-numpy-aliases.pth`` at every interpreter start of an environment where
gluon-amp is installed (a wheel or ``pip install -e .``): restores the numpy aliases MXNet
1.9.1 and GluonCV 0.10 use, just before either is first imported.

At start it imports only ``sys`` and ``os`` (not even ``typing``; numpy is not touched) and
puts one finder at the front of ``sys.meta_path``. The first time anything imports ``mxnet`` or ``gluoncv``, the
finder removes itself, runs ``gluon_amp/_numpy_shim.py`` (by path: the gluon_amp package is
not imported) and lets the normal import go on. ``GLUON_AMP_NUMPY_SHIM=0`` turns it off
(the .pth line does not even import this module then). See docs/python.md.
"""
from __future__ import annotations

import os
import sys

TRIGGERS = ("mxnet", "gluoncv")


class NumpyAliasesBeforeMXNet:
    """A meta-path finder that finds nothing: it runs the numpy shim once, on the first
    import of a name in :data:`TRIGGERS`, then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if path is None and name in TRIGGERS:
            remove()
            restore_numpy_aliases()
        return None


def restore_numpy_aliases() -> list[str]:
    """Run ``restore_numpy_aliases`` of the gluon_amp/_numpy_shim.py this environment has.

    Loaded by path under a private name, so neither gluon_amp nor MXNet is imported here.
    Nothing happens when gluon_amp cannot be found (uninstalled, a broken environment):
    the import then fails as it would without gluon-amp.
    """
    import importlib.util
    spec = importlib.util.find_spec("gluon_amp")
    if spec is None or not spec.submodule_search_locations:
        return []
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "_numpy_shim.py")
        if os.path.isfile(path):
            shim_spec = importlib.util.spec_from_file_location("_gluon_amp_numpy_shim_at_start", path)
            shim = importlib.util.module_from_spec(shim_spec)
            shim_spec.loader.exec_module(shim)
            return shim.restore_numpy_aliases()
    return []


def install() -> None:
    """Put the finder first in ``sys.meta_path`` (once), unless mxnet is already imported."""
    if "mxnet" not in sys.modules and not installed():
        sys.meta_path.insert(0, NumpyAliasesBeforeMXNet())


def _ours(finder: object) -> bool:
    # by name: a second copy of this module (another checkout on PYTHONPATH) has its own class
    return type(finder).__name__ == NumpyAliasesBeforeMXNet.__name__


def remove() -> None:
    """Take every such finder out of ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]


def installed() -> bool:
    """True while the finder waits for the first import of mxnet or gluoncv."""
    return any(_ours(f) for f in sys.meta_path)
