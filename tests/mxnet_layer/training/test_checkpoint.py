"""Checkpoints: nothing in a file runs on load, saves are atomic, resume is bitwise exact."""
import io
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gluon_amp
from gluon_amp.training import checkpoint

from helpers import ROOT


class Scale(nn.HybridBlock):
    """y = x * w + b: element-wise only, so float16 weights (O2/O3) run on any CPU."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.w = self.params.get("w", shape=(8,), init=mx.init.Uniform(1.0))
            self.b = self.params.get("b", shape=(8,), init=mx.init.Zero())

    def hybrid_forward(self, F, x, w, b):
        return F.broadcast_add(F.broadcast_mul(x, w), b)


def _setup(optimizer, seed, level=None, scaler=None):
    mx.random.seed(seed)
    net = Scale()
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), optimizer,
                            {"learning_rate": 0.05, **({"momentum": 0.9} if optimizer == "sgd" else {})},
                            update_on_kvstore=False)
    if level:
        gluon_amp.initialize(net, trainer, level, target_dtype="float16", loss_scale=scaler or "dynamic")
    else:
        gluon_amp.init_trainer(trainer, scaler or "dynamic")
    return net, trainer


def _data(n=64):
    rng = np.random.RandomState(0)
    return mx.nd.array(rng.normal(size=(n, 8))), mx.nd.array(rng.normal(size=(n, 8)))


def _fit(net, trainer, steps, start=0):
    x, y = _data()
    loss_fn = gluon.loss.L2Loss()
    for i in range(start, start + steps):
        xb, yb = x[(i * 8) % 64:(i * 8) % 64 + 8], y[(i * 8) % 64:(i * 8) % 64 + 8]
        with autograd.record():
            loss = loss_fn(net(xb), yb)
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(8)


def _weights(net):
    return {k[len(net.prefix):]: v.data().asnumpy() for k, v in net.collect_params().items()}


def _resume_matches(tmp_path, optimizer, level=None):
    straight, tr = _setup(optimizer, 1, level)
    _fit(straight, tr, 8)
    first, tr1 = _setup(optimizer, 1, level)
    _fit(first, tr1, 4)
    first.save_parameters(str(tmp_path / "p.params"))
    gluon_amp.save_states(tr1, str(tmp_path / "t.states"))
    second, tr2 = _setup(optimizer, 7, level)  # another init: everything must come from the files
    second.load_parameters(str(tmp_path / "p.params"))
    gluon_amp.load_states(tr2, str(tmp_path / "t.states"))
    _fit(second, tr2, 4, start=4)
    want, got = _weights(straight), _weights(second)
    assert all(np.array_equal(want[k], got[k]) for k in want), optimizer
    assert gluon_amp.get_scaler(tr).state_dict() == gluon_amp.get_scaler(tr2).state_dict()
    assert tr._optimizer.num_update == tr2._optimizer.num_update


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_is_bitwise_exact(tmp_path, optimizer):
    _resume_matches(tmp_path, optimizer)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_resume_with_low_precision_weights_and_master_copies_is_bitwise_exact(tmp_path, level):
    _resume_matches(tmp_path, "sgd", level)
    with zipfile.ZipFile(tmp_path / "t.states") as z:
        meta = z.read("meta.json").decode()
    assert f'"opt_level": "{level}"' in meta and '"target_dtype": "float16"' in meta


def test_shared_scaler_and_two_trainers_resume_exactly(tmp_path):
    def run(seed, steps, start=0, load=False):
        scaler = gluon_amp.LossScaler(init_scale=2.0 ** 10, growth_interval=3)
        a, ta = _setup("sgd", seed, scaler=scaler)
        b, tb = _setup("sgd", seed + 1, scaler=scaler)
        if load:
            for n, t, tag in ((a, ta, "a"), (b, tb, "b")):
                n.load_parameters(str(tmp_path / f"{tag}.params"))
                gluon_amp.load_states(t, str(tmp_path / f"{tag}.states"))
        for i in range(start, start + steps):
            _fit(a, ta, 1, start=i)
            _fit(b, tb, 1, start=i)
        return a, ta, b, tb, scaler

    a, _, b, _, scaler = run(1, 6)
    a1, ta1, b1, tb1, _ = run(1, 3)
    for n, t, tag in ((a1, ta1, "a"), (b1, tb1, "b")):
        n.save_parameters(str(tmp_path / f"{tag}.params"))
        gluon_amp.save_states(t, str(tmp_path / f"{tag}.states"))
    a2, _, b2, _, scaler2 = run(50, 3, start=3, load=True)
    assert scaler.state_dict() == scaler2.state_dict() and scaler.loss_scale > 2.0 ** 10
    for want, got in ((a, a2), (b, b2)):
        assert all(np.array_equal(x, y) for x, y in zip(_weights(want).values(), _weights(got).values()))


class _Evil:
    """Unpickling this creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _trainer():
    return _setup("sgd", 1)[1]


def test_a_payload_at_the_top_level_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.states"
    evil.write_bytes(pickle.dumps({"format": checkpoint.OLD_FORMAT, "x": _Evil(str(marker))}))
    with pytest.raises(ValueError, match="refused to load"):
        gluon_amp.load_states(_trainer(), str(evil))
    assert not marker.exists()


def test_a_payload_in_place_of_the_optimizer_blob_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.states"
    evil.write_bytes(pickle.dumps({"format": checkpoint.OLD_FORMAT, "trainer": pickle.dumps(_Evil(str(marker))),
                                   "scaler": {}}))
    with pytest.raises(ValueError, match="trusted=True.*upgrade"):
        gluon_amp.load_states(_trainer(), str(evil))
    assert not marker.exists()
    # the new format cannot carry one either: an object array member is refused by NumPy
    good = tmp_path / "good.states"
    net, tr = _setup("sgd", 1)
    _fit(net, tr, 1)
    gluon_amp.save_states(tr, str(good))
    bad = tmp_path / "bad.states"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name.startswith("arrays/"):
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.array([_Evil(str(marker))], dtype=object), allow_pickle=True)
                data = buf.getvalue()
            zout.writestr(name, data)
    with pytest.raises(ValueError, match="pickle"):
        gluon_amp.load_states(_trainer(), str(bad))
    assert not marker.exists()


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    net, tr = _setup("sgd", 1)
    _fit(net, tr, 2)
    path = tmp_path / "t.states"
    gluon_amp.save_states(tr, str(path))
    before = path.read_bytes()
    _fit(net, tr, 2, start=2)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return np.lib.format.__dict__["_real_write_array"](*args, **kwargs)

    np.lib.format._real_write_array = np.lib.format.write_array
    monkeypatch.setattr(np.lib.format, "write_array", broken)
    with pytest.raises(OSError, match="disk full"):
        gluon_amp.save_states(tr, str(path))
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["t.states"]
    gluon_amp.load_states(_trainer(), str(path))  # still loads


def _old_file(trainer, path):
    """A file as gluon_amp wrote it before this format: a pickle around MXNet's blob."""
    trainer.save_states(str(path) + ".mx")
    with open(str(path) + ".mx", "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        pickle.dump({"format": checkpoint.OLD_FORMAT, "trainer": blob,
                     "scaler": gluon_amp.get_scaler(trainer).state_dict()}, f)


def test_a_trusted_old_file_gets_every_check_a_current_file_gets(tmp_path):
    """``trusted=True`` handed the pickle to MXNet's ``trainer.load_states``: an SGD file made an
    Adam trainer SGD, another model's states loaded and failed at the next step; and files that
    are no old checkpoint gave raw pickle errors, not the ``ValueError`` the API names."""
    net, tr = _setup("sgd", 1)
    _fit(net, tr, 2)
    old = tmp_path / "old.states"
    _old_file(tr, old)
    adam = _setup("adam", 1)[1]
    with pytest.raises(checkpoint.CheckpointError, match="saved with optimizer 'SGD', this trainer has 'Adam'"):
        gluon_amp.load_states(adam, str(old), trusted=True)
    assert type(adam._optimizer).__name__ == "Adam"
    current = tmp_path / "current.states"
    gluon_amp.save_states(tr, str(current))
    for path, match in ((current, "current format already.*without trusted=True"),
                        (tmp_path / "junk", "not a gluon_amp.save_states file")):
        if path.name == "junk":
            path.write_bytes(b"\x80\x04junk")
        with pytest.raises(checkpoint.CheckpointError, match=match):
            checkpoint.upgrade(str(path), str(tmp_path / "new.states"))
    with pytest.raises(ValueError, match="not a gluon_amp.save_states file"):
        gluon_amp.load_states(_trainer(), str(tmp_path / "junk"), trusted=True)


def test_an_old_o2_file_unpickles_at_the_module_its_class_moved_to_and_keeps_its_mode(tmp_path, monkeypatch):
    """Old O2 files pickled ``MasterState`` from ``gluon_amp.master_weights`` (now
    ``gluon_amp.training.master_weights``): "No module named ...; the file is damaged". One
    that unpickled loaded into an O1 trainer without the mode's check (the upgrade recorded
    none) and failed at the next step with MXNet's "Positional arguments must have NDArray type"."""
    import types
    from gluon_amp.training.master_weights import MasterState
    old_module = types.ModuleType("gluon_amp.master_weights")

    class OldMasterState(MasterState):
        pass
    OldMasterState.__module__, OldMasterState.__qualname__ = old_module.__name__, "MasterState"
    old_module.MasterState = OldMasterState
    monkeypatch.setitem(sys.modules, old_module.__name__, old_module)
    net, tr = _setup("sgd", 1)
    _fit(net, tr, 2)
    states = {i: OldMasterState(mx.nd.ones((2,)), None) for i in range(2)}
    blob = pickle.dumps((states, tr._optimizer))
    monkeypatch.delitem(sys.modules, old_module.__name__)
    old = tmp_path / "old_o2.states"
    with open(old, "wb") as f:
        pickle.dump({"format": checkpoint.OLD_FORMAT, "trainer": blob,
                     "scaler": gluon_amp.get_scaler(tr).state_dict()}, f)
    checkpoint.upgrade(str(old), str(tmp_path / "new.states"))
    assert type(checkpoint.read(str(tmp_path / "new.states")).states(mx.cpu())[0]) is MasterState
    with pytest.raises(checkpoint.CheckpointError, match="saved with float32 master weights"):
        gluon_amp.load_states(_trainer(), str(old), trusted=True)


def test_old_files_are_refused_unless_trusted_and_can_be_upgraded(tmp_path):
    net, tr = _setup("sgd", 1)
    _fit(net, tr, 3)
    old = tmp_path / "old.states"
    _old_file(tr, old)
    with pytest.raises(ValueError, match="trusted=True.*python -m gluon_amp.training.checkpoint upgrade"):
        gluon_amp.load_states(_trainer(), str(old))
    trusted = _trainer()
    gluon_amp.load_states(trusted, str(old), trusted=True)
    assert gluon_amp.get_scaler(trusted).state_dict() == gluon_amp.get_scaler(tr).state_dict()
    new = tmp_path / "new.states"
    r = subprocess.run([sys.executable, "-m", "gluon_amp.training.checkpoint", "upgrade", str(old), str(new)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr  # runpy's, once: the module ran twice
    upgraded = _trainer()
    gluon_amp.load_states(upgraded, str(new))
    want = {k: v[0].asnumpy() if isinstance(v, tuple) else v.asnumpy()
            for k, v in tr._updaters[0].states.items()}
    got = upgraded._updaters[0].states
    assert all(np.array_equal(want[k], (got[k][0] if isinstance(got[k], tuple) else got[k]).asnumpy()) for k in want)
    assert upgraded._optimizer.num_update == tr._optimizer.num_update


def test_plain_trainer_files_point_to_trainer_load_states(tmp_path):
    tr = _trainer()
    tr.save_states(str(tmp_path / "plain.states"))
    with pytest.raises(ValueError, match="trainer.load_states"):
        gluon_amp.load_states(_trainer(), str(tmp_path / "plain.states"))


def _built_at(counters, units):
    """A two-layer net whose Dense blocks are named as Gluon's counter names them when it
    stands at ``counters`` (another process, or more blocks built before this one)."""
    mx.random.seed(7)
    net = nn.HybridSequential(prefix="model_")
    with net.name_scope():
        for c, (u, i) in zip(counters, units):
            net.add(nn.Dense(u, in_units=i, prefix=f"dense{c}_"))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer)
    return net, trainer


def _train(net, trainer, steps, uneven=False):
    rng = np.random.RandomState(3)
    for k in range(steps):
        with autograd.record():
            loss = net(mx.nd.array(rng.rand(4, 12))).square().mean()
        with gluon_amp.scale_loss(loss, trainer) as s:
            s.backward()
        if uneven and k == 0:  # the first layer's bias misses a step: its Adam update count differs
            list(net.collect_params().values())[1].list_data()[0]._fresh_grad = False
            trainer.step(4, ignore_stale_grad=True)
        else:
            trainer.step(4)


@pytest.mark.parametrize("units", [[(12, 12), (12, 12)], [(16, 12), (4, 16)]], ids=["same-shapes", "two-shapes"])
def test_a_model_built_with_other_block_counters_gets_each_layers_own_state(tmp_path, units):
    """MXNet's Trainer numbers parameters by names sorted as strings: built when Gluon's
    counter stood at 8 (``dense8``, ``dense9``) and at 9 (``dense10`` sorts before ``dense9``),
    one model numbers its layers in opposite orders. A checkpoint of the first loads into
    the second layer by layer: the run goes on bit for bit as the first model's does (with
    two shapes it was refused as another model's; with one shape each layer silently took
    the other's Adam moments)."""
    first, tr1 = _built_at([8, 9], units)
    _train(first, tr1, 3, uneven=True)
    path = str(tmp_path / "run.states")
    gluon_amp.save_states(tr1, path)
    second, tr2 = _built_at([9, 10], units)
    assert [p.name for p in tr2._params][:2] == ["model_dense10_bias", "model_dense10_weight"]
    for a, b in zip(first.collect_params().values(), second.collect_params().values()):
        b.set_data(a.data())
    gluon_amp.load_states(tr2, path)
    _train(first, tr1, 2)
    _train(second, tr2, 2)
    for a, b in zip(first.collect_params().values(), second.collect_params().values()):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy())


def test_a_model_whose_layers_differ_is_still_refused(tmp_path):
    first, tr1 = _built_at([8, 9], [(16, 12), (4, 16)])
    _train(first, tr1, 1)
    path = str(tmp_path / "run.states")
    gluon_amp.save_states(tr1, path)
    _, tr2 = _built_at([9, 10], [(16, 12), (5, 16)])
    with pytest.raises(checkpoint.CheckpointError, match="saved for another model"):
        gluon_amp.load_states(tr2, path)


#: every optimizer MXNet 1.9.1 registers, with what makes it keep more than its updaters' states
#: (LBSGD sums gradients over a macro-batch in an attribute); SGLD is left out: its noise comes
#: from MXNet's generator, whose state no checkpoint holds, MXNet's own included
_REGISTERED = sorted(set(mx.optimizer.Optimizer.opt_registry) - {"sgld"})
_OPTIONS = {"lbsgd": {"batch_scale": 2}, "dcasgd": {"momentum": 0.0}}


class _Rows(nn.HybridBlock):
    """One 2-D weight, no bias: what every registered optimizer updates (GroupAdaGrad only 2-D)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = nn.Dense(4, in_units=8, use_bias=False)

    def hybrid_forward(self, F, x):
        return self.dense(x)


def _registered_run(optimizer, steps, seed, save=None, load=None, start=0):
    mx.random.seed(seed)
    net = _Rows()
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.05, **_OPTIONS.get(optimizer, {})},
                            update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, 1.0)
    if load is not None:
        net.load_parameters(load + ".params")
        gluon_amp.load_states(trainer, load + ".states")
    x, y = _data()
    for i in range(start, start + steps):
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(x[i * 8:i * 8 + 8]), y[i * 8:i * 8 + 8, :4])
            with gluon_amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(8)
    if save is not None:
        net.save_parameters(save + ".params")
        gluon_amp.save_states(trainer, save + ".states")
    return net.dense.weight.data().asnumpy()


@pytest.mark.parametrize("optimizer", _REGISTERED)
def test_every_registered_optimizer_resumes_bit_for_bit(tmp_path, optimizer):
    """GroupAdaGrad's history (one value per row) was refused as "saved for another model", and
    LBSGD's gradients summed over a macro-batch were dropped silently: its resumed run differed."""
    straight = _registered_run(optimizer, 5, 1)
    prefix = str(tmp_path / "ck")
    _registered_run(optimizer, 3, 1, save=prefix)  # LBSGD: in the middle of its second macro-batch
    resumed = _registered_run(optimizer, 2, 7, load=prefix, start=3)
    assert np.isfinite(straight).all() and np.array_equal(resumed, straight)
