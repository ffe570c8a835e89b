"""Fixtures of the operator tests: the ``celery leases`` command as a real subprocess."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.workers import CELERY, ROOT

#: The app module the commands run against (-A).
TASKS = "tests.support.apps.leased_app"


@pytest.fixture
def cli(celery_env):
    """cli("ls", "--json") -> CompletedProcess of `celery -A tests.support.apps.leased_app leases ls --json`."""
    def run(*args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CELERY, "-A", TASKS, "leases", *args], cwd=str(ROOT), capture_output=True, text=True,
            input=input, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env, **env})
    return run


@pytest.fixture
def registry():
    """A Prometheus registry of the test's own (tests/ops/test_metrics*.py)."""
    prometheus_client = pytest.importorskip("prometheus_client",
                                            reason="pip install -e '.[test]' installs prometheus-client")
    return prometheus_client.CollectorRegistry()


@pytest.fixture
def metrics(client_app, registry):
    """celery-leases' metrics of ``client_app`` exported to ``registry``; disabled after the test."""
    from celery_leases.ops.metrics import enable_prometheus
    m = enable_prometheus(client_app, registry)
    yield m
    m.disable()
