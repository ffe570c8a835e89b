"""The pytest plugin's fixtures and its report hook (loaded through ``celery_leases.testing``).

Every fixture starts with ``leases_`` so none collides with pytest-celery's
(``celery_app``, ``celery_worker``, ...) or your own. See docs/testing.md.
"""
from __future__ import annotations

import os
from typing import Any, Iterator
from uuid import uuid4

import pytest

from .servers import REDIS_URL_ENV, RedisServer
from .workers import WorkerFactory

__all__ = ["leases_redis_url", "leases_key_prefix", "leases_conf", "leases_worker",
           "pytest_runtest_makereport", "report_worker_logs"]


@pytest.fixture(scope="session")
def leases_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the Redis server the session's tests use for leases, broker and results.

    ``$LEASES_TEST_REDIS_URL`` when set (a shared server: tests keep apart by
    key prefix and queue, nothing is flushed); otherwise a throwaway
    ``redis-server`` on a free port of 127.0.0.1, without persistence, stopped
    when the session ends.
    """
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        yield url
        return
    try:
        server = RedisServer(dir=tmp_path_factory.mktemp("leases-redis")).start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def leases_key_prefix() -> str:
    """A ``leases_key_prefix`` unique to this test (also used as its queue name)."""
    return f"lt{uuid4().hex[:12]}"


@pytest.fixture
def leases_conf(leases_redis_url: str, leases_key_prefix: str) -> dict:
    """Settings that put an app on this test's Redis, key prefix and queue.

    ``broker_url``, ``result_backend`` and ``leases_redis_url`` point at
    ``leases_redis_url``; ``leases_key_prefix`` and ``task_default_queue`` are
    the test's prefix, so tasks left over by one test never reach another's
    worker; ``leases_worker_recovery`` is off, so recovery runs only when the
    test runs it (``run_recovery``, ``make_stale``). A plain dict: change or
    delete entries in your own fixture. ``leases_worker`` applies it to the
    worker and to the app in the test process.
    """
    return {
        "broker_url": leases_redis_url,
        "result_backend": leases_redis_url,
        "leases_redis_url": leases_redis_url,
        "leases_key_prefix": leases_key_prefix,
        "task_default_queue": leases_key_prefix,
        "leases_worker_recovery": False,
    }


_WORKERS = pytest.StashKey[list]()  # lists of workers, one per fixture that starts some


def report_worker_logs(node: pytest.Item, workers: list) -> None:
    """Show the logs of ``workers`` (a list that may still grow) in ``node``'s report if it fails.

    ``leases_worker`` does this for its own workers; a fixture of yours that
    starts :class:`~celery_leases.testing.Worker` objects calls it with
    ``request.node``.
    """
    node.stash.setdefault(_WORKERS, []).append(workers)


@pytest.fixture
def leases_worker(request: pytest.FixtureRequest, leases_conf: dict,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator["WorkerFactory"]:
    """Factory starting real ``celery worker`` subprocesses for your app.

    ``leases_worker("proj.celery:app")`` (or ``"proj.celery"``, found the way
    ``celery -A`` finds it) returns a ready :class:`Worker`; see
    :meth:`WorkerFactory.__call__` for the options. Every worker still running
    is killed when the test ends, and a failed test's report shows the logs of
    its workers.
    """
    factory = WorkerFactory(leases_conf, tmp_path_factory.mktemp("leases-workers"),
                            extra_paths=[str(request.config.rootpath)])
    report_worker_logs(request.node, factory.started)
    try:
        yield factory
    finally:
        for worker in factory.started:
            worker.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """Attach the logs of a failed test's workers to its report."""
    outcome = yield
    workers = [worker for group in item.stash.get(_WORKERS, ()) for worker in group]
    if not workers:
        return
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when in ("call", "setup"):
        for worker in workers:
            report.sections.append((f"celery-leases worker {worker.name} log", worker.log_tail()))
