import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp import LossScaler
from helpers import sgd_trainer


def _mlp(seed=0, ctx=None, grad_req="write"):
    mx.random.seed(seed)
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation="relu", in_units=4), nn.Dense(2, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=ctx or mx.cpu())
    if grad_req != "write":
        net.collect_params().setattr("grad_req", grad_req)
    return net


def _params(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def _step(net, trainer, x, y, poison=None):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = loss_fn(net(x), y).mean()
        if poison == "loss":
            loss = loss * float("inf")
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    if poison == "grad":
        g = list(net.collect_params().values())[0].grad()
        g[0, 0] = float("nan")
    trainer.step(1)
    return loss


X = mx.nd.random.uniform(-1, 1, shape=(8, 4))
Y = mx.nd.array([0, 1] * 4)
#: a scaler that checks every step (static, scale 1): the default checks float16 steps only,
#: and these steps run float32
CHECKED = 1.0


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_injected_overflow_skips_exactly_that_step(poison):
    net = _mlp()
    trainer = sgd_trainer(net, lr=0.1)
    scaler = gluon_amp.init_trainer(trainer, LossScaler())  # scales every step, float32 included
    _step(net, trainer, X, Y)
    assert not scaler.last_step_skipped
    before, scale = _params(net), scaler.loss_scale
    _step(net, trainer, X, Y, poison=poison)
    assert scaler.last_step_skipped and scaler.skipped_steps == 1 and scaler.total_steps == 2
    assert scaler.loss_scale == scale / 2
    for a, b in zip(before, _params(net)):
        assert np.array_equal(a, b)  # bitwise unchanged
    _step(net, trainer, X, Y)
    assert not scaler.last_step_skipped
    assert any(not np.array_equal(a, b) for a, b in zip(before, _params(net)))


def test_unscaling_is_folded_into_rescale_and_matches_fp32():
    x, y = X, Y
    ref = _mlp(seed=3)
    ref_tr = sgd_trainer(ref, lr=0.1)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = loss_fn(ref(x), y).mean()
    loss.backward()
    ref_tr.step(1)
    net = _mlp(seed=3)
    tr = sgd_trainer(net, lr=0.1)
    gluon_amp.init_trainer(tr, LossScaler())  # scales every step, float32 included
    _step(net, tr, x, y)
    for a, b in zip(_params(ref), _params(net)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert tr._scale == ref_tr._scale  # restored after the step


def test_lr_schedule_does_not_advance_on_skipped_step():
    net = _mlp()
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5, base_lr=0.1)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"lr_scheduler": sched}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, CHECKED)
    _step(net, trainer, X, Y)
    n = trainer.optimizer.num_update
    _step(net, trainer, X, Y, poison="loss")
    assert trainer.optimizer.num_update == n
    _step(net, trainer, X, Y)
    assert trainer.optimizer.num_update == n + 1


def test_multi_context_overflow_on_either_context():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    for bad in (0, 1):
        net = _mlp(ctx=ctxs)
        trainer = sgd_trainer(net, lr=0.1)
        scaler = gluon_amp.init_trainer(trainer, CHECKED)
        xs = gluon.utils.split_and_load(X, ctxs)
        ys = gluon.utils.split_and_load(Y, ctxs)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        before = _params(net)
        with autograd.record():
            losses = [loss_fn(net(a), b).mean() for a, b in zip(xs, ys)]
            losses[bad] = losses[bad] * float("nan")
            with gluon_amp.scale_loss(losses, trainer) as scaled:
                assert isinstance(scaled, list) and len(scaled) == 2
                autograd.backward(scaled)
        trainer.step(2)
        assert scaler.last_step_skipped, f"overflow on context {bad} missed"
        for a, b in zip(before, _params(net)):
            assert np.array_equal(a, b)


def test_gradient_accumulation_with_grad_req_add():
    ref = _mlp(seed=5)
    ref_tr = sgd_trainer(ref, lr=0.1)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = loss_fn(ref(X), Y).sum()
    loss.backward()
    ref_tr.step(8)
    net = _mlp(seed=5, grad_req="add")
    tr = sgd_trainer(net, lr=0.1)
    gluon_amp.init_trainer(tr, LossScaler())  # scales every step, float32 included
    for part in (slice(0, 4), slice(4, 8)):
        with autograd.record():
            loss = loss_fn(net(X[part]), Y[part]).sum()
            with gluon_amp.scale_loss(loss, tr) as scaled:
                scaled.backward()
    tr.step(8)
    for a, b in zip(_params(ref), _params(net)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unscale_for_clipping_and_once_per_step():
    net = _mlp()
    tr = sgd_trainer(net, lr=0.1)
    scaler = gluon_amp.init_trainer(tr, LossScaler())  # scales every step, float32 included
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():
        loss = loss_fn(net(X), Y).mean()
        with gluon_amp.scale_loss(loss, tr) as scaled:
            scaled.backward()
    assert scaler.loss_scale == 2.0 ** 16
    scaled_grad = list(net.collect_params().values())[0].grad().asnumpy().copy()
    gluon_amp.unscale(tr)
    unscaled = list(net.collect_params().values())[0].grad().asnumpy()
    np.testing.assert_allclose(unscaled * scaler.loss_scale, scaled_grad, rtol=1e-6)
    with pytest.raises(RuntimeError, match="already"):
        gluon_amp.unscale(tr)
    norm = gluon_amp.clip_global_norm(tr, 1e-3)
    assert norm > 1e-3
    total = np.sqrt(sum((p.grad().asnumpy() ** 2).sum() for p in net.collect_params().values()))
    assert total == pytest.approx(1e-3, rel=1e-3)
    tr.step(1)
    gluon_amp.unscale(tr)  # allowed again after the step


def test_several_trainers_own_or_shared_scalers():
    a, b = _mlp(seed=1), _mlp(seed=2)
    ta, tb = sgd_trainer(a, lr=0.1), sgd_trainer(b, lr=0.1)
    sa, sb = gluon_amp.init_trainer(ta, CHECKED), gluon_amp.init_trainer(tb, CHECKED)
    assert sa is not sb
    _step(a, ta, X, Y, poison="loss")
    assert sa.skipped_steps == 1 and sb.skipped_steps == 0
    shared = LossScaler(init_scale=1024.0)
    c, d = _mlp(seed=3), _mlp(seed=4)
    tc, td = sgd_trainer(c, lr=0.1), sgd_trainer(d, lr=0.1)
    assert gluon_amp.init_trainer(tc, shared) is gluon_amp.init_trainer(td, shared)
    _step(c, tc, X, Y, poison="loss")
    _step(d, td, X, Y)
    assert shared.loss_scale == 512.0 and shared.total_steps == 1  # one round, one update
    assert gluon_amp.get_scaler(tc) is shared


def test_collapse_guard_names_parameters():
    net = _mlp()
    tr = sgd_trainer(net, lr=0.1)
    gluon_amp.init_trainer(tr, LossScaler(max_consecutive_skips=3))
    _step(net, tr, X, Y, poison="grad")
    _step(net, tr, X, Y, poison="grad")
    with pytest.raises(RuntimeError, match=r"3 steps in a row.*dense\d+_weight"):
        _step(net, tr, X, Y, poison="grad")


def test_static_and_disabled_loss_scale():
    net = _mlp()
    tr = sgd_trainer(net, lr=0.1)
    s = gluon_amp.init_trainer(tr, 128.0)
    _step(net, tr, X, Y, poison="loss")
    assert s.loss_scale == 128.0 and s.last_step_skipped
    net2 = _mlp()
    tr2 = sgd_trainer(net2, lr=0.1)
    s2 = gluon_amp.init_trainer(tr2, None)
    _step(net2, tr2, X, Y)
    assert s2.loss_scale == 1.0 and s2.total_steps == 1


def test_misuse_errors():
    net = _mlp()
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        gluon_amp.init_trainer(sgd_trainer(net, update_on_kvstore=True, lr=0.1))
    with pytest.raises(TypeError, match="Trainer"):
        gluon_amp.init_trainer("sgd")
    t = gluon.Trainer(net.collect_params(), "sgd")
    gluon_amp.init_trainer(t)  # update_on_kvstore=None becomes False
    assert t._kvstore_params["update_on_kvstore"] is False
    scaler = gluon_amp.get_scaler(t)
    assert gluon_amp.init_trainer(t) is scaler  # asked again as before: the scaler it has (the peer: a fresh one)
    with pytest.raises(RuntimeError, match=r"already has a loss scaler \(from loss_scale='dynamic'\).*1024"):
        gluon_amp.init_trainer(t, 1024.0)
    assert gluon_amp.init_trainer(t, scaler) is scaler  # its own scaler, passed back (per epoch)
    static = sgd_trainer(_mlp(), lr=0.1)
    assert gluon_amp.init_trainer(static, 8) is gluon_amp.init_trainer(static, np.float32(8.0))  # NumPy's too
    with pytest.raises(RuntimeError, match="already has"):
        gluon_amp.init_trainer(static, gluon_amp.LossScaler())
    with pytest.raises(ValueError, match="loss_scale"):
        gluon_amp.init_trainer(sgd_trainer(_mlp(), lr=0.1), "auto")
    plain = sgd_trainer(_mlp(), lr=0.1)
    with pytest.raises(RuntimeError, match="init_trainer"):
        with gluon_amp.scale_loss(mx.nd.ones(1), plain):
            pass
    with pytest.raises(RuntimeError, match="init_trainer"):
        gluon_amp.unscale(plain)
    with pytest.raises(ValueError, match="max_norm"):
        gluon_amp.clip_global_norm(t, -1)


@pytest.mark.parametrize("loss", [None, 2.5, {"loss": 1}, [[mx.nd.ones(1)]], [], (mx.nd.ones(1), "x")],
                         ids=["None", "float", "dict", "nested", "empty", "tuple-with-str"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scale_loss_names_a_loss_that_is_not_arrays_whatever_the_scale(loss, dtype):
    """Python's "unsupported operand type(s) for *" came out under float16 (scale 65536), and
    nothing under bfloat16 (scale 1) until backward."""
    gluon_amp.init(dtype, emulate=True)
    t = sgd_trainer(_mlp(), lr=0.1)
    gluon_amp.init_trainer(t)
    with pytest.raises(TypeError, match="scale_loss: the loss must be an NDArray"):
        with autograd.record():
            with gluon_amp.scale_loss(loss, t):
                pass
    with autograd.record():  # the trainer is as it was
        with gluon_amp.scale_loss([mx.nd.ones(1)], t) as scaled:
            assert isinstance(scaled, list) and len(scaled) == 1


@pytest.mark.parametrize("given", [list, tuple])
def test_scale_loss_over_trainers_with_several_scalers_says_how_to_share_one(given):
    """A PyTorch user with two optimizers passed both: "expects a mxnet.gluon.Trainer, got list"
    said nothing of what to do. A list is taken where its trainers share one scaler."""
    gluon_amp.init("float16", emulate=True)
    trainers = [sgd_trainer(_mlp(), lr=0.1), sgd_trainer(_mlp(), lr=0.1)]
    for t in trainers:
        gluon_amp.init_trainer(t)
    with autograd.record():
        loss = mx.nd.ones(1) * 2
        with pytest.raises(ValueError, match=r"2 trainers given have 2 loss scalers.*"
                                             r"init_trainer\(t1, loss_scale=scaler\)"):
            with gluon_amp.scale_loss(loss, given(trainers)):
                pass
    with pytest.raises(TypeError, match="takes one trainer, got a list of 2"):
        gluon_amp.unscale(list(trainers))


def _two_nets(amp, steps_of_t1=1, plain_t1=False):
    """Two networks and SGD trainers sharing one scaler (or, with ``amp`` False, FP32): one loss
    over both scaled through ``[t0, t1]``, t1 stepping every ``steps_of_t1``-th iteration (then
    ``end_round``); or, with ``plain_t1``, t0's loss scaled through t0 and t1's own loss with a
    plain ``backward``. Each net's weights after 6 iterations."""
    if amp:
        gluon_amp.init("float16", emulate=True)
    nets = [_mlp(seed=1), _mlp(seed=2)]
    trainers = [sgd_trainer(n, lr=0.05) for n in nets]
    if amp:
        scaler = gluon_amp.init_trainer(trainers[0], loss_scale=gluon_amp.LossScaler(init_scale=1024,
                                                                                       growth_interval=1))
        gluon_amp.init_trainer(trainers[1], loss_scale=scaler)
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, 4)))
    for i in range(6):
        with autograd.record():
            losses = [(nets[0](x) ** 2).mean(), (nets[1](x) ** 2).mean()]
            if not amp:
                (losses[0] if plain_t1 else losses[0] + losses[1]).backward()
            elif plain_t1:
                with gluon_amp.scale_loss(losses[0], trainers[0]) as scaled:
                    autograd.backward(scaled)
            else:
                with gluon_amp.scale_loss(losses[0] + losses[1], trainers) as scaled:
                    autograd.backward(scaled)
        if plain_t1:
            with autograd.record():
                (nets[1](x) ** 2).mean().backward()
        trainers[0].step(1)
        if i % steps_of_t1 == steps_of_t1 - 1:
            trainers[1].step(1)
        if amp and steps_of_t1 > 1:
            scaler.end_round()
    if amp:
        assert scaler.skipped_steps == 0
        gluon_amp.disable()
    return [[p.data().asnumpy() for p in n.collect_params().values()] for n in nets]  # names differ per run


@pytest.mark.parametrize("steps_of_t1, plain_t1", [(1, False), (2, False), (1, True)],
                         ids=["one-loss", "one-loss-t1-every-2nd", "t1-own-plain-backward"])
def test_a_loss_over_two_trainers_of_one_scaler_is_unscaled_for_each(steps_of_t1, plain_t1):
    """PyTorch's one GradScaler, two optimizers: ``scale_loss(loss, [t0, t1])`` and each step
    divides by the scale (growing every step here), also where t1 steps at half the rate; a
    trainer not given keeps its own plain backward (FP32's update, with the scaler's warning)."""
    ref = _two_nets(False, steps_of_t1, plain_t1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _two_nets(True, steps_of_t1, plain_t1)
    for net_ref, net_got in zip(ref, got):
        for k, (r, g) in enumerate(zip(net_ref, net_got)):
            np.testing.assert_allclose(g, r, rtol=0, atol=5e-3, err_msg=f"parameter {k}")


def _penalized(mode, skip=()):
    """docs/training.md's gradient-penalty recipe (``mode`` float16 or bfloat16, emulated), or
    its FP32 form (``mode`` None, no update at the iterations in ``skip``): the penalties, the
    final weights after 8 iterations, and the iterations the scaler skipped."""
    if mode:
        gluon_amp.init(mode, emulate=True)
    mx.random.seed(3)
    net = nn.Dense(1, in_units=4)
    net.initialize(mx.init.Xavier())
    trainer = sgd_trainer(net, lr=0.05)
    if mode:
        gluon_amp.init_trainer(trainer)
    rng = np.random.RandomState(0)
    x0, y = mx.nd.array(rng.randn(8, 4)), mx.nd.array(rng.randn(8, 1))
    penalties, skipped = [], []
    for i in range(8):
        x = x0.copy()
        x.attach_grad()
        with autograd.record():
            out = mx.nd.tanh(net(x))
            loss = mx.nd.elemwise_sub(out, y).square().mean()
            scale = 1.0
            if mode:
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    scale = trainer._amp_loss_scaler.loss_scale
                assert float((scaled / loss).asscalar()) == pytest.approx(scale)
            (g,) = autograd.grad(out, [x], head_grads=mx.nd.ones_like(out) * scale, create_graph=True,
                                 retain_graph=True)
            penalty = ((g / scale) ** 2).sum()
            total = loss + 0.1 * penalty
            if mode:
                with gluon_amp.scale_loss(total, trainer) as scaled:
                    scaled.backward()
            else:
                total.backward()
        before = gluon_amp.get_scaler(trainer).skipped_steps if mode else 0
        if i not in skip:
            trainer.step(8)
        if mode and gluon_amp.get_scaler(trainer).skipped_steps > before:
            skipped.append(i)
        penalties.append(float(penalty.asscalar()))
    gluon_amp.disable()
    return penalties, net.weight.data().asnumpy(), skipped


@pytest.mark.parametrize("mode", ["float16", "bfloat16"])
def test_the_documented_gradient_penalty_recipe_trains_as_fp32(mode):
    """PyTorch users take a penalty's gradients of the scaled loss and divide by ``inv_scale``;
    the docs gave no way to read this step's scale (``get_scaler(t).loss_scale`` is the kept
    float16 scale, also in bfloat16 steps, where the loss is not scaled)."""
    got, w, skipped = _penalized(mode)
    assert len(skipped) <= 3, skipped  # float16's first steps may overflow at 65536
    ref, ref_w, _ = _penalized(None, skip=set(skipped))  # FP32 leaving out the same updates
    np.testing.assert_allclose(got, ref, rtol=0.05)
    np.testing.assert_allclose(w, ref_w, rtol=0, atol=0.02)


def test_checkpoint_errors(tmp_path):
    net = _mlp()
    tr = sgd_trainer(net, lr=0.1)
    gluon_amp.init_trainer(tr)
    with pytest.raises(ValueError, match="no such file"):
        gluon_amp.load_states(tr, str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a gluon_amp.save_states file"):
        gluon_amp.load_states(tr, str(junk))
    # an int was taken as a file descriptor (raw OverflowError for 2**40), "" gave the
    # FileNotFoundError of gluon_amp's temporary file
    for call in (gluon_amp.save_states, gluon_amp.load_states):
        with pytest.raises(TypeError, match="the file name must be a str or os.PathLike path, got int"):
            call(tr, 2 ** 40)
        with pytest.raises(ValueError, match="is empty; give the path of a file"):
            call(tr, "")
        with pytest.raises(ValueError, match="is a directory"):
            call(tr, tmp_path)
    with pytest.raises(TypeError, match="got NoneType"):
        gluon_amp.load_states(tr, None, trusted=True)
    gluon_amp.save_states(tr, tmp_path / "as-pathlib")  # os.PathLike stays fine
    gluon_amp.load_states(tr, tmp_path / "as-pathlib")


@pytest.mark.parametrize("emulated", [None, "bfloat16", "float16"])
def test_a_skip_that_range_cannot_explain_warns_once(emulated):
    if emulated:
        gluon_amp.init(target_dtype=emulated, emulate=True)
    net = nn.Dense(2, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer, "dynamic" if emulated == "float16" else CHECKED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with autograd.record():
                loss = (net(mx.nd.ones((1, 3))) * float("inf")).sum()
                with gluon_amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(1)
    said = [w for w in caught if "the loss scale is not the cause" in str(w.message)]
    assert scaler.skipped_steps == 2
    assert len(said) == (0 if emulated == "float16" else 1)  # float16: a scale can overflow its range
    if said:
        assert (emulated or "float32") in str(said[0].message) and "dense" in str(said[0].message)


def test_a_step_while_autograd_records_says_why_and_the_next_step_works():
    """A Ctrl-C inside ``autograd.record()``'s exit leaves recording on (MXNet's scope): every
    later update then failed with MXNet's "Assigning to NDArrays that are already in a
    computational graph" (the 10-minute soak's main thread, 29,017 times). The step now says
    what happened and what to do, before the scaler counts it; then the next step works."""
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    scaler = gluon_amp.init_trainer(trainer)
    x = mx.nd.ones((2, 8))
    with autograd.record():
        loss = net(x).sum()
        with gluon_amp.scale_loss(loss, trainer) as scaled:
            scaled.backward()
    before = net.weight.data().asnumpy().copy()
    steps = scaler.state_dict()
    autograd.set_recording(True)  # what the interrupted exit leaves
    try:
        with pytest.raises(RuntimeError, match=r"set_recording\(False\)"):
            trainer.step(2)
    finally:
        autograd.set_recording(False)
    assert (net.weight.data().asnumpy() == before).all()
    assert scaler.state_dict() == steps  # not counted as a step
    trainer.step(2)
    assert not (net.weight.data().asnumpy() == before).all()


def _sparse_run(feature, scaled):
    """An Embedding with sparse gradients and a Dense, 4 SGD steps; ``scaled``: under a static
    2**10 scaler (float32: scaling is exact), else plain MXNet (clipping by MXNet's own)."""
    rng = np.random.RandomState(0)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Embedding(30, 4, sparse_grad=True), mx.gluon.nn.Dense(3, flatten=False))
    net.initialize()
    net(mx.nd.zeros((1, 5)))
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, p.shape)))
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                               update_on_kvstore=False)
    if scaled:
        gluon_amp.init_trainer(trainer, gluon_amp.LossScaler.static(2.0 ** 10))
    for step in range(4):
        x = mx.nd.array(rng.randint(0, 30, (6, 5)))
        with mx.autograd.record():
            loss = (net(x) ** 2).sum()
            if scaled:
                with gluon_amp.scale_loss(loss, trainer) as s:
                    s.backward()
            else:
                loss.backward()
        grads = [p.grad() for p in net.collect_params().values()]
        if feature == "unscale" and scaled:
            gluon_amp.unscale(trainer)
        elif feature.startswith("clip"):
            max_norm = 1.0 if feature == "clip-tight" else 1e6
            if scaled:
                gluon_amp.clip_global_norm(trainer, max_norm)
            else:
                mx.gluon.utils.clip_global_norm(grads, max_norm, check_isfinite=False)
        trainer.step(6)
    return [p.data().asnumpy() for p in net.collect_params().values()]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("feature", ["step", "unscale", "clip-loose", "clip-tight"])
def test_unscale_and_clipping_reach_sparse_gradients(feature, monkeypatch):
    """``unscale`` and ``clip_global_norm`` scaled a copy of a row_sparse gradient's values
    (``.data``), so the update after them was the loss scale times too big. A scaled run must
    end with plain MXNet's weights, the embedding's included (a power-of-two scale is exact)."""
    monkeypatch.setenv("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")
    plain = _sparse_run(feature, scaled=False)
    ours = _sparse_run(feature, scaled=True)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def _sparse_weight_run(mode, loss_scale="dynamic", steps=3, scaled=True):
    """A ``SparseEmbedding`` (a row_sparse weight, which MXNet updates on the kvstore only)
    trained with Adam under ``mode`` (None: without gluon_amp); its weight after ``steps``."""
    if mode is not None:
        gluon_amp.init(**mode)
    try:
        mx.random.seed(0)
        emb = gluon.contrib.nn.SparseEmbedding(20, 4)
        emb.initialize()
        trainer = gluon.Trainer(emb.collect_params(), "adam", {"learning_rate": 0.1})
        if mode is not None:
            gluon_amp.init_trainer(trainer, loss_scale=loss_scale)
        tokens = mx.nd.array([[1, 2], [3, 4]])
        for _ in range(steps):
            with autograd.record():
                loss = (emb(tokens) ** 2).sum()
                if mode is None or not scaled:
                    loss.backward()
                else:
                    with gluon_amp.scale_loss(loss, trainer) as scaled_loss:
                        scaled_loss.backward()
            trainer.step(2)
        return emb.weight.row_sparse_data(mx.nd.arange(20, dtype="int64")).asnumpy()
    finally:
        gluon_amp.disable()


@pytest.mark.parametrize("mode", [{}, {"target_dtype": "bfloat16", "emulate": True}, "native"],
                         ids=["amp-off", "bfloat16-emulated", "native-bfloat16"])
def test_sparse_weights_train_on_the_kvstore_as_without_amp(mode):
    """A Trainer with a row_sparse weight: init_trainer set update_on_kvstore=False, which MXNet
    refuses for sparse weights ("Cannot set update_on_kvstore=False when sparse weights are
    present") at the first step, with AMP off too (helper X). The update stays on the kvstore,
    where float32 and bfloat16 steps need no check: the weights FP32 gives."""
    want = _sparse_weight_run(None)
    if mode == "native":
        with gluon_amp.runtime.simulate_native_bf16():
            got = _sparse_weight_run({"target_dtype": "bfloat16"})
    else:
        got = _sparse_weight_run(mode)
    np.testing.assert_array_equal(got, want)


def test_sparse_weights_in_float16_are_refused_with_what_to_do_where_a_check_cannot_come_first():
    with pytest.raises(RuntimeError, match=r"sparse weights \(sparseembedding\d+_weight\).*loss_scale=None"):
        _sparse_weight_run({"target_dtype": "float16", "emulate": True})
    with pytest.raises(ValueError, match=r"sparse weights .*loss_scale=128.0 checks every step"):
        _sparse_weight_run({"target_dtype": "float16", "emulate": True}, loss_scale=128.0)
    unscaled = _sparse_weight_run({"target_dtype": "float16", "emulate": True}, loss_scale=None)
    np.testing.assert_allclose(unscaled, _sparse_weight_run(None), rtol=0, atol=2e-3)  # float16's 11 bits
    # the default scaler and a plain backward (no scale_loss): the check found list_data() refused
    # on the row_sparse weight, MXNet's RuntimeError (helper BB); the kvstore updated already
    plain = _sparse_weight_run({"target_dtype": "float16", "emulate": True}, scaled=False)
    np.testing.assert_allclose(plain, unscaled, rtol=0, atol=1e-6)
    assert not gluon_amp.is_enabled()
