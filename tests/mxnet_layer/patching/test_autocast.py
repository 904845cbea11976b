"""``autocast(enabled=...)``: nestable, thread-local regions (issue 37, part 3).

Imperative dtypes are checked where every host runs them: an fp32-class op (softmax) on a
float16 input gives float32 under a float16 policy and float16 without one; a low-precision
op (FullyConnected) under emulated float16 gives float32 holding float16-rounded values.
Graph dtypes are MXNet's type inference of the graph built.
"""
import threading
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet.gluon import nn

import gluon_amp

X16 = mx.nd.array(np.linspace(-1, 1, 6).reshape(2, 3), dtype="float16")
_rng = np.random.RandomState(0)
DATA = mx.nd.array(_rng.uniform(-1, 1, (4, 8)) / 3)
WEIGHT = mx.nd.array(_rng.uniform(-1, 1, (5, 8)) / 7)


def _fc():
    return mx.nd.FullyConnected(DATA, WEIGHT, num_hidden=5, no_bias=True).asnumpy()


REFERENCE = _fc()  # float32, no AMP


def _rounded_to(out, dtype):
    """True when ``out`` holds values of ``dtype`` (and differs from the float32 result)."""
    if dtype == "float32":
        return np.array_equal(out, REFERENCE)
    low = np.float16 if dtype == "float16" else None
    if low is None:  # bfloat16: the top 16 bits of a float32
        exact = out.view(np.uint32) & 0xFFFF == 0
    else:
        exact = out.astype(low).astype(np.float32) == out
    return bool(exact.all()) and not np.array_equal(out, REFERENCE)


def _sym_out_dtype():
    fc = mx.sym.FullyConnected(mx.sym.var("d"), num_hidden=5, no_bias=True, name="fc")
    return np.dtype(fc.infer_type(d=np.float32)[1][0]).name


@pytest.mark.parametrize("outer", ["init", "autocast"])
def test_enabled_false_inside_amp_runs_float32_and_low_precision_comes_back_after(outer):
    ctx = gluon_amp.autocast("float16", emulate=True) if outer == "autocast" else None
    if ctx is None:
        gluon_amp.init("float16", emulate=True)
    else:
        ctx.__enter__()
    try:
        assert _rounded_to(_fc(), "float16")
        with gluon_amp.autocast(enabled=False) as policy:
            assert policy is None and gluon_amp.current_policy() is None and not gluon_amp.is_enabled()
            assert _rounded_to(_fc(), "float32")
        assert _rounded_to(_fc(), "float16")
        assert gluon_amp.current_policy().target_dtype == "float16"
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def test_native_dtypes_inside_enabled_false_are_float32_ones():
    """The real dtypes (float16 kernels cannot run here: the graph is only typed, and the
    imperative op is an fp32-class one, which the original function runs in its input's dtype)."""
    gluon_amp.init("float16")
    assert _sym_out_dtype() == "float16" and mx.nd.softmax(X16).dtype == np.float32
    with gluon_amp.autocast(enabled=False):
        assert _sym_out_dtype() == "float32" and mx.nd.softmax(X16).dtype == np.float16
    assert _sym_out_dtype() == "float16" and mx.nd.softmax(X16).dtype == np.float32


def _dense():
    net = nn.Dense(5, in_units=8, use_bias=False)
    net.initialize()
    net.weight.set_data(WEIGHT)
    net.hybridize()
    return net


def test_a_hybridized_block_keeps_the_graph_of_the_region_it_was_built_in():
    gluon_amp.init("float16", emulate=True)
    inside, outside = _dense(), _dense()
    with gluon_amp.autocast(enabled=False):
        assert _rounded_to(inside(DATA).asnumpy(), "float32")  # built here: a float32 graph
    assert _rounded_to(outside(DATA).asnumpy(), "float16")  # built under the policy: its plan
    assert _rounded_to(inside(DATA).asnumpy(), "float32")  # ... and each keeps its graph elsewhere
    with gluon_amp.autocast(enabled=False):
        assert _rounded_to(outside(DATA).asnumpy(), "float16")
        inside.hybridize()  # a rebuild takes the region it happens in
    assert _rounded_to(inside(DATA).asnumpy(), "float16")


def test_a_block_traced_outside_any_region_says_so_once_when_it_runs_in_one():
    """A block first called with AMP off (a summary or a check before a loop of autocast
    regions) keeps that float32 graph in the regions: silently, before, AMP did nothing."""
    net = _dense()
    with gluon_amp.autocast("float16", emulate=True):
        pass  # patched from here on, with no policy outside the region
    net(DATA)
    with gluon_amp.autocast("float16", emulate=True):
        with pytest.warns(RuntimeWarning, match=r"cached its graph .*outside any autocast region"):
            assert _rounded_to(net(DATA).asnumpy(), "float32")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            net(DATA)  # once
        net.hybridize()  # as it says
        assert _rounded_to(net(DATA).asnumpy(), "float16")


@pytest.mark.parametrize("built_in", ["init", "region"])
def test_disable_drops_every_plan_a_block_traced_and_the_block_runs_mxnets_graph(built_in):
    """Found by a program that evaluated in FP32 after ``disable()``: its block kept running
    the emulated float16 plan, while ``is_enabled()`` said False."""
    if built_in == "init":
        gluon_amp.init("float16", emulate=True)
        net = _dense()
        assert _rounded_to(net(DATA).asnumpy(), "float16")
    else:
        net = _dense()
        with gluon_amp.autocast("float16", emulate=True):
            assert _rounded_to(net(DATA).asnumpy(), "float16")
        assert _rounded_to(net(DATA).asnumpy(), "float16")  # the region's graph, as documented
    gluon_amp.disable()
    assert _rounded_to(net(DATA).asnumpy(), "float32")


@pytest.mark.parametrize("then", ["nothing", "init again"])
def test_export_right_after_disable_writes_the_parameters(then, tmp_path):
    """Found by a helper: disable() put back the block's FP32 graph but emptied the list of
    the CachedOp's parameters that MXNet's export() saves, so the .params file was empty and
    SymbolBlock.imports failed later ("Parameter ... is missing in file")."""
    gluon_amp.init("float16", emulate=True)
    net = _dense()
    net(DATA)
    gluon_amp.disable()
    if then == "init again":
        gluon_amp.init("bfloat16", emulate=True)
    net.export(str(tmp_path / "d"))
    saved = mx.nd.load(str(tmp_path / "d-0000.params"))
    assert sorted(saved) == sorted(f"arg:{p.name}" for p in net.collect_params().values()), sorted(saved)
    gluon_amp.disable()
    back = nn.SymbolBlock.imports(str(tmp_path / "d-symbol.json"), ["data"], str(tmp_path / "d-0000.params"))
    assert np.array_equal(back(DATA).asnumpy(), REFERENCE)


def test_a_block_traced_under_one_policy_takes_the_next_after_disable_and_init():
    """float16 -> disable() -> bfloat16: the block's plan is bfloat16's, not float16's (which the
    trainer, following bfloat16, would neither scale nor check)."""
    gluon_amp.init("float16", emulate=True)
    net = _dense()
    assert _rounded_to(net(DATA).asnumpy(), "float16")
    gluon_amp.disable()
    gluon_amp.init("bfloat16", emulate=True)
    assert _rounded_to(net(DATA).asnumpy(), "bfloat16")
    assert gluon_amp.report(net).totals_by_dtype.get("float16", 0) == 0


@pytest.mark.parametrize("how", ["imported", "built under init"])
def test_a_symbol_block_keeps_its_own_graph_after_disable(how, tmp_path):
    """A SymbolBlock's graph is the user's: disable() leaves it and the block runs as it ran (a
    symbol built under init holds that policy's casts itself, as GluonCV's feature extractors'
    under the launcher do; run without them, float16 would reach MXNet's CPU kernels)."""
    plain = _dense()
    plain(DATA)
    plain.export(str(tmp_path / "d"))  # exported before any AMP: an FP32 graph
    gluon_amp.init("float16", emulate=True)
    if how == "imported":
        block = nn.SymbolBlock.imports(str(tmp_path / "d-symbol.json"), ["data"], str(tmp_path / "d-0000.params"))
        want = "float32"
    else:  # as GluonCV's feature extractors build theirs
        data = mx.sym.var("data")
        block = nn.SymbolBlock(mx.sym.FullyConnected(data, num_hidden=5, no_bias=True, name="fc"), [data])
        block.initialize()
        block.collect_params()["fc_weight"].set_data(WEIGHT)
        want = "float16"
    block.hybridize()
    under = block(DATA).asnumpy()
    gluon_amp.disable()
    after = block(DATA).asnumpy()
    assert _rounded_to(after, want) and np.array_equal(after, under)


def test_another_policy_nests_and_the_outer_one_is_back_after_it_even_on_error():
    gluon_amp.init("float16", emulate=True)
    fp16 = _fc()
    with gluon_amp.autocast("bfloat16", emulate=True) as policy:
        assert policy.target_dtype == "bfloat16" and gluon_amp.current_policy() is policy
        assert _rounded_to(_fc(), "bfloat16") and not np.array_equal(_fc(), fp16)
        with gluon_amp.autocast(enabled=False):
            assert _rounded_to(_fc(), "float32")
            with gluon_amp.autocast() as inner:  # enabled, no target: the innermost policy in force
                assert inner is policy and _rounded_to(_fc(), "bfloat16")
    with pytest.raises(KeyError):
        with gluon_amp.autocast(enabled=False):
            raise KeyError("boom")
    assert _rounded_to(_fc(), "float16") and gluon_amp.current_policy().target_dtype == "float16"


@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_region_left_out_of_order_is_cut_out_and_the_ones_around_it_hold(how):
    """A generator suspended in ``autocast(enabled=False)`` (an evaluation loader), closed inside
    a later region: the thread kept running float32 after every region had exited."""
    gluon_amp.init("float16", emulate=True)

    def batches():
        with gluon_amp.autocast(enabled=False):
            yield _fc()
            yield _fc()

    g = batches()
    assert _rounded_to(next(g), "float32")
    with gluon_amp.autocast("bfloat16", emulate=True):
        with gluon_amp.autocast(enabled=False):
            if how == "close":
                g.close()
            else:
                del g  # closed by its finalizer
            assert _rounded_to(_fc(), "float32")  # the innermost region holds
        assert _rounded_to(_fc(), "bfloat16")  # its exit leads past the region cut out
    assert _rounded_to(_fc(), "float16") and gluon_amp.current_policy().target_dtype == "float16"


_KINDS = {"float16": dict(target_dtype="float16", emulate=True),
          "bfloat16": dict(target_dtype="bfloat16", emulate=True),
          "off": dict(enabled=False), "on": {}}


@pytest.mark.parametrize("process", [None, "bfloat16"])
@pytest.mark.parametrize("cut", ["float16", "bfloat16", "off"])
@pytest.mark.parametrize("kept", ["float16", "bfloat16", "off", "on"])
def test_autocast_without_a_target_inside_a_region_whose_outer_was_cut_out(process, cut, kept):
    """Generated: region ``cut``, region ``kept`` inside it, ``cut`` left out of order, then
    ``autocast()`` inside ``kept``. It means ``kept``'s policy, else init's, never the region
    left: a float16 region cut from below ``autocast(enabled=False)`` came back in a later
    ``autocast()`` (found by the stateful test's random run)."""
    if process is not None:
        gluon_amp.init(process, emulate=True)
    outer = gluon_amp.autocast(**_KINDS[cut])
    outer.__enter__()
    with gluon_amp.autocast(**_KINDS[kept]) as kept_policy:
        outer.__exit__(None, None, None)
        if kept_policy is not None:
            want = kept_policy.target_dtype
        elif process is not None:  # a float32 region passes on what is outside it: now init's
            want = process
        else:  # nothing in force anywhere: init's default on this host
            default = gluon_amp.make_policy(None)
            want = default.target_dtype if default.enabled else None
        with gluon_amp.autocast() as policy:
            got = policy.target_dtype if policy is not None else None
            assert got == want, (cut, kept, process, got)
            assert _rounded_to(_fc(), got or "float32")


def test_enabled_true_without_a_target_means_the_active_or_the_default_policy():
    default = gluon_amp.make_policy(None)
    with gluon_amp.autocast(enabled=True) as policy:
        assert policy == (default if default.enabled else None)
        assert gluon_amp.current_policy() == policy
    active = gluon_amp.init("float16", emulate=True)
    with gluon_amp.autocast(enabled=True) as policy:
        assert policy is active and _rounded_to(_fc(), "float16")
    with pytest.raises(TypeError, match="enabled"):
        with gluon_amp.autocast(enabled="no"):
            pass
    assert gluon_amp.current_policy() is active


def test_regions_patch_once_and_disable_leaves_every_function_as_it_was():
    """The first region patches; the functions stay patched (a later region costs a store, not a
    patch) and run MXNet's own code outside regions; disable() puts every one back."""
    code = mx.nd.FullyConnected.__code__
    with gluon_amp.autocast("float16", emulate=True):
        with gluon_amp.autocast(enabled=False):
            assert mx.nd.FullyConnected.__code__ is not code  # patched while a policy is in force
    patched = gluon_amp.patched_functions()
    assert mx.nd.FullyConnected.__code__ is not code and patched
    assert _rounded_to(_fc(), "float32") and gluon_amp.current_policy() is None
    with gluon_amp.autocast("float16", emulate=True):
        assert gluon_amp.patched_functions() == patched  # nothing patched again
    gluon_amp.disable()
    assert mx.nd.FullyConnected.__code__ is code and gluon_amp.patched_functions() == ()
    assert all(p.function.__code__ is p.code for p in patched)


def _run_in_threads(first, second):
    """Run both callables at once, each in its own thread; their results."""
    results, errors = [None, None], []
    barrier = threading.Barrier(2)

    def run(k, fn):
        try:
            barrier.wait()
            results[k] = fn()
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k, fn)) for k, fn in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _dtypes(n=1000):
    return {np.dtype(mx.nd.softmax(X16).dtype).name for _ in range(n)}


@pytest.mark.parametrize("how", ["autocast-in-one-thread", "init-and-enabled-false-in-one-thread"])
def test_each_thread_keeps_its_own_amp_state_for_1000_calls(how):
    if how == "autocast-in-one-thread":
        def amp():
            with gluon_amp.autocast("float16"):
                return _dtypes(), gluon_amp.is_enabled()

        def plain():
            return _dtypes(), gluon_amp.is_enabled()
    else:
        gluon_amp.init("float16")

        def amp():
            return _dtypes(), gluon_amp.is_enabled()

        def plain():
            with gluon_amp.autocast(enabled=False):
                return _dtypes(), gluon_amp.is_enabled()

    with_amp, without = _run_in_threads(amp, plain)
    assert with_amp == ({"float32"}, True)
    assert without == ({"float16"}, False)


def test_outside_every_region_a_parameter_cast_is_mxnets_own():
    """Functions stay patched after a region (patched once), but outside it gluon_amp is not
    there: ``net.cast('float16')`` (code written for a GPU, or to save float16 weights) casts as
    MXNet does, where the patched cast rule would refuse it on a CPU."""
    net = nn.Dense(3, in_units=4)
    net.initialize()
    with gluon_amp.autocast("float16", emulate=True):
        _fc()
    try:
        net.cast("float16")
        dtypes = {p.data().dtype for p in net.collect_params().values()}
    finally:
        gluon_amp.disable()
    assert dtypes == {np.float16}


@pytest.mark.parametrize("args, kwargs", [((), {}), (("bfloat16",), {}), (("float16",), {"emulate": True})])
def test_a_region_entered_every_step_makes_its_policy_once(args, kwargs, monkeypatch):
    """PyTorch users enter ``autocast()`` around every step: building the op table each time
    cost 4.4 ms a step (and as much for a target that falls back to float32, unpatched). The
    same arguments give the same policy until ``disable``, which forgets it (a changed
    ``$GLUON_AMP_TUNE`` is then read again)."""
    import gluon_amp.patching as patching
    made = []
    real = patching.as_policy
    monkeypatch.setattr(patching, "as_policy", lambda *a, **k: made.append(a) or real(*a, **k))
    seen = []
    for _ in range(4):
        with gluon_amp.autocast(*args, **kwargs) as policy:
            seen.append(policy)
    assert len(made) == 1 and all(p is seen[0] for p in seen)
    gluon_amp.disable()
    monkeypatch.setenv("GLUON_AMP_TUNE", "0")
    with gluon_amp.autocast(*args, **kwargs) as again:
        pass
    assert len(made) == 2
    if again is not None:
        assert again.tune is False


def test_autocast_without_arguments_follows_init_and_outer_regions():
    """No arguments: the policy in force (an outer region's, else init's) is not made again."""
    with gluon_amp.autocast("float16", emulate=True) as outer:
        with gluon_amp.autocast() as inner:
            assert inner is outer
    policy = gluon_amp.init(target_dtype="bfloat16", emulate=True)
    with gluon_amp.autocast() as inner:
        assert inner is policy


def test_regions_of_ever_new_arguments_stay_bounded_and_the_ones_in_use_are_kept():
    """``autocast`` with a new argument each time (a layer excluded at a time, by hand) kept a
    wrapper per patched function for every policy until ``disable()``: about 2 MB and 21,500
    objects each, without end. Idle regions beyond the latest few are forgotten; the ones a
    thread is in (at any depth) and init's stay, and each still runs its own dtype."""
    from gluon_amp import patching
    kept = patching.IDLE_REGIONS_KEPT
    gluon_amp.init("bfloat16", emulate=True)
    init_region = patching._init_region
    outer = gluon_amp.autocast("float16", emulate=True, excluded_sym_names=("outer",))
    outer.__enter__()
    try:
        outer_region = gluon_amp.state.frame().region
        for i in range(3 * kept):
            with gluon_amp.autocast("bfloat16" if i % 2 else "float16", emulate=True, excluded_sym_names=(f"n{i}",)):
                assert _rounded_to(_fc(), "bfloat16" if i % 2 else "float16")
            with gluon_amp.autocast(enabled=False):
                assert _rounded_to(_fc(), "float32")
            regions = set(patching._patched.regions.values())
            assert len(regions) <= kept + 2, len(regions)  # + init's and the outer region
            assert {init_region, outer_region} <= regions
            for site in patching._patched.sites.values():
                assert set(site.routes) <= regions
        assert _rounded_to(_fc(), "float16")  # the outer region, through all of it
        with gluon_amp.autocast("float16", emulate=True, excluded_sym_names=("n0",)):  # forgotten, built again
            assert _rounded_to(_fc(), "float16")
    finally:
        outer.__exit__(None, None, None)
    assert _rounded_to(_fc(), "bfloat16")  # init's
