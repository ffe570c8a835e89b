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

#: Modules that run for minutes: collected first, so that under ``make test``'s
#: two xdist processes (``--dist loadfile``) they start at once and the other
#: process works through the rest meanwhile, instead of one long module
#: starting last.
LONG_MODULES = ("test_chaos.py", "test_celery_suite_sample.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    items.sort(key=lambda item: item.path.name not in LONG_MODULES)  # stable: keeps the rest in order


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


# -- real Celery workers ------------------------------------------------------


@pytest.fixture
def celery_env(redis_server_url: str, key_prefix: str) -> dict:
    """Environment for tests/apps/leased_app.py: this test's broker, backend, prefix and queue."""
    return {"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
            "LEASES_TEST_TTL": "2", "LEASES_TEST_RECOVERY_INTERVAL": "1"}


@pytest.fixture
def client_app(celery_env: dict):
    """The test's own Celery app (same settings as its workers) for sending and waiting."""
    from tests.apps.leased_app import create_app
    app = create_app(celery_env)
    yield app
    app.close()


@pytest.fixture
def start_worker(celery_env: dict, tmp_path):
    """Factory: start_worker("a", pool="threads", LEASES_TEST_TTL="1") -> a ready Worker."""
    from tests.workers import Worker
    started: list = []

    def start(name: str, pool: str = "prefork", concurrency: int = 2, **env: str):
        worker = Worker(name, {**celery_env, **env}, pool=pool, concurrency=concurrency, log_dir=tmp_path)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def history(redis_client, key_prefix):
    """Execution events the test app's tasks recorded: list of (event, task_id, pid, fields)."""
    def read() -> list:
        out = []
        for raw in redis_client.lrange(f"{key_prefix}:history", 0, -1):
            event, task_id, pid, *fields = raw.decode().split("|")
            out.append((event, task_id, int(pid), dict(f.split("=", 1) for f in fields)))
        return out
    return read
