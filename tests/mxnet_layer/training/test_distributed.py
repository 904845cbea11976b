"""Loss scaling across workers: real 2-worker jobs on 127.0.0.1 and 2 CPU contexts in one process.

Every job trains the float32 MLP of ``tests/mxnet_layer/dist/dist_scenario.py``: an inf on one worker at
one step, a checkpoint saved by rank 0 and restored (after scrambling) on every rank. Each
must match one process training on the whole global batch, step for step.
"""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import mxnet as mx
import numpy as np
import psutil
import pytest
from mxnet import gluon

import gluon_amp
from gluon_amp import LossScaler
from gluon_amp.training import distributed
from helpers import LAYER, ROOT

sys.path.insert(0, os.path.join(LAYER, "dist"))

import dist_launcher  # noqa: E402
import dist_scenario as sc  # noqa: E402
import dist_worker  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    ref = sc.reference()
    # The scenario is only a test if the inf costs exactly one step and the scale moves.
    assert [i for i, s in enumerate(ref["skipped"]) if s] == [sc.POISON_STEP]
    assert len(set(ref["scale"])) >= 3
    return ref


def _results(out_dir, prefix, workers=2):
    found = []
    for rank in range(workers):
        with open(os.path.join(out_dir, f"{prefix}-rank{rank}.json")) as f:
            found.append(json.load(f))
    return found


def _assert_params_close(params, ref):
    assert sorted(params) == sorted(ref)
    for name in ref:
        np.testing.assert_allclose(np.array(params[name]), np.array(ref[name]), rtol=1e-5, atol=1e-6,
                                   err_msg=f"parameter {name} differs from the single-process run")


def assert_workers_agree(results, reference):
    """Same skips, scales and weights on every worker; all equal to the single-process run."""
    first = results[0]
    for r in results:
        assert r["skipped"] == first["skipped"], f"rank {r['rank']} skipped other steps than rank 0"
        assert r["scale"] == first["scale"], f"rank {r['rank']} has other loss scales than rank 0"
        assert r["params"] == first["params"], f"rank {r['rank']} ended with other weights than rank 0"
    # The inf was on one worker only, and every worker skipped that step and halved the scale.
    poisoned = [r["rank"] for r in results if not all(r["finite_by_ctx"][sc.POISON_STEP])]
    assert poisoned == [sc.POISON_RANK]
    assert all(r["skipped"][sc.POISON_STEP] for r in results)
    assert first["scale"][sc.POISON_STEP] == first["scale"][sc.POISON_STEP - 1] / 2
    # ... exactly as one process on the global batch (this also covers the resume: every rank
    # scrambled its state before RESUME_STEP and restored rank 0's checkpoint).
    assert first["skipped"] == reference["skipped"]
    assert first["scale"] == reference["scale"]
    _assert_params_close(first["params"], reference["params"])


def assert_probes(results):
    """What dist_worker.probe_disagreements saw, on every worker."""
    for r in results:
        c = r["checks"]
        # update() without allreduce_grads(): gradients differ, the decision does not.
        assert c["unreduced_finite_by_ctx"] == [r["rank"] != sc.POISON_RANK]
        assert c["unreduced_skipped"] is True, \
            f"rank {r['rank']} applied update() although rank {sc.POISON_RANK} had an inf"
        assert c["unreduced_params"] == results[0]["checks"]["unreduced_params"]
        assert c["scale_mismatch"].startswith("RuntimeError: the loss scale differs"), c["scale_mismatch"]
        assert c["shared_with_local"].startswith("RuntimeError: one LossScaler is shared"), \
            c["shared_with_local"]


def test_dist_sync_kvstore_two_workers(tmp_path, reference):
    dist_launcher.run_dist_sync(["--engine", "dist_sync", "--out", str(tmp_path), "--checks"], str(tmp_path))
    results = _results(tmp_path, "dist_sync-step")
    assert {r["size"] for r in results} == {2}
    assert_workers_agree(results, reference)
    assert_probes(results)


def test_dist_sync_allreduce_grads_then_update(tmp_path, reference):
    dist_launcher.run_dist_sync(["--engine", "dist_sync", "--mode", "split", "--out", str(tmp_path)],
                                str(tmp_path))
    assert_workers_agree(_results(tmp_path, "dist_sync-split"), reference)


def test_horovod_two_workers(tmp_path, reference):
    dist_launcher.run_horovod(["--engine", "horovod", "--out", str(tmp_path), "--checks"], str(tmp_path))
    results = _results(tmp_path, "horovod-step")
    assert {r["size"] for r in results} == {2}
    assert_workers_agree(results, reference)
    assert_probes(results)


def test_device_kvstore_two_contexts_in_one_process(tmp_path, reference):
    r = dist_worker.run("device", str(tmp_path))
    # The inf is on context 1 only; the step is skipped for both copies.
    assert r["finite_by_ctx"][sc.POISON_STEP] == [True, False]
    assert r["skipped"] == reference["skipped"] and r["scale"] == reference["scale"]
    copy0, copy1 = r["params_by_ctx"]
    assert copy0 == copy1
    _assert_params_close(copy0, reference["params"])


MODULE_WORKER = os.path.join(LAYER, "dist", "dist_module_worker.py")


def _module_run(out_dir, horovod=False, **job):
    if horovod:
        dist_launcher.run_horovod(["--engine", "horovod", "--out", str(out_dir)], str(out_dir), worker=MODULE_WORKER)
    elif job:
        dist_launcher.run_dist_sync(["--out", str(out_dir)], str(out_dir), worker=MODULE_WORKER, **job)
    else:  # the single process on the whole global batch
        subprocess.run([sys.executable, MODULE_WORKER, "--workers", "1", "--out", str(out_dir)], check=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.load(open(os.path.join(out_dir, f))) for f in sorted(os.listdir(out_dir))
            if f.startswith("module-rank")]


def test_a_module_on_dist_sync_updating_on_the_workers_skips_with_every_worker(tmp_path):
    """2 workers, MXNET_UPDATE_ON_KVSTORE=0: the inf on one worker's shard skips the step on
    both, the scale moves alike, and both end with the single process's weights."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "job").mkdir()
    [ref] = _module_run(tmp_path / "ref")
    assert [i for i, s in enumerate(ref["skipped"]) if s] == [2] and len(set(ref["scale"])) >= 3
    results = _module_run(tmp_path / "job", env_extra={"MXNET_UPDATE_ON_KVSTORE": "0"})
    assert [r["rank"] for r in results] == [0, 1] and {r["workers"] for r in results} == {2}
    for r in results:
        assert r["update_on_kvstore"] is False
        assert r["skipped"] == ref["skipped"], f"rank {r['rank']} skipped other steps than one process"
        assert r["scale"] == ref["scale"], f"rank {r['rank']} has other loss scales than one process"
        assert r["params"] == results[0]["params"], f"rank {r['rank']} ended with other weights than rank 0"
    _assert_params_close(results[0]["params"], ref["params"])


def test_a_module_with_horovods_distributed_optimizer_skips_with_every_worker_and_unscales(tmp_path):
    """MXNet's example/distributed_training-horovod/module_mnist.py: a Module whose optimizer is
    hvd.DistributedOptimizer, which allreduces inside its update. The unscale set
    ``rescale_grad`` on the wrapper, which its update never reads (the weights took steps the
    loss scale times too big), and each worker decided its skip alone: the worker without the
    inf went on into the allreduce. Both workers must skip the poisoned step, move the scale
    alike and end with the single process's weights."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "job").mkdir()
    [ref] = _module_run(tmp_path / "ref")
    assert [i for i, s in enumerate(ref["skipped"]) if s] == [2] and len(set(ref["scale"])) >= 3
    results = _module_run(tmp_path / "job", horovod=True)
    assert [r["rank"] for r in results] == [0, 1] and {r["workers"] for r in results} == {2}
    for r in results:
        assert r["skipped"] == ref["skipped"], f"rank {r['rank']} skipped other steps than one process"
        assert r["scale"] == ref["scale"], f"rank {r['rank']} has other loss scales than one process"
        assert r["params"] == results[0]["params"], f"rank {r['rank']} ended with other weights than rank 0"
    _assert_params_close(results[0]["params"], ref["params"])


def test_a_module_whose_optimizer_runs_on_dist_servers_is_refused_naming_the_setting(tmp_path):
    [r] = _module_run(tmp_path, workers=1)  # a dist_sync job of one worker: MXNet's default update_on_kvstore
    assert r["update_on_kvstore"] is True
    assert r["refused"].startswith("gluon_amp") and "MXNET_UPDATE_ON_KVSTORE=0" in r["refused"], r["refused"]


def test_horovod_distributed_optimizer_is_refused():
    code = textwrap.dedent("""
        import gluon_amp, mxnet as mx, horovod.mxnet as hvd
        from mxnet import autograd, gluon
        hvd.init()
        net = gluon.nn.Dense(1, in_units=2); net.initialize()
        trainer = gluon.Trainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD()),
                                kvstore=None, update_on_kvstore=False)
        gluon_amp.init_trainer(trainer)
        with autograd.record():
            with gluon_amp.scale_loss(net(mx.nd.ones((1, 2))).sum(), trainer) as scaled:
                scaled.backward()
        w = net.weight.data().copy()
        try:
            trainer.step(1)
        except RuntimeError as exc:
            assert (net.weight.data() == w).asnumpy().all(), "weights changed before the error"
            print("REFUSED", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "hvd.DistributedTrainer" in out.stdout, out.stdout + out.stderr[-2000:]


# -- agree_finite's rules, with a stand-in engine of 2 workers ---------------------------------

def _trainer(ctxs=(mx.cpu(),), kvstore=None):
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(ctx=list(ctxs))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kvstore,
                            update_on_kvstore=False)
    return net, trainer


def _other_worker(finite, scale):
    """An engine whose other worker reports ``finite`` at ``scale``."""
    other = np.array([0.0 if finite else 1.0, scale, scale * scale], dtype="float32")
    return distributed.Engine("a stand-in engine", 2, lambda v: v + other)


def test_agree_finite_skips_when_another_worker_overflowed(monkeypatch):
    _, trainer = _trainer()
    scaler = gluon_amp.init_trainer(trainer, LossScaler(init_scale=64.0))
    monkeypatch.setattr(distributed, "engine_of", lambda t: _other_worker(False, 64.0))
    assert distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True) is False
    monkeypatch.setattr(distributed, "engine_of", lambda t: _other_worker(True, 64.0))
    assert distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True) is True
    assert distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), False) is False
    assert scaler.loss_scale == 64.0  # agreeing does not step the scaler


@pytest.mark.parametrize("other_scale", [128.0, 32.0, 64.5])
def test_agree_finite_refuses_differing_scales(monkeypatch, other_scale):
    _, trainer = _trainer()
    gluon_amp.init_trainer(trainer, LossScaler(init_scale=64.0))
    monkeypatch.setattr(distributed, "engine_of", lambda t: _other_worker(True, other_scale))
    with pytest.raises(RuntimeError, match="loss scale differs.*this worker: 64.*load_states"):
        distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True)


def test_agree_finite_accepts_equal_odd_static_scales(monkeypatch):
    _, trainer = _trainer()
    gluon_amp.init_trainer(trainer, 1234.567)
    monkeypatch.setattr(distributed, "engine_of", lambda t: _other_worker(True, 1234.567))
    assert distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True) is True


def test_scaler_shared_by_distributed_and_local_trainer_is_refused(monkeypatch):
    _, dist_trainer = _trainer()
    _, local_trainer = _trainer()
    scaler = gluon_amp.init_trainer(dist_trainer)
    gluon_amp.init_trainer(local_trainer, scaler)
    monkeypatch.setattr(distributed, "engine_of",
                        lambda t: _other_worker(True, scaler.loss_scale) if t is dist_trainer else None)
    assert distributed.agree_finite(dist_trainer, gluon_amp.get_scaler(dist_trainer), True) is True
    with pytest.raises(RuntimeError, match="one LossScaler is shared.*a stand-in engine"):
        distributed.agree_finite(local_trainer, gluon_amp.get_scaler(local_trainer), True)


def test_scaler_shared_by_local_trainers_is_fine():
    _, a = _trainer()
    _, b = _trainer(ctxs=(mx.cpu(0), mx.cpu(1)), kvstore="device")
    scaler = gluon_amp.init_trainer(a)
    gluon_amp.init_trainer(b, scaler)
    assert distributed.agree_finite(a, gluon_amp.get_scaler(a), True) is True
    assert distributed.agree_finite(b, gluon_amp.get_scaler(b), False) is False


def test_dist_kvstore_without_init_kvstore_warns_once(monkeypatch):
    _, trainer = _trainer()
    scaler = gluon_amp.init_trainer(trainer)
    engine = _other_worker(True, scaler.loss_scale)
    monkeypatch.setattr(distributed, "engine_of",
                        lambda t: distributed.Engine(engine.name, 2, engine.reduce, kvstore=True))
    with pytest.warns(RuntimeWarning, match="init_kvstore"):
        distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True)


def test_init_kvstore_rejects_non_trainers_and_deferred_shapes():
    with pytest.raises(TypeError, match="Trainer"):
        distributed.init_kvstore("trainer")
    net = gluon.nn.Dense(2)  # no in_units: shapes unknown until the first forward
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore="device", update_on_kvstore=False)
    with pytest.raises(RuntimeError, match="not initialised yet.*forward pass"):
        distributed.init_kvstore(trainer)


def test_engine_of_local_trainers_is_none():
    _, a = _trainer()
    _, b = _trainer(ctxs=(mx.cpu(0), mx.cpu(1)), kvstore="device")
    distributed.init_kvstore(b)
    assert distributed.engine_of(a) is None and distributed.engine_of(b) is None


# -- the launcher cleans up -------------------------------------------------------------------

def test_launcher_kills_every_process_when_a_worker_fails(tmp_path):
    sleeper = ("import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)")
    with pytest.raises(dist_launcher.JobFailed, match="exit codes {'fails': 3}"):
        with dist_launcher.Job(str(tmp_path), timeout=60) as job:
            job.start("sleeps", [sys.executable, "-c", sleeper], dict(os.environ))
            job.start("fails", [sys.executable, "-c", "import time, sys; time.sleep(1); sys.exit(3)"],
                      dict(os.environ))
            job.wait()
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GLUON_AMP_TEST_JOB") == job.tag:
                left.append(p)
        except psutil.Error:
            pass
    assert left == []


def test_launcher_failure_shows_the_first_error_under_later_output(tmp_path):
    # a Horovod job's first failing rank is followed by pages of the other ranks' errors
    script = ("import sys; print('Segmentation fault: 11', flush=True); "
              "[print('later line', i) for i in range(2000)]; sys.exit(255)")
    with pytest.raises(dist_launcher.JobFailed) as info:
        with dist_launcher.Job(str(tmp_path), timeout=60) as job:
            job.start("rank", [sys.executable, "-c", script], dict(os.environ))
            job.wait()
    text = str(info.value)
    assert "exit codes {'rank': 255}" in text
    assert "----- rank: its first error -----\nSegmentation fault: 11" in text
    assert text.rstrip().endswith("later line 1999")


def test_launcher_times_out(tmp_path):
    with pytest.raises(dist_launcher.JobFailed, match="still running at the deadline"):
        with dist_launcher.Job(str(tmp_path), timeout=1) as job:
            job.start("sleeps", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ))
            job.wait()
    assert job.procs["sleeps"].poll() is not None


def test_disabled_scaler_needs_no_agreement(monkeypatch):
    _, trainer = _trainer()
    gluon_amp.init_trainer(trainer, None)

    def no_collective(values):
        raise AssertionError("a disabled scaler must not start a collective")
    monkeypatch.setattr(distributed, "engine_of", lambda t: distributed.Engine("x", 2, no_collective))
    assert distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True) is True


def test_dist_kvstore_with_gradient_compression_is_refused(monkeypatch):
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None, update_on_kvstore=False,
                            compression_params={"type": "2bit", "threshold": 0.5})
    scaler = gluon_amp.init_trainer(trainer)
    engine = _other_worker(True, scaler.loss_scale)
    monkeypatch.setattr(distributed, "engine_of",
                        lambda t: distributed.Engine(engine.name, 2, engine.reduce, kvstore=True))
    with pytest.raises(RuntimeError, match="gradient compression.*2bit"):
        distributed.agree_finite(trainer, gluon_amp.get_scaler(trainer), True)


@pytest.mark.bf16_kernels
def test_ssd_benchmark_under_horovod_reports_per_worker_and_total(tmp_path):
    bench = os.path.join(ROOT, "benchmarks", "ssd_synthetic.py")
    out = tmp_path / "hvd.json"

    def run() -> None:
        with dist_launcher.Job(str(tmp_path), timeout=600) as job:
            job.start("bench", [sys.executable, bench, "--horovod", "2", "--batch-size", "1", "--iters", "1",
                                "--warmup", "0", "--json", str(out)], dict(os.environ))
            job.wait()
    try:
        run()
    except dist_launcher.JobFailed as exc:
        # Once in CI (stop 82) a rank died mid-step with exit 255, MXNet's segfault handler's
        # code, and 0 of 25 runs here repeated it. That crash, and only it, gets one more run;
        # what it printed is kept as a warning. Any other failure, or a second crash, fails.
        if "'bench': 1" not in str(exc) or "exit with status code 255" not in str(exc):
            raise
        warnings.warn(f"a Horovod rank crashed; run again once:\n{exc}", RuntimeWarning)
        run()
    doc = json.loads(out.read_text())
    cores = os.cpu_count()
    expected = ([(1, cores)] + ([(1, cores // 2)] if cores >= 2 and cores // 2 != cores else [])
                + [(2, max(1, cores // 2))])
    assert [(r["processes"], r["threads_per_process"]) for r in doc["runs"]] == expected
    for run in doc["runs"]:
        per = run["per_worker_samples_per_sec"]
        assert len(per) == run["processes"] and all(v > 0 for v in per)
        assert run["total_samples_per_sec"] == pytest.approx(sum(per))
        assert [r["rank"] for r in run["ranks"]] == list(range(run["processes"]))
        assert len({r["loss_scale"] for r in run["ranks"]}) == 1  # the workers agree
    assert doc["runs"][0]["total_vs_1_process"] == 1.0
    assert "per-worker samples/s" in (tmp_path / "bench.log").read_text()
