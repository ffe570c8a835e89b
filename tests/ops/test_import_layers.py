"""The package's import graph has no circles, and the protocol imports nothing above it.

Read from the source with ast, not by importing. Imports at module level and
inside functions (where a circle hides until the function runs) count for both
rules. Imports under ``if TYPE_CHECKING`` count for the layer rules (a type
import back up a layer still couples the layers), not for circles: they never
run, and a helper module typing the one class that calls it (the store's
recovery, renewals and admin functions take the store) is not a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source import parse

PACKAGE = "celery_leases"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: What the Celery-free protocol package may import of this package besides itself.
PROTOCOL = f"{PACKAGE}.protocol"
#: ``defaults`` holds plain constants (one source of every default, for the store and the
#: settings alike) and imports nothing.
PROTOCOL_MAY_IMPORT = {f"{PACKAGE}.exceptions", f"{PACKAGE}.defaults"}
#: Third-party top-level packages the protocol must not import (it runs without Celery).
CELERY_PACKAGES = {"celery", "kombu", "billiard"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (before its imported names)."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return found


def imports(name: str, path: Path, known: set[str], *, typing: bool = True) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; names of the package resolved
    to the module they load (``from . import x`` is module ``x`` when ``x`` is one).
    ``typing=False`` leaves out the imports under ``if TYPE_CHECKING``."""
    out: list[tuple[str, int]] = []
    tree = parse(path)
    skip = set() if typing else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def graph(*, typing: bool = True) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: first line}."""
    found = modules()
    known = set(found)
    edges: dict[str, dict[str, int]] = {}
    for name, path in found.items():
        targets = edges.setdefault(name, {})
        for target, line in imports(name, path, known, typing=typing):
            if target in known and target != name:
                targets.setdefault(target, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected group of more than one module, as one circle through it
    followed by the group's other modules (each lies on a circle with the first)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is small enough to recurse
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.add(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_circle(group, edges) + sorted(group - set(_circle(group, edges))) for group in groups]


def _circle(group: set[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One circle inside ``group``, from its first module back to it (breadth-first: shortest)."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges[node]):
            if nxt == start:
                return paths[node] + [start]
            if nxt in group and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return sorted(group)


def _describe(found: list[str], edges: dict[str, dict[str, int]]) -> str:
    """``a (line n) -> b (line m) -> a``, then the other modules caught in the same tangle."""
    end = found.index(found[0], 1)
    circle, others = found[:end + 1], found[end + 1:]
    text = " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"
    return text + (f"; also on circles with it: {', '.join(others)}" if others else "")


def test_the_package_has_no_import_circles():
    edges = graph(typing=False)
    found = cycles(edges)
    assert not found, "import circles:\n" + "\n".join(_describe(c, edges) for c in found)


def test_the_protocol_imports_nothing_of_the_package_but_itself_the_exceptions_and_defaults():
    found = modules()
    known = set(found)
    protocol = {name: path for name, path in found.items()
                if name == PROTOCOL or name.startswith(PROTOCOL + ".")}
    wrong = []
    for name, path in sorted(protocol.items()):
        for target, line in imports(name, path, known):
            top = target.partition(".")[0]
            inside = target == PROTOCOL or target.startswith(PROTOCOL + ".") or target in PROTOCOL_MAY_IMPORT
            if (top == PACKAGE and not inside) or top in CELERY_PACKAGES:
                wrong.append(f"{name} imports {target} (line {line})")
    assert not wrong, "celery_leases.protocol must stay below the wiring:\n" + "\n".join(wrong)


#: Modules and packages below the worker wiring: the store registry, recovery's Celery side
#: (what it publishes with, parks, and when a pass runs) and the shared outage log.
BELOW_THE_WIRING = ("runtime", "recovery", "outage")
#: What they must not reach, even through another module: the wiring, the publisher side
#: and the tools above them.
ABOVE = ("worker", "task", "publishing", "install", "cli", "ops", "testing")
#: The layer packages: none of them imports ``install`` (the composition root imports them).
LAYERS = ("task", "publishing", "recovery", "ops", "worker", "outbox", "config", "runtime")
def package_of(module: str) -> str:
    """``celery_leases.task.leased`` -> ``task``; a top-level module is its own unit."""
    return module.split(".")[1] if module.count(".") else "<root>"


def package_graph(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The import graph between top-level packages (and top-level modules), from ``edges``;
    the package's own ``__init__`` (the lazy public names) is left out."""
    found: dict[str, dict[str, int]] = {}
    for name, targets in edges.items():
        if name == PACKAGE:
            continue
        for target in targets:
            a, b = package_of(name), package_of(target)
            found.setdefault(a, {})
            if a != b and b != "<root>":
                found[a].setdefault(b, 1)
    return found


def test_no_layer_package_imports_install():
    edges = graph()
    wrong = [f"{name} imports {target} (line {line})"
             for name, targets in sorted(edges.items()) if package_of(name) in LAYERS
             for target, line in targets.items() if target == f"{PACKAGE}.install"]
    assert not wrong, "install.py wires the layers; none imports it back:\n" + "\n".join(wrong)


def test_the_top_level_packages_import_no_circle():
    found = cycles(package_graph(graph(typing=False)))
    assert found == [], f"circles between packages: {found}"


def reachable(edges: dict[str, dict[str, int]], start: str) -> dict[str, list[str]]:
    """Module -> the import path from ``start`` to it, for every module ``start`` loads."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return paths


def test_the_store_registry_and_recovery_import_nothing_above_them():
    edges = graph()
    wrong = []
    starts = [name for name in edges for low in BELOW_THE_WIRING
              if name == f"{PACKAGE}.{low}" or name.startswith(f"{PACKAGE}.{low}.")]
    for start in sorted(starts):
        for target, path in reachable(edges, start).items():
            if target.partition(".")[2].split(".")[0] in ABOVE:  # celery_leases.<ABOVE>[.*]
                wrong.append(" -> ".join(path))
    assert not wrong, "imports running back up a layer:\n" + "\n".join(wrong)


def test_the_checks_see_a_circle_and_a_protocol_import_up(tmp_path):
    # The graph code itself: a circle of three is found and named in order.
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert _describe(["a", "b", "c", "a"], edges) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    # And relative imports resolve as Python does (package __init__ vs plain module).
    source = "from . import x\nfrom ..y import z\nfrom .w import v\n"
    init = tmp_path / "__init__.py"
    init.write_text(source)
    mod = tmp_path / "m.py"
    mod.write_text(source)
    known = {"p.q.x", "p.y", "p.q.w"}
    assert [t for t, _ in imports("p.q", init, known)] == ["p.q.x", "p.y", "p.q.w"]
    assert [t for t, _ in imports("p.q.m", mod, known)] == ["p.q.x", "p.y", "p.q.w"]


def test_the_chaos_suite_imports_nothing_of_the_tests():
    # chaos/ runs on its own (make chaos): it may use the package, never tests/.
    chaos = ROOT.parent / "chaos"
    wrong = []
    for path in sorted(chaos.rglob("*.py")):
        for node in ast.walk(parse(path)):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{path.name} imports {name} (line {node.lineno})"
                      for name in names if name.partition(".")[0] == "tests"]
    assert not wrong, "chaos/ must not depend on tests/:\n" + "\n".join(wrong)
