"""pytest plugin for Celery's own integration suite: every test app is leased.

Loaded with ``-p tests.celery_suite.leased`` by ``run.py``. Celery's fixtures
build their apps through ``celery.contrib.testing.app.TestApp``; wrapping it
makes each app's default task class ``LeasedTask`` and installs celery-leases
on it, so the suite's own tasks (``shared_task``s in ``t.integration.tasks``)
run leased in the in-process session worker, with nothing in Celery's tests
changed. The lease store falls back to the suite's Redis broker URL.
"""
from __future__ import annotations

from typing import Any

import celery.contrib.testing.app as testing_app

import celery_leases

_original = testing_app.TestApp


def _leased_test_app(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("task_cls", "celery_leases:LeasedTask")
    app = _original(*args, **kwargs)
    celery_leases.install(app)
    return app


def pytest_configure(config: Any) -> None:
    testing_app.TestApp = _leased_test_app


def pytest_report_header(config: Any) -> str:
    return "celery-leases: every task of every test app is a LeasedTask (celery_leases.install)"
