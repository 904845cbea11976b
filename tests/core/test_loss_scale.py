import json
import math
import os

import pytest

from gluon_amp_core.loss_scale import LossScaler, Stage

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "gradscaler_trajectory.json")


def _torch_like(s):
    # torch's GradScaler has no clamp: min 0, max inf
    return LossScaler(init_scale=s["init_scale"], growth_factor=s["growth_factor"],
                      backoff_factor=s["backoff_factor"], growth_interval=s["growth_interval"],
                      min_scale=0.0, max_scale=math.inf, max_consecutive_skips=None)


with open(GOLDEN) as _f:
    _SCENARIOS = json.load(_f)["scenarios"]


@pytest.mark.parametrize("scenario", _SCENARIOS, ids=[s["name"] for s in _SCENARIOS])
def test_trajectory_matches_torch_gradscaler(scenario):
    """Recorded from torch 2.13 GradScaler by tools/gen_gradscaler_golden.py."""
    scaler = _torch_like(scenario)
    scales, skipped, trackers = [], [], []
    for finite in scenario["steps"]:
        skipped.append(scaler.update(finite))
        scales.append(scaler.loss_scale)
        trackers.append(scaler.state.growth_tracker)
    assert scales == scenario["scales_after_update"]
    assert skipped == scenario["skipped"]
    assert trackers == scenario["growth_tracker_after_update"]
    assert scaler.skipped_steps == sum(scenario["skipped"])


def test_defaults_match_torch_except_clamp():
    s = LossScaler()
    assert (s.loss_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0 ** 16, 2.0, 0.5, 2000)
    assert s.max_scale == 2.0 ** 24


def test_clamps():
    s = LossScaler(init_scale=2.0 ** 24, growth_interval=1)
    s.update(True)
    assert s.loss_scale == 2.0 ** 24
    s = LossScaler(init_scale=2.0, min_scale=1.0, max_consecutive_skips=None)
    for _ in range(5):
        s.update(False)
    assert s.loss_scale == 1.0


def test_static_and_disabled():
    s = LossScaler.static(128.0)
    assert s.update(False) is True and s.loss_scale == 128.0
    for _ in range(5000):
        s.update(True)
    assert s.loss_scale == 128.0
    d = LossScaler.disabled()
    assert d.loss_scale == 1.0 and d.update(False) is False


def test_collapse_detection():
    s = LossScaler(max_consecutive_skips=3)
    s.update(False), s.update(False)
    assert not s.collapsed()
    s.update(False)
    assert s.collapsed()
    s.update(True)
    assert not s.collapsed()


def test_state_dict_round_trip_exact():
    a = LossScaler(init_scale=1024.0, growth_interval=3, min_scale=0.5)
    for f in [True, False, True, True, True, True]:
        a.update(f)
    sd = a.state_dict()
    json.dumps(sd)  # plain values
    b = LossScaler()
    b.load_state_dict(sd)
    assert b.state == a.state and b.state_dict() == sd
    for f in [True, True, False, True]:
        assert a.update(f) == b.update(f)
    assert a.state == b.state


def test_next_state_is_pure():
    s = LossScaler()
    before = s.state
    after = s.next_state(before, False)
    assert s.state is before and after.scale == before.scale / 2


@pytest.mark.parametrize("kwargs", [
    dict(init_scale=0), dict(init_scale=-1.0), dict(init_scale=float("nan")), dict(growth_factor=1.0),
    dict(backoff_factor=1.5), dict(growth_interval=0), dict(growth_interval=2.5), dict(min_scale=-1),
    dict(init_scale=2.0 ** 30), dict(max_consecutive_skips=0),
])
def test_bad_settings_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        LossScaler(**kwargs)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError):
        LossScaler(init_scale="big")


@pytest.mark.parametrize("name", ["enabled", "dynamic"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1, None, [False]])
def test_a_switch_takes_a_bool_not_what_is_truthy(name, value):
    """``enabled='false'`` was a scaler enabled (any object by its truth), while
    ``load_state_dict`` and ``init`` refuse such values."""
    with pytest.raises(TypeError, match=f"{name}=.*True or False"):
        LossScaler(**{name: value})
    assert getattr(LossScaler(**{name: False}), name) is False


def test_load_state_dict_rejects_foreign_dicts():
    with pytest.raises(ValueError, match="missing"):
        LossScaler().load_state_dict({"scale": 2.0})
    with pytest.raises(TypeError):
        LossScaler().load_state_dict([1, 2])


class _Member:
    """Stands in for a trainer's hook: any weak-referenceable object."""


def test_stages_follow_unscale_and_step():
    s = LossScaler(init_scale=8.0)
    m = _Member()
    s.attach(m)
    assert s.stage(m) is Stage.READY
    s.mark_unscaled(m)
    assert s.stage(m) is Stage.UNSCALED
    with pytest.raises(RuntimeError, match="already"):
        s.mark_unscaled(m)
    assert s.record_step(m, finite=True) is False
    assert s.stage(m) is Stage.READY and s.total_steps == 1   # alone: the round ends at once
    with pytest.raises(RuntimeError, match="not attached"):
        s.stage(_Member())


def test_shared_scaler_moves_once_per_round():
    s = LossScaler(init_scale=8.0)
    a, b = _Member(), _Member()
    s.attach(a)
    s.attach(b)
    assert s.record_step(a, finite=False) is True      # a skips on its own gradients
    assert s.stage(a) is Stage.STEPPED and s.loss_scale == 8.0
    assert s.record_step(b, finite=True) is False      # b does not
    assert s.loss_scale == 4.0 and s.total_steps == 1  # one update for the round
    assert s.stage(a) is Stage.READY and s.stage(b) is Stage.READY


def test_uneven_rates_need_an_explicit_end_of_round():
    s = LossScaler(init_scale=8.0)
    a, b = _Member(), _Member()
    s.attach(a)
    s.attach(b)
    s.record_step(a, finite=True)
    with pytest.raises(RuntimeError, match="end_round"):
        s.record_step(a, finite=True)
    s.end_round()
    assert s.total_steps == 1 and s.stage(a) is Stage.READY
    s.record_step(a, finite=True)
    s.end_round()
    assert s.total_steps == 2


def test_checkpoint_keeps_attachments():
    s = LossScaler(init_scale=8.0)
    m = _Member()
    s.attach(m)
    s.load_state_dict(LossScaler(init_scale=2.0).state_dict())
    assert s.loss_scale == 2.0 and s.stage(m) is Stage.READY


def test_the_default_scales_float16_steps_only():
    """loss_scale='dynamic': float16 steps are scaled; bfloat16 and float32 ones use 1."""
    from gluon_amp_core.loss_scale import NEEDS_SCALING, loss_scaler_from
    s = loss_scaler_from("dynamic")
    assert s.scaled_dtypes == NEEDS_SCALING == frozenset({"float16"})
    assert [s.scale_for(d) for d in ("float16", "bfloat16", "float32")] == [2.0 ** 16, 1.0, 1.0]
    given = [LossScaler(), loss_scaler_from(128.0)]  # built by hand, or a number: every step
    assert [g.scale_for("float32") for g in given] == [2.0 ** 16, 128.0]
    assert LossScaler.disabled().scale_for("float16") == 1.0
    assert "for float16" in repr(s)


@pytest.mark.parametrize("spec, checked", [
    ("dynamic", {"float16"}),                        # the default: float16's range only
    (128.0, {"float16", "bfloat16", "float32"}),     # a number scales, so checks, every step
    (LossScaler(), {"float16", "bfloat16", "float32"}),
    (LossScaler(scaled_dtypes=()), {"float16"}),      # scales none: float16 still checked
    (LossScaler(scaled_dtypes=["bfloat16"]), {"float16", "bfloat16"}),
    (LossScaler(scaled_dtypes=["float32"]), {"float16", "float32"}),
    (None, set()),                                   # disabled: nothing
])
def test_a_step_is_checked_where_it_is_scaled_or_computed_in_float16(spec, checked):
    """bfloat16 and float32 steps a scaler does not scale are FP32's steps: not checked."""
    from gluon_amp_core.loss_scale import loss_scaler_from
    s = loss_scaler_from(spec)
    got = {d for d in ("float16", "bfloat16", "float32") if s.checks(d, s.scales(d))}
    assert got == checked
    assert s.checks("float32", True) is s.enabled  # a step the caller scaled after all (a Module's head)


def test_an_unscaled_step_is_skipped_but_leaves_the_scale_alone():
    s = LossScaler.where_needed(growth_interval=2, max_consecutive_skips=2)
    assert s.update(False, scaled=False) is True
    assert (s.loss_scale, s.skipped_steps, s.total_steps, s.last_step_skipped) == (2.0 ** 16, 1, 1, True)
    s.update(True, scaled=True)
    s.update(True, scaled=False)       # does not count toward growth
    assert s.loss_scale == 2.0 ** 16 and s.state.growth_tracker == 1
    s.update(True, scaled=True)
    assert s.loss_scale == 2.0 ** 17
    s.update(False, scaled=False), s.update(False, scaled=False)
    assert s.collapsed() and s.loss_scale == 2.0 ** 17  # the collapse guard counts them
    a, b = _Member(), _Member()        # a round moves the scale if any member's loss was scaled
    s.attach(a)
    s.attach(b)
    s.record_step(a, finite=False, scaled=False)
    s.record_step(b, finite=True, scaled=True)
    assert s.loss_scale == 2.0 ** 16


def test_scaled_dtypes_checked_and_kept_by_state_dict():
    s = LossScaler.where_needed(init_scale=8.0)
    sd = s.state_dict()
    json.dumps(sd)
    assert sd["scaled_dtypes"] == ["float16"]
    other = LossScaler()
    other.load_state_dict(sd)
    assert other.scaled_dtypes == frozenset({"float16"}) and other.state_dict() == sd
    old = dict(sd)
    del old["scaled_dtypes"]           # written before scaled_dtypes existed: keeps the scaler's own
    mine = LossScaler()
    mine.load_state_dict(old)
    assert mine.scaled_dtypes is None and mine.loss_scale == 8.0
    with pytest.raises(ValueError, match="int8"):
        LossScaler(scaled_dtypes=["float16", "int8"])
    with pytest.raises(TypeError, match="scaled_dtypes"):
        LossScaler(scaled_dtypes="float16")


class _Hookish:
    """A member that may stop counting (its trainer dropped): ``attached()`` says so."""

    def __init__(self) -> None:
        self.alive = True

    def attached(self) -> bool:
        return self.alive


class _Rounds:
    """The round rules, written plainly (dicts, no copies): the reference the scaler's
    bookkeeping must agree with, step by step."""

    def __init__(self, scaler: LossScaler) -> None:
        self.rule, self.state = scaler, scaler.state
        self.stages, self.steps, self.abandoned = {}, {}, set()
        self.finite, self.scaled = True, False

    def _complete(self, excused=()):
        return all(s is Stage.STEPPED or m in excused for m, s in self.stages.items() if m.attached())

    def _end(self):
        self.state = self.rule.next_state(self.state, self.finite, self.scaled)
        self.finite, self.scaled, self.abandoned = True, False, set()
        self.stages = dict.fromkeys(self.stages, Stage.READY)

    def attach(self, m):
        self.stages[m] = Stage.READY
        self.steps.setdefault(m, 0)

    def mark_unscaled(self, m):
        if self.stages[m] is Stage.UNSCALED:
            raise RuntimeError
        self.stages[m] = Stage.UNSCALED

    def abandon(self, m, steps):
        if steps in (None, self.steps[m]) and self.stages[m] is not Stage.STEPPED:
            self.abandoned.add(m)

    def record_step(self, m, finite, scaled):
        if self.stages[m] is Stage.STEPPED:
            if not self._complete(self.abandoned):
                raise RuntimeError
            self._end()
        self.stages[m] = Stage.STEPPED
        self.steps[m] += 1
        self.abandoned.discard(m)
        self.finite, self.scaled = self.finite and finite, self.scaled or scaled
        if self._complete():
            self._end()
        return self.rule.enabled and not finite

    def end_round(self):
        self._end()


@pytest.mark.parametrize("seed", range(40))
def test_rounds_agree_with_the_plain_rules_over_random_runs(seed):
    """1 to 3 trainers on one scaler (a sole trainer is the common case, which keeps its
    round's mappings as they are): random steps, unscales, interrupted steps, ends of round
    and dropped trainers. After each, the scaler's stages, counts, state and answers are the
    plain rules'."""
    import random
    rng = random.Random(seed)
    scaler = LossScaler(init_scale=2.0 ** rng.randint(2, 8), growth_interval=rng.choice([1, 2, 3]),
                        enabled=rng.random() > 0.1)
    ref = _Rounds(scaler)
    members = [_Hookish() for _ in range(rng.choice([1, 1, 2, 3]))]
    for m in members:
        scaler.attach(m)
        ref.attach(m)
    for _ in range(60):
        m = rng.choice(members)
        op = rng.choice(["step", "step", "step", "unscale", "abandon", "end", "drop"])
        if op == "drop" and len(members) > 1:
            m.alive = not m.alive
            continue
        calls = {"step": lambda o: o.record_step(m, rng_finite, rng_scaled),
                 "unscale": lambda o: o.mark_unscaled(m),
                 "abandon": lambda o: o.abandon(m, steps_arg),
                 "end": lambda o: o.end_round()}
        if op not in calls:
            continue
        rng_finite, rng_scaled = rng.random() > 0.2, rng.random() > 0.3
        steps_arg = rng.choice([None, ref.steps[m], ref.steps[m] - 1])
        outcomes = []
        for o in (scaler, ref):
            try:
                outcomes.append(("ok", calls[op](o)))
            except RuntimeError:
                outcomes.append(("raised", None))
        assert outcomes[0] == outcomes[1], (op, outcomes)
        assert scaler.state == ref.state
        assert [scaler.stage(x) for x in members] == [ref.stages[x] for x in members]
        assert [scaler.steps_of(x) for x in members] == [ref.steps[x] for x in members]
        assert scaler._round_finite == ref.finite and scaler._round_scaled == ref.scaled
        assert set(scaler._abandoned) == ref.abandoned


def test_a_state_that_went_through_numpy_loads_and_a_bad_flag_names_its_type():
    """A state_dict whose flags became ``numpy.bool_`` was refused with "'dynamic' must be True
    or False, got True": the value shown looked right."""
    class bool_:  # numpy.bool_ as the scaler sees it (the core's tests run without NumPy)
        def __init__(self, value):
            self.value = value

        def item(self):
            return self.value

        def __repr__(self):
            return repr(self.value)

    scaler = LossScaler(init_scale=1024.0)
    state = scaler.state_dict()
    through = {k: bool_(v) if isinstance(v, bool) else v for k, v in state.items()}
    other = LossScaler()
    other.load_state_dict(through)
    assert other.state_dict() == state and type(other.state_dict()["dynamic"]) is bool
    with pytest.raises(ValueError, match=r"'enabled' must be True or False, got 1 \(int\)"):
        other.load_state_dict({**state, "enabled": 1})


def test_which_init_trainer_arguments_ask_for_the_scaler_a_trainer_has():
    """Asked again, ``init_trainer`` returns the attached scaler exactly where this says so."""
    from gluon_amp_core.loss_scale import asks_for
    scaler, other = LossScaler(), LossScaler()
    assert asks_for(scaler, "dynamic", "dynamic") and asks_for(scaler, 8, 8.0) and asks_for(scaler, None, None)
    assert asks_for(scaler, "dynamic", scaler) and asks_for(scaler, scaler, scaler)
    assert not asks_for(scaler, scaler, other) and not asks_for(scaler, scaler, "dynamic")
    assert not asks_for(scaler, "dynamic", other) and not asks_for(scaler, 8, "dynamic")
    assert asks_for(scaler, 1.0, "dynamic", chose_default=True) and not asks_for(scaler, 1.0, 2.0, chose_default=True)
