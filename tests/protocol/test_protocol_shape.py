"""The protocol package's shape: no import circle inside it, and no module over 400 lines.

Read from the source with ``ast``, not by importing. Stricter than
tests/ops/test_import_layers.py for this package: imports under ``if TYPE_CHECKING``
count too, so a helper that types the store calling it (the circle issue #32 found
between the store and its admin, recovery and renewals helpers) fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source import parse

PACKAGE = "celery_leases.protocol"
ROOT = Path(__file__).resolve().parents[2] / "celery_leases" / "protocol"
#: docs/architecture.md: "No module over about 400 lines".
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the protocol package, subpackages included."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the protocol package that ``path`` imports, anywhere in the file (module
    level, inside functions, under TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{node.module}" if node.module else anchor
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out.update(subs or ([base] if base in known else []))
            if len(subs) < len(names) and base in known:
                out.add(base)
    out.discard(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def test_the_protocol_package_has_no_import_circle():
    # Given every import of every protocol module, TYPE_CHECKING ones included
    found = modules()
    graph = {name: imported(name, path, set(found)) for name, path in found.items()}
    assert graph[f"{PACKAGE}.store"] >= {f"{PACKAGE}.core", f"{PACKAGE}.admin"}  # the walk sees imports

    # When it is searched for a circle, Then there is none
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in the protocol: " + " -> ".join(cycle or [])


def test_the_cycle_search_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_protocol_module_is_over_400_lines():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for path in modules().values()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
