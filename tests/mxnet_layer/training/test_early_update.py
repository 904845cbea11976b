"""A step that dispatches its update before its overflow verdict (training/early_update.py).

Generated over MXNet's optimizers, dtypes and the steps a run meets (finite, inf, NaN,
huge finite values, a first step that makes the states): a run whose steps update early
ends bit for bit where the same run ends when every step waits for its verdict: weights,
optimizer states, update counts, fresh-gradient flags and the scaler. Where the undo
would not be exact (an optimizer with other Python-side state, a kvstore, sparse
gradients, too much to copy) the step waits; a step that raises anywhere in MXNet's
update leaves nothing behind.
"""
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import LossScaler
from gluon_amp import mxnet_internals as mxi
from gluon_amp.training import early_update

pytestmark = pytest.mark.filterwarnings("ignore:gluon_amp. a training step was skipped:RuntimeWarning")

#: a scaler that checks every step: float32 steps here (the default checks float16 ones only)
CHECKED = 1.0

#: what each generated run's batches hold: finite values, an inf, a NaN, values whose sum
#: of squares overflows float32 while every gradient stays finite
BATCHES = ("finite", "finite", "inf", "finite", "nan", "huge", "finite", "inf", "finite")
OPTIMIZERS = {
    "sgd": {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3},
    "sgd-plain": {"learning_rate": 0.05},
    "nag": {"learning_rate": 0.05, "momentum": 0.9},
    "adam": {"learning_rate": 0.01},
    "adagrad": {"learning_rate": 0.05},
    "rmsprop": {"learning_rate": 0.01, "centered": True},
    "adadelta": {},
    "ftrl": {"learning_rate": 0.05},
    "adamax": {"learning_rate": 0.01},
    "ftml": {"learning_rate": 0.01},
    "signum": {"learning_rate": 0.01, "momentum": 0.9},
    "lamb": {"learning_rate": 0.01},
    "sgd-scheduled": {"learning_rate": 0.05, "momentum": 0.9},  # with a FactorScheduler (stateful)
}


class _Spy:
    """Counts the steps that updated early and those that waited (``entry``: the trainer's
    ``begin`` or the Module's ``begin_module``)."""

    def __init__(self, monkeypatch, entry="begin"):
        self.early = self.waited = 0
        real = getattr(early_update, entry)

        def spied(*args):
            out = real(*args)
            if out is None:
                self.waited += 1
            else:
                self.early += 1
            return out

        monkeypatch.setattr(early_update, entry, spied)


class _Elementwise(nn.HybridBlock):
    """float16 weights on a CPU, whose float16 GEMMs do not exist: elementwise ops only."""

    def __init__(self):
        super().__init__(prefix="elementwise_")
        self.w = self.params.get("w", shape=(6,))
        self.b = self.params.get("b", shape=(6,))

    def hybrid_forward(self, F, x, w, b):
        return F.tanh(F.broadcast_add(F.broadcast_mul(x, w), b))


def _batch(kind, rng, dtype):
    x = rng.randn(4, 6).astype("float32")
    if kind == "inf":
        x[1, 2] = np.inf
    elif kind == "nan":
        x[0, 0] = np.nan
    elif kind == "huge":
        x *= 1e18  # squares overflow float32; the values and gradients do not
    return mx.nd.array(x, dtype=dtype)


class _Branch(nn.Block):
    """A second head used on some steps only: on the others its parameters get no gradient
    (``ignore_stale_grad=True`` leaves them out of the update)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Dense(5, in_units=6, activation="tanh", prefix="body_")
        self.head = nn.Dense(2, in_units=5, prefix="head_")
        self.side = nn.Dense(2, in_units=5, prefix="side_")

    def forward(self, x, use_side=False):
        h = self.body(x)
        return self.head(h) + self.side(h) if use_side else self.head(h)


#: how a step is called, as clients write it
HOW = ("step", "unscale-clip-step", "allreduce-update", "stale-branch", "accumulate-2")


def _train_step(how, trainer, net, x, i):
    """One step of ``how``: forward, scaled backward and the update calls."""
    with autograd.record():
        out = net(x, i % 2 == 0) if how == "stale-branch" else net(x)
        loss = (out.astype("float32") ** 2).mean()
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            scaled.backward()
    if how == "step":
        trainer.step(4)
    elif how == "unscale-clip-step":  # GluonNLP's: unscale, clip the global norm, update
        gluon_amp.unscale(trainer)
        grads = [p.grad() for p in net.collect_params().values() if p.grad_req != "null"]
        gluon.utils.clip_global_norm(grads, 1.0, check_isfinite=False)
        trainer.step(4)
    elif how == "allreduce-update":
        trainer.allreduce_grads()
        trainer.update(4)
    elif how == "stale-branch":
        trainer.step(4, ignore_stale_grad=True)
    elif how == "accumulate-2":  # grad_req 'add': two batches' gradients, one update
        if i % 2 == 1:
            trainer.step(8)
            for p in net.collect_params().values():
                p.zero_grad()


def _run(optimizer, early, dtype="float32", batches=BATCHES, scaler=CHECKED, monkeypatch=None, how="step"):
    """Train on ``batches``; early updates allowed or not. Everything a step may change.
    Every run's parameters have the same names: MXNet's Trainer orders them by name, and
    the update counts and states compared are by that order."""
    if not early:
        monkeypatch.setattr(early_update, "MAX_BYTES", -1)
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    if how == "stale-branch":
        net = _Branch()
    else:
        net = _Elementwise() if dtype == "float16" else nn.HybridSequential()
    if dtype != "float16" and how != "stale-branch":
        net.add(nn.Dense(5, in_units=6, activation="tanh", prefix="d1_"), nn.Dense(2, in_units=5, prefix="d2_"))
    net.initialize(mx.init.Xavier() if dtype != "float16" else mx.init.Uniform(1.0))
    if how == "accumulate-2":
        for p in net.collect_params().values():
            p.grad_req = "add"
    net.cast(dtype)
    params = dict(OPTIMIZERS[optimizer])
    name = optimizer.split("-")[0]
    if dtype == "float16":
        params["multi_precision"] = True
    if optimizer == "sgd-scheduled":
        params["lr_scheduler"] = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)
    trainer = gluon.Trainer(net.collect_params(), name, params, update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer, scaler)
    for i, kind in enumerate(batches):
        _train_step(how, trainer, net, _batch(kind, rng, dtype), i)
    monkeypatch.undo()
    states = []
    for index, state in sorted(trainer._updaters[0].states.items()):
        leaves = []
        early_update._leaves(state, leaves)
        states += [a.asnumpy() for a in leaves]
    opt = trainer._optimizer
    return {
        "weights": [p.data().asnumpy() for p in net.collect_params().values()],
        "states": states,
        "counts": mxi.optimizer_counters(opt),
        "fresh": [mxi.fresh_grad(p.data()) for p in net.collect_params().values()],
        "scaler": scaler.state_dict(),
    }


def _same(a, b):
    assert a["scaler"] == b["scaler"]
    assert a["counts"] == b["counts"]
    assert a["fresh"] == b["fresh"]
    assert len(a["weights"]) == len(b["weights"]) and len(a["states"]) == len(b["states"])
    for x, y in zip(a["weights"] + a["states"], b["weights"] + b["states"]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_an_early_run_ends_bit_for_bit_where_a_waiting_run_ends(optimizer, monkeypatch):
    spy = _Spy(monkeypatch)
    early = _run(optimizer, True, monkeypatch=monkeypatch)
    assert spy.early == len(BATCHES) - 1 and spy.waited == 1  # the first step makes the states
    spy = _Spy(monkeypatch)
    waiting = _run(optimizer, False, monkeypatch=monkeypatch)
    assert spy.early == 0
    _same(early, waiting)
    assert early["scaler"]["skipped_steps"] == 3  # inf, nan, inf; the huge batch updates
    assert all(np.isfinite(w).all() for w in early["weights"] + early["states"])


@pytest.mark.parametrize("how", HOW[1:])
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "lamb"])
def test_each_way_of_calling_a_step_updates_early_and_ends_where_waiting_ends(optimizer, how, monkeypatch):
    """Unscale and clip before the step (GluonNLP's), ``allreduce_grads`` + ``update``,
    ``ignore_stale_grad`` with a head used on alternate steps, and accumulated gradients."""
    spy = _Spy(monkeypatch)
    early = _run(optimizer, True, monkeypatch=monkeypatch, how=how)
    assert spy.early >= 2, (spy.early, spy.waited)
    spy = _Spy(monkeypatch)
    waiting = _run(optimizer, False, monkeypatch=monkeypatch, how=how)
    assert spy.early == 0
    _same(early, waiting)
    assert early["scaler"]["skipped_steps"] >= 1
    assert all(np.isfinite(w).all() for w in early["weights"] + early["states"])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("scaler", ["dynamic", "static"])
def test_float16_weights_with_master_copies_and_a_scaled_loss_update_early_alike(optimizer, scaler, monkeypatch):
    """float16 gradients are not summed: they take the value-by-value check."""
    chosen = LossScaler(init_scale=2.0 ** 12, growth_interval=2) if scaler == "dynamic" else 128.0
    spy = _Spy(monkeypatch)
    early = _run(optimizer, True, dtype="float16", scaler=chosen, monkeypatch=monkeypatch)
    assert spy.early == len(BATCHES) - 1
    chosen = LossScaler(init_scale=2.0 ** 12, growth_interval=2) if scaler == "dynamic" else 128.0
    waiting = _run(optimizer, False, dtype="float16", scaler=chosen, monkeypatch=monkeypatch)
    _same(early, waiting)


@pytest.mark.parametrize("case", ["nadam", "too-big", "sparse", "first-step"])
def test_where_an_update_cannot_be_undone_exactly_the_step_waits_for_its_verdict(case, monkeypatch):
    spy = _Spy(monkeypatch)
    if case == "too-big":
        monkeypatch.setattr(early_update, "MAX_BYTES", 100)
    mx.random.seed(0)
    if case == "sparse":
        net = nn.Embedding(10, 4, sparse_grad=True)
        x = mx.nd.array([[1, 2], [3, 4]])
    else:
        net = nn.Dense(3, in_units=4)
        x = mx.nd.ones((2, 4))
    net.initialize()
    ctx = [mx.cpu(0), mx.cpu(1)] if case == "kvstore" else [mx.cpu(0)]
    if case == "kvstore":
        net.collect_params().reset_ctx(ctx)
    trainer = gluon.Trainer(net.collect_params(), "nadam" if case == "nadam" else "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9} if case != "nadam" else {"learning_rate": 0.1},
                            kvstore="device" if case == "kvstore" else None, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, CHECKED)
    steps = 1 if case == "first-step" else 3
    for i in range(steps):
        losses = []
        with autograd.record():
            for c in ctx:
                out = net(x.as_in_context(c))
                losses.append((out * (np.inf if i == steps - 1 else 1)).sum())
        with gluon_amp.scale_loss(losses, trainer) as scaled:
            autograd.backward(scaled)
        before = [p.data().asnumpy() for p in net.collect_params().values()]
        trainer.step(2)
    assert spy.early == 0 and spy.waited == steps
    assert gluon_amp.get_scaler(trainer).skipped_steps == 1
    for a, p in zip(before, net.collect_params().values()):
        np.testing.assert_array_equal(a, p.data().asnumpy())  # the last, inf, step was skipped


@pytest.mark.parametrize("fault", [KeyboardInterrupt, ValueError])
@pytest.mark.parametrize("at_update", [1, 2])
def test_a_step_that_raises_inside_mxnets_update_leaves_nothing_behind(fault, at_update, monkeypatch):
    """MXNet's own code is not gluon_amp's: a fault there, after the early dispatch (in the
    second of two aggregated updates, or the first), undoes the updates already made."""
    monkeypatch.setenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", "1")  # one update call per parameter
    mx.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3), nn.Dense(2, in_units=4))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1}, update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer, CHECKED)
    x = mx.nd.ones((2, 3))

    def step():
        with autograd.record():
            loss = net(x).sum()
            with gluon_amp.scale_loss(loss, trainer) as s:
                s.backward()
        trainer.step(2)

    step()
    step()
    opt = trainer._optimizer
    real, calls = type(opt).update_multi_precision, []

    def failing(self, index, weight, grad, state):
        calls.append(index)
        if len(calls) == at_update:
            raise fault("injected in MXNet's update")
        return real(self, index, weight, grad, state)

    before = [p.data().asnumpy() for p in net.collect_params().values()]
    states = [s.asnumpy() for st in trainer._updaters[0].states.values() for s in st]
    counts, total = mxi.optimizer_counters(opt), scaler.total_steps
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(type(opt), "update_multi_precision", failing)
    with pytest.raises(fault):
        step()
    monkeypatch.setattr(type(opt), "update_multi_precision", real)
    assert spy.early == 1
    for a, p in zip(before, net.collect_params().values()):
        np.testing.assert_array_equal(a, p.data().asnumpy())
    for a, b in zip(states, [s.asnumpy() for st in trainer._updaters[0].states.values() for s in st]):
        np.testing.assert_array_equal(a, b)
    assert mxi.optimizer_counters(opt) == counts and scaler.total_steps == total
    step()  # the run goes on
    assert scaler.total_steps == total + 1


def test_a_hook_called_outside_a_step_never_leaves_an_early_update_pending(monkeypatch):
    """Code that calls the peer's ``has_overflow`` itself (not through ``Trainer._update``)
    gets the waiting check: nothing is dispatched that no one would finish."""
    net = nn.Dense(2, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, CHECKED)
    for _ in range(2):
        with autograd.record():
            loss = net(mx.nd.ones((1, 3))).sum()
        loss.backward()
        trainer.step(1)
    spy = _Spy(monkeypatch)
    with autograd.record():
        loss = (net(mx.nd.ones((1, 3))) * np.inf).sum()
    loss.backward()
    hook = trainer._amp_loss_scaler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hook.has_overflow(trainer._params) is True
    assert spy.early == 0 and hook._early is None


def test_a_skipped_early_step_spends_its_gradients_as_a_waiting_one_does(monkeypatch):
    """MXNet marks a gradient used once its update runs; a skipped step marks them so too
    (an early one after putting back what its update changed), so a gradient no later backward
    writes is not read again (tests/mxnet_layer/training/test_stale_gradients.py)."""
    ends_skipped = BATCHES[:3]
    assert ends_skipped[-1] == "inf"
    early = _run("sgd", True, batches=ends_skipped, monkeypatch=monkeypatch)
    waiting = _run("sgd", False, batches=ends_skipped, monkeypatch=monkeypatch)
    _same(early, waiting)
    assert early["fresh"] == [False] * len(early["fresh"])


def _conv_run(early, monkeypatch):
    """A convolutional net evaluated between its training steps: oneDNN reorders weights
    for inference in place, the arrays the copies must follow."""
    if not early:
        monkeypatch.setattr(early_update, "MAX_BYTES", -1)
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, in_channels=2, activation="relu"), nn.Conv2D(3, 3, in_channels=4), nn.Dense(2))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                            update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer, CHECKED)
    evaluated = []
    for kind in ("finite", "finite", "inf", "finite", "inf", "finite"):
        x = mx.nd.array(rng.randn(2, 2, 8, 8))
        if kind == "inf":
            x[0, 0, 0, 0] = np.inf
        with autograd.record():
            loss = (net(x) ** 2).mean()
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                scaled.backward()
        trainer.step(2)
        evaluated.append(net(mx.nd.ones((1, 2, 8, 8))).asnumpy())  # inference: not recorded
    monkeypatch.undo()
    return [p.data().asnumpy() for p in net.collect_params().values()], evaluated, scaler.state_dict()


def test_weights_that_inference_reordered_in_place_are_copied_and_put_back_exactly(monkeypatch):
    spy = _Spy(monkeypatch)
    early = _conv_run(True, monkeypatch)
    assert spy.early == 5
    waiting = _conv_run(False, monkeypatch)
    assert early[2] == waiting[2] and early[2]["skipped_steps"] == 2
    for a, b in zip(early[0] + early[1], waiting[0] + waiting[1]):
        np.testing.assert_array_equal(a, b)


# -- mx.mod.Module: the same undo, keyed by _update_params' indices -------------------------

def _module_run(optimizer, early, monkeypatch, contexts=1, batches=BATCHES, fault_at=None):
    if not early:
        monkeypatch.setattr(early_update, "MAX_BYTES", -1)
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    data = mx.sym.var("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=5, name="fc1"), act_type="tanh")
    out = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(h, num_hidden=2, name="fc2"), name="lro")
    ctx = [mx.cpu(k) for k in range(contexts)]
    mod = mx.mod.Module(out, data_names=["data"], label_names=["lro_label"], context=ctx)
    mod.bind(data_shapes=[("data", (4, 6))], label_shapes=[("lro_label", (4, 2))])
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer=optimizer.split("-")[0], optimizer_params=dict(OPTIMIZERS[optimizer]))
    scaler = gluon_amp.init_trainer(mod, CHECKED)
    for n, kind in enumerate(batches):
        batch = mx.io.DataBatch([_batch(kind, rng, "float32")], [mx.nd.array(rng.randn(4, 2))])
        mod.forward_backward(batch)
        if fault_at is not None and n == len(batches) - 1:
            fault_at(mod)
        mod.update()
    monkeypatch.undo()
    args, _ = mod.get_params()
    states = []
    for index, state in sorted(mxi.module.module_updater(mod).states.items()):
        early_update._leaves(state, states)
    return {"weights": [args[k].asnumpy() for k in sorted(args)], "states": [s.asnumpy() for s in states],
            "counts": mxi.optimizer_counters(mod._optimizer), "scaler": scaler.state_dict(), "fresh": []}


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop", "sgd-scheduled"])
def test_a_modules_early_run_ends_bit_for_bit_where_a_waiting_run_ends(optimizer, monkeypatch):
    spy = _Spy(monkeypatch, "begin_module")
    early = _module_run(optimizer, True, monkeypatch)
    assert spy.early == len(BATCHES) - 1 and spy.waited == 1
    waiting = _module_run(optimizer, False, monkeypatch)
    _same(early, waiting)
    assert early["scaler"]["skipped_steps"] == 3


def _bucketing_run(early, monkeypatch):
    """A BucketingModule whose buckets (sequence lengths 3 and 5) share their parameters,
    switching bucket at every batch, as MXNet's lstm_bucketing example does."""
    if not early:
        monkeypatch.setattr(early_update, "MAX_BYTES", -1)
    mx.random.seed(0)
    rng = np.random.RandomState(0)

    def sym_gen(length):
        data = mx.sym.var("data")
        pooled = mx.sym.sum(data, axis=1)  # (batch, length, 6) -> (batch, 6)
        h = mx.sym.Activation(mx.sym.FullyConnected(pooled, num_hidden=5, name="fc1"), act_type="tanh")
        out = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(h, num_hidden=2, name="fc2"), name="lro")
        return out, ("data",), ("lro_label",)

    mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=5, context=mx.cpu())
    mod.bind(data_shapes=[("data", (4, 5, 6))], label_shapes=[("lro_label", (4, 2))])
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer="sgd", optimizer_params=dict(OPTIMIZERS["sgd"]))
    scaler = gluon_amp.init_trainer(mod, CHECKED)
    for n, kind in enumerate(BATCHES):
        length = 3 if n % 2 else 5
        x = np.concatenate([_batch(kind, rng, "float32").asnumpy()[:, None, :]] * length, axis=1)
        batch = mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(rng.randn(4, 2))], bucket_key=length,
                                provide_data=[("data", (4, length, 6))], provide_label=[("lro_label", (4, 2))])
        mod.forward_backward(batch)
        mod.update()
    monkeypatch.undo()
    args, _ = mod.get_params()
    states = []
    for index, state in sorted(mxi.module.module_updater(mod._curr_module).states.items()):
        early_update._leaves(state, states)
    return {"weights": [args[k].asnumpy() for k in sorted(args)], "states": [s.asnumpy() for s in states],
            "counts": mxi.optimizer_counters(mod._curr_module._optimizer), "scaler": scaler.state_dict(),
            "fresh": []}


@pytest.mark.parametrize("kept", [early_update.PLANS_KEPT, 1])
def test_a_bucketing_module_switching_buckets_updates_early_and_ends_where_waiting_ends(kept, monkeypatch):
    """Each bucket's plan (and copies) is built once while kept; with one kept, at every
    switch, and the run still ends where waiting ends."""
    built = []
    real = early_update.Plan.__init__

    def counting(self, *args):
        built.append(1)
        real(self, *args)

    monkeypatch.setattr(early_update.Plan, "__init__", counting)
    monkeypatch.setattr(early_update, "PLANS_KEPT", kept)
    spy = _Spy(monkeypatch, "begin_module")
    early = _bucketing_run(True, monkeypatch)
    assert spy.early >= len(BATCHES) - 2, (spy.early, spy.waited)
    assert len(built) == (2 if kept > 1 else len(BATCHES) - 1)  # two buckets; the first step makes the states
    waiting = _bucketing_run(False, monkeypatch)
    _same(early, waiting)
    assert early["scaler"]["skipped_steps"] == 3


def test_a_module_on_a_kvstore_waits_for_its_verdict(monkeypatch):
    """Two contexts: the Module makes a local kvstore, through which the update goes."""
    spy = _Spy(monkeypatch, "begin_module")
    early = _module_run("sgd", True, monkeypatch, contexts=2)
    assert spy.early == 0
    waiting = _module_run("sgd", False, monkeypatch, contexts=2)
    _same(early, waiting)


@pytest.mark.parametrize("fault", [KeyboardInterrupt, ValueError])
def test_a_module_step_that_raises_inside_mxnets_update_leaves_nothing_behind(fault, monkeypatch):
    monkeypatch.setenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", "1")  # one update call per parameter
    seen = {}

    def plant(mod):
        opt = mod._optimizer
        real, calls = type(opt).update_multi_precision, []

        def failing(self, index, weight, grad, state):
            calls.append(index)
            if len(calls) == 2:
                raise fault("injected in MXNet's update")
            return real(self, index, weight, grad, state)

        seen["before"] = [a.asnumpy() for a in mxi.module.module_update_arrays(mod)[0]]
        seen["counts"], seen["steps"] = mxi.optimizer_counters(opt), gluon_amp.get_scaler(mod).total_steps
        monkeypatch.setattr(type(opt), "update_multi_precision", failing)
        try:
            mod.update()
        except fault:
            seen["after"] = [a.asnumpy() for a in mxi.module.module_update_arrays(mod)[0]]
            seen["after_counts"] = mxi.optimizer_counters(opt)
            seen["after_steps"] = gluon_amp.get_scaler(mod).total_steps
            seen["calls"] = len(calls)
        monkeypatch.setattr(type(opt), "update_multi_precision", real)

    spy = _Spy(monkeypatch, "begin_module")
    _module_run("adam", True, monkeypatch, batches=("finite", "finite", "finite"), fault_at=plant)
    assert spy.early == 3 and seen["calls"] == 2  # the planted step went early, and failed in MXNet's loop
    for a, b in zip(seen["before"], seen["after"]):
        np.testing.assert_array_equal(a, b)
    assert seen["after_counts"] == seen["counts"] and seen["after_steps"] == seen["steps"]


@pytest.mark.parametrize("kvstore", [None, "device"])
def test_two_contexts_without_a_dist_kvstore_update_early_and_end_where_waiting_ends(kvstore, monkeypatch):
    """``kvstore=None``: an updater, states and weights per context. A ``device`` kvstore sums
    the contexts' gradients before the update (Sockeye's trainer passes one even on a single
    device): the verdict is still this process's."""
    def run(early):
        if not early:
            monkeypatch.setattr(early_update, "MAX_BYTES", -1)
        mx.random.seed(0)
        ctx = [mx.cpu(0), mx.cpu(1)]
        net = nn.Dense(3, in_units=4)
        net.initialize(mx.init.Xavier(), ctx=ctx)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                kvstore=kvstore, update_on_kvstore=False)
        scaler = gluon_amp.init_trainer(trainer, CHECKED)
        for i in range(5):
            with autograd.record():
                losses = [(net(mx.nd.ones((2, 4), ctx=c) * (k + 1)) * (np.inf if i == 2 and k == 1 else 1)).sum()
                          for k, c in enumerate(ctx)]
            with gluon_amp.scale_loss(losses, trainer) as scaled:
                autograd.backward(scaled)
            trainer.step(4)
        assert (trainer._kvstore is None) == (kvstore is None)
        monkeypatch.undo()
        return ([a.asnumpy() for p in net.collect_params().values() for a in p.list_data()],
                [s.asnumpy() for u in trainer._updaters for s in u.states.values()],
                scaler.state_dict())

    spy = _Spy(monkeypatch)
    early = run(True)
    assert spy.early == 4
    waiting = run(False)
    assert early[2] == waiting[2] and early[2]["skipped_steps"] == 1
    for a, b in zip(early[0] + early[1], waiting[0] + waiting[1]):
        np.testing.assert_array_equal(a, b)


class _TwoHeads(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.body = nn.Dense(8, in_units=10, activation="tanh")
            self.head_b, self.head_c = nn.Dense(3, in_units=8), nn.Dense(3, in_units=8)

    def hybrid_forward(self, F, x, use_c=0):
        return (self.head_c if use_c else self.head_b)(self.body(x))


def _stale_then_ignored(optimizer, scaled):
    """A step MXNet refuses (head_c's gradient is stale), then a batch through head_c only
    stepped with ``ignore_stale_grad=True``: the parameters after it."""
    rng = np.random.RandomState(1)
    net = _TwoHeads()
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.randn(*p.shape) * 0.3))
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.01}, update_on_kvstore=False)
    if scaled:
        gluon_amp.init_trainer(trainer, CHECKED)
    x, y = rng.randn(4, 16, 10), rng.randint(0, 3, (4, 16))

    def backward(k, use_c):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(mx.nd.array(x[k]), use_c), mx.nd.array(y[k])).mean()
            if scaled:
                with gluon_amp.scale_loss(loss, trainer) as s:
                    s.backward()
            else:
                loss.backward()

    backward(0, 1)
    trainer.step(16, ignore_stale_grad=True)
    backward(1, 0)
    trainer.step(16, ignore_stale_grad=True)
    backward(2, 0)
    with pytest.raises(UserWarning, match="has not been updated by backward"):
        trainer.step(16)
    backward(3, 1)
    trainer.step(16, ignore_stale_grad=True)
    return [(p.shape, p.data().asnumpy()) for p in net.collect_params().values()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_step_mxnet_refuses_for_a_stale_gradient_spends_the_gradients_it_passed(optimizer, monkeypatch):
    """MXNet's loop clears the fresh flag of each gradient before the stale one, then raises:
    without AMP those gradients are spent. The early step's undo set them fresh again, so the
    next ``step(ignore_stale_grad=True)`` applied head_b's old gradient on a batch that never
    reached head_b."""
    spy = _Spy(monkeypatch)
    mine, plain = _stale_then_ignored(optimizer, True), _stale_then_ignored(optimizer, False)
    assert spy.early >= 1  # the refused step (those leaving a stale parameter out wait for their verdict)
    assert [shape for shape, _ in mine] == [shape for shape, _ in plain]
    for (_, a), (_, b) in zip(mine, plain):
        np.testing.assert_array_equal(a, b)
