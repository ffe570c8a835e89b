"""Written as t/smoke/tests/conftest.py into a copy of Celery's sdist by tests/celery_smoke/run.py.

Nearer the tests than t/smoke/conftest.py, so these fixtures win: the brokers,
backends, workers and the Redis of the integration tasks are local processes
(celery_leases.testing.pytest_celery), every task is leased, and nothing
touches 6379 (t/smoke/conftest.py hard-codes REDIS_PORT=6379 for the workers).
"""
import os

import pytest

from celery_leases.testing import pytest_celery as leases
# The adapter's fixtures, re-bound here so that they win over t/smoke/conftest.py's containers.
for _name in ("celery_backend_cluster", "celery_broker_cluster", "celery_setup_app", "default_redis_backend",
              "default_redis_broker", "default_worker_container", "leases_local_worker",
              "leases_pytest_celery_conf", "leases_pytest_celery_dir"):
    globals()[_name] = getattr(leases, _name)


@pytest.fixture
def leases_pytest_celery_install():
    """Every task leased; LEASES_SMOKE_PLAIN=1 (make smoke-plain) runs the workers without
    celery-leases, to tell what leases change from what the adapter cannot do."""
    return False if os.environ.get("LEASES_SMOKE_PLAIN") == "1" else "all"


@pytest.fixture
def redis_test_container(leases_pytest_celery_dir):
    container = leases.LocalRedisContainer("integration", leases_pytest_celery_dir / "integration")
    yield container
    container.teardown()


@pytest.fixture
def default_worker_env(default_worker_env, redis_test_container):
    return {**default_worker_env, "REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(redis_test_container.port)}


def _local_worker(container_cls, default_worker_initial_content, default_worker_env, leases_pytest_celery_conf,
                  leases_pytest_celery_dir, leases_pytest_celery_install):
    return leases.local_worker_container(container_cls, default_worker_initial_content, default_worker_env,
                                         leases_pytest_celery_conf, leases_pytest_celery_dir,
                                         leases_pytest_celery_install)


@pytest.fixture
def alt_dev_worker_container(default_worker_initial_content, default_worker_env, leases_pytest_celery_conf,
                             leases_pytest_celery_dir, leases_pytest_celery_install):
    from t.smoke.workers.alt import AltSmokeWorkerContainer

    container = _local_worker(AltSmokeWorkerContainer, default_worker_initial_content, default_worker_env,
                              leases_pytest_celery_conf, leases_pytest_celery_dir, leases_pytest_celery_install)
    yield container
    container.teardown()


@pytest.fixture
def other_dev_worker_container(default_worker_initial_content, default_worker_env, leases_pytest_celery_conf,
                               leases_pytest_celery_dir, leases_pytest_celery_install):
    from t.smoke.workers.other import OtherSmokeWorkerContainer

    container = _local_worker(OtherSmokeWorkerContainer, default_worker_initial_content, default_worker_env,
                              leases_pytest_celery_conf, leases_pytest_celery_dir, leases_pytest_celery_install)
    yield container
    container.teardown()


#: Files t/smoke's tasks keep in /tmp: empty in a new container, but local workers share the host's /tmp.
CONTAINER_TMP_FILES = ("/tmp/kill_child_process_once",)


@pytest.fixture(autouse=True)
def fresh_container_tmp():
    """Each test's workers start with none of t/smoke's marker files in /tmp, as a new container would
    (kill_child_process_once kills its pool child only while its marker is absent)."""
    for path in CONTAINER_TMP_FILES:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    yield
