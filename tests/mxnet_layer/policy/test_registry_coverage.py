"""Every operator the installed MXNet registers is classified exactly once."""
import pytest

from gluon_amp import mxnet_internals as mxi
from gluon_amp_core.lists import bfloat16 as bf16_lists, float16 as fp16_lists
from gluon_amp.policy_builder import make_policy
from gluon_amp_core.table import OpClass


def _listed(lists):
    names = list(lists.LOW_PRECISION) + list(lists.FP32) + list(lists.WIDEST) + list(lists.NEUTRAL)
    return names + [c[0] for c in lists.CONDITIONAL_FP32]


@pytest.mark.parametrize("lists", [fp16_lists, bf16_lists], ids=["float16", "bfloat16"])
def test_every_registered_op_classified_exactly_once(lists):
    infos = mxi.op_infos()
    listed = _listed(lists)
    dupes = sorted({n for n in listed if listed.count(n) > 1})
    assert not dupes, f"listed twice: {dupes}"
    not_registered = sorted(set(listed) - set(infos))
    assert not not_registered, f"table names ops this MXNet does not register: {not_registered}"
    aliases_listed = sorted(n for n in listed if infos[n].canonical != n)
    assert not aliases_listed, f"list the canonical op, not its alias: {aliases_listed}"
    unclassified = sorted(n for n, i in infos.items() if i.canonical not in set(listed))
    assert not unclassified, f"registered but unclassified: {unclassified}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_registered_name_resolves_to_one_class(dtype):
    t = make_policy(dtype).table
    for name in mxi.op_infos():
        assert isinstance(t.class_of(name), OpClass)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ops_without_tensor_inputs_are_neutral(dtype):
    t = make_policy(dtype).table
    # Custom-style ops declare their inputs at run time, so the registry shows none.
    runtime_inputs = {"Custom", "_CustomFunction", "_NDArray", "_Native"}
    bad = sorted(n for n, i in mxi.op_infos().items()
                 if not i.inputs and not i.variadic and i.canonical not in runtime_inputs
                 and t.class_of(n) is not OpClass.NEUTRAL)
    assert not bad, f"ops with no tensor inputs must be neutral: {bad}"


def test_every_patchable_function_maps_to_a_registered_op():
    sites = list(mxi.op_function_sites())
    assert len(sites) > 2000
    ops = {s[3] for s in sites}
    assert ops <= set(mxi.op_infos())
    namespaces = {s[0].__name__ for s in sites}
    for ns in ("mxnet.ndarray", "mxnet.ndarray.op", "mxnet.symbol.op", "mxnet.ndarray.contrib",
               "mxnet.symbol.linalg", "mxnet.ndarray.random", "mxnet.ndarray.image",
               "mxnet.ndarray.sparse", "mxnet.ndarray._internal", "mxnet.numpy_extension",
               "mxnet.ndarray.numpy._internal"):
        assert ns in namespaces, ns
