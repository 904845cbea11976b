"""A converted block's export writes the whole model, on any CPU, with no forward pass
(MXNet 1.9.1's writes only what a forward pass collected: nothing where the target cannot
run). Each file is read back and compared with the converter's parameters."""
import json
import subprocess
import sys

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp_core.dtypes import dtype_name
from helpers import cnn, no_bf16_env

X = mx.nd.array(np.random.RandomState(0).normal(size=(2, 1, 8, 8)))


def _net():
    net = cnn()  # conv -> BN -> relu -> pool -> dense: BN's aux states, and oneDNN fusion for bf16
    net(X)
    return net


def _f32(a):
    """The values of an array of any float dtype, exactly, as float32 (bfloat16 included)."""
    return mx.nd.amp_cast(a, dtype="float32").asnumpy()


def _graph_params(symbol_file):
    """``{"arg:name" | "aux:name"}`` for every input of the saved graph except ``data``."""
    sym = mx.sym.load(symbol_file)
    return ({f"arg:{n}" for n in sym.list_arguments() if n != "data"}
            | {f"aux:{n}" for n in sym.list_auxiliary_states()})


def _check_file(prefix, epoch, expected, plan_dtypes):
    """The pair at ``prefix`` holds every parameter of ``expected`` (``{"arg:n"|"aux:n": NDArray}``,
    the converter's) by name, dtype (the plan's) and value, and nothing else."""
    saved = mx.nd.load(f"{prefix}-{epoch:04d}.params")
    assert set(saved) == set(expected) == _graph_params(f"{prefix}-symbol.json")
    for key, arr in saved.items():
        name = key.split(":", 1)[1]
        assert dtype_name(arr.dtype) == dtype_name(expected[key].dtype) == plan_dtypes[name], key
        assert np.array_equal(_f32(arr), _f32(expected[key])), key


def _block_params(blk):
    aux = set(blk._cached_graph[1].list_auxiliary_states())  # the converted graph's (1.9.1)
    return {f"{'aux' if p.name in aux else 'arg'}:{p.name}": p.data() for p in blk.collect_params().values()}


def _loads_like(prefix, epoch, blk):
    """``SymbolBlock.imports`` reads the pair back with the block's parameters and graph."""
    loaded = mx.gluon.SymbolBlock.imports(f"{prefix}-symbol.json", ["data"], f"{prefix}-{epoch:04d}.params")
    mine = {p.name: p for p in blk.collect_params().values()}
    got = {p.name: p for p in loaded.collect_params().values()}
    assert set(got) == set(mine)
    for n, p in got.items():
        assert (dtype_name(p.dtype), p.data().shape) == (dtype_name(mine[n].dtype), mine[n].data().shape), n
        assert np.array_equal(_f32(p.data()), _f32(mine[n].data())), n
    return loaded


@pytest.mark.parametrize("cast", [False, True])
def test_float16_export_on_a_cpu_writes_every_parameter_in_the_plans_dtype(tmp_path, cast):
    """float16 cannot run on this CPU build: before, export wrote a 32-byte file of 0 arrays."""
    net = _net()
    net.export(str(tmp_path / "fp32"), 0)
    blk = gluon_amp.convert_hybrid_block(net, "float16", cast_optional_params=cast)
    prefix = str(tmp_path / "fp16")
    blk.export(prefix, 7)
    plan = blk.amp_result.param_dtypes
    assert ("float16" in plan.values()) == cast
    # the converter's parameters, two ways: the block's, and convert_model's from the FP32 files
    sym, args, aux = mx.model.load_checkpoint(str(tmp_path / "fp32"), 0)
    new_sym, new_args, new_aux = gluon_amp.convert_model(sym, args, aux, "float16", cast_optional_params=cast)
    converted = {**{f"arg:{k}": v for k, v in new_args.items()}, **{f"aux:{k}": v for k, v in new_aux.items()}}
    _check_file(prefix, 7, converted, plan)
    _check_file(prefix, 7, _block_params(blk), plan)
    with open(f"{prefix}-symbol.json") as f:
        assert json.load(f) == json.loads(blk.deployed_symbol().tojson(remove_amp_cast=False))
    _loads_like(prefix, 7, blk)
    # convert_model's result saved as a checkpoint, as before, round-trips too
    new_sym.save(str(tmp_path / "cm-symbol.json"), remove_amp_cast=False)
    mx.nd.save(str(tmp_path / "cm-0000.params"), converted)
    _check_file(str(tmp_path / "cm"), 0, converted, plan)


def test_bfloat16_export_without_a_forward_pass_equals_mxnets_after_one(native_host, tmp_path):
    """Where bfloat16 runs, the files equal MXNet's own forward-then-export (fused graph
    included), and the loaded pair computes the same outputs."""
    net = _net()
    # tune=False: the plan runs as converted (the speed rule would run this small net in float32,
    # and MXNet's export after a forward writes what ran: convert/test_conversion_speed_rule.py)
    mine = gluon_amp.convert_hybrid_block(net, "bfloat16", cast_optional_params=True, tune=False)
    assert mine.fuse_backend == "MKLDNN"
    mine.export(str(tmp_path / "mine"), 0)  # no forward pass
    ref = gluon_amp.convert_hybrid_block(net, "bfloat16", cast_optional_params=True, tune=False)
    out = ref(X).asnumpy()
    mx.gluon.HybridBlock.export(ref, str(tmp_path / "ref"), 0, remove_amp_cast=False)  # MXNet's own
    with open(tmp_path / "mine-symbol.json") as a, open(tmp_path / "ref-symbol.json") as b:
        graph = json.load(a)
        if not gluon_amp.runtime.simulated():  # MXNet writes back the partition of what ran: there, the
            assert graph == json.load(b)       # simulation's float32 copy, which the block does not keep
    assert "_sg_mkldnn_conv" in {n["op"] for n in graph["nodes"]}
    theirs = mx.nd.load(str(tmp_path / "ref-0000.params"))
    assert "bfloat16" in {dtype_name(v.dtype) for v in theirs.values()}
    _check_file(str(tmp_path / "mine"), 0, theirs, mine.amp_result.param_dtypes)
    _check_file(str(tmp_path / "mine"), 0, _block_params(mine), mine.amp_result.param_dtypes)
    loaded = _loads_like(str(tmp_path / "mine"), 0, mine)
    if gluon_amp.runtime.simulated():  # the fused export's oneDNN ops run float32, rounded around only
        assert np.linalg.norm(loaded(X).asnumpy() - out) <= 2 ** -8 * np.linalg.norm(out)
    else:
        assert np.array_equal(loaded(X).asnumpy(), out)
    assert np.array_equal(mine(X).asnumpy(), out)  # exporting first changed nothing the block runs


_CONVERT = """
import sys, json
import gluon_amp, mxnet as mx
prefix = sys.argv[1]
net = mx.gluon.SymbolBlock.imports(prefix + "fp32-symbol.json", ["data"], prefix + "fp32-0000.params")
net.hybridize()
net(mx.nd.ones((2, 1, 8, 8)))
blk = gluon_amp.convert_hybrid_block(net, "bfloat16", cast_optional_params=True)
blk.export(prefix + "bf16", 0)
aux = set(blk.deployed_symbol().list_auxiliary_states())
mx.nd.save(prefix + "expected.params", {("aux:" if p.name in aux else "arg:") + p.name: p.data()
                                        for p in blk.collect_params().values()})
print(json.dumps({"runs_bf16": gluon_amp.runtime.executable("bfloat16", "cpu"), "fuse": blk.fuse_backend,
                  "plan": blk.amp_result.param_dtypes}))
"""

_LOAD = """
import sys, json
import gluon_amp, mxnet as mx
prefix = sys.argv[1]
blk = mx.gluon.SymbolBlock.imports(prefix + "bf16-symbol.json", ["data"], prefix + "bf16-0000.params")
print(json.dumps({p.name: [str(mx.nd.amp_cast(p.data(), dtype="float32").asnumpy().tolist()), p.data().shape,
                           gluon_amp.mxnet_internals.FLOAT_NAMES[p.dtype]]
                  for p in blk.collect_params().values()}))
"""


def _run(code, prefix):
    r = subprocess.run([sys.executable, "-c", code, prefix], capture_output=True, text=True,
                       env=no_bf16_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bfloat16_export_on_a_host_without_bf16_kernels_is_whole(tmp_path):
    """Under DNNL_MAX_CPU_ISA=AVX2 the bf16 block cannot run; its export is whole, and a
    fresh process of that host loads it."""
    _net().export(str(tmp_path / "fp32"), 0)
    prefix = str(tmp_path) + "/"
    facts = _run(_CONVERT, prefix)
    assert facts["runs_bf16"] is False and facts["fuse"] == "MKLDNN"
    assert "bfloat16" in facts["plan"].values()
    expected = mx.nd.load(prefix + "expected.params")
    _check_file(prefix + "bf16", 0, expected, facts["plan"])
    loaded = _run(_LOAD, prefix)
    assert {f"{'aux' if 'running' in n else 'arg'}:{n}" for n in loaded} == set(expected)
    for key, arr in expected.items():
        values, shape, dtype = loaded[key.split(":", 1)[1]]
        assert (tuple(shape), dtype) == (arr.shape, dtype_name(arr.dtype)), key
        assert values == str(_f32(arr).tolist()), key
