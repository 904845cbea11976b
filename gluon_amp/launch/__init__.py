"""Running code you do not own under gluon_amp: ``python -m gluon_amp.run`` (the launcher,
:mod:`.cli`), and gluon_amp answering imports of the peer, MXNet's own AMP module (:mod:`.install`,
:mod:`.facade`). :mod:`.runner` runs a script or module as ``python`` would; :mod:`.threads`
ends the process when a thread dies of an exception."""
from .install import install_as_contrib_amp, installed_policy, uninstall_contrib_amp

__all__ = ["install_as_contrib_amp", "uninstall_contrib_amp", "installed_policy"]
