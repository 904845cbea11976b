"""Regions are exact and loss scaling reads per-thread facts (issue 42, items 6-8).

- A region's policy is what its ``autocast`` call says for its whole extent, whatever
  ``init``/``disable`` do in other threads meanwhile (a region equal to init's included), and
  ``disable()`` with a region open elsewhere puts the functions back when that region ends.
- A step's loss scale follows the policies in force on its own thread since its last step:
  another thread's regions never count, however many there are (no log to overflow).
"""
import threading

import mxnet as mx
import pytest
from mxnet import autograd, gluon

import gluon_amp
from gluon_amp import state
from helpers import FcDtype

_FC = FcDtype(seed=7)
_fc = _FC.probe
X = _FC.x


@pytest.fixture
def kinds():
    """Output hash -> the dtype the op ran in."""
    return _FC.kinds()


def _in_thread(body):
    """Run ``body(step)`` in a thread; ``step()`` there waits for the test to call ``go()``."""
    ready, go, done, errors = threading.Semaphore(0), threading.Semaphore(0), threading.Semaphore(0), []

    def step():
        ready.release()
        go.acquire()

    def run():
        try:
            body(step)
        except BaseException as e:  # reported in the test's thread, which must not wait for it
            errors.append(e)
            for _ in range(64):
                ready.release()
        finally:
            done.release()

    t = threading.Thread(target=run)
    t.start()

    def advance():
        go.release()

    return t, ready, advance, errors


# (init before the region, what the other thread does while it is open, in order)
OTHER = [
    ("float16", ["disable", "init bfloat16", "disable", "init float16"]),
    ("bfloat16", ["disable", "init float16"]),
    (None, ["init float16", "disable", "init bfloat16"]),
]


@pytest.mark.parametrize("before,actions", OTHER)
def test_a_region_keeps_its_policy_whatever_other_threads_init_and_disable(kinds, before, actions):
    if before is not None:
        gluon_amp.init(before, emulate=True)
    seen = []

    def body(step):
        with gluon_amp.autocast("float16", emulate=True):
            for _ in range(len(actions) + 1):
                seen.append((kinds[_fc()], gluon_amp.is_enabled(), gluon_amp.current_policy().target_dtype))
                step()

    t, ready, advance, errors = _in_thread(body)
    ready.acquire()
    for action in actions:
        if action == "disable":
            gluon_amp.disable()
        else:
            gluon_amp.init(action.split()[1], emulate=True)
        advance()
        ready.acquire()
    advance()
    t.join()
    assert not errors, errors
    assert seen == [("float16", True, "float16")] * (len(actions) + 1)
    # this thread has no region: it runs what init/disable said last
    policy = gluon_amp.current_policy()
    assert kinds[_fc()] == (policy.target_dtype if policy is not None else "float32")


def test_disable_with_a_region_open_elsewhere_restores_every_function_when_it_ends(kinds):
    code = mx.nd.FullyConnected.__code__
    inside = []

    def body(step):
        with gluon_amp.autocast("float16", emulate=True):
            step()
            inside.append(kinds[_fc()])

    t, ready, advance, errors = _in_thread(body)
    ready.acquire()
    gluon_amp.disable()  # the other thread's region still holds its policy
    assert mx.nd.FullyConnected.__code__ is not code and kinds[_fc()] == "float32"
    advance()
    t.join()
    assert not errors and inside == ["float16"]
    assert mx.nd.FullyConnected.__code__ is code and gluon_amp.patched_functions() == ()


def _trainer():
    mx.random.seed(0)
    net = gluon.nn.Dense(4, in_units=64)
    net.initialize()
    net.hybridize()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    gluon_amp.init_trainer(tr)
    return net, tr


def _other_thread(regions: int, kind):
    def serve():
        for _ in range(regions):
            with (gluon_amp.autocast(enabled=False) if kind is None else gluon_amp.autocast(kind, emulate=True)):
                pass
    t = threading.Thread(target=serve)
    t.start()
    t.join()


@pytest.mark.parametrize("regions", [1, 3000])
def test_a_float32_step_is_not_scaled_by_another_threads_float16_regions(regions):
    net, tr = _trainer()
    with autograd.record():
        with gluon_amp.autocast(enabled=False):  # this thread computes in float32
            loss = net(X).mean()
        _other_thread(regions, "float16")
        with gluon_amp.scale_loss(loss, tr) as scaled:
            used = tr._amp_loss_scaler.loss_scale
            autograd.backward(scaled)
    tr.step(4)
    assert used == 1.0


@pytest.mark.parametrize("kind", [None, "bfloat16"])
def test_a_float16_step_stays_scaled_whatever_the_regions_other_threads_open_meanwhile(kind):
    gluon_amp.init("bfloat16", emulate=True)
    used = []
    for regions in (0, 5000):
        net, tr = _trainer()
        with autograd.record():
            with gluon_amp.autocast("float16", emulate=True):
                out = net(X)
            loss = (out * 1e-6).mean()
            _other_thread(regions, kind)  # an inference thread serving requests meanwhile
            with gluon_amp.scale_loss(loss, tr) as scaled:
                used.append(tr._amp_loss_scaler.loss_scale)
                autograd.backward(scaled)
        tr.step(4)
    assert used[0] == used[1] == gluon_amp.get_scaler(tr).init_scale


@pytest.mark.parametrize("other", ["float16", "bfloat16", None])
@pytest.mark.parametrize("mine", ["float16", "bfloat16", None])
def test_each_step_is_scaled_as_its_own_threads_forward_ran_while_another_thread_sits_in_a_region(mine, other):
    """PyTorch's pattern (forward inside the region, scale_loss after it), three steps, while
    another thread holds a region of another kind open the whole time (MXNet's autograd does
    not train two threads at once, so the other thread only holds its region)."""
    def hold(step):
        with (gluon_amp.autocast(other, emulate=True) if other else gluon_amp.autocast(enabled=False)):
            step()

    t, ready, advance, errors = _in_thread(hold)
    ready.acquire()
    try:
        net, tr = _trainer()
        used = []
        for _ in range(3):
            with autograd.record():
                with (gluon_amp.autocast(mine, emulate=True) if mine else gluon_amp.autocast(enabled=False)):
                    loss = net(X).mean()
                with gluon_amp.scale_loss(loss, tr) as scaled:
                    used.append(tr._amp_loss_scaler.loss_scale)
                    autograd.backward(scaled)
            tr.step(4)
    finally:
        advance()
        t.join()
    assert not errors
    if mine == "float16":
        assert all(s > 1 for s in used), used
    else:
        assert used == [1.0] * 3


# how float16 is in force on this thread across a step: init's policy, or a region left open
_F16_SOURCES = ["init", "region"]
# what ends float16 between the next forward and its scale_loss
_F16_ENDS = {"init": ["disable", "enter bfloat16", "enter off"],
             "region": ["leave", "enter bfloat16", "enter off"]}


@pytest.mark.parametrize("source,end", [(s, e) for s in _F16_SOURCES for e in _F16_ENDS[s]])
def test_a_float16_forward_stays_scaled_when_float16_ends_before_its_scale_loss(source, end):
    """float16 was in force on the thread before the trainer's last step and still is when the
    next forward runs; the policy then changes before ``scale_loss`` (CI's state machine: init
    float16, a step, a forward, ``disable``, a step scaled by 1). The rule counts every policy in
    force since the last step, so that step is scaled."""
    import contextlib
    with contextlib.ExitStack() as stack:
        region = None
        if source == "init":
            gluon_amp.init("float16", emulate=True, tune=False)
        else:
            region = stack.enter_context(contextlib.ExitStack())
            region.enter_context(gluon_amp.autocast("float16", emulate=True, tune=False))
        net, tr = _trainer()
        used = []
        for i in range(2):
            with autograd.record():
                loss = net(X).mean()
            if i == 1:
                if end == "disable":
                    gluon_amp.disable()
                elif end == "leave":
                    region.close()
                else:
                    stack.enter_context(gluon_amp.autocast("bfloat16", emulate=True, tune=False)
                                        if end == "enter bfloat16" else gluon_amp.autocast(enabled=False))
            with autograd.record(), gluon_amp.scale_loss(loss, tr) as scaled:
                used.append(tr._amp_loss_scaler.loss_scale)
                autograd.backward(scaled)
            tr.step(4)
    gluon_amp.disable()
    assert all(s > 1 for s in used), f"float16 forwards' loss scales {used}"


def test_a_region_a_dead_thread_left_open_does_not_reach_a_thread_that_gets_its_ident():
    """A thread that ends inside a region (a generator suspended in ``autocast(enabled=False)``,
    kept alive) left it under its ident, and CPython gives idents again: the next threads
    started with AMP off."""
    gluon_amp.init("float16", emulate=True)
    kept, seen = [], []

    def leaves_one_open():
        def batches():
            with gluon_amp.autocast(enabled=False):
                yield 1
                yield 2
        g = batches()
        next(g)
        kept.append((threading.get_ident(), g))

    def looks():
        seen.append((threading.get_ident(), gluon_amp.is_enabled()))

    t = threading.Thread(target=leaves_one_open)
    t.start()
    t.join()
    assert kept and kept[0][0] not in state.regions  # the thread's end dropped its region
    for _ in range(8):  # an ident often comes back at once (not always, beside other threads)
        t = threading.Thread(target=looks)
        t.start()
        t.join()
    assert all(enabled for _, enabled in seen), seen
    kept[0][1].close()  # its region's exit, on another thread, changes nothing here
    assert gluon_amp.is_enabled()
