"""pytest-celery's ``celery_setup`` on local processes: leased workers without Docker.

Enable it in a conftest::

    pytest_plugins = ["celery_leases.testing.pytest_celery"]

pytest-celery's components (``CeleryTestSetup``, ``CeleryTestWorker``,
``CeleryTestBroker``, ``CeleryTestBackend`` and their clusters) type-check their
members as nodes and duck-type the container inside a node. This module
overrides the fixtures that build those containers, so that:

- the broker and the result backend are throwaway ``redis-server`` processes
  on free loopback ports (append-only file on, so ``restart()`` keeps the
  data), never the machine's shared Redis on 6379;
- each worker is a real ``celery worker`` subprocess of the test's worker app
  (pytest-celery's generated app module, with your task and signal handler
  modules), run by :class:`celery_leases.testing.Worker` with
  ``celery_leases.install(app)`` applied and the lease store on the broker's
  server; the test process's ``celery_setup.app`` is configured the same way.

Everything pytest-celery documents on a node works: ``kill()`` (a SIGKILL of
the whole worker, returning once it is gone), ``kill(signal="SIGTERM")`` and
the other signals (to the main process), ``restart()``, ``logs()``,
``wait_for_log()``, ``assert_log_exists()``, ``ready()``; broker and backend
``restart()``. Helpers for leases: :func:`expire_worker_leases`,
:func:`run_recovery`, :func:`lease_record`, :func:`freeze` and :func:`thaw`.

The containers themselves (``LocalRedisContainer``, ``LocalWorkerContainer``) are in
containers.py; this module holds the fixtures (a pytest plugin module) and the helpers.
``CONTAINER_API`` lists what a node calls on its container; the contract test
(tests/plugin/test_pytest_celery_contract.py) fails, naming the method, when a
pytest-celery release calls something else. See docs/testing.md.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator
from uuid import uuid4

import pytest
from pytest_celery import (
    CeleryBackendCluster, CeleryBrokerCluster, CeleryTestSetup, RedisTestBackend, RedisTestBroker,
)

from .helpers import configure, expire_lease, run_recovery
from .containers import (CONTAINER_API, LocalRedisContainer, LocalWorkerContainer,  # noqa: F401
                         local_worker_container, worker_command_args)

__all__ = ["LocalRedisContainer", "LocalWorkerContainer", "local_worker_container", "CONTAINER_API",
           "expire_worker_leases", "run_recovery", "lease_record", "freeze", "thaw"]


@pytest.fixture
def leases_pytest_celery_dir() -> Iterator[Path]:
    """A directory for this test's local servers and workers, removed after it."""
    path = Path(tempfile.mkdtemp(prefix="leases-pytest-celery-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def leases_pytest_celery_workers(request: pytest.FixtureRequest) -> list:
    """The test's local workers (:class:`celery_leases.testing.Worker`), in start order: a failed
    test's report shows their logs, which are gone with the test's directory afterwards."""
    from .plugin import report_worker_logs

    started: list = []
    report_worker_logs(request.node, started)
    return started


@pytest.fixture
def default_redis_broker(leases_pytest_celery_dir: Path) -> Iterator[LocalRedisContainer]:
    container = LocalRedisContainer("broker", leases_pytest_celery_dir / "broker")
    yield container
    container.teardown()


@pytest.fixture
def default_redis_backend(leases_pytest_celery_dir: Path) -> Iterator[LocalRedisContainer]:
    container = LocalRedisContainer("backend", leases_pytest_celery_dir / "backend")
    yield container
    container.teardown()


@pytest.fixture
def celery_broker_cluster(default_redis_broker: LocalRedisContainer) -> Iterator[CeleryBrokerCluster]:
    cluster = CeleryBrokerCluster(RedisTestBroker(default_redis_broker))
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(default_redis_backend: LocalRedisContainer) -> Iterator[CeleryBackendCluster]:
    cluster = CeleryBackendCluster(RedisTestBackend(default_redis_backend))
    yield cluster
    cluster.teardown()


@pytest.fixture
def leases_pytest_celery_conf(default_redis_broker: LocalRedisContainer) -> dict:
    """Lease settings of the workers and of ``celery_setup.app``: the store on the broker's server,
    a key prefix of this test's."""
    return {"leases_redis_url": default_redis_broker.server.url,
            "leases_key_prefix": f"lpc{uuid4().hex[:10]}"}


@pytest.fixture
def celery_setup_app(celery_setup_cls: type[CeleryTestSetup], celery_setup_config: dict,
                     celery_setup_name: str, leases_pytest_celery_conf: dict) -> Any:
    import celery_leases

    app = celery_setup_cls.create_setup_app(celery_setup_config=celery_setup_config,
                                            celery_setup_app_name=celery_setup_name)
    configure(app, leases_pytest_celery_conf)
    celery_leases.install(app)
    return app


@pytest.fixture
def leases_pytest_celery_install() -> bool | str:
    """How workers install celery-leases: True (``install(app)``), or ``"all"``
    (``install(app, all_tasks=True)``: every task is leased, as for Celery's own smoke tests)."""
    return True


@pytest.fixture
def default_worker_container(default_worker_container_cls: Any, default_worker_initial_content: dict,
                             default_worker_env: dict, default_worker_command: list[str],
                             leases_pytest_celery_conf: dict, leases_pytest_celery_dir: Path,
                             leases_pytest_celery_install: bool | str,
                             leases_pytest_celery_workers: list) -> Iterator[LocalWorkerContainer]:
    container = local_worker_container(default_worker_container_cls, default_worker_initial_content,
                                       default_worker_env, leases_pytest_celery_conf, leases_pytest_celery_dir,
                                       leases_pytest_celery_install, default_worker_command)
    leases_pytest_celery_workers.append(container.worker)
    yield container
    container.teardown()


@pytest.fixture
def leases_local_worker(default_worker_cls: Any, default_worker_container_cls: Any,
                        default_worker_initial_content: dict, default_worker_env: dict,
                        default_worker_app: Any, leases_pytest_celery_conf: dict,
                        leases_pytest_celery_dir: Path, leases_pytest_celery_install: bool | str,
                        leases_pytest_celery_workers: list) -> Iterator[Any]:
    """Factory: ``leases_local_worker()`` starts one more worker node like ``celery_worker``.

    For a worker cluster of several, override ``celery_worker_cluster``::

        @pytest.fixture
        def celery_worker_cluster(celery_worker, leases_local_worker):
            cluster = CeleryWorkerCluster(celery_worker, leases_local_worker())
            yield cluster
            cluster.teardown()
    """
    made: list = []

    def make() -> Any:
        container = local_worker_container(default_worker_container_cls, default_worker_initial_content,
                                           default_worker_env, leases_pytest_celery_conf,
                                           leases_pytest_celery_dir, leases_pytest_celery_install)
        leases_pytest_celery_workers.append(container.worker)
        node = default_worker_cls(container=container, app=default_worker_app)
        made.append(node)
        return node

    yield make
    for node in made:
        node.teardown()


# -- helpers for leases --------------------------------------------------------------


def expire_worker_leases(setup: CeleryTestSetup, task_ids: list[str]) -> int:
    """Make the leases of ``task_ids`` due now, as if their ttl had run out; how many were indexed."""
    return sum(bool(expire_lease(setup.app, task_id)) for task_id in task_ids)


def lease_record(setup: CeleryTestSetup, task_id: str) -> Any:
    """The lease record of ``task_id`` (``celery_leases.LeaseRecord``), or None."""
    from ..install import store
    return store(setup.app).get(task_id)


def freeze(worker: Any) -> None:
    """SIGSTOP a worker node's main process and pool children: it neither runs nor renews."""
    worker.container.worker.pause()


def thaw(worker: Any) -> None:
    """SIGCONT what :func:`freeze` stopped."""
    worker.container.worker.resume()
