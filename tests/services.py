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


#: RabbitMQ used by the broker-parametrised tests.
AMQP_URL = os.environ.get("LEASES_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def amqp_url() -> str:
    """The RabbitMQ URL, after checking that it answers (skip or fail otherwise)."""
    from kombu import Connection
    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # noqa: BLE001 - any failure means "not there"
        skip_or_fail(f"RabbitMQ not reachable at {AMQP_URL.split('@')[-1]} "
                     f"(set LEASES_TEST_AMQP_URL): {exc!r}")
    return AMQP_URL
