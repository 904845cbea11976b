"""tools/house_report.py: its figures parse, and it finds what is planted in a package of its own."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "house_report.py")


def _run(*args):
    r = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120, check=True)
    return r.stdout


def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_the_repository_report_parses_and_adds_up():
    doc = json.loads(_run("--json"))
    assert doc["modules"] > 50
    state = doc["mutable_state"]
    assert state["total"] == sum(len(v) for v in state["by_module"].values())
    assert state["modules"] == len(state["by_module"])
    assert all(isinstance(c, list) and len(c) > 1 for c in doc["circles"])
    for imp in doc["against_layering"]:
        assert set(imp) == {"importer", "target", "line", "lazy"} and imp["importer"] != imp["target"]
    text = _run()
    assert f"{doc['modules']} modules" in text and f"import circles: {len(doc['circles'])}" in text


def test_a_planted_circle_through_a_function_level_import_is_found(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .a import x\n    return x\n",
        "pkg/c.py": "import pkg.a\n",
    })
    doc = json.loads(_run("--json", "--root", str(tmp_path), "--packages", "pkg"))
    assert doc["circles"] == [["pkg.a", "pkg.b"]]
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    assert json.loads(_run("--json", "--root", str(tmp_path), "--packages", "pkg"))["circles"] == []


def test_state_and_imports_against_the_layering_are_found(tmp_path):
    _write(tmp_path, {
        "gluon_amp_core/__init__.py": "",
        "gluon_amp_core/pure.py": "import json\n\ndef f():\n    import numpy\n",
        "gluon_amp/__init__.py": "",
        "gluon_amp/patching/__init__.py": "",
        "gluon_amp/training/__init__.py": "",
        "gluon_amp/training/trainer.py": (
            "import threading\nimport weakref\nfrom .. import patching\n"
            "TABLE = {'a': 1}\n_LOCK = threading.Lock()\n_seen = set()\n_by_trainer = weakref.WeakKeyDictionary()\n"
            "_count = 0\n\ndef bump():\n    global _count\n    _count += 1\n"),
    })
    doc = json.loads(_run("--json", "--root", str(tmp_path)))
    against = {(i["importer"], i["target"]) for i in doc["against_layering"]}
    assert against == {("gluon_amp_core.pure", "numpy"), ("gluon_amp.training.trainer", "gluon_amp.patching")}
    assert [i["lazy"] for i in doc["against_layering"] if i["target"] == "numpy"] == [True]
    state = {"gluon_amp.training.trainer": ["_LOCK", "_by_trainer", "_count", "_seen"]}  # TABLE is a constant
    assert doc["mutable_state"]["by_module"] == state
    assert doc["locks"]["by_module"] == {"gluon_amp.training.trainer": ["_LOCK"]}
