"""``gluon_amp_core.switches``: which values turn a switch off."""
import pytest

from gluon_amp_core.switches import switched_off


@pytest.mark.parametrize("value", ["0", "off", "OFF", "False", " no ", "no\n"])
def test_these_turn_it_off(value):
    assert switched_off({"X": value}, "X")


@pytest.mark.parametrize("env", [{}, {"X": ""}, {"X": "1"}, {"X": "on"}, {"X": "00"}, {"Y": "0"}])
def test_anything_else_or_nothing_leaves_it_on(env):
    assert not switched_off(env, "X")
