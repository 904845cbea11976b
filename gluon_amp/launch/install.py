"""gluon_amp answers imports of the peer (MXNet's own AMP module, :data:`.facade.PEER`) for the
whole process, and takes it back.

As ``pymysql.install_as_MySQLdb()`` does for ``MySQLdb``: code you do not own (GluonCV's R-CNN
training task, its estimators, GluonNLP's attention cell, the scripts of both) imports the
peer itself; after :func:`install_as_contrib_amp` those imports get :mod:`.facade`'s modules.
The peer is never imported. A peer module imported earlier is adapted in place (its public
functions become gluon_amp's, its ``_amp_initialized`` reads gluon_amp's state); a peer that
was already *initialized* cannot be taken over, and is refused.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec

from .. import patching
from ..patching import low_cast
from ..policy_builder import as_policy
from . import facade

_MISSING = object()
_OWNER = "install_as_contrib_amp"


class _FacadeFinder:
    """First on ``sys.meta_path`` while installed: finds the facade's modules again if someone
    drops them from ``sys.modules``, and refuses the peer's other submodules clearly."""

    def __init__(self, modules: Dict[str, types.ModuleType]) -> None:
        self.modules = modules

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self.modules:
            return importlib.util.spec_from_loader(name, self)
        if name.startswith(facade.PEER + "."):
            raise ImportError(
                f"No module named {name!r} here: gluon_amp answers for {facade.PEER} in this process "
                f"(gluon_amp.run or gluon_amp.install_as_contrib_amp()) with {', '.join(sorted(self.modules))}; "
                "MXNet's own is not used. A trainer's loss scale is gluon_amp.get_scaler(trainer).loss_scale "
                f"(also trainer._amp_loss_scaler.loss_scale). To use MXNet's {facade.PEER} instead, run "
                "without gluon_amp.run, or call gluon_amp.uninstall_contrib_amp() first.", name=name)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return self.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        return None


@dataclass
class _Adapted:
    """A peer module imported before the install, and what was changed on it."""

    module: types.ModuleType
    cls: type
    attrs: Dict[str, Any]


@dataclass
class _Installed:
    policy: Policy
    modules: Dict[str, types.ModuleType]
    finder: _FacadeFinder
    #: sys.modules entries under the peer's name before the install (_MISSING: absent)
    saved: Dict[str, Any]
    contrib_attr: Any
    adapted: List[_Adapted] = field(default_factory=list)
    #: True when the install turned AMP on (uninstall then turns it off)
    enabled_here: bool = False


_lock = threading.RLock()
_state: Optional[_Installed] = None


def install_as_contrib_amp(target_dtype: Any = None, *,
                           target_precision_ops: Optional[Sequence[str]] = None,
                           conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
                           fp32_ops: Optional[Sequence[str]] = None, **options: Any) -> Policy:
    """Turn AMP on for the process and make gluon_amp answer imports of the peer.

    What ``python -m gluon_amp.run`` does before it runs a program, as one call. From now on
    the peer's import forms (``from mxnet.contrib import amp``, ``from mxnet.contrib.amp import amp``,
    ``import mxnet.contrib.amp.lists``) give gluon_amp's modules, whose functions (``init``,
    ``init_trainer``, ``scale_loss``, ``unscale``, ``convert_*``, ``list_*``) are gluon_amp's own
    and whose ``amp._amp_initialized`` is True while gluon_amp runs ops in low precision. The
    policy built from the arguments (as :func:`gluon_amp.init` takes them) is turned on now and
    kept: the program's own ``amp.init(...)`` returns it, with a ``RuntimeWarning`` if it asked
    for something else. While installed, a ``Block.cast``/``Parameter.cast`` to a low dtype the
    CPU cannot execute follows the policy (:mod:`gluon_amp.patching.low_cast`).

    Idempotent: a second call with no arguments or the same policy returns it; with another
    policy it raises ``RuntimeError``. :func:`uninstall_contrib_amp` undoes all of it.

    Raises
    ------
    RuntimeError
        When the peer was already initialized in this process (its ``init``
        wrapped MXNet's op functions: gluon_amp cannot take that back), or another gluon_amp
        policy is on.
    """
    global _state
    given = (target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, *options.values())
    with _lock:
        if _state is not None and all(v is None for v in given):
            return _state.policy
        policy = as_policy(target_dtype, target_precision_ops=target_precision_ops,
                           conditional_fp32_ops=conditional_fp32_ops, fp32_ops=fp32_ops, **options)
        if _state is not None:
            if policy == _state.policy:
                return _state.policy
            raise RuntimeError(
                f"gluon_amp already answers for {facade.PEER} with policy {_state.policy.describe()}; "
                f"asked for {policy.describe()}. Call gluon_amp.uninstall_contrib_amp() first.")
        _refuse_initialized_peer()
        was_on = patching.is_enabled()
        if policy.enabled:
            patching.init(policy)  # RuntimeError if another policy is on
        try:
            _state = _take_over(policy, enabled_here=policy.enabled and not was_on)
        except BaseException:
            if policy.enabled and not was_on:
                patching.disable()
            raise
        return policy


def uninstall_contrib_amp() -> None:
    """Undo :func:`install_as_contrib_amp`: ``sys.modules``, the peer's package attribute and adapted
    peer modules as they were, the cast rule released, AMP off if the install turned it on.
    A no-op when not installed."""
    global _state
    with _lock:
        st, _state = _state, None
        if st is None:
            return
        facade.pin(None)
        low_cast.release(_OWNER)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not st.finder]
        contrib = sys.modules.get(facade.PEER_PACKAGE)
        if contrib is not None and vars(contrib).get("amp") is st.modules[facade.PEER]:
            if st.contrib_attr is _MISSING:
                del contrib.amp
            else:
                contrib.amp = st.contrib_attr
        for name, mod in st.modules.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
        for name, mod in st.saved.items():
            if mod is not _MISSING:
                sys.modules[name] = mod
        for a in st.adapted:
            a.module.__class__ = a.cls
            for attr, value in a.attrs.items():
                if value is _MISSING:
                    vars(a.module).pop(attr, None)
                else:
                    setattr(a.module, attr, value)
        if st.enabled_here and patching.current_policy() == st.policy:
            patching.disable()


def installed_policy() -> Optional[Policy]:
    """The policy :func:`install_as_contrib_amp` set, or ``None`` when not installed."""
    return _state.policy if _state is not None else None


def _refuse_initialized_peer() -> None:
    peer = sys.modules.get(f"{facade.PEER}.amp")
    if isinstance(peer, types.ModuleType) and vars(peer).get("_amp_initialized") is True:
        raise RuntimeError(
            f"{facade.PEER} was already initialized in this process (its amp.init() ran and wrapped "
            "MXNet's op functions), so gluon_amp cannot answer for it. Run the program under "
            "`python -m gluon_amp.run [options] SCRIPT` (gluon_amp then answers before anything imports "
            f"{facade.PEER}), or call gluon_amp.install_as_contrib_amp() before the first "
            f"{facade.PEER}.init().")


def _take_over(policy: Policy, enabled_here: bool) -> _Installed:
    modules = facade.build()
    prefix = facade.PEER + "."
    saved: Dict[str, Any] = {n: m for n, m in sys.modules.items() if n == facade.PEER or n.startswith(prefix)}
    adapted = [_adapt(saved[n]) for n in (facade.PEER, f"{facade.PEER}.amp")
               if isinstance(saved.get(n), types.ModuleType)]
    for name in saved:
        del sys.modules[name]  # the peer's other submodules are refused from now on
    sys.modules.update(modules)
    for name in modules:
        saved.setdefault(name, _MISSING)
    contrib = sys.modules[facade.PEER_PACKAGE]
    contrib_attr = vars(contrib).get("amp", _MISSING)
    contrib.amp = modules[facade.PEER]
    finder = _FacadeFinder(modules)
    sys.meta_path.insert(0, finder)
    low_cast.acquire(_OWNER)
    facade.pin(policy)
    return _Installed(policy, modules, finder, saved, contrib_attr, adapted, enabled_here)


def _adapt(module: types.ModuleType) -> _Adapted:
    """Make a peer module imported before the install answer as the facade does."""
    funcs = facade.functions()
    saved = _Adapted(module, module.__class__, {n: vars(module).get(n, _MISSING) for n in funcs})
    module.__class__ = facade.LiveAmpModule
    for name, fn in funcs.items():
        setattr(module, name, fn)
    return saved
