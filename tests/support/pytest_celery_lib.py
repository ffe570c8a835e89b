"""pytest-celery for the adapter's tests, from ``.pytest-celery/`` (``make test`` installs it there).

It is never installed into the suite's own environment: its pytest plugin would
load into every test. The adapter's example suite runs in a subprocess with the
directory on ``PYTHONPATH``; the contract test imports it from there. Missing
(a bare ``pytest`` without ``make``): skipped with the reason, failed under CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.services import in_ci

LIB = Path(__file__).resolve().parents[2] / ".pytest-celery"


def require() -> Path:
    """The directory holding pytest-celery, on ``sys.path`` from now on (skip or fail if absent;
    callable in a test or at a module's top)."""
    if not (LIB / "pytest_celery").is_dir():
        reason = f"pytest-celery is not in {LIB}: make test (or make smoke) installs it there"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    if str(LIB) not in sys.path:
        sys.path.append(str(LIB))
    return LIB
