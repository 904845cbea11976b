"""``gluon_amp_core.switches``: which values turn a switch off or on, and which are refused."""
import pytest

from gluon_amp_core.switches import OFF, ON, switched_off, switched_on


@pytest.mark.parametrize("value", ["0", "off", "OFF", "False", " no ", "no\n"])
def test_these_turn_it_off(value):
    assert switched_off({"X": value}, "X") and not switched_on({"X": value}, "X")


@pytest.mark.parametrize("env", [{}, {"X": ""}, {"X": "1"}, {"X": "on"}, {"X": " TRUE "}, {"Y": "0"}])
def test_an_on_value_or_nothing_leaves_it_on(env):
    assert not switched_off(env, "X")
    assert switched_on(env, "X") == (env.get("X", "").strip().lower() in ON)


@pytest.mark.parametrize("value", ["00", "disable", "none", "-1", "n", "y", "enabled"])
def test_a_value_that_is_neither_is_refused_naming_the_variable_and_the_choices(value):
    """``GLUON_AMP_TUNE=disable`` left tuning on without a word."""
    for read in (switched_off, switched_on):
        with pytest.raises(ValueError, match=rf"^X={value!r} is neither on nor off: set it to one of "
                                             rf"{', '.join(ON)} \(on\) or {', '.join(OFF)} \(off\)"):
            read({"X": value}, "X")
