"""A block gets one plan in legacy and numpy mode: each numpy-frontend op is classed as its
legacy twin (gluon_amp_core/lists/numpy_twins.py), but for the pairs listed apart, with why."""
import pytest

from gluon_amp_core.lists.numpy_twins import BFLOAT16_APART, FLOAT16_APART, TWINS
from gluon_amp_core.table import build_table

APART = {"bfloat16": BFLOAT16_APART, "float16": FLOAT16_APART}
TABLES = {dtype: build_table(dtype) for dtype in APART}


@pytest.mark.parametrize("dtype", sorted(APART))
@pytest.mark.parametrize("legacy, numpy", TWINS, ids=[b for _, b in TWINS])
def test_a_numpy_op_is_classed_as_its_legacy_twin(dtype, legacy, numpy):
    table = TABLES[dtype]
    same = table.class_of(legacy) is table.class_of(numpy)
    assert same is ((legacy, numpy) not in APART[dtype]), (
        f"{dtype}: {legacy} is {table.class_of(legacy).name}, {numpy} {table.class_of(numpy).name}"
        + (f" (listed apart: {APART[dtype][(legacy, numpy)]})" if not same else " (listed apart, yet alike)"))


@pytest.mark.parametrize("dtype", sorted(APART))
def test_every_pair_listed_apart_is_a_twin(dtype):
    assert set(APART[dtype]) <= set(TWINS)
