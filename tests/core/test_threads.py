"""gluon_amp_core.threads: MXNet 1.9's OpenMP thread count from the environment, and the note."""
import itertools

import pytest

from gluon_amp_core.threads import MXNET_MAX, OMP, expected_threads, thread_use

OMP_VALUES = [None, "1", "3", "4,2", " 2 ", "abc", "0", "-1"]
MAX_VALUES = [None, "1", "8"]
CPUS = [1, 2, 3, 4, 16, 64]
PER_CORE = [None, 1, 2]


def _env(omp, mx_max):
    env = {"PATH": "/usr/bin"}
    if omp is not None:
        env[OMP] = omp
    if mx_max is not None:
        env[MXNET_MAX] = mx_max
    return env


CASES = list(itertools.product(OMP_VALUES, MAX_VALUES, CPUS, PER_CORE))


@pytest.mark.parametrize("omp, mx_max, cpus, per_core", CASES)
def test_the_count_follows_the_setting_that_decides_it(omp, mx_max, cpus, per_core):
    env = _env(omp, mx_max)
    n = expected_threads(env, cpus)
    assert n >= 1
    if omp is not None:
        first = omp.split(",")[0].strip()
        readable = first.lstrip("-").isdigit() and int(first) > 0
        assert n == (int(first) if readable else cpus)  # libgomp's own reading, else its default
    elif mx_max is not None:
        assert n == cpus  # MXNet leaves libgomp alone: every CPU
    else:
        assert n <= max(1, cpus / 2) and (cpus < 2 or 2 * n >= cpus - 1)  # MXNet halves the CPUs
    assert expected_threads(env, cpus, x86=False) == (n if omp is not None else cpus)


@pytest.mark.parametrize("omp, mx_max, cpus, per_core", CASES)
def test_the_note_appears_only_where_mxnet_chose_to_idle_whole_cores(omp, mx_max, cpus, per_core):
    use = thread_use(_env(omp, mx_max), cpus, per_core)
    idle = use.threads < use.cpus
    chosen_by_user = omp is not None or mx_max is not None
    assert (use.note is not None) == (idle and not chosen_by_user and per_core == 1)
    if use.note is not None:
        assert f"{OMP}={cpus}" in use.note and f"on {cpus} CPUs" in use.note
        assert f"runs {use.threads} OpenMP thread" in use.note
    assert (OMP in use.set_by) and ((MXNET_MAX in use.set_by) == (omp is None and mx_max is not None))
    assert use.to_dict()["threads"] == use.threads


@pytest.mark.parametrize("measured", [1, 2, 5])
def test_a_measured_count_overrides_the_prediction(measured):
    use = thread_use({}, 4, 1, measured=measured)
    assert use.threads == measured
    assert (use.note is not None) == (measured < 4)


@pytest.mark.parametrize("measured", [None, 0, -3])
def test_no_measured_count_falls_back_to_the_prediction(measured):
    assert thread_use({}, 8, 2, measured=measured).threads == expected_threads({}, 8) == 4


def test_off_x86_mxnet_leaves_every_cpu_to_libgomp():
    use = thread_use({}, 8, 1, x86=False)
    assert use.threads == 8 and use.note is None
