"""The timing cache: keyed, validated on read, written atomically."""
import json
import os
import subprocess
import sys
import tempfile

from gluon_amp_core.timing_cache import FORMAT, TimingCache, cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = {"cpu": "AMD EPYC", "flags": ["avx2", "avx512_bf16"], "threads": {"cpus": 2}}


def test_cache_dir_follows_xdg():
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "gluon-amp")
    assert cache_dir({}).endswith(os.path.join(".cache", "gluon-amp"))


def test_stored_entries_are_read_back_and_merged(tmp_path):
    c = TimingCache(str(tmp_path / "new"), KEY)
    assert c.load().entries == {} and c.load().ignored is None
    c.store({"a": 1})
    c.store({"b": [2.0]})
    assert TimingCache(str(tmp_path / "new"), dict(KEY)).load().entries == {"a": 1, "b": [2.0]}
    assert not [p for p in os.listdir(tmp_path / "new") if p.endswith(".tmp")]


def test_a_key_change_reads_nothing_and_does_not_touch_the_other_file(tmp_path):
    TimingCache(str(tmp_path), KEY).store({"a": 1})
    other = TimingCache(str(tmp_path), {**KEY, "threads": {"cpus": 4}})
    assert other.path != TimingCache(str(tmp_path), KEY).path and other.load().entries == {}


def test_corrupt_foreign_and_stale_files_are_ignored_then_rewritten(tmp_path):
    c = TimingCache(str(tmp_path), KEY)
    os.makedirs(tmp_path, exist_ok=True)
    bad = {"corrupt": "{not json", "not ours": json.dumps([1, 2]),
           "foreign": json.dumps({"format": FORMAT, "key": {**KEY, "cpu": "other"}, "entries": {"a": 9}}),
           "stale": json.dumps({"format": FORMAT - 1, "key": KEY, "entries": {"a": 9}})}
    for what, text in bad.items():
        with open(c.path, "w") as f:
            f.write(text)
        loaded = c.load()
        assert loaded.entries == {} and loaded.ignored, what
        c.store({"a": 1})
        assert c.load().entries == {"a": 1}, what


WRITER = r'''
import sys
from gluon_amp_core.timing_cache import TimingCache
c = TimingCache(sys.argv[1], {"cpu": "AMD EPYC", "flags": ["avx2", "avx512_bf16"], "threads": {"cpus": 2}})
for i in range(200):
    c.store({sys.argv[2]: i, "big": [sys.argv[2]] * 2000})
    assert isinstance(c.load().entries, dict)
'''


def test_two_processes_writing_at_once_always_leave_a_whole_file(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], env=env,
                              stderr=subprocess.PIPE, text=True) for name in ("one", "two")]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    loaded = TimingCache(str(tmp_path), KEY).load()
    assert loaded.ignored is None and loaded.entries["big"] in (["one"] * 2000, ["two"] * 2000)
    assert {"one", "two"} & set(loaded.entries)


HOLDER = r'''
import sys, time
from gluon_amp_core.timing_cache import TimingCache
c = TimingCache(sys.argv[1], {"k": 1})
with c.lock():
    print("held", flush=True)
    time.sleep(1.0)
    c.store({"first": time.time()})
'''


def test_the_lock_makes_a_second_process_wait_for_the_first_ones_figures(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert p.stdout.readline().strip() == "held"
    c = TimingCache(str(tmp_path), {"k": 1})
    with c.lock():
        assert "first" in c.load().entries  # it waited for the holder to store and let go
    p.wait(timeout=60)


def test_a_lock_that_must_not_wait_says_when_another_holds_it(tmp_path):
    """A training step must not wait while another process measures (flock: a second open
    file is another holder, even in one process)."""
    c = TimingCache(str(tmp_path), KEY)
    with c.lock() as first:
        assert first is True
        with TimingCache(str(tmp_path), KEY).lock(blocking=False) as second:
            assert second is False
    with c.lock(blocking=False) as again:
        assert again is True


def test_the_cache_folder_is_absolute_whatever_the_environment(monkeypatch):
    """A relative ``XDG_CACHE_HOME`` was used as given, and with no home to expand ``~`` to the
    caches went to a ``~`` folder in the working directory."""
    from gluon_amp_core import timing_cache
    assert timing_cache.cache_dir({"XDG_CACHE_HOME": "/x/y"}) == "/x/y/gluon-amp"
    monkeypatch.setattr(os.path, "expanduser", lambda p: "/home/u" if p == "~" else p)
    assert timing_cache.cache_dir({"XDG_CACHE_HOME": "rel/cache"}) == "/home/u/.cache/gluon-amp"
    assert timing_cache.cache_dir({}) == "/home/u/.cache/gluon-amp"
    monkeypatch.setattr(os.path, "expanduser", lambda p: p)  # no $HOME, no passwd entry
    homeless = timing_cache.cache_dir({})
    assert os.path.isabs(homeless) and homeless.startswith(tempfile.gettempdir())
