"""Skip-or-fail for tests that need an external service (RabbitMQ, PostgreSQL).

Locally a missing service skips the test with a visible reason; under CI
(``CI=true``) it fails, so a misconfigured pipeline cannot pass by skipping.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the current test with ``reason``, or fail it when ``CI=true``."""
    if in_ci():
        pytest.fail(f"required service unavailable under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def require_service(name: str, reachable: bool, reason: str = "") -> None:
    """Return if ``reachable``; otherwise skip (locally) or fail (CI)."""
    if not reachable:
        skip_or_fail(f"{name} not reachable" + (f": {reason}" if reason else ""))
