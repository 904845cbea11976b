"""The house in figures: process state, imports against the layering, and import circles.

Run from anywhere: ``python tools/house_report.py`` (text) or ``--json`` (one JSON document).
It reads the source only (``ast``), imports nothing of the packages, and needs no MXNet.

- **Module-level mutable state**: a name bound at module level to a mutable object (a list,
  dict or set display or comprehension, or a call of ``list``/``dict``/``set``/``WeakSet``/
  ``WeakKeyDictionary``/``WeakValueDictionary``/``defaultdict``/``OrderedDict``/``deque``/
  ``Counter``/``threading.local``, or a lock), unless it is an UPPER_CASE constant that the
  module never changes (no item assignment, no mutating method call on it, no ``global``); and
  every name a function rebinds with ``global``. Locks are also counted on their own.
- **Imports against the layering**: every import (function-level ones included) whose target
  sits in a higher layer than its importer, or in another unit of the same layer (peers do not
  import each other), by :data:`LAYERS`; and anything in ``gluon_amp_core`` that imports
  ``gluon_amp``, ``mxnet`` or ``numpy``.
- **Import circles**: strongly connected components of the module graph (every import, at
  module or function level; an import of ``a.b.c`` counts as an edge to ``a.b.c`` only, not to
  the packages ``a`` and ``a.b`` it also runs).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("gluon_amp", "gluon_amp_core")

#: The intended layers of gluon_amp, lowest first. A module may import its own unit (a unit is
#: a package or a module named here) and any unit of a lower layer; an import of a higher
#: layer, or of another unit of the same layer, runs against the layering (except in the top
#: layer: a program may run another's code). A module belongs to the unit of its nearest named
#: parent; ``gluon_amp`` names the package's ``__init__`` only, so a new module of gluon_amp's
#: top level is listed as in no layer until it is placed here.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("the pure core", ("gluon_amp_core",)),
    ("numpy's aliases, before MXNet loads", ("gluon_amp._numpy_shim",)),
    ("process state", ("gluon_amp.state",)),
    ("what is kept beside a plan", ("gluon_amp.plan_notes",)),
    ("the door to MXNet", ("gluon_amp._compat", "gluon_amp.mxnet_internals")),
    ("MXNet's services", ("gluon_amp.type_inference", "gluon_amp.emulation_kernel")),
    ("measuring", ("gluon_amp.speed",)),
    ("the machine", ("gluon_amp.runtime",)),
    ("policy, emulation and tuning", ("gluon_amp.policy_builder", "gluon_amp.lists_api", "gluon_amp.emulation",
                                      "gluon_amp.tuning")),
    ("execution, where MXNet binds a plan", ("gluon_amp.execution",)),
    ("the features, peers", ("gluon_amp.patching", "gluon_amp.training", "gluon_amp.convert")),
    ("composing the features (Apex's initialize)", ("gluon_amp.opt_levels",)),
    ("reading the features", ("gluon_amp.reporting", "gluon_amp.debug", "gluon_amp.conformance")),
    ("the launcher", ("gluon_amp.launch",)),
    ("the public API and the programs (python -m)", (
        "gluon_amp", "gluon_amp.run", "gluon_amp.convert.cli", "gluon_amp.convert.__main__", "gluon_amp.debug.cli",
        "gluon_amp.debug.__main__", "gluon_amp.emulation_kernel.selftest", "gluon_amp.conformance.__main__")),
)
#: What the pure core never imports.
CORE_FORBIDDEN = ("gluon_amp", "mxnet", "numpy")

MUTABLE_CALLS = {"Held", "list", "dict", "set", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "defaultdict",
                 "OrderedDict", "deque", "Counter", "local", "Lock", "RLock", "Condition", "Semaphore"}
#: Calls of a class that give no process state.
NOT_STATE_CALLS = {"TypeVar", "NamedTuple", "ContextVar", "Enum", "Path", "Decimal", "Fraction", "MappingProxyType"}
LOCK_CALLS = {"Lock", "RLock", "Condition", "Semaphore"}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard",
            "clear", "appendleft", "popleft", "__setitem__"}


@dataclass
class Module:
    name: str
    path: str
    is_package: bool
    tree: ast.Module


@dataclass
class Import:
    importer: str
    target: str
    line: int
    lazy: bool  # inside a function or method


@dataclass
class Report:
    modules: int
    state: Dict[str, List[str]] = field(default_factory=dict)
    locks: Dict[str, List[str]] = field(default_factory=dict)
    against_layering: List[Import] = field(default_factory=list)
    circles: List[List[str]] = field(default_factory=list)
    unplaced: List[str] = field(default_factory=list)


def find_modules(root: str, packages: Sequence[str]) -> Dict[str, Module]:
    """Every ``.py`` file of ``packages`` under ``root``, by dotted name."""
    found = {}
    for pkg in packages:
        for d, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_package else parts)
                with open(path, encoding="utf-8") as fh:
                    found[name] = Module(name, path, is_package, ast.parse(fh.read(), path))
    return found


def _lazy_nodes(tree: ast.AST) -> Set[int]:
    """ids of the import nodes inside a function body."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def imports(mod: Module, known: Iterable[str]) -> List[Import]:
    """The modules ``mod`` imports, resolved (relative imports; ``from pkg import submodule``)."""
    known = set(known)
    lazy = _lazy_nodes(mod.tree)
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(mod.name, alias.name, node.lineno, id(node) in lazy))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if len(subs) < len(node.names) or not subs:  # names taken from the module itself
                out.append(Import(mod.name, target, node.lineno, id(node) in lazy))
            out.extend(Import(mod.name, s, node.lineno, id(node) in lazy) for s in subs)
    return out


EXACT_UNITS = {"gluon_amp"}


def unit_of(name: str) -> Optional[Tuple[int, str]]:
    """The (layer index, unit) of a module name, or None outside :data:`LAYERS`."""
    best = None
    for i, (_, units) in enumerate(LAYERS):
        for u in units:
            inside = name == u or (u not in EXACT_UNITS and name.startswith(u + "."))
            if inside and (best is None or len(u) > len(best[1])):
                best = (i, u)
    return best


def against_layering(imp: Import) -> bool:
    if imp.importer.split(".")[0] == "gluon_amp_core":
        return imp.target.split(".")[0] in CORE_FORBIDDEN
    src, dst = unit_of(imp.importer), unit_of(imp.target)
    if src is None or dst is None or src[1] == dst[1]:
        return False
    return dst[0] > src[0] or (dst[0] == src[0] and dst[0] < len(LAYERS) - 1)


def module_state(mod: Module) -> Tuple[List[str], List[str]]:
    """(the module's mutable state names, its locks)."""
    bound: Dict[str, str] = {}  # name -> "lock" / "mutable" / "instance"
    for stmt in mod.tree.body:
        targets, value = [], None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        kind = _mutable_kind(value)
        for t in targets:
            if kind and isinstance(t, ast.Name):
                bound[t.id] = kind
    declared_global: Set[str] = set()
    changed: Set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    changed.add(t.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
    state = {n for n, k in bound.items()
             if not (n.startswith("__") and n.endswith("__"))
             and (k == "lock" or n in changed or n in declared_global
                  or (k == "mutable" and not n.isupper()) or (k == "instance" and n.startswith("_")))}
    state |= declared_global
    locks = sorted(n for n, k in bound.items() if k == "lock")
    return sorted(state), locks


def _mutable_kind(value: Optional[ast.AST]) -> Optional[str]:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return "mutable"
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name in LOCK_CALLS:
            return "lock"
        if name in MUTABLE_CALLS:
            return "mutable"
        if name and name.lstrip("_")[:1].isupper() and name not in NOT_STATE_CALLS:
            return "instance"
    return None


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def build(root: str = ROOT, packages: Sequence[str] = PACKAGES) -> Report:
    mods = find_modules(root, packages)
    report = Report(modules=len(mods))
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for m in mods.values():
        if unit_of(m.name) is None:
            report.unplaced.append(m.name)
        state, locks = module_state(m)
        if state:
            report.state[m.name] = state
        if locks:
            report.locks[m.name] = locks
        for imp in imports(m, mods):
            if imp.target in mods and imp.target != m.name:
                graph[m.name].add(imp.target)
            if against_layering(imp):
                report.against_layering.append(imp)
    report.circles = circles(graph)
    return report


def as_dict(r: Report) -> dict:
    return {"modules": r.modules,
            "mutable_state": {"total": sum(map(len, r.state.values())), "modules": len(r.state), "by_module": r.state},
            "locks": {"total": sum(map(len, r.locks.values())), "by_module": r.locks},
            "against_layering": [{"importer": i.importer, "target": i.target, "line": i.line, "lazy": i.lazy}
                                 for i in r.against_layering],
            "circles": r.circles,
            "in_no_layer": r.unplaced,
            "layers": [{"layer": n, "units": list(u)} for n, u in LAYERS]}


def as_text(r: Report) -> str:
    d = as_dict(r)
    lines = [f"{r.modules} modules"]
    lines.append(f"module-level mutable state: {d['mutable_state']['total']} names in {len(r.state)} modules "
                 f"({d['locks']['total']} locks)")
    lines += [f"  {m}: {', '.join(names)}" for m, names in sorted(r.state.items())]
    lines.append(f"imports against the layering: {len(r.against_layering)}")
    lines += [f"  {i.importer} -> {i.target} (line {i.line}{', in a function' if i.lazy else ''})"
              for i in r.against_layering]
    lines.append(f"import circles: {len(r.circles)}")
    lines += [f"  {' <-> '.join(c)}" for c in r.circles]
    if r.unplaced:
        lines.append(f"modules in no layer (add them to LAYERS): {', '.join(r.unplaced)}")
    lines.append("layers, lowest first: " + " < ".join(n for n, _ in LAYERS))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT, help="the directory that holds the packages (default: this repository)")
    ap.add_argument("--packages", nargs="+", default=list(PACKAGES), help="top-level packages to read")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args(argv)
    r = build(a.root, a.packages)
    print(json.dumps(as_dict(r), indent=1) if a.json else as_text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
