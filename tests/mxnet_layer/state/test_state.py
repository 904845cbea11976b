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
