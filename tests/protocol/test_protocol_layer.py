"""The protocol package stays Celery-free and does not reach back up a layer.

``celery_leases.protocol`` is the part a web tier, a script or the CLI can use
without Celery (docs/architecture.md, DESIGN: "importing it loads no Celery").
Two checks hold that: importing it (and each module of it) in a fresh
interpreter loads no ``celery``/``kombu`` module, and its modules import nothing
of this package outside ``celery_leases.protocol`` except two Celery-free leaves,
``celery_leases.exceptions`` (the public exception hierarchy) and
``celery_leases.defaults`` (the documented default of every setting).
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import celery_leases.protocol
from tests.support.source import parse

PROTOCOL_DIR = Path(celery_leases.protocol.__file__).resolve().parent
MODULES = ["celery_leases.protocol"] + sorted(
    f"celery_leases.protocol.{path.stem}" for path in PROTOCOL_DIR.glob("*.py") if path.stem != "__init__")
ALLOWED_OUTSIDE = {"celery_leases.exceptions", "celery_leases.defaults"}

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu"))))
"""


@pytest.mark.parametrize("module", MODULES)
def test_importing_a_protocol_module_loads_no_celery(module):
    # Given a fresh interpreter; When it imports one protocol module;
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    # Then no Celery or kombu module came with it.
    assert json.loads(out.strip().splitlines()[-1]) == [], f"{module} loads Celery: {out}"


def imports_of(nodes) -> set[str]:
    """Absolute names of the celery_leases modules the import statements among ``nodes`` name."""
    package = "celery_leases.protocol"
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if node.module:
                names.add(target)
            else:  # "from .. import defaults": the names are modules of that package
                names.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "celery_leases"}


def imported_modules(path: Path) -> set[str]:
    """The celery_leases modules ``path`` imports, at any depth of its code."""
    return imports_of(ast.walk(parse(path)))


@pytest.mark.parametrize("path", sorted(PROTOCOL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_protocol_imports_stay_in_the_protocol(path):
    # Given a protocol module's own import statements (inside functions too);
    outside = {name for name in imported_modules(path)
               if not (name == "celery_leases.protocol" or name.startswith("celery_leases.protocol."))
               and name not in ALLOWED_OUTSIDE}
    # Then none reaches up into the Celery wiring.
    assert not outside, f"{path.name} imports {sorted(outside)} from outside celery_leases.protocol"


def test_the_layer_check_sees_relative_imports():
    # The check itself: ".." from protocol is the package, "." is the protocol.
    source = PROTOCOL_DIR / "store.py"
    assert "celery_leases.exceptions" in imported_modules(source)
    assert any(name.startswith("celery_leases.protocol.") for name in imported_modules(source))


def module_level_imports(path: Path) -> set[str]:
    """The protocol modules ``path`` imports as it loads (not inside functions or TYPE_CHECKING)."""
    body = [node for node in parse(path).body
            if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))]
    return {name for name in imports_of(body) if name.startswith("celery_leases.protocol.")}


def test_the_protocol_modules_import_no_circle():
    # Given what each protocol module imports as it loads
    graph = {f"celery_leases.protocol.{p.stem}": module_level_imports(p)
             for p in PROTOCOL_DIR.glob("*.py") if p.stem != "__init__"}
    # Then following those imports never leads back to where it started
    def visit(name: str, path: list[str]) -> None:
        for target in graph.get(name, ()):
            assert target not in path, "import circle: " + " -> ".join(path + [target])
            visit(target, path + [target])
    for name in graph:
        visit(name, [name])
