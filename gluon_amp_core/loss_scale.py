"""Loss-scale state and its update rule. Pure: no MXNet.

The update rule is PyTorch GradScaler's (tested against a recorded torch trajectory):
a non-finite step multiplies the scale by ``backoff_factor`` and resets the growth
tracker; ``growth_interval`` finite steps in a row multiply it by ``growth_factor``.
On top of that the scale is clamped to ``[min_scale, max_scale]``, and the count of
consecutive skipped steps is kept so a collapsing run can be stopped with a diagnosis.

A scaler may apply its scale only to steps computed in some dtypes (``scaled_dtypes``):
the default one (``'dynamic'``) scales float16 steps only, as PyTorch's GradScaler is
meant for float16 and bfloat16 autocast runs without one. Other steps are multiplied by 1;
float16 ones are still checked and skipped on inf/NaN, bfloat16 and float32 ones are FP32's
steps, not checked (:meth:`LossScaler.checks`).
"""
from __future__ import annotations

import enum
import math
import numbers
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple, Union

#: The compute dtypes whose range a loss scale protects, for the default scaler: float16
#: (5 exponent bits). bfloat16 has float32's exponent range; measured on BERT and SSD
#: (docs/training.md), scaling changed no gradient there, so it is not scaled by default.
#: Their steps are also the ones checked for inf/NaN when not scaled (:meth:`LossScaler.checks`).
NEEDS_SCALING: FrozenSet[str] = frozenset({"float16"})
_COMPUTE_DTYPES = ("float16", "bfloat16", "float32")


class Stage(enum.Enum):
    """Where one trainer (optimizer) stands in the current step, as in PyTorch's GradScaler."""

    READY = "ready"          # gradients may be scaled and accumulated
    UNSCALED = "unscaled"    # unscale() ran: gradients are true-sized until the step
    STEPPED = "stepped"      # stepped; waiting for the other trainers of the round


@dataclass(frozen=True)
class ScaleState:
    """Where a loss scaler stands. Immutable: ``LossScaler.next_state`` returns a new one."""

    scale: float
    growth_tracker: int = 0
    consecutive_skips: int = 0
    total_steps: int = 0
    skipped_steps: int = 0
    last_skipped: bool = False


def _positive(name: str, value: Any, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (value > 0 and (allow_inf or math.isfinite(value))):
        raise ValueError(f"{name} must be a positive{'' if allow_inf else ' finite'} number, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True or False (a NumPy bool too); anything else is refused, as a
    string such as ``'false'`` would silently mean True."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"LossScaler({name}=...) takes True or False, got {value!r}")


def _reads(field: str, doc: str) -> property:
    """A read-only property of the scaler: one field of its ``state``."""
    return property(lambda self: getattr(self.state, field), doc=doc)


class LossScaler:
    """Loss scaler: dynamic (default), static, or disabled.

    Parameters
    ----------
    init_scale : float
        Starting scale (2**16, as in PyTorch and Apex).
    growth_factor, backoff_factor : float
        Multipliers after ``growth_interval`` finite steps / after a non-finite step.
    growth_interval : int
        Finite steps in a row before the scale grows.
    min_scale, max_scale : float
        Clamp for the scale. ``min_scale=0`` and ``max_scale=inf`` give torch's behaviour.
    max_consecutive_skips : int or None
        After this many skipped steps in a row, the next ``trainer.step`` (or a Module's
        ``update``) raises ``RuntimeError`` naming the parameters with non-finite gradients
        (the scale has collapsed; something other than range is wrong). ``None`` never raises.
    dynamic : bool
        ``False`` keeps ``init_scale`` fixed; non-finite steps are still skipped.
    enabled : bool
        ``False`` makes the scaler a no-op: scale 1, nothing skipped, nothing checked.
    scaled_dtypes : iterable of str or None
        The compute dtypes (``'float16'``, ``'bfloat16'``, ``'float32'``) whose steps are
        multiplied by the scale; steps in other dtypes use 1 and leave the scale where it is.
        Of those, float16 ones are still checked and skipped on inf/NaN; bfloat16 and float32
        ones are updated as FP32 updates them (:meth:`checks`). ``None`` (the default) scales
        every step. ``loss_scale='dynamic'`` builds one with :data:`NEEDS_SCALING`.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24,
                 max_consecutive_skips: int | None = 25, dynamic: bool = True,
                 enabled: bool = True, scaled_dtypes: Optional[Iterable[str]] = None) -> None:
        self.init_scale = _positive("init_scale", init_scale)
        self.growth_factor = _positive("growth_factor", growth_factor)
        self.backoff_factor = _positive("backoff_factor", backoff_factor)
        if self.growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.growth_interval = growth_interval
        if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or min_scale < 0:
            raise ValueError(f"min_scale must be a number >= 0, got {min_scale!r}")
        self.min_scale = float(min_scale)
        self.max_scale = _positive("max_scale", max_scale, allow_inf=True)
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(f"init_scale={init_scale!r} must lie in [min_scale={min_scale!r}, "
                             f"max_scale={max_scale!r}]")
        if max_consecutive_skips is not None and (
                isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int)
                or max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}")
        self.max_consecutive_skips = max_consecutive_skips
        self.dynamic = _flag("dynamic", dynamic)
        self.enabled = _flag("enabled", enabled)
        self.scaled_dtypes = _dtype_set(scaled_dtypes)
        self.state = ScaleState(scale=self.init_scale if enabled else 1.0)
        # The round's bookkeeping. Each change builds new values and commits them with one
        # ``vars(self).update(...)`` (a single C call): an exception or a Ctrl-C at any
        # bytecode before it changes nothing, and none can land inside it.
        self._stages: "weakref.WeakKeyDictionary[Any, Stage]" = weakref.WeakKeyDictionary()
        #: steps each member has recorded (a member's per-step cache is valid for one count)
        self._steps: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        #: members whose step of this round was interrupted before it counted (the round
        #: does not wait for them once the others step again)
        self._abandoned: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
        self._round_finite = True
        self._round_scaled = False

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def static(cls, scale: float, **kwargs: Any) -> "LossScaler":
        """A fixed scale. Non-finite steps are still skipped."""
        return cls(init_scale=scale, dynamic=False, min_scale=0.0, max_scale=math.inf, **kwargs)

    @classmethod
    def disabled(cls) -> "LossScaler":
        return cls(enabled=False)

    @classmethod
    def where_needed(cls, **kwargs: Any) -> "LossScaler":
        """Dynamic scaling of float16 steps only (:data:`NEEDS_SCALING`): what
        ``loss_scale='dynamic'`` means. Other steps use 1 and are not checked (:meth:`checks`)."""
        return cls(scaled_dtypes=NEEDS_SCALING, **kwargs)

    # -- reading: fields of ``state`` ----------------------------------------------
    loss_scale = _reads("scale", "float: the scale the next loss in a scaled dtype is multiplied by "
                                 "(see scale_for).")
    last_step_skipped = _reads("last_skipped", "bool: the last step was skipped (non-finite gradients).")
    skipped_steps = _reads("skipped_steps", "int: steps skipped so far.")
    total_steps = _reads("total_steps", "int: steps taken so far, skipped ones included.")

    def scales(self, dtype: str) -> bool:
        """True when a step computed in ``dtype`` is multiplied by the scale."""
        return self.enabled and (self.scaled_dtypes is None or dtype in self.scaled_dtypes)

    def checks(self, dtype: str, scaled: bool) -> bool:
        """True when a step computed in ``dtype`` is checked for inf/NaN (and skipped on
        them): every step the scale multiplied (``scaled``), and every float16 step
        (:data:`NEEDS_SCALING`: its narrow range overflows where float32's does not). A
        bfloat16 or float32 step that is not scaled is FP32's step, updated as FP32 updates
        it, as PyTorch's bfloat16 autocast runs without a GradScaler: checking it made every
        such step wait for its backward pass (MobileNet 0.92x FP32 against 1.00x unchecked)."""
        return self.enabled and (scaled or dtype in NEEDS_SCALING)

    def scale_for(self, dtype: str) -> float:
        """The scale a loss computed in ``dtype`` is multiplied by now: :attr:`loss_scale`
        where :meth:`scales` says so, else 1."""
        return self.state.scale if self.scales(dtype) else 1.0

    # -- the rule -------------------------------------------------------------------
    def next_state(self, state: ScaleState, finite: bool, scaled: bool = True) -> ScaleState:
        """The state after one step whose gradients were (not) all finite. Pure.

        ``scaled=False``: the step's loss was not multiplied by the scale (see
        :meth:`scales`); it is counted and skipped on inf/NaN, but the scale and its
        growth count stay as they are, since the scale had no part in it.
        """
        # ScaleState(...) spelled out, not dataclasses.replace: this runs at every step
        steps = state.total_steps + 1
        if not self.enabled:
            return ScaleState(state.scale, state.growth_tracker, state.consecutive_skips, steps,
                              state.skipped_steps, False)
        if not scaled:
            return ScaleState(state.scale, state.growth_tracker, 0 if finite else state.consecutive_skips + 1,
                              steps, state.skipped_steps + (not finite), not finite)
        if not finite:
            scale = state.scale
            if self.dynamic:
                scale = max(scale * self.backoff_factor, self.min_scale)
            return ScaleState(scale, 0, state.consecutive_skips + 1, steps, state.skipped_steps + 1, True)
        tracker, scale = state.growth_tracker + 1, state.scale
        if self.dynamic and tracker >= self.growth_interval:
            scale, tracker = min(scale * self.growth_factor, self.max_scale), 0
        return ScaleState(scale, tracker, 0, steps, state.skipped_steps, False)

    def assign(self, scale: Optional[float] = None, growth_tracker: Optional[int] = None) -> None:
        """Replace the state's ``scale`` and/or ``growth_tracker`` (a restored checkpoint of
        another tool, the peer's fields assigned); the next step starts from them.

        ``scale`` must lie in ``[min_scale, max_scale]``; ``growth_tracker`` is an int >= 0
        (at ``growth_interval`` or above, the next finite step grows the scale).
        """
        state = self.state
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
                raise TypeError(f"the loss scale must be a number, got {scale!r}")
            scale = float(scale)
            if not (math.isfinite(scale) and self.min_scale <= scale <= self.max_scale and scale > 0):
                raise ValueError(f"loss scale {scale!r} is outside this scaler's [min_scale={self.min_scale:g}, "
                                 f"max_scale={self.max_scale:g}] (and must be finite and > 0); set min_scale or "
                                 "max_scale on the scaler first to allow it.")
            state = replace(state, scale=scale)
        if growth_tracker is not None:
            if (isinstance(growth_tracker, bool) or not isinstance(growth_tracker, numbers.Integral)
                    or growth_tracker < 0):
                raise ValueError(f"the count of finite steps since the scale last changed must be an int >= 0, "
                                 f"got {growth_tracker!r}")
            state = replace(state, growth_tracker=int(growth_tracker))
        self.state = state

    def update(self, finite: bool, scaled: bool = True) -> bool:
        """Advance by one step; return True if that step must be skipped."""
        self.state = self.next_state(self.state, finite, scaled)
        return self.state.last_skipped

    # -- per-trainer stages and rounds -----------------------------------------------
    # A round is one step of every trainer attached to this scaler. The scale moves once
    # per round, on whether all their gradients were finite; each trainer skips on its
    # own gradients. A round ends when every attached trainer has stepped, or when
    # end_round() is called (needed when trainers step at different rates). A member whose
    # ``attached()`` says False (its trainer was dropped) is not waited for.

    def _copies(self) -> "Tuple[weakref.WeakKeyDictionary[Any, Stage], weakref.WeakKeyDictionary[Any, int]]":
        return weakref.WeakKeyDictionary(self._stages), weakref.WeakKeyDictionary(self._steps)

    def attach(self, member: Any) -> None:
        """Register ``member`` (one per trainer, weakly held) as a participant of each round."""
        stages, steps = self._copies()
        stages[member] = Stage.READY
        steps.setdefault(member, 0)
        vars(self).update(_stages=stages, _steps=steps)

    def stage(self, member: Any) -> Stage:
        """The stage of ``member`` in the current round: an attached trainer or Module (a
        member token whose ``represents(obj)`` says so), or the token itself."""
        stages = self._stages
        try:
            return stages[member]
        except (KeyError, TypeError):
            pass
        for token, stage in list(stages.items()):
            represents = getattr(token, "represents", None)
            if represents is not None and represents(member):
                return stage
        raise RuntimeError(f"{type(member).__name__} {member!r} is not attached to this scaler: "
                           "gluon_amp.init_trainer(trainer, scaler) attaches a trainer or Module to it; "
                           "gluon_amp.get_scaler(trainer) gives the scaler a trainer has.")

    def steps_of(self, member: Any) -> int:
        """How many steps ``member`` has recorded: what it decided for its current step is
        valid while this count stays the same (a step that was interrupted records nothing)."""
        return self._steps.get(member, 0)

    def mark_unscaled(self, member: Any) -> None:
        """READY -> UNSCALED; ``RuntimeError`` if the gradients were already unscaled."""
        if self.stage(member) is Stage.UNSCALED:
            raise RuntimeError("unscale(trainer) was already called since the last trainer.step(); "
                               "the gradients are unscaled already.")
        stages = weakref.WeakKeyDictionary(self._stages)
        stages[member] = Stage.UNSCALED
        self._stages = stages

    def abandon(self, member: Any, steps: Optional[int]) -> None:
        """``member``'s step was interrupted before it counted (its count still ``steps``;
        None: before it read the count):
        the round does not wait for it once the others step again (as if it skipped this
        round); it stays READY, and its next step counts as usual."""
        if steps in (None, self._steps.get(member, 0)) and self._stages.get(member) is not Stage.STEPPED:
            abandoned = weakref.WeakKeyDictionary(self._abandoned)
            abandoned[member] = True
            self._abandoned = abandoned

    def record_step(self, member: Any, finite: bool, scaled: bool = True) -> bool:
        """``member`` stepped with (non-)finite gradients, its loss multiplied by the
        scale or not (``scaled``); return True if it must skip.

        Ends the round once every attached member has stepped. The scale moves only if
        some member's loss of the round was scaled. All or nothing: the stage, the round and
        the scale change in one statement at the end.
        """
        state, finite_all, scaled_any = self.state, self._round_finite, self._round_scaled
        # Copy on write: the mappings are never changed in place, so one a step leaves as it
        # was is kept as it is (one trainer's round: every step, a few microseconds).
        stages, abandoned = self._stages, self._abandoned
        stage = self.stage(member)
        if stage is Stage.STEPPED:
            if not _round_complete(stages, abandoned):
                raise RuntimeError(
                    "a trainer stepped twice in one round of a shared LossScaler before the other "
                    f"{_live_count(stages) - 1} trainer(s) stepped; when trainers step at different rates, "
                    "call scaler.end_round() once per iteration after the last step.")
            # the others it waited for were dropped, or their step was interrupted: that round is over
            state = self.next_state(state, finite_all, scaled_any)
            finite_all, scaled_any, abandoned = True, False, _EMPTY
            stages, stage = _all_ready(stages), Stage.READY
        alone = len(stages) == 1  # the scaler of this member only (stage() found it): its round ends
        count = self._steps.get(member, 0) + 1
        if alone:
            steps = weakref.WeakKeyDictionary({member: count})
        else:
            steps = weakref.WeakKeyDictionary(self._steps)
            steps[member] = count
        if member in abandoned:
            abandoned = weakref.WeakKeyDictionary(abandoned)
            del abandoned[member]
        finite_all, scaled_any = finite_all and finite, scaled_any or scaled
        if alone or _round_complete(stages, (), stepped=member):
            state = self.next_state(state, finite_all, scaled_any)
            finite_all, scaled_any, abandoned = True, False, _EMPTY
            stages = stages if alone and stage is Stage.READY else _all_ready(stages)
        else:
            stages = weakref.WeakKeyDictionary(stages)
            stages[member] = Stage.STEPPED
        skip = self.enabled and not finite
        new = {"state": state, "_stages": stages, "_steps": steps, "_round_finite": finite_all,
               "_round_scaled": scaled_any, "_abandoned": abandoned}
        return vars(self).update(new) or skip  # the commit, one C call, and nothing after it

    def end_round(self) -> None:
        """Close the round: update the scale once and make every trainer READY again."""
        stages = weakref.WeakKeyDictionary(dict.fromkeys(list(self._stages), Stage.READY))
        vars(self).update(state=self.next_state(self.state, self._round_finite, self._round_scaled),
                          _stages=stages, _round_finite=True, _round_scaled=False,
                          _abandoned=weakref.WeakKeyDictionary())

    def collapsed(self) -> bool:
        """True once ``max_consecutive_skips`` steps in a row were skipped."""
        limit = self.max_consecutive_skips
        return self.enabled and limit is not None and self.state.consecutive_skips >= limit

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Union[float, int, bool]]:
        """Settings and state as plain Python values (JSON- and pickle-safe)."""
        return {
            "init_scale": self.init_scale, "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
            "min_scale": self.min_scale, "max_scale": self.max_scale,
            "max_consecutive_skips": self.max_consecutive_skips, "dynamic": self.dynamic,
            "enabled": self.enabled, "scaled_dtypes": _dtype_list(self.scaled_dtypes), **asdict(self.state),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Unknown or missing keys, and values a scaler
        cannot hold (a scale that is not finite and positive, negative counts), raise
        ``ValueError`` and change nothing; a dict without ``scaled_dtypes`` (gluon_amp before
        it existed) keeps this scaler's."""
        fresh = self.checked(state)
        fresh._stages, fresh._steps, fresh._abandoned, fresh._round_finite, fresh._round_scaled = (
            self._stages, self._steps, self._abandoned, self._round_finite, self._round_scaled)  # attachments stay
        self.__dict__.update(fresh.__dict__)  # one C call: the load is whole or nothing

    def checked(self, state: Dict[str, Any]) -> "LossScaler":
        """A new scaler holding ``state`` (a :meth:`state_dict`), every value checked;
        ``ValueError``/``TypeError`` naming the bad one. This scaler is not changed."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects a dict from LossScaler.state_dict(), got {type(state).__name__}")
        expected = set(self.state_dict())
        missing = expected - set(state) - {"scaled_dtypes"}
        if missing or set(state) - expected:
            raise ValueError(f"not a LossScaler state_dict: missing {sorted(missing)}, "
                             f"unexpected {sorted(set(state) - expected)}")
        flags = {key: _as_bool(state[key]) for key in ("dynamic", "enabled", "last_skipped")}
        for key, flag in flags.items():
            if flag is None:
                raise ValueError(f"LossScaler state: {key!r} must be True or False, got {state[key]!r} "
                                 f"({type(state[key]).__name__})")
        state = {**state, **flags}  # a NumPy bool (a state that went through NumPy) as Python's
        counts = {}
        for key in ("growth_tracker", "consecutive_skips", "total_steps", "skipped_steps"):
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"LossScaler state: {key!r} must be an int >= 0, got {v!r}")
            counts[key] = int(v)
        if counts["skipped_steps"] > counts["total_steps"]:
            raise ValueError(f"LossScaler state: skipped_steps={counts['skipped_steps']} exceeds "
                             f"total_steps={counts['total_steps']}")
        fresh = LossScaler(scaled_dtypes=state.get("scaled_dtypes", self.scaled_dtypes), **{k: state[k] for k in (
            "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale",
            "max_scale", "max_consecutive_skips", "dynamic", "enabled")})
        scale = state["scale"]
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f"LossScaler state: the scale must be a finite number > 0, got {scale!r}")
        if fresh.enabled and not fresh.min_scale <= float(scale) <= fresh.max_scale:
            raise ValueError(f"LossScaler state: the scale {scale!r} lies outside its [min_scale={fresh.min_scale:g}, "
                             f"max_scale={fresh.max_scale:g}]")
        fresh.state = ScaleState(float(scale), counts["growth_tracker"], counts["consecutive_skips"],
                                 counts["total_steps"], counts["skipped_steps"], state["last_skipped"])
        return fresh

    def __repr__(self) -> str:
        kind = "disabled" if not self.enabled else ("dynamic" if self.dynamic else "static")
        if self.enabled and self.scaled_dtypes is not None:
            kind += f" for {'/'.join(_dtype_list(self.scaled_dtypes)) or 'no dtype'}"
        s = self.state
        return (f"LossScaler({kind}, scale={s.scale:g}, skipped={s.skipped_steps}/{s.total_steps}, "
                f"last_skipped={s.last_skipped})")


def _attached(member: Any) -> bool:
    """Whether a round waits for ``member``: False once its owner is gone (``member.attached()``)."""
    attached = getattr(member, "attached", None)
    return attached() if callable(attached) else True


def _live_count(stages: "weakref.WeakKeyDictionary[Any, Stage]") -> int:
    return sum(1 for m in list(stages) if _attached(m))


def _round_complete(stages: "weakref.WeakKeyDictionary[Any, Stage]", excused: Any = (),
                    stepped: Any = None) -> bool:
    """Whether every attached member has stepped (or is ``excused``), ``stepped`` counted as
    stepped. A member's stage is read before it is asked whether it is attached (that asks
    its trainer's parameters)."""
    return all(m is stepped or s is Stage.STEPPED or m in excused or not _attached(m)
               for m, s in list(stages.items()))


def _all_ready(stages: "weakref.WeakKeyDictionary[Any, Stage]") -> "weakref.WeakKeyDictionary[Any, Stage]":
    """``stages`` with every member READY: itself where they already are (never changed in place)."""
    if all(s is Stage.READY for s in list(stages.values())):
        return stages
    return weakref.WeakKeyDictionary(dict.fromkeys(list(stages), Stage.READY))


#: the empty mapping of abandoned members a round starts with (never changed in place)
_EMPTY: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def asks_for(scaler: LossScaler, made_from: Any, loss_scale: Any, chose_default: bool = False) -> bool:
    """Whether ``loss_scale`` (an ``init_trainer`` argument) asks for ``scaler``, made from
    ``made_from``: that very scaler, an argument equal to the first, or the default
    (``'dynamic'``) where the first was chosen for the caller (``chose_default``: an opt level's)."""
    if loss_scale is scaler:
        return True
    if isinstance(loss_scale, LossScaler) or isinstance(made_from, LossScaler):
        return False
    return bool(made_from == loss_scale) or (chose_default and loss_scale == "dynamic")


def _as_bool(value: Any) -> Optional[bool]:
    """``value`` as a Python bool where it is one, or NumPy's (``numpy.bool_``); else None."""
    if isinstance(value, bool):
        return value
    item = getattr(value, "item", None)
    if callable(item) and type(value).__name__ in ("bool_", "bool8"):
        flag = item()
        return flag if isinstance(flag, bool) else None
    return None


def loss_scaler_from(spec: Any) -> LossScaler:
    """The :class:`LossScaler` a ``loss_scale`` argument asks for: ``'dynamic'`` (dynamic
    where the step's dtype needs it: :meth:`LossScaler.where_needed`), a positive number
    (static, every step), ``None``/``False`` (disabled) or a ``LossScaler`` (itself, as
    given). The one parser of that argument; ``ValueError`` names the choices."""
    if isinstance(spec, LossScaler):
        return spec
    if spec == "dynamic":
        return LossScaler.where_needed()
    if spec is None or spec is False:
        return LossScaler.disabled()
    if isinstance(spec, numbers.Real) and _as_bool(spec) is None and math.isfinite(spec) and spec > 0:
        return LossScaler.static(float(spec))  # NumPy's scalars too (numbers registers them)
    raise ValueError(f"loss_scale={spec!r} is not valid; use 'dynamic', a finite positive number "
                     "(static scale), None (no scaling) or a gluon_amp.LossScaler.")


def _dtype_set(dtypes: Optional[Iterable[str]]) -> Optional[FrozenSet[str]]:
    """``scaled_dtypes`` checked: ``None`` or compute dtype names."""
    if dtypes is None:
        return None
    try:
        names = frozenset(dtypes) if not isinstance(dtypes, str) else None
    except TypeError:
        names = None
    if names is None:
        raise TypeError(f"scaled_dtypes must be None or a collection of dtype names, got {dtypes!r}")
    bad = sorted(str(d) for d in names if d not in _COMPUTE_DTYPES)
    if bad:
        raise ValueError(f"scaled_dtypes={sorted(map(str, names))!r}: {bad} are not compute dtypes; "
                         f"use names from {list(_COMPUTE_DTYPES)}, or None to scale every step.")
    return names


def _dtype_list(dtypes: Optional[FrozenSet[str]]) -> Optional[List[str]]:
    return None if dtypes is None else sorted(dtypes)
