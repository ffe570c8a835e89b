"""pytest plugin: test your own leased tasks on real workers, without Docker.

Installed with the package and loaded by pytest automatically (entry point
``pytest11``, name ``celery_leases``, this module; disable with
``-p no:celery_leases``). Every fixture starts with ``leases_`` so none
collides with pytest-celery's (``celery_app``, ``celery_worker``, ...) or your own.

Fixtures (:mod:`.plugin`):

- ``leases_redis_url`` (session): ``$LEASES_TEST_REDIS_URL``, or a throwaway
  ``redis-server`` on a free loopback port.
- ``leases_key_prefix``: a key prefix unique to the test.
- ``leases_conf``: the settings that point an app at this test's Redis,
  key prefix and queue.
- ``leases_worker``: a factory that starts a real ``celery worker``
  subprocess for your app and stops it after the test.

Helpers (plain functions, :mod:`.helpers`): ``configure``, ``wait_for_lease``,
``expire_lease``, ``make_stale``, ``run_recovery``, ``undo_patches`` (every change
the package made to Celery's and kombu's code in this process put back:
celery_leases/patches.py); the launcher
(:mod:`.workers`): ``Worker``, ``WorkerFactory``; and, importable without
pytest (:mod:`.servers`, :mod:`.cluster`, :mod:`.supervisor`): ``RedisServer``,
``find_redis_server``, ``free_port``, ``wait_for``, ``RedisClusterServer``,
``Interrupts`` and ``Processes``.

Importing this module starts nothing and imports neither Celery nor redis-py
beyond what ``celery_leases`` itself imports: fixtures do their work only
when a test asks for them. ``python -m celery_leases.testing APP worker ...``
is the worker side of ``Worker`` (``__main__.py``). See docs/testing.md.
"""
from __future__ import annotations

from .helpers import configure, expire_lease, make_stale, run_recovery, undo_patches, wait_for_lease
from .plugin import (
    leases_conf, leases_key_prefix, leases_redis_url, leases_worker, pytest_runtest_makereport,
    report_worker_logs,
)
from .servers import (
    REDIS_SERVER_ENV, REDIS_URL_ENV, START_TIMEOUT, RedisServer, RedisServerError,
    find_redis_server, free_port, wait_for,
)
from .workers import Worker, WorkerFactory

__all__ = [
    "leases_redis_url", "leases_key_prefix", "leases_conf", "leases_worker", "pytest_runtest_makereport",
    "report_worker_logs", "Worker", "WorkerFactory", "configure", "wait_for_lease", "expire_lease", "make_stale",
    "run_recovery", "undo_patches", "find_redis_server", "free_port", "RedisServer", "RedisServerError", "wait_for",
    "REDIS_SERVER_ENV", "REDIS_URL_ENV", "START_TIMEOUT",
]
