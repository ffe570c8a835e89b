"""The app's settings are looked up only where Celery or the user hands the code an app.

``config/`` builds one LeaseConfig per app on first use (docs/architecture.md, "The
settings are read once per app"); each entry point below takes it there and hands it,
or the values it needs, down to the modules it calls. Read from the source with ast.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.source import parse

ROOT = Path(__file__).resolve().parents[2] / "celery_leases"
LOOKUPS = {"client_config", "get_config"}

#: Module -> the entry point it is: the only modules that look the settings up by app.
ENTRY_POINTS = {
    "install.py": "install(app) and store(app)",
    "runtime.py": "the process's store for an app, built on first use",
    "task/leased.py": "LeasedTask's methods, which Celery calls with the task's app",
    "worker/steps.py": "the worker's bootsteps",
    "worker/startup.py": "the worker's start-up signal handlers",
    "publishing/tracking.py": "the publish hooks kombu and Celery call",
    "recovery/beat.py": "the beat schedule's recovery task",
    "outbox/__init__.py": "outbox.send(conn, sig, app=...) and the relay's table",
    "ops/diagnosis.py": "diagnose(app), the doctor",
    "cli/base.py": "the celery leases commands",
    "cli/maintenance.py": "the celery leases commands",
    "cli/outbox.py": "the celery leases commands",
}


def _lookups(path: Path) -> bool:
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in LOOKUPS:
                return True
    return False


def test_only_the_entry_points_look_the_settings_up_by_app():
    # Given every module of the package but config/ itself
    found = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
             if path.relative_to(ROOT).parts[0] != "config" and _lookups(path)}
    # Then the modules that look the settings up are exactly the entry points: a module below
    # them (recovery, parking, tracing, the protocol) is handed what it needs
    below, stale = found - set(ENTRY_POINTS), set(ENTRY_POINTS) - found
    assert below == set(), f"settings looked up below the entry points: {below}"
    assert stale == set(), f"entry points listed that no longer look the settings up: {stale}"


def test_the_checker_sees_a_lookup(tmp_path: Path):
    # Given a module calling client_config, as attribute or name, Then it is seen
    (tmp_path / "m.py").write_text("from x import config\nconfig.client_config(app).ttl\n")
    (tmp_path / "n.py").write_text("get_config = 1\n")
    assert _lookups(tmp_path / "m.py") and not _lookups(tmp_path / "n.py")
