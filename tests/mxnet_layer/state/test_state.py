"""gluon_amp.state: one home for process state, and one ``reset`` that forgets it (issue 38)."""
import pytest
import mxnet as mx

import gluon_amp
from gluon_amp import execution, plan_notes, state
from gluon_amp.mxnet_internals import gluon as mxg
from gluon_amp.training import module as scaling
from gluon_amp_core.walk import Note


def test_reset_forgets_block_notes_module_scalers_and_converted_results_and_releases_their_hooks():
    """What the features keep per object (a block's notes, a Module's scaler, a converter's
    result) is state's: ``state.reset()`` alone forgets it, and releases the execution hooks
    the converted results held and the Module patches the explicit scaler needed."""
    module_bind = mx.mod.Module.bind
    block = mx.gluon.nn.Dense(2)
    traced, kept = object(), object()
    plan_notes.record(block, "tuner", {"fc": Note("measured")})
    plan_notes.record_emulated(block, {"fc": "float16"})
    plan_notes.record_traced(block, traced, kept)
    sym = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2, name="fc")
    policy = gluon_amp.make_policy("float16", emulate=True)
    execution.remember(sym, policy)
    module = mx.mod.Module(mx.sym.SoftmaxOutput(sym, name="softmax"))
    scaler = gluon_amp.init_trainer(module)
    assert plan_notes.notes(block) == {"fc": Note("measured")}
    assert plan_notes.emulated_dtypes(block) == {"fc": "float16"}
    assert plan_notes.traced_graph(block, kept) is traced
    assert execution.policy_for(sym) is policy and execution.runs_emulated(sym)
    assert mx.sym.Symbol.bind is not mxg._BIND and mx.mod.Module.bind is not module_bind
    assert scaling.attached_scaler(module) is scaler

    state.reset()

    assert plan_notes.notes(block) == {}
    assert plan_notes.emulated_dtypes(block) is None and plan_notes.traced_graph(block, kept) is None
    assert execution.policy_for(sym) is None and not execution.runs_emulated(sym)
    assert scaling.attached_scaler(module) is None
    assert mx.sym.Symbol.bind is mxg._BIND and mx.mod.Module.bind is module_bind


def test_a_held_install_whose_removal_was_cut_short_is_removed_before_it_is_installed_again():
    """An exception (a Ctrl-C) inside ``remove`` must not leave it installed and forgotten: the
    next hold would install it over itself (Module's methods wrapped twice)."""
    events = []
    fail = [True]

    def remove(token):
        events.append(("remove", token))
        if fail[0]:
            fail[0] = False
            raise KeyboardInterrupt

    count = iter(range(1, 100))
    held = state.Held(lambda: events.append(("install", next(count))) or events[-1][1], remove)
    held.hold("a")
    with pytest.raises(KeyboardInterrupt):
        held.release("a")
    held.hold("b")
    held.release("b")
    assert events == [("install", 1), ("remove", 1), ("remove", 1), ("install", 2), ("remove", 2)]
    assert held.installed is None


def _slower_warning_site(call):
    import warnings
    state.process.said.clear()  # said once per process: each entry point says it afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    gluon_amp.disable()
    sites = [(w.filename, w.lineno) for w in caught if "as asked, though" in str(w.message)]
    assert len(sites) == 1, [str(w.message) for w in caught]
    return sites[0]


def _blocks():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(2, in_units=2))
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((1, 2)))
    return net


ENTRY_POINTS = {
    "init": lambda: gluon_amp.init(target_dtype="bfloat16", tune=False),
    "make_policy": lambda: gluon_amp.make_policy("bfloat16"),
    "initialize-O1": lambda: gluon_amp.initialize(_blocks(), None, "O1", target_dtype="bfloat16"),
    "initialize-O2": lambda: gluon_amp.initialize(_blocks(), None, "O2", target_dtype="bfloat16"),
    "autocast": lambda: gluon_amp.autocast(target_dtype="bfloat16").__enter__(),
    "convert_hybrid_block": lambda: gluon_amp.convert_hybrid_block(_blocks(), "bfloat16"),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_slower_bfloat16_asked_for_is_said_at_the_users_line(native_host, tmp_path, entry):
    """bfloat16 asked for where the probe measured it slower (the planted figures of this
    project's Xeon without AMX) warns once, naming the line that asked, through whichever
    entry point: the fixed stacklevel named policy_builder.py or opt_levels.py for all but
    make_policy."""
    from helpers import planted_probe, probe_host_items
    with planted_probe(probe_host_items("intel_xeon_no_amx"), tmp_path / "cache"):
        site = _slower_warning_site(ENTRY_POINTS[entry])
    assert site == (__file__, ENTRY_POINTS[entry].__code__.co_firstlineno)  # the lambda's call
