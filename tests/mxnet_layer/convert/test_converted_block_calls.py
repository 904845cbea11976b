"""What MXNet's own callers do with the block ``convert_hybrid_block`` returns: ``optimize_for``
(which passes ``hybridize`` its arguments by position), ``hybridize(backend=None)`` to unfuse,
calls from several threads at once, and ``export`` for other readers (ONNX's exporter reads no
``_sg_mkldnn_*`` node, and no reader takes a graph whose casts were removed under low weights)."""
import json
import threading
import warnings

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from helpers import cnn

X = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 1, 8, 8)))


def _convert(**kwargs):
    net = cnn()
    net(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gluon_amp.convert_hybrid_block(net, **kwargs)


def _exported_ops(block, tmp_path, **kwargs):
    block.export(str(tmp_path / "m"), 0, **kwargs)
    with open(tmp_path / "m-symbol.json") as f:
        return {n["op"] for n in json.load(f)["nodes"]}


@pytest.mark.parametrize("policy", [dict(target_dtype="bfloat16"), dict(target_dtype="float16", emulate=True)])
def test_optimize_for_passes_hybridize_mxnet_s_arguments_by_position(native_host, policy):
    """1.9.1's ``optimize_for`` calls ``self.hybridize(True, backend, clear, static_alloc, ...)``:
    the converted block's ``hybridize`` took two positional arguments (a ``TypeError``)."""
    block = _convert(**policy)
    before = block(X).asnumpy()
    block.optimize_for(X, backend="MKLDNN")
    after = block(X).asnumpy()
    assert np.linalg.norm(after - before) <= 2 ** -7 * np.linalg.norm(before)
    with pytest.raises(TypeError, match="at most 8 positional arguments"):
        block.hybridize(True, None, True, False, False, 2, None, None, "one too many")


def test_hybridize_backend_none_runs_and_exports_unfused(native_host, tmp_path):
    """The export error's advice, ``hybridize(backend=None)``, kept the fusion (None meant the
    block's default); ``hybridize()`` without a backend fuses again."""
    block = _convert(target_dtype="bfloat16")
    assert block.fuse_backend == "MKLDNN"
    fused = block(X).asnumpy()
    assert any(op.startswith("_sg_mkldnn") for op in _exported_ops(block, tmp_path))
    block.hybridize(backend=None)
    unfused = block(X).asnumpy()
    assert not any(op.startswith("_sg_mkldnn") for op in _exported_ops(block, tmp_path))
    assert np.linalg.norm(unfused - fused) <= 2 ** -7 * np.linalg.norm(fused)
    block.hybridize()
    assert any(op.startswith("_sg_mkldnn") for op in _exported_ops(block, tmp_path))


def test_a_plan_left_float32_exports_its_graph_unfused(monkeypatch, tmp_path):
    """Where the target does not run, the default converts nothing and fuses for speed here:
    its export held only ``_sg_mkldnn_*`` nodes, which ONNX's exporter cannot read. The FP32
    block's own export has none; the converted one's is now the same graph."""
    monkeypatch.setattr(gluon_amp.runtime, "capability", lambda: gluon_amp.runtime.Capability(
        0, gluon_amp.runtime.Bf16.NONE, "AVX2", "no bfloat16 kernels (in-process stand-in)", amx_hint=""))
    block = _convert()
    assert block.fuse_backend == "MKLDNN" and not block._plans_low()
    out = block(X).asnumpy()
    ops = _exported_ops(block, tmp_path)
    assert "Convolution" in ops and not any(op.startswith("_sg_mkldnn") for op in ops)
    loaded = mx.gluon.SymbolBlock.imports(str(tmp_path / "m-symbol.json"), ["data"], str(tmp_path / "m-0000.params"))
    assert np.allclose(loaded(X).asnumpy(), out, rtol=1e-5, atol=1e-6)
    block.hybridize(backend="MKLDNN")  # asked for (another backend than the default, or fuse=True): written fused
    fused = _convert(fuse=True)
    assert any(op.startswith("_sg_mkldnn") for op in _exported_ops(fused, tmp_path))


def test_removing_the_casts_under_low_weights_is_refused_at_export(tmp_path):
    """MXNet writes the graph without casts beside float16 weights: every reader refuses it
    later with "This layer requires uniform type"."""
    block = _convert(target_dtype="float16", emulate=True, cast_optional_params=True)
    with pytest.raises(ValueError, match=r"remove_amp_cast=True.*conv0_weight.*remove_amp_cast=False"):
        block.export(str(tmp_path / "m"), 0, remove_amp_cast=True)
    kept = _convert(target_dtype="float16", emulate=True, cast_optional_params=False)
    kept.export(str(tmp_path / "m"), 0, remove_amp_cast=True)  # float32 weights: MXNet's way, and readable
    loaded = mx.gluon.SymbolBlock.imports(str(tmp_path / "m-symbol.json"), ["data"], str(tmp_path / "m-0000.params"))
    assert loaded(X).shape == (2, 2)


def test_concurrent_first_calls_wait_for_the_binding(native_host):
    """Four threads' first calls of one converted block: the binding of one (fused, then the
    float32 stand-in) changed the block under the others: MXNet's "Gluon failed to build the
    cache", or ``optimize_for``'s assertion on a backend set to None meanwhile."""
    net = mx.gluon.nn.HybridSequential()  # one the speed rule runs as its float32 stand-in: bound twice
    net.add(mx.gluon.nn.Conv2D(8, 3, padding=1), mx.gluon.nn.BatchNorm(), mx.gluon.nn.Activation("relu"),
            mx.gluon.nn.MaxPool2D(), mx.gluon.nn.Conv2D(8, 3), mx.gluon.nn.GlobalAvgPool2D(), mx.gluon.nn.Dense(5))
    net.initialize()
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(1).uniform(size=(2, 3, 16, 16)))
    net(x)
    errors, outs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")(x).asnumpy()
    for _ in range(40):  # the race showed in about 1 trial of 20
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block = gluon_amp.convert_hybrid_block(net, target_dtype="bfloat16")
        start = threading.Barrier(4)

        def call(block=block, start=start):
            start.wait()
            try:
                outs.append(block(x).asnumpy())
            except Exception as error:  # noqa: BLE001  reported below
                errors.append(repr(error))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and len(outs) == 160
    assert all(np.array_equal(o, ref) for o in outs)
