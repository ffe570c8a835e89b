"""Shared fixtures: a real throwaway Redis server and per-test key prefixes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from uuid import uuid4

import pytest
import redis

from tests.redis_server import RedisServer
from tests.services import require_service, skip_or_fail  # noqa: F401  (re-exported)

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis server for the whole session.

    ``$LEASES_TEST_REDIS_URL`` if set (the server is shared: tests isolate
    themselves by key prefix and never FLUSHALL); otherwise a throwaway
    ``redis-server`` on a free loopback port, stopped at session end.
    """
    url = os.environ.get("LEASES_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer(dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix unique to this test, so tests share one server safely."""
    return f"t{uuid4().hex[:10]}"
