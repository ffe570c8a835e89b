"""celery_leases.testing.pytest_celery against the installed pytest-celery: what its nodes call.

pytest-celery's nodes duck-type their container; the adapter's containers
implement what pytest-celery 1.3 calls (``CONTAINER_API``). A release that calls
something else fails here, naming the method, instead of deep in a user's test.
pytest-celery comes from ``.pytest-celery/`` (tests/support/pytest_celery_lib.py).
"""
from __future__ import annotations

import inspect
import re

import pytest

from tests.support import pytest_celery_lib

pytest_celery_lib.require()

from pytest_celery import CeleryTestBackend, CeleryTestBroker, CeleryTestWorker  # noqa: E402
from pytest_celery.api.base import CeleryTestCluster, CeleryTestNode  # noqa: E402

from celery_leases.testing import containers  # noqa: E402
from celery_leases.testing import pytest_celery as adapter  # noqa: E402

CALL = re.compile(r"\.container\.(\w+)")


def called_on_container(*classes: type) -> set[str]:
    return {name for cls in classes for name in CALL.findall(inspect.getsource(cls))}


@pytest.mark.parametrize("kind, classes", [
    ("node", (CeleryTestNode, CeleryTestCluster, CeleryTestBroker, CeleryTestBackend)),
    ("worker", (CeleryTestWorker,)),
])
def test_every_method_a_node_calls_on_its_container_is_known(kind, classes):
    known = set(adapter.CONTAINER_API["node"]) | set(adapter.CONTAINER_API[kind])
    unknown = sorted(called_on_container(*classes) - known)
    assert not unknown, (f"pytest-celery's {kind} nodes now call {unknown} on their container: "
                         "implement them on the local containers of celery_leases.testing.pytest_celery "
                         "and add them to CONTAINER_API")


@pytest.mark.parametrize("container, kinds", [
    (adapter.LocalWorkerContainer, ("node", "worker")),
    (adapter.LocalRedisContainer, ("node", "redis")),
])
def test_the_local_containers_implement_what_nodes_call(container, kinds):
    # name and id are set per instance, in __init__
    init = inspect.getsource(container.__init__)
    missing = [name for kind in kinds for name in adapter.CONTAINER_API[kind]
               if not hasattr(container, name) and f"self.{name} =" not in init]
    assert not missing, f"{container.__name__} lacks {missing}"


@pytest.mark.parametrize("command, expected", [
    # pytest-celery's own command: everything in it is set by the adapter (app, log level, node, queue).
    (["celery", "-A", "app", "worker", "--loglevel=INFO", "-n", "w@%h", "-Q", "q"], []),
    # A test's default_worker_command adds options: they reach the local worker.
    (["celery", "-A", "app", "worker", "-l", "INFO", "-n", "w@%h", "--pool=solo", "-c", "4"],
     ["--pool=solo", "-c", "4"]),
    (["python", "-m", "debugpy", "--listen", "0.0.0.0:5678", "-m", "celery", "-A", "app", "worker",
      "--autoscale=4,1"], ["--autoscale=4,1"]),
])
def test_worker_command_options_beyond_the_adapters_own_are_passed_on(command, expected):
    assert adapter.worker_command_args(command) == expected


def test_a_local_worker_without_pool_or_concurrency_leaves_them_to_the_app(tmp_path):
    # pytest-celery's container sets neither -P nor -c: worker_pool / worker_concurrency of the
    # test's worker app decide (Celery's smoke tests set worker_concurrency = 1).
    command = ["python", "-m", "celery_leases.testing", "app", "worker", "-P", "prefork", "-c", "1",
               "-n", "x@y", "-Q", "q"]
    assert containers._without_options(command, {"-P": True, "-c": True}) == [
        "python", "-m", "celery_leases.testing", "app", "worker", "-n", "x@y", "-Q", "q"]


def test_redis_node_exec_run_points_redis_cli_at_its_own_server(tmp_path):
    # Celery's smoke tests run `redis-cli CLIENT KILL ...` in the broker's container.
    container = adapter.LocalRedisContainer("broker", tmp_path / "broker")
    try:
        container.client.set("mark", "here")
        code, output = container.exec_run(["redis-cli", "GET", "mark"])
        assert (code, output.strip()) == (0, b"here")
    finally:
        container.teardown()
