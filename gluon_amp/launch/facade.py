"""The module objects that answer imports of the peer (:data:`PEER`, MXNet's own AMP module)
while gluon_amp stands in for it.

Built fresh (the peer is never imported), they carry gluon_amp's own peer-compatible
functions and answer the attributes third-party code reads, live:
the peer's ``amp._amp_initialized`` is True exactly while gluon_amp runs ops in low
precision (GluonNLP's attention cell reads it to pick a mask fill float16 can hold).
:mod:`.install` puts them in ``sys.modules`` and adapts peer modules imported earlier.
"""
from __future__ import annotations

import importlib.machinery
import threading
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from gluon_amp_core.policy import Policy
from gluon_amp_core.table import ConditionalSpec

from .. import lists_api, patching
from ..convert import convert_hybrid_block, convert_model, convert_symbol
from ..convert.bucketing import convert_bucketing_module
from ..policy_builder import as_policy, check_options
from ..training.trainer import init_trainer, scale_loss, unscale

#: The import name gluon_amp answers to (never imported: its modules are built here). The one
#: place the name is written; messages and the installer read it from here.
PEER = "mxnet.contrib.amp"
PEER_PACKAGE = PEER.rpartition(".")[0]  # whose attribute "amp" is set too
#: The peer's public names (its ``amp.__all__`` and ``convert_bucketing_module``), all gluon_amp's.
PUBLIC = ("init", "init_trainer", "scale_loss", "unscale", "convert_model", "convert_symbol",
          "convert_hybrid_block", "convert_bucketing_module", "list_lp16_ops", "list_fp32_ops",
          "list_lp16_fp32_ops", "list_conditional_fp32_ops", "list_widest_type_cast",
          "list_loss_output_functions", "list_lp16_use_fp32_params")
#: Submodules answered, relative to PEER (``lists.*`` hold the default op lists).
SUBMODULES = ("amp", "lists", "lists.symbol_fp16", "lists.symbol_bf16")
#: Fields of a Policy that ``init`` arguments set (compared when a pinned policy is kept).
_FIELDS = ("target_dtype", "target_precision_ops", "conditional_fp32_ops", "fp32_ops", "widest_type_ops",
           "keep_batchnorm_fp32", "emulate", "excluded_sym_names", "tune")

_lock = threading.Lock()
_pin: Dict[str, Any] = {"policy": None, "warned": False}


def pin(policy: Optional[Policy]) -> None:
    """Make :func:`init` keep ``policy`` whatever it is asked (``None``: plain ``gluon_amp.init``)."""
    with _lock:
        _pin["policy"], _pin["warned"] = policy, False


def pinned() -> Optional[Policy]:
    return _pin["policy"]


def init(target_dtype: Any = None, target_precision_ops: Optional[Sequence[str]] = None,
         conditional_fp32_ops: Optional[Sequence[ConditionalSpec]] = None,
         fp32_ops: Optional[Sequence[str]] = None, **options: Any) -> Policy:
    """The peer's ``init`` as gluon_amp answers it.

    Where a policy was set for the process (``python -m gluon_amp.run``'s options, or
    :func:`gluon_amp.install_as_contrib_amp`), that policy stays, whatever this call asks:
    arguments that ask for something else get one ``RuntimeWarning`` naming them. Otherwise
    it is :func:`gluon_amp.init` (whose ``target_dtype=None`` picks for the machine; the
    peer's default is float16).
    """
    check_options("init", options)
    policy = pinned()
    if policy is None:
        return patching.init(target_dtype, target_precision_ops, conditional_fp32_ops, fp32_ops, **options)
    asked = {"target_dtype": target_dtype, "target_precision_ops": target_precision_ops,
             "conditional_fp32_ops": conditional_fp32_ops, "fp32_ops": fp32_ops, **options}
    asked = {k: v for k, v in asked.items() if v is not None}
    if asked:
        with warnings.catch_warnings():  # about a policy that will not run: only the one below counts
            warnings.simplefilter("ignore")
            requested = as_policy(**asked)  # bad arguments still get their ValueError/TypeError
        differ = [k for k in asked if k in _FIELDS and getattr(requested, k) != getattr(policy, k)]
        with _lock:
            warn, _pin["warned"] = bool(differ) and not _pin["warned"], _pin["warned"] or bool(differ)
        if warn:
            shown = ", ".join(f"{k}={asked[k]!r}" for k in differ)
            warnings.warn(
                f"gluon_amp: the program's amp.init({shown}) is ignored: the policy set for this process "
                f"stays ({policy.describe()}). Choose the policy with gluon_amp.run's options (or the "
                "arguments of gluon_amp.install_as_contrib_amp) instead.", RuntimeWarning, stacklevel=2)
    return patching.init(policy) if policy.enabled else policy


class LiveAmpModule(types.ModuleType):
    """A module whose peer state attributes are read from gluon_amp at each access.

    Properties of the class win over the instance ``__dict__``, so a peer module imported
    earlier answers live too once its ``__class__`` is this one (see :mod:`.install`).
    """

    @property
    def _amp_initialized(self) -> bool:
        return patching.is_enabled()


def functions() -> Dict[str, Callable]:
    """The peer's public names, each bound to gluon_amp's function."""
    return {"init": init, "init_trainer": init_trainer, "scale_loss": scale_loss, "unscale": unscale,
            "convert_model": convert_model, "convert_symbol": convert_symbol,
            "convert_hybrid_block": convert_hybrid_block, "convert_bucketing_module": convert_bucketing_module,
            **{name: getattr(lists_api, name) for name in PUBLIC if name.startswith("list_")}}


def _module(name: str, doc: str, package: bool, cls: type = types.ModuleType) -> types.ModuleType:
    mod = cls(name, doc)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    mod.__package__ = name if package else name.rpartition(".")[0]
    if package:
        mod.__path__ = []  # nothing below it is found on disk: the peer's files stay unread
    return mod


def _op_lists(dtype: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the peer's list constants from gluon_amp's table."""
    low = "FP16" if dtype == "float16" else "BF16"
    names = {f"{low}_FUNCS": lists_api.list_lp16_ops, f"{low}_FP32_FUNCS": lists_api.list_lp16_fp32_ops,
             "FP32_FUNCS": lists_api.list_fp32_ops, "CONDITIONAL_FP32_FUNCS": lists_api.list_conditional_fp32_ops,
             "WIDEST_TYPE_CASTS": lists_api.list_widest_type_cast,
             "LOSS_OUTPUT_FUNCTIONS": lists_api.list_loss_output_functions}
    if dtype == "bfloat16":
        names["BF16_USE_FP32_PARAMS"] = lists_api.list_lp16_use_fp32_params

    def __getattr__(attr: str) -> Any:
        if attr in names:
            return names[attr](dtype)  # a new list each time: changing it changes nothing
        raise AttributeError(f"module {PEER}.lists.symbol_{low.lower()} (answered by gluon_amp) has no "
                             f"attribute {attr!r}; it has {sorted(names)}")
    return __getattr__


def build() -> Dict[str, types.ModuleType]:
    """Fresh module objects for PEER and its SUBMODULES, by full name."""
    doc = ("Answered by gluon_amp (gluon_amp.run / gluon_amp.install_as_contrib_amp): the functions are "
           f"gluon_amp's own, MXNet's {PEER} is not used in this process.")
    funcs = functions()
    pkg = _module(PEER, doc, True, LiveAmpModule)
    amp = _module(f"{PEER}.amp", doc, False, LiveAmpModule)
    lists = _module(f"{PEER}.lists", "Default op lists, read from gluon_amp's tables. " + doc, True)
    fp16 = _module(f"{PEER}.lists.symbol_fp16", "float16 op lists. " + doc, False)
    bf16 = _module(f"{PEER}.lists.symbol_bf16", "bfloat16 op lists. " + doc, False)
    for mod in (pkg, amp):
        vars(mod).update(funcs)
        mod.__all__ = list(PUBLIC)
    fp16.__getattr__, bf16.__getattr__ = _op_lists("float16"), _op_lists("bfloat16")
    lists.symbol_fp16, lists.symbol_bf16 = fp16, bf16
    pkg.amp, pkg.lists = amp, lists
    return {m.__name__: m for m in (pkg, amp, lists, fp16, bf16)}


def names() -> List[str]:
    return [PEER] + [f"{PEER}.{s}" for s in SUBMODULES]
