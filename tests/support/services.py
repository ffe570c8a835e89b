"""Skip-or-fail for tests that need an external service (RabbitMQ, PostgreSQL).

Locally a missing service skips the test with a visible reason; under CI
(``CI=true``) it fails, so a misconfigured pipeline cannot pass by skipping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def broker_env(celery_env: dict, broker: str, redis_url: str, queue: str) -> Iterator[dict]:
    """``celery_env`` (tests/conftest.py) with ``broker`` ("redis" or "amqp") as the Celery broker.

    Leases and results stay on ``redis_url``. On RabbitMQ (skip or fail when it
    is not there) the test's durable queue outlives the test: that queue, and
    only that one, is deleted on exit.
    """
    if broker == "redis":
        yield celery_env
        return
    if broker != "amqp":
        raise ValueError(f"broker: unknown {broker!r} (known: redis, amqp)")
    url = amqp_url()
    try:
        yield {**celery_env, "LEASES_TEST_BROKER": url, "LEASES_TEST_BACKEND": redis_url,
               "LEASES_TEST_LEASES_URL": redis_url}
    finally:
        from kombu import Connection
        with Connection(url) as conn:
            try:
                conn.default_channel.queue_delete(queue)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
