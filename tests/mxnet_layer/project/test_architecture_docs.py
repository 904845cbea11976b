"""Docs that cannot drift: docs/architecture.md names every module, and every reference to a
Python object in a docstring or a doc page resolves to a real one.

- Every module of ``gluon_amp`` and ``gluon_amp_core`` is named in the module tree of
  docs/architecture.md by its path inside its package (``speed/probe.py``; a package by its
  folder, ``speed/``; ``{a,b}`` lists alternatives), under that package's line.
- Every Sphinx role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:data:``, ``:attr:``,
  ``:exc:``) and every ````gluon_amp...```` literal in the packages' source, and every
  ```gluon_amp...``` code span and ``gluon_amp/...py`` path in README.md and docs/*.md, names an
  object that exists: ``~`` and a leading ``.`` (relative to the module, then its packages)
  are resolved as Sphinx does; an unqualified name is looked up from the module it is in.
"""
import ast
import importlib
import os
import re
from typing import List, Optional, Tuple

import pytest

from helpers import ROOT
PACKAGES = ("gluon_amp", "gluon_amp_core")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))

ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|data|attr|exc|obj):`([^`<>]+?)`")
LITERAL = re.compile(r"``((?:gluon_amp|gluon_amp_core)\.[\w.]+)(?:\(\))?``")
SPAN = re.compile(r"(?<!`)`((?:gluon_amp|gluon_amp_core)\.[\w.]+)(?:\(\))?`(?!`)")
PATH = re.compile(r"\b((?:gluon_amp|gluon_amp_core)/[\w/]+\.py)\b")


def _modules() -> List[Tuple[str, str]]:
    """(package, path inside it) of every module, e.g. ("gluon_amp", "speed/probe.py")."""
    out = []
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            out += [(pkg, os.path.relpath(os.path.join(d, f), os.path.join(ROOT, pkg)).replace(os.sep, "/"))
                    for f in sorted(files) if f.endswith(".py")]
    return out


def _expand(token: str) -> List[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in _expand(token[:m.start()] + alt.strip() + token[m.end():])]


def _tree_names(text: str) -> dict:
    """package -> the paths its lines of the module tree name."""
    block = re.search(r"## Modules\s*```\n(.*?)```", text, flags=re.S)
    assert block, "docs/architecture.md has no module tree (a ``` block under '## Modules')"
    names, pkg = {}, None
    for line in block.group(1).splitlines():
        if line and not line[0].isspace():
            pkg = line.split()[0].rstrip("/")
            names.setdefault(pkg, set())
            continue
        if pkg is None:
            continue
        for token in re.findall(r"[\w{},/.]*[\w}]/[\w{},/.]*|[\w{},/.]*\.py\b", line):
            names[pkg].update(_expand(token.strip(",.")))
    return names


def test_every_module_is_named_in_the_architecture():
    with open(ARCHITECTURE) as f:
        named = _tree_names(f.read())
    missing = []
    for pkg, rel in _modules():
        want = rel[: -len("__init__.py")] if rel.endswith("/__init__.py") else rel
        if rel == "__init__.py":
            continue  # the package itself: its line in the tree
        if want not in named.get(pkg, ()):
            missing.append(f"{pkg}/{want}")
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"


def test_the_architecture_says_what_the_import_graph_holds():
    """The doc's claims on circles match tools/house_report.py's figures, both ways."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "house_report.py"), "--json", "--root", ROOT],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    doc = json.loads(out)
    with open(ARCHITECTURE) as f:
        text = f.read()
    if doc["circles"]:
        assert "no import circle" not in text, f"the doc claims no import circle; there are {doc['circles']}"
    for circle in doc["circles"]:
        assert " <-> ".join(circle) in text, f"the doc does not name the circle {circle}"
    named = re.findall(r"(gluon_amp[\w.]*(?: <-> gluon_amp[\w.]*)+)", text)
    gone = [c for c in named if c.split(" <-> ") not in doc["circles"]]
    assert not gone, f"the doc names circles that are no more: {gone}"


def _module_file(name: str) -> Optional[str]:
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def _exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reachable from one."""
    parts = dotted.split(".")
    if not all(parts):
        return False
    if parts[0] in PACKAGES:
        if _module_file(dotted):
            return True  # a module of ours: found without running it (run.py, __main__)
        for i in range(len(parts) - 1, 0, -1):
            if _module_file(".".join(parts[:i])):
                return _attr_chain(importlib.import_module(".".join(parts[:i])), parts[i:])
        return False
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _attr_chain(obj, parts[i:])
    return False


def _attr_chain(obj, names) -> bool:
    for n in names:
        if hasattr(obj, n):
            obj = getattr(obj, n)
            continue
        fields = getattr(obj, "__dataclass_fields__", {})
        annotations = {k for c in getattr(obj, "__mro__", ()) for k in getattr(c, "__annotations__", {})}
        if n in fields or n in annotations or (isinstance(obj, type) and n in _instance_attrs(obj)):
            return n == names[-1]
        return False
    return True


def _instance_attrs(cls) -> set:
    """Names the class's methods assign on ``self``."""
    import inspect
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", src))


def _resolves(target: str, module: Optional[str]) -> bool:
    target = target.strip().lstrip("~!").removesuffix("()")
    if target.startswith("."):
        target = target[1:]
        scopes = []
        while module:
            scopes.append(module)
            module = module.rpartition(".")[0]
        return any(_exists(f"{s}.{target}") for s in scopes)
    if module and not target.startswith(PACKAGES):
        scope = module
        while scope:
            if _exists(f"{scope}.{target}"):
                return True
            scope = scope.rpartition(".")[0]
    return _exists(target) or _exists(f"builtins.{target}")


def _class_scopes(text: str, module: str) -> List[Tuple[int, int, str]]:
    """(first line, last line, dotted name) of every class in a module's source."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                out.append((child.lineno, child.end_lineno, f"{prefix}.{child.name}"))
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix)
    visit(ast.parse(text), module)
    return out


def _scope(classes, line: int, module: str) -> str:
    """The innermost class around ``line``, else the module: where an unqualified name is looked up."""
    inside = [c for c in classes if c[0] <= line <= c[1]]
    return max(inside, key=lambda c: c[0])[2] if inside else module


def _source_references():
    for pkg, rel in _modules():
        path = os.path.join(ROOT, pkg, rel)
        module = f"{pkg}.{rel[:-3].replace('/', '.')}".removesuffix(".__init__")
        with open(path) as f:
            text = f.read()
        classes = _class_scopes(text, module)
        for m in ROLE.finditer(text):
            line = text.count(chr(10), 0, m.start()) + 1
            yield f"{pkg}/{rel}:{line}", m.group(0), m.group(2), _scope(classes, line, module)
        for m in LITERAL.finditer(text):
            yield f"{pkg}/{rel}:{text.count(chr(10), 0, m.start()) + 1}", m.group(0), m.group(1), None


def _page_references():
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for m in SPAN.finditer(text):
            yield f"{page}:{text.count(chr(10), 0, m.start()) + 1}", m.group(0), m.group(1)
        for m in PATH.finditer(text):
            yield f"{page}:{text.count(chr(10), 0, m.start()) + 1}", m.group(0), m.group(1)


def test_every_reference_in_a_docstring_resolves():
    broken = [f"{where}: {shown}" for where, shown, target, module in _source_references()
              if not _resolves(target, module)]
    assert not broken, "references to nothing:\n" + "\n".join(broken)


def test_every_module_or_object_a_doc_page_names_exists():
    broken = [f"{where}: {shown}" for where, shown, target in _page_references()
              if not (os.path.exists(os.path.join(ROOT, target)) if "/" in target else _resolves(target, None))]
    assert not broken, "names of nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize("role, module, ok", [
    (":func:`gluon_amp_core.decide.decide`", None, True),
    (":func:`~gluon_amp_core.decide.decide`", None, True),
    (":class:`Policy`", "gluon_amp_core.policy", True),
    (":func:`.decide`", "gluon_amp_core.policy", True),
    (":mod:`gluon_amp.run`", None, True),
    (":func:`gluon_amp_core.capability.resolve_target`", None, False),
    (":mod:`gluon_amp.wrappers`", None, False),
    (":class:`Nowhere`", "gluon_amp_core.policy", False),
])
def test_the_resolver_itself(role, module, ok):
    m = ROLE.match(role)
    assert m and _resolves(m.group(2), module) is ok
