"""Checkpoint loads check everything before they change anything (issue 42, items 9-12 and 14).

Generated damage: every byte flipped in turn (a sample of offsets across the file, every one of
meta.json's), cuts at many offsets, each member dropped: each load raises ``CheckpointError``
(a ValueError) naming the file, or loads the very same state; never another exception, and a
failed load leaves the trainer exactly as it was. Then the values a file may hold that no
scaler or trainer can (NaN or negative scales, another model's state tree, a Module's file),
and the temporary files of saves killed by SIGKILL, which the next save removes.
"""
import json
import os
import signal
import stat
import subprocess
import sys
import time
import zipfile

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon

import gluon_amp
from gluon_amp.training import checkpoint
from gluon_amp.training.checkpoint import CheckpointError
from helpers import ROOT


def _setup(hidden=6, prefix="m_", optimizer="sgd"):
    mx.random.seed(0)
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(hidden, in_units=5), gluon.nn.Dense(3, in_units=hidden))
    net.initialize(mx.init.Xavier())
    opts = {"learning_rate": 0.05, **({"momentum": 0.9} if optimizer == "sgd" else {})}
    trainer = gluon.Trainer(net.collect_params(), optimizer, opts, update_on_kvstore=False)
    gluon_amp.init_trainer(trainer, gluon_amp.LossScaler(init_scale=2.0 ** 8, growth_interval=2))
    return net, trainer


def _step(net, trainer, n=3):
    x = mx.nd.array(np.random.RandomState(1).randn(4, 5))
    for _ in range(n):
        with autograd.record():
            loss = (net(x) ** 2).mean()
            with gluon_amp.scale_loss(loss, trainer) as s:
                s.backward()
        trainer.step(4)


def _snapshot(trainer):
    """Everything a load may change: the optimizer's fields, the updater states, the scaler."""
    opt = trainer._optimizer
    fields = {k: repr(v) for k, v in vars(opt).items() if k not in ("param_dict", "idx2name")}
    states = []
    for u in trainer._updaters:
        for k in sorted(u.states):
            v = u.states[k]
            states.append((k, v.asnumpy().tobytes() if isinstance(v, mx.nd.NDArray) else repr(v)))
    return fields, states, gluon_amp.get_scaler(trainer).state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    net, trainer = _setup()
    _step(net, trainer)
    path = str(d / "good.states")
    gluon_amp.save_states(trainer, path)
    net2, loaded = _setup()
    gluon_amp.load_states(loaded, path)
    gluon_amp.state.reset()
    return path, open(path, "rb").read(), _snapshot(loaded)


def _fresh():
    net, trainer = _setup()
    _step(net, trainer, 1)  # a trainer with a state of its own, which a failed load must keep
    return trainer


def _try_load(path, whole):
    """CheckpointError naming ``path`` and the trainer unchanged, or a load identical to ``whole``."""
    trainer = _fresh()
    before = _snapshot(trainer)
    try:
        gluon_amp.load_states(trainer, path)
    except CheckpointError as exc:
        assert path in str(exc)
        assert _snapshot(trainer) == before
        return "refused"
    assert _snapshot(trainer) == whole
    return "loaded"


def _offsets(blob):
    meta_at = blob.find(b'{"format"')
    meta_end = blob.find(b"PK", meta_at)
    spread = np.linspace(0, len(blob) - 1, 90).astype(int).tolist()
    return sorted(set(spread) | set(range(meta_at, meta_end, 11)) | set(range(len(blob) - 120, len(blob))))


def test_every_flipped_byte_is_refused_as_a_checkpoint_error_or_loads_the_same(saved, tmp_path):
    path, blob, whole = saved
    seen = {"refused": 0, "loaded": 0}
    for i in _offsets(blob):
        damaged = bytearray(blob)
        damaged[i] ^= 0xFF
        p = str(tmp_path / f"flip{i}.states")
        with open(p, "wb") as f:
            f.write(bytes(damaged))
        seen[_try_load(p, whole)] += 1
        gluon_amp.state.reset()
    assert seen["refused"] > 60  # most damage is refused; the rest (unused header bytes) is harmless


def test_every_cut_and_every_dropped_member_is_refused(saved, tmp_path):
    path, blob, whole = saved
    for n in sorted(set(np.linspace(0, len(blob) - 1, 60).astype(int).tolist())):
        p = str(tmp_path / f"cut{n}.states")
        with open(p, "wb") as f:
            f.write(blob[:n])
        assert _try_load(p, whole) == "refused", n
        gluon_amp.state.reset()
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    assert len(members) > 2
    for drop in members:
        p = str(tmp_path / "dropped.states")
        with zipfile.ZipFile(p, "w") as z:
            for n, b in members.items():
                if n != drop:
                    z.writestr(n, b)
        assert _try_load(p, whole) == "refused", drop
        gluon_amp.state.reset()


def _rewrite(path, out, change):
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["meta.json"])
    change(meta)
    members["meta.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(out, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    return out


@pytest.mark.parametrize("field, value", [
    ("scale", float("nan")), ("scale", -1.0), ("scale", 0.0), ("scale", float("inf")), ("scale", "big"),
    ("growth_tracker", -3), ("total_steps", 1.5), ("last_skipped", "no"), ("init_scale", -1.0)])
def test_a_scaler_state_no_scaler_can_hold_is_refused_and_nothing_changes(saved, tmp_path, field, value):
    path, _, whole = saved
    bad = _rewrite(path, str(tmp_path / "bad.states"), lambda m: m["scaler"].__setitem__(field, value))
    assert _try_load(bad, whole) == "refused"


def test_another_models_checkpoint_is_refused_at_load(tmp_path):
    for hidden, prefix in ((8, "m_"), (6, "other_")):
        net, trainer = _setup(hidden=hidden, prefix=prefix)
        _step(net, trainer, 1)
        path = str(tmp_path / f"{prefix}{hidden}.states")
        gluon_amp.save_states(trainer, path)
        target = _fresh()  # hidden=6, prefix m_
        before = _snapshot(target)
        if prefix == "m_":  # other shapes
            with pytest.raises(CheckpointError, match="another model"):
                gluon_amp.load_states(target, path)
            assert _snapshot(target) == before
    # other parameter count: a one-layer model's state into a two-layer trainer, and back
    mx.random.seed(0)
    small = gluon.nn.Dense(3, in_units=5, prefix="m_dense0_")
    small.initialize()
    tr = gluon.Trainer(small.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                       update_on_kvstore=False)
    gluon_amp.init_trainer(tr)
    with autograd.record():
        loss = small(mx.nd.ones((2, 5))).sum()
    loss.backward()
    tr.step(2)
    p = str(tmp_path / "small.states")
    gluon_amp.save_states(tr, p)
    target = _fresh()
    with pytest.raises(CheckpointError, match="another model"):
        gluon_amp.load_states(target, p)


def test_a_checkpoint_without_recorded_parameters_is_still_checked_by_its_state_shapes(saved, tmp_path):
    path, _, whole = saved
    old = _rewrite(path, str(tmp_path / "noparams.states"), lambda m: m.pop("params"))
    assert _try_load(old, whole) == "loaded"
    net, trainer = _setup(hidden=8)
    _step(net, trainer, 1)
    with pytest.raises(CheckpointError, match="another model"):
        gluon_amp.load_states(trainer, old)


def test_module_and_trainer_checkpoints_refuse_each_other(saved, tmp_path):
    path, _, whole = saved
    as_module = _rewrite(path, str(tmp_path / "module.states"), lambda m: m["mode"].__setitem__("module", True))
    trainer = _fresh()
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError, match="Module"):
        gluon_amp.load_states(trainer, as_module)
    assert _snapshot(trainer) == before
    data = mx.sym.Variable("data")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=3, name="fc"), name="softmax")
    mod = mx.mod.Module(out, data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (2, 5))], label_shapes=[("softmax_label", (2,))])
    mod.init_params()
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.05, "momentum": 0.9})
    gluon_amp.init_trainer(mod)
    with pytest.raises(CheckpointError, match="Trainer"):
        gluon_amp.load_states(mod, path)


def test_a_load_interrupted_while_it_applies_leaves_the_trainer_as_it_was(saved, monkeypatch):
    path, _, _ = saved
    trainer = _fresh()
    before = _snapshot(trainer)
    real = gluon_amp.mxnet_internals.set_updater_states

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt("Ctrl-C after the updaters took the file's states")
    monkeypatch.setattr(gluon_amp.mxnet_internals, "set_updater_states", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gluon_amp.load_states(trainer, path)
    assert _snapshot(trainer) == before


_SAVER = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import mxnet as mx
from mxnet import gluon, autograd
import gluon_amp
net = gluon.nn.Dense(512, in_units=512)
net.initialize()
tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, update_on_kvstore=False)
gluon_amp.init_trainer(tr)
with autograd.record():
    loss = net(mx.nd.ones((2, 512))).mean()
loss.backward()
tr.step(2)
gluon_amp.save_states(tr, sys.argv[1])  # one whole save first: a kill in the next must leave it
if sys.argv[2:] == ["hold"]:  # the next save stops at its fsync, its file written but not renamed
    import os, time
    def hold(fd):
        print("writing", flush=True)
        time.sleep(600)
    os.fsync = hold
    gluon_amp.save_states(tr, sys.argv[1])
print("ready", flush=True)
while True:
    gluon_amp.save_states(tr, sys.argv[1])
"""


def test_saves_killed_mid_write_leave_no_temporary_file_after_the_next_save(tmp_path):
    target = str(tmp_path / "run.states")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    leftovers = 0
    # Kills at random moments of a save loop, then, where none of them landed mid-write
    # (under load they may all fall between two saves), one at a save held at its fsync.
    for k in range(4):
        hold = k == 3 and not leftovers
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, target] + ["hold"] * hold, env=env,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == ("writing" if hold else "ready")
            time.sleep(0.05 + 0.03 * k)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        leftovers += len([n for n in os.listdir(tmp_path) if n.endswith(".tmp")])
    assert leftovers > 0  # a kill did land mid-write (else the test proves nothing)
    net, trainer = _setup()
    _step(net, trainer, 1)
    other = str(tmp_path / "next.states")
    gluon_amp.save_states(trainer, other)  # any later save in the folder cleans up
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
    assert checkpoint.read(target).meta["format"] == checkpoint.FORMAT  # the checkpoint itself survived


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    mine = tmp_path / f".gluon_amp-{checkpoint._host()}-{os.getpid()}-abc.tmp"
    parent = tmp_path / f".gluon_amp-{checkpoint._host()}-{os.getppid()}-abc.tmp"
    other_host = tmp_path / ".gluon_amp-elsewhere-1-abc.tmp"
    for p in (mine, parent, other_host):
        p.write_bytes(b"x")
    assert checkpoint.clean_stale_temporaries(str(tmp_path)) == []


def test_a_temporary_file_its_writer_holds_is_left_whoever_wrote_it_and_a_day_old_one_goes(tmp_path):
    """Two containers with one hostname (or names alike in their first 40 characters) saving to
    a shared folder: the one cleaning looked up the other's pid in its own PID namespace, found
    none, and deleted the live writer's file; its save then failed with FileNotFoundError."""
    dead_pid = 2 ** 22 + 12345  # above any pid_max: no process has it
    held = tmp_path / f".gluon_amp-{checkpoint._host()}-{dead_pid}-held.tmp"
    held.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'rb'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(120)", str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert checkpoint.clean_stale_temporaries(str(tmp_path)) == []  # its pid looks dead: the lock says no
    finally:
        holder.kill()
        holder.wait(timeout=60)
    elsewhere = tmp_path / ".gluon_amp-elsewhere_0123456789-1-abc.tmp"
    elsewhere.write_bytes(b"x")
    day_ago = time.time() - checkpoint._STALE_AFTER_S - 60
    os.utime(elsewhere, (day_ago, day_ago))
    assert sorted(checkpoint.clean_stale_temporaries(str(tmp_path))) == sorted([held.name, elsewhere.name])


def test_a_save_writes_through_a_link_and_keeps_the_files_mode(tmp_path):
    """``save_states`` replaced the user's ``latest.states`` link by a file (its target kept the
    old bytes), and gave every checkpoint mkstemp's 0600: a serving job of another user lost it."""
    net, trainer = _setup()
    _step(net, trainer, 1)
    run = tmp_path / "run3"
    run.mkdir()
    target = run / "trainer.states"
    gluon_amp.save_states(trainer, str(target))
    os.chmod(target, 0o644)
    before = target.read_bytes()
    link = tmp_path / "latest.states"
    link.symlink_to(target)
    _step(net, trainer, 1)
    gluon_amp.save_states(trainer, str(link))
    assert link.is_symlink() and target.read_bytes() != before
    assert os.stat(target).st_mode & 0o777 == 0o644
    mask = os.umask(0o027)
    try:
        gluon_amp.save_states(trainer, str(tmp_path / "new.states"))
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "new.states").st_mode & 0o777 == 0o640


def test_a_save_to_no_regular_file_is_refused_and_leaves_it(tmp_path):
    """``save_states(trainer, os.devnull)`` (as root) replaced the device by a regular file, and a
    loop of links was replaced by one: MXNet's saves write into the device and refuse the loop."""
    net, trainer = _setup()
    _step(net, trainer, 1)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match="is no regular file \\(a named pipe\\)"):
        gluon_amp.save_states(trainer, str(pipe))
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError, match="loop of symbolic links"):
        gluon_amp.save_states(trainer, str(tmp_path / "a"))
    assert os.path.islink(tmp_path / "a") and [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
