"""gluon_amp's off switches: an environment variable that turns a behaviour off."""
from __future__ import annotations

from typing import Mapping

#: what turns a switch off, in any case, with spaces around ignored
OFF = ("0", "off", "false", "no")


def switched_off(environ: Mapping[str, str], name: str) -> bool:
    """Whether ``environ`` (``os.environ``) sets the switch ``name`` off."""
    return environ.get(name, "").strip().lower() in OFF
