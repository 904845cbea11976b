"""Compile ``rounding.cc`` once per machine into the user's cache, and check the build.

The library lives in ``$XDG_CACHE_HOME/gluon-amp/emulation-kernel/<key>/`` (``~/.cache`` by
default), where ``<key>`` hashes everything the build depends on: the source, MXNet's
version and ``libmxnet.so`` (path, size, modification time), the compiler (its path and
``--version``) and the flags. As ``torch.utils.cpp_extension.load`` and CuPy's kernel cache
do, the first process builds and later ones load:

- a lock file (``flock``) makes processes started together build once; the others wait and
  then read the result;
- the compiler writes to a temporary name in that folder, renamed into place when whole;
- a fresh process loads the build and checks it (:mod:`.selftest`: values to the bit against
  the pure reference, a oneDNN training graph forward and backward) before any process uses
  it, so a build that breaks in MXNet's process breaks there, not in the user's;
- the outcome is written next to the library (``ok.json`` or ``failed.json``, atomically):
  a failed build is not retried until something in the key changes;
- every file is fsynced, and its folder, before it is renamed into place, and ``ok.json``
  records the library's size and SHA-256: a process checks both before it loads the library,
  and builds it again where they differ (a file cut short by a crash or a power loss would
  otherwise kill every process that loads it with SIGBUS).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from gluon_amp_core.durable import fsync_path
from gluon_amp_core.timing_cache import cache_dir

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "rounding.cc")
#: The fresh process's check (:mod:`.selftest`), whose verdict the cache records.
CHECK = os.path.join(HERE, "selftest.py")
#: Environment variable naming the C++ compiler (as for most build tools); default ``c++``.
CXX_ENV = "CXX"
#: Seconds a compile, and the check of a build, may take.
BUILD_TIMEOUT = 600
CHECK_TIMEOUT = 600
#: Flags besides the ones that depend on MXNet's build (:func:`command`).
BASE_FLAGS = ("-std=c++14", "-O3", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden",
              "-DDMLC_USE_GLOG=0", "-DMSHADOW_USE_CUDA=0", "-DMSHADOW_USE_MKL=0",
              "-DMSHADOW_USE_CBLAS=0", "-DMSHADOW_USE_SSE=0", "-DMSHADOW_USE_F16C=0")


@dataclass(frozen=True)
class Build:
    """A library in the cache, or why there is none.

    Attributes
    ----------
    library : str or None
        Path of the checked library; ``None`` when there is none.
    why : str
        How it was obtained (built now, or found), or why there is none.
    """

    library: Optional[str]
    why: str


def source_version(source: str = SOURCE) -> int:
    """``GA_KERNEL_VERSION`` of the source: the library must report the same."""
    with open(source, encoding="utf-8") as f:
        found = re.search(r"#define GA_KERNEL_VERSION (\d+)", f.read())
    if found is None:
        raise RuntimeError(f"{source} has no GA_KERNEL_VERSION")
    return int(found.group(1))


def find_compiler(env: Mapping[str, str]) -> Tuple[Optional[str], str]:
    """``(command, description)`` of the C++ compiler (``$CXX`` may hold words: ``ccache g++``),
    or ``(None, why not)``."""
    name = env.get(CXX_ENV) or "c++"
    try:
        words = shlex.split(name)  # as make reads it: "ccache g++", "g++ -O2"
    except ValueError:
        words = [name]
    path = shutil.which(words[0]) if words else None
    if path is None:
        where = f"{CXX_ENV}={name}" if env.get(CXX_ENV) else f"{name} (set {CXX_ENV} to choose one)"
        return None, f"no C++ compiler: {where} was not found"
    cxx = shlex.join([path, *words[1:]])
    try:
        r = subprocess.run([path, *words[1:], "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the C++ compiler {cxx} does not run: {exc}"
    first = (r.stdout or r.stderr).strip().splitlines()
    return cxx, first[0] if first else cxx


def uses_cxx11_abi(library: str) -> bool:
    """True when ``library`` was built with libstdc++'s C++11 string ABI (its symbols name
    ``__cxx11``); the pip wheel of MXNet 1.9.1 was not."""
    marker = b"__cxx11"
    with open(library, "rb") as f:
        tail = b""
        while True:
            block = f.read(1 << 22)
            if not block:
                return False
            if marker in tail + block:
                return True
            tail = block[-len(marker):]


def command(cxx: str, facts: Mapping[str, Any], output: str, cxx11_abi: bool) -> List[str]:
    """The compile command: ``rounding.cc`` against MXNet's headers, linked to ``libmxnet.so``."""
    include, lib_dir = facts["include"], os.path.dirname(facts["libmxnet"])
    return [*shlex.split(cxx), *BASE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
            f"-DMXNET_USE_MKLDNN={int(bool(facts['mkldnn']))}",
            "-I", include, "-I", os.path.join(include, "mkldnn"), SOURCE, "-o", output,
            "-L", lib_dir, f"-l:{os.path.basename(facts['libmxnet'])}", f"-Wl,-rpath,{lib_dir}"]


def build_key(facts: Mapping[str, Any], compiler: str, cxx: str, cxx11_abi: bool) -> Dict[str, Any]:
    """Everything the library and its acceptance depend on: a changed check checks it again."""
    digests = {}
    for name, path in (("source", SOURCE), ("check", CHECK)):
        with open(path, "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    return {**digests, "compiler": compiler, "cxx": cxx, "flags": list(BASE_FLAGS),
            "cxx11_abi": cxx11_abi, **{k: facts[k] for k in sorted(facts)}}


def ensure(facts: Mapping[str, Any], env: Mapping[str, str], log: Any = None) -> Build:
    """The checked library for this MXNet and compiler, built and checked if need be.

    ``facts`` come from :func:`gluon_amp.mxnet_internals.mxnet_build_facts`; ``log`` (a
    callable taking a message) hears about a build before it starts (seconds to a minute).
    """
    cxx, compiler = find_compiler(env)
    if cxx is None:
        return Build(None, compiler)
    cxx11_abi = uses_cxx11_abi(facts["libmxnet"])
    key = build_key(facts, compiler, cxx, cxx11_abi)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(cache_dir(env), "emulation-kernel", digest)
    library = os.path.join(folder, "rounding.so")
    found = _outcome(folder, key, library)
    if found is not None:
        return found
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return Build(None, f"cannot write the kernel cache {folder}: {exc}")
    with _locked(os.path.join(folder, ".lock")):
        found = _outcome(folder, key, library)  # another process may have built it meanwhile
        if found is not None:
            return found
        if log is not None:
            log(f"building gluon_amp's emulation kernel with {compiler} into {folder} "
                "(once per machine and MXNet; a few seconds to a minute)")
        error = _compile(lambda out: command(cxx, facts, out, cxx11_abi), folder, library)
        if error is None:
            error = _check(library, env)
        if error is not None and _transient(error):  # a full disk, a timeout: the next process tries again
            return Build(None, f"{error} (not recorded: the next process builds again)")
        try:
            doc = {"key": key, "error": error, **({} if error else {"library": _fingerprint(library)})}
            _write_json(os.path.join(folder, "failed.json" if error else "ok.json"), doc)
        except OSError as exc:
            error = error or f"cannot write the kernel cache {folder}: {exc}"
    return Build(None, error) if error else Build(library, f"built now with {compiler}")


def _outcome(folder: str, key: Mapping[str, Any], library: str) -> Optional[Build]:
    """What an earlier process found for ``key`` in ``folder``, if anything."""
    for name, ok in (("ok.json", True), ("failed.json", False)):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("key") != json.loads(json.dumps(key)):
            continue
        if ok and os.path.exists(library) and doc.get("library") == _fingerprint(library):
            return Build(library, f"cached in {folder}")
        if not ok:
            return Build(None, f"{doc.get('error')} (recorded in {folder}; a new compiler, MXNet or "
                               "gluon-amp builds again, and so does deleting that folder)")
    return None


def _compile(command_for: Callable[[str], List[str]], folder: str, library: str) -> Optional[str]:
    """Run the compiler into a temporary file and move the result into place; the error, if any."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rounding-", suffix=".so", dir=folder)
    except OSError as exc:  # e.g. a full disk
        return f"the compiler did not run: cannot create its output file in {folder}: {exc}"
    os.close(fd)
    cmd = command_for(tmp)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if r.returncode != 0:
            said = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
            lines = [ln for ln in said if "error" in ln.lower() or _FULL in ln] or said
            return (f"the compiler failed (exit status {r.returncode}): {' '.join(lines[:3])[:600]}"
                    + (f" ({_FULL})" if any(_FULL in ln for ln in said) and _FULL not in ' '.join(lines[:3]) else "")
                    + f"; command: {shlex.join(cmd)}")
        fsync_path(tmp)
        os.replace(tmp, library)
        fsync_path(folder)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the compiler did not run: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


#: what a full disk makes the compiler, the linker or the system say
_FULL = "No space left on device"


def _transient(error: str) -> bool:
    """Whether a build failed for a reason of the moment (a full disk, a timeout on a loaded
    machine, a compiler that could not start or was killed), not for the compiler and MXNet at hand."""
    return any(sign in error for sign in (_FULL, "timed out", "did not run", "did not finish",  # the OOM killer:
                                          "Killed signal", "killed by", "exit status -"))


def _check(library: str, env: Mapping[str, str]) -> Optional[str]:
    """Load ``library`` in a fresh process and check it (:mod:`.selftest`); the error, if any."""
    root = os.path.dirname(os.path.dirname(HERE))
    child_env = {**env, "PYTHONPATH": root + os.pathsep + env.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "gluon_amp.emulation_kernel.selftest", library]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CHECK_TIMEOUT, env=child_env)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the check of the built kernel did not finish: {exc}"
    last = r.stdout.strip().splitlines()[-1:] or [""]
    try:
        doc = json.loads(last[0])
    except ValueError:
        doc = None
    if r.returncode == 0 and isinstance(doc, dict) and doc.get("ok"):
        return None
    why = doc.get("error") if isinstance(doc, dict) else None
    tail = " ".join([line.strip() for line in r.stderr.splitlines() if line.strip()][-2:])[-400:]
    status = f"exit status {r.returncode}"
    if r.returncode < 0:  # the check crashed: its last stderr line names the step it was on
        with contextlib.suppress(ValueError):
            status = f"killed by {signal.Signals(-r.returncode).name}"
    return f"the built kernel failed its check ({status}): {why or tail or 'no output'}"


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (nothing where there is no ``fcntl``)."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_json(path: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` whole or not at all (a temporary file, renamed)."""
    fd, tmp = tempfile.mkstemp(prefix=".outcome-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fingerprint(library: str) -> Optional[Dict[str, Any]]:
    """Size and SHA-256 of ``library`` (None where it cannot be read): what ``ok.json`` records."""
    digest = hashlib.sha256()
    try:
        with open(library, "rb") as f:
            size = 0
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                size += len(block)
    except OSError:
        return None
    return {"size": size, "sha256": digest.hexdigest()}

