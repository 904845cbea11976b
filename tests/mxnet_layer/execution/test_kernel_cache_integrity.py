"""A cached emulation kernel is verified before use (issue 42, item 13).

``ok.json`` records the library's size and SHA-256; a library cut short (a crash or power
loss after the build was recorded) or changed is built again instead of being loaded (a cut
``.so`` kills the loading process with SIGBUS). Stand-in compiler and check: nothing is compiled.
"""
import json
import os
import stat

from gluon_amp import mxnet_internals as mxi
from gluon_amp.emulation_kernel import build


def _compiler(tmp_path):
    """A stand-in C++ compiler that writes a 64 KiB 'library' to its ``-o`` and logs each build."""
    log = tmp_path / "okcc.log"
    script = tmp_path / "okcc"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "okcc 1.0"; exit 0; fi
echo build >> "{log}"
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then head -c 65536 /dev/urandom > "$2"; exit 0; fi
  shift
done
exit 1
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), log


def _calls(log):
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_cut_or_changed_cached_library_is_built_again_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_check", lambda library, env: None)  # the stand-in passes its check
    cxx, log = _compiler(tmp_path)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": cxx}
    facts = mxi.mxnet_build_facts()
    first = build.ensure(facts, env)
    assert first.library is not None and _calls(log) == 1
    recorded = json.loads(next((tmp_path / "cache").rglob("ok.json")).read_text())
    assert recorded["library"]["size"] == 65536
    assert build.ensure(facts, env).library == first.library and _calls(log) == 1  # cached, whole

    with open(first.library, "r+b") as f:  # cut short after the build was recorded
        f.truncate(4096)
    again = build.ensure(facts, env)
    assert _calls(log) == 2 and again.library == first.library and os.path.getsize(again.library) == 65536

    data = bytearray(open(first.library, "rb").read())  # same size, one byte changed
    data[100] ^= 0xFF
    open(first.library, "wb").write(bytes(data))
    build.ensure(facts, env)
    assert _calls(log) == 3
    assert json.loads(next((tmp_path / "cache").rglob("ok.json")).read_text())["library"] == build._fingerprint(
        first.library)
    assert not [p for p in (tmp_path / "cache").rglob(".*") if p.name not in (".lock",)]  # no temporaries left
