"""examples/pytest_celery/ run as a user runs it: pytest-celery's celery_setup on local processes.

pytest-celery comes from ``.pytest-celery/`` (tests/support/pytest_celery_lib.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import pytest_celery_lib

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytest_celery"


def test_the_pytest_celery_example_passes_without_docker(pytester: pytest.Pytester, monkeypatch):
    for path in EXAMPLE.iterdir():
        if path.is_file():
            shutil.copy(path, pytester.path / path.name)
    lib = pytest_celery_lib.require()
    monkeypatch.setenv("PYTHONPATH", f"{lib}:{Path(__file__).resolve().parents[2]}")
    # Nothing may reach Docker: an unset daemon address makes any attempt fail loudly.
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", timeout=240)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 4 and not outcomes.get("failed"), failure_digest(result.outlines)


def failure_digest(lines: list[str]) -> str:
    """The inner run's errors first (``E`` lines, FAILED lines), then its failure reports with
    the workers' logs: a CI log that keeps only the start of a failure still shows why."""
    key = [line for line in lines if line.startswith(("E ", "FAILED", "ERROR"))]
    return "\n".join(["inner run failed:", *key[:40], "", *lines])
