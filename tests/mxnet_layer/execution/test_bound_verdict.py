"""init's per-graph verdict where a plan is bound as a Symbol (Module, simple_bind):
execution._bound_verdict, the rule a hybridized block's graph gets at its first call
(gluon_amp_core.tuning.verdict), at the bind's shapes."""
import itertools
import warnings

import numpy as np
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp.tuning import tuner
from helpers import planted_probe, probe_host_items


def _dense(mx_sym):
    """Small products between elementwise ops (a recurrent cell's shape): 15 multiply-adds
    per element its casts convert, far below the rule's 128."""
    x = mx_sym.var("data")
    for i in range(3):
        x = mx_sym.Activation(mx_sym.FullyConnected(x, num_hidden=40, name=f"fc{i}"), act_type="tanh", name=f"t{i}")
    return mx_sym.FullyConnected(x, num_hidden=4, name="head")


def _conv(mx_sym):
    """Two 3x3 convolutions of 64 channels at 16x16: thousands of multiply-adds per cast element."""
    x = mx_sym.var("data")
    x = mx_sym.Activation(mx_sym.Convolution(x, num_filter=64, kernel=(3, 3), pad=(1, 1), name="c0"),
                          act_type="relu", name="r0")
    x = mx_sym.Convolution(x, num_filter=64, kernel=(3, 3), pad=(1, 1), name="c1")
    return mx_sym.FullyConnected(x, num_hidden=4, name="head")


GRAPHS = {"dense": (_dense, (8, 20)), "conv": (_conv, (4, 64, 16, 16))}


def _values(sym, shape):
    rng = np.random.RandomState(0)
    arg_shapes, _, _ = sym.infer_shape(data=shape)
    return {n: mx.nd.array(rng.uniform(-1, 1, s)) for n, s in zip(sym.list_arguments(), arg_shapes)}


def _run(sym, values, api, trains):
    """The bound graph's output for ``values``, bound as ``api`` does it."""
    shape = values["data"].shape
    if api == "module":
        mod = mx.mod.Module(sym, data_names=["data"], label_names=None, context=mx.cpu())
        mod.bind(data_shapes=[("data", shape)], for_training=trains)
        mod.set_params({k: v for k, v in values.items() if k != "data"}, {})
        mod.forward(mx.io.DataBatch([values["data"]]), is_train=trains)
        return mod.get_outputs()[0].asnumpy()
    exe = sym.simple_bind(mx.cpu(), grad_req="write" if trains else "null", data=shape)
    for k, v in values.items():
        v.copyto(exe.arg_dict[k])
    return exe.forward(is_train=trains)[0].asnumpy()


CASES = list(itertools.product(GRAPHS, ["module", "simple_bind"], [True, False], [True, False]))


@pytest.mark.simulated_native
@pytest.mark.parametrize("graph, api, trains, tune", CASES)
def test_a_bound_plan_runs_float32_where_the_rule_says_so_and_names_the_users_line(graph, api, trains, tune):
    make, shape = GRAPHS[graph]
    values = _values(make(mx.sym), shape)
    fp32 = _run(make(mx.sym), values, api, trains)
    gluon_amp.init(tune=tune)  # the simulated host: bfloat16, the probe found it faster (the suite's
    # GLUON_AMP_TUNE=0 makes tune=None mean False: the launcher's and init's default is True)
    plan = make(mx.sym)
    assert any(n["op"] == "amp_cast" for n in gluon_amp.mxnet_internals.symbol_graph(plan)["nodes"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run(plan, values, api, trains)
    said = [w for w in caught if "a bound symbol" in str(w.message)]
    float32 = graph == "dense" and tune  # tune=False runs the plan as it is
    assert np.array_equal(out, fp32) is float32
    if not float32:
        assert np.abs(out - fp32).max() < 0.05 * np.abs(fp32).max()  # the plan, in bfloat16
    assert len(said) == float32
    if float32:
        assert said[0].filename == __file__ and "runs float32 until measured" in str(said[0].message)
        assert "a bind measures nothing" in str(said[0].message)
        assert "tune=False" in str(said[0].message) and "multiply-adds per cast element" in str(said[0].message)


@pytest.mark.simulated_native
@pytest.mark.parametrize("graph", GRAPHS)
def test_an_explicit_dtype_the_probe_found_slower_binds_every_plan_float32(graph, tmp_path):
    make, shape = GRAPHS[graph]
    values = _values(make(mx.sym), shape)
    fp32 = _run(make(mx.sym), values, "module", True)
    with planted_probe(probe_host_items("intel_xeon_no_amx"), tmp_path) as verdict:
        assert not verdict.faster
        with pytest.warns(RuntimeWarning, match="as asked"):
            gluon_amp.init("bfloat16", tune=True)
        with pytest.warns(UserWarning, match="a bound symbol"):
            out = _run(make(mx.sym), values, "module", True)
    assert np.array_equal(out, fp32)


@pytest.mark.simulated_native
@pytest.mark.parametrize("graph, faster", [("dense", True), ("conv", False)])
def test_a_whole_graph_outcome_in_the_timing_cache_decides_over_the_rule(monkeypatch, graph, faster):
    make, shape = GRAPHS[graph]
    values = _values(make(mx.sym), shape)
    fp32 = _run(make(mx.sym), values, "module", True)
    stored = tuner.Outcome({}, {}, check=(500.0, 1000.0) if faster else (1000.0, 900.0))
    keys = []

    def load(cache, sig, nodes):
        keys.append(sig)
        return stored
    monkeypatch.setattr(tuner, "load_outcome", load)
    gluon_amp.init(tune=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run(make(mx.sym), values, "module", True)
    assert keys and np.array_equal(out, fp32) is not faster  # the rule alone gives the other answer
    said = [str(w.message) for w in caught if "a bound symbol" in str(w.message)]
    assert len(said) == (not faster) and all("measured 0.90x float32's speed" in m for m in said)
    assert not any("measures nothing" in m for m in said)


@pytest.mark.simulated_native
@pytest.mark.parametrize("fit", [False, True], ids=["manual", "fit"])
def test_a_step_skipped_in_a_module_bound_float32_says_float32_at_the_users_line(fit):
    """The Module's loss scaling reads the dtype of the graph its executors run: a skipped step
    of a plan the verdict bound float32 is a float32 step, said at the user's ``update`` line."""
    gluon_amp.init(tune=True)
    sym = mx.sym.SoftmaxOutput(_dense(mx.sym), name="softmax")
    mod = mx.mod.Module(sym, context=mx.cpu())
    gluon_amp.init_trainer(mod, 1.0)  # checks every step: the default checks float16 ones only
    x = np.ones((8, 20), "float32")
    x[0, 0] = np.inf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fit:  # MXNet's fit between the user's line and the update
            mod.fit(mx.io.NDArrayIter(x, np.zeros(8, "float32"), batch_size=8), num_epoch=1)
        else:
            mod.bind(data_shapes=[("data", (8, 20))], label_shapes=[("softmax_label", (8,))])
            mod.init_params()
            mod.init_optimizer()
            mod.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.zeros((8,))]))
            mod.update()
    assert [w.filename for w in caught if "a bound symbol" in str(w.message)] == [__file__]
    skipped = [w for w in caught if "was skipped" in str(w.message)]
    assert gluon_amp.get_scaler(mod).skipped_steps == 1
    assert len(skipped) == 1 and "computes in float32" in str(skipped[0].message)
    assert skipped[0].filename == __file__


@pytest.mark.simulated_native
def test_each_graph_the_verdict_binds_float32_says_so_once(tmp_path):
    """Two graphs alike in their op count and last node, and one of them bound again: two
    warnings, where the reason (a probe that found the dtype slower) is the same for both."""
    with planted_probe(probe_host_items("intel_xeon_no_amx"), tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gluon_amp.init("bfloat16", tune=True)
        _bind_twice_alike()


def _bind_twice_alike():
    wide = mx.sym.FullyConnected(mx.sym.Activation(mx.sym.FullyConnected(
        mx.sym.var("data"), num_hidden=48, name="fc0"), act_type="tanh", name="t0"), num_hidden=4, name="head")
    narrow = mx.sym.FullyConnected(mx.sym.Activation(mx.sym.FullyConnected(
        mx.sym.var("data"), num_hidden=40, name="fc0"), act_type="tanh", name="t0"), num_hidden=4, name="head")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sym in (wide, narrow, wide):
            sym.simple_bind(mx.cpu(), grad_req="null", data=(8, 20))
    said = [str(w.message) for w in caught if "a bound symbol" in str(w.message)]
    assert len(said) == 2 and said[0] != said[1]


def _bucket_sym(depth):
    """A bucket of ``depth`` small dense layers (the rule binds each float32), its head shared."""
    x = mx.sym.var("data")
    for i in range(depth):
        x = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=40, name=f"fc{i}"), act_type="tanh", name=f"t{i}")
    return mx.sym.FullyConnected(x, num_hidden=4, name="head"), ("data",), None


def _run_buckets(keys, for_training):
    mod = mx.mod.BucketingModule(_bucket_sym, default_bucket_key=max(keys), context=mx.cpu())
    mod.bind(data_shapes=[("data", (8, 20))], for_training=for_training)
    mod.init_params()
    for key in keys:
        batch = mx.io.DataBatch([mx.nd.ones((8, 20))], bucket_key=key,
                                provide_data=[mx.io.DataDesc("data", (8, 20))])
        mod.forward(batch, is_train=for_training)
        mod.get_outputs()[0].wait_to_read()
    return mod


@pytest.mark.simulated_native
@pytest.mark.parametrize("for_training", [True, False])
def test_a_bucketing_module_says_its_buckets_verdict_once(for_training):
    """Each bucket is a graph of its own, bound on the default bucket's memory: one warning for
    the BucketingModule, not one per bucket; another BucketingModule says its own."""
    gluon_amp.init(tune=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _run_buckets([3, 1, 2, 1], for_training)
        second = _run_buckets([2, 1], for_training)
    said = [w for w in caught if "a bound symbol" in str(w.message)]
    assert len(first._buckets) == 3 and len(second._buckets) == 2
    assert len(said) == 2 and said[0].message.args != said[1].message.args
    assert all("once for all its buckets" in str(w.message) and w.filename == __file__ for w in said)
