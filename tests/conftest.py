"""Shared fixtures: the plugin's Redis server, per-test key prefixes, real workers."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest
import redis

from tests.support.services import require_service, skip_or_fail  # noqa: F401  (re-exported)

pytest_plugins = ("celery.contrib.pytest",)

#: Modules that run for minutes: collected first, so that under ``make test``'s
#: xdist processes (``--dist loadfile``) they start at once and the others
#: work through the rest meanwhile, instead of one long module starting last.
#: (Six on two cores: most tests wait on real workers and servers, not on CPU; on
#: 2026-12-07 the same tree took 9 min 41 s with six, 12 min 19 s with four.)
LONG_MODULES = ("test_chaos.py",)


#: Fixtures that start real ``celery worker`` processes: a test using one is ``slow``.
WORKER_FIXTURES = {"start_worker", "one_worker", "workers", "cluster", "celery_worker"}
#: Text by which a test module starts workers itself (celery_leases.testing.Worker, the
#: chaos cluster, the adversarial runner): its tests are ``slow`` too.
WORKER_CALLS = ("Worker(", "Cluster(", "bench_worker(", ".worker(", "run_scenario(")


def _starts_workers(item: pytest.Item, seen: dict) -> bool:
    if WORKER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    path = item.path
    if path not in seen:
        text = path.read_text("utf-8") if path.suffix == ".py" else ""
        seen[path] = any(call in text for call in WORKER_CALLS)
    return seen[path]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    # Every test that runs real workers carries the `slow` marker (`-m "not slow"` is the quick
    # suite), whether or not its module says so.
    seen: dict = {}
    for item in items:
        if item.get_closest_marker("slow") is None and _starts_workers(item, seen):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.name not in LONG_MODULES)  # stable: keeps the rest in order


@pytest.fixture(scope="session")
def redis_server_url(leases_redis_url: str) -> str:
    """URL of the session's Redis server: the pytest plugin's ``leases_redis_url``.

    The suite tests on the fixture users get: ``$LEASES_TEST_REDIS_URL`` if set
    (the server is shared: tests isolate themselves by key prefix and never
    FLUSHALL), otherwise a throwaway ``redis-server`` on a free loopback port.
    """
    return leases_redis_url


@pytest.fixture
def redis_client(redis_server_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def own_server(tmp_path):
    """Factory: ``own_server("broker")`` -> a started throwaway ``RedisServer`` of this test
    (no persistence, its own port and directory), stopped when the test ends. For tests that
    kill, restart or flush a server: never the session's."""
    from celery_leases.testing.servers import RedisServer, free_port
    started = []

    def start(name: str) -> RedisServer:
        server = RedisServer(port=free_port(), dir=tmp_path / name)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix unique to this test, so tests share one server safely."""
    return f"t{uuid4().hex[:10]}"


# -- real Celery workers ------------------------------------------------------


@pytest.fixture
def celery_env(redis_server_url: str, key_prefix: str) -> dict:
    """Environment for tests/support/apps/leased_app.py: this test's broker, backend, prefix and queue.

    Everything else is the product's default, publish tracking on included: a task's
    record is ``queued`` from its publish until a worker acquires it (``wait_for_lease``).
    A module overrides this fixture to change the setup for all its tests (its broker,
    a short ``LEASES_TEST_DELIVERY_TIMEOUT``); ``client_app`` and ``start_worker`` follow.
    """
    return {"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
            "LEASES_TEST_TTL": "2", "LEASES_TEST_RECOVERY_INTERVAL": "1"}


@pytest.fixture
def broker_server(tmp_path):
    """A redis-server of the test's own for the broker, without persistence (the common
    setup): a test can kill, restart or flush it without touching the session's server."""
    from celery_leases.testing.servers import RedisServer, free_port
    server = RedisServer(port=free_port(), dir=tmp_path / "broker")
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def client_app(celery_env: dict):
    """The test's own Celery app (same settings as its workers) for sending and waiting."""
    from tests.support.apps.leased_app import create_app
    app = create_app(celery_env)
    yield app
    app.close()


@pytest.fixture
def start_worker(celery_env: dict, tmp_path, request):
    """Factory: start_worker("a", pool="threads", LEASES_TEST_TTL="1") -> a ready Worker.

    A failed test's report shows the logs of the workers it started.
    """
    from celery_leases.testing import report_worker_logs
    from tests.support.workers import Worker
    started: list = []
    report_worker_logs(request.node, started)

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
