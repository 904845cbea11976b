"""gluon_amp's switches: environment variables that turn a behaviour off (or, named
``..._DISABLE_...``, on). A value that is neither is refused, naming the variable: a typo
must not leave the behaviour as it was without a word."""
from __future__ import annotations

from typing import Mapping

#: what turns a switch off, in any case, with spaces around ignored
OFF = ("0", "off", "false", "no")
#: what turns it on (unset or empty: the default)
ON = ("1", "on", "true", "yes")


def _read(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip().lower()
    if value and value not in OFF + ON:
        raise ValueError(f"{name}={environ.get(name)!r} is neither on nor off: set it to one of "
                         f"{', '.join(ON)} (on) or {', '.join(OFF)} (off), or unset it for the default.")
    return value


def switched_off(environ: Mapping[str, str], name: str) -> bool:
    """Whether ``environ`` (``os.environ``) sets the switch ``name`` off; ``ValueError`` for a
    value that is neither on nor off."""
    return _read(environ, name) in OFF


def switched_on(environ: Mapping[str, str], name: str) -> bool:
    """Whether ``environ`` sets the switch ``name`` (off by default) on; ``ValueError`` for a
    value that is neither on nor off."""
    return _read(environ, name) in ON
