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

``CONTAINER_API`` lists what a node calls on its container; the contract test
(tests/plugin/test_pytest_celery_contract.py) fails, naming the method, when a
pytest-celery release calls something else. See docs/testing.md.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal as signals
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator
from uuid import uuid4

import pytest
from pytest_celery import (
    CeleryBackendCluster, CeleryBrokerCluster, CeleryTestSetup, RedisTestBackend, RedisTestBroker,
)

from .helpers import configure, expire_lease, run_recovery
from .servers import RedisServer
from .workers import Worker

__all__ = ["LocalRedisContainer", "LocalWorkerContainer", "local_worker_container", "CONTAINER_API",
           "expire_worker_leases", "run_recovery", "lease_record", "freeze", "thaw"]

#: What pytest-celery 1.3's nodes call on their container, by kind of node.
CONTAINER_API = {
    "node": ("ready", "logs", "name", "id", "status", "kill", "reload", "restart", "teardown",
             "celeryconfig"),
    "worker": ("version", "log_level", "worker_name", "worker_queue", "exec_run"),
    "redis": ("get_addr", "client", "attrs"),
}

#: Seconds a local worker may take to start.
WORKER_START_TIMEOUT = 60.0
#: Seconds ``kill(signal=...)`` waits after a signal other than SIGKILL (``docker kill``'s round trip
#: gives a worker that time to run its handler before the next signal comes).
SIGNAL_SETTLE = 0.5


def _signal_number(sig: str | int) -> int:
    return sig if isinstance(sig, int) else int(getattr(signals, sig if sig.startswith("SIG") else f"SIG{sig}"))


class LocalRedisContainer:
    """A throwaway ``redis-server`` that pytest-celery's Redis broker and backend nodes drive."""

    def __init__(self, role: str, dir: Path) -> None:
        self.name = f"local-redis-{role}"
        self.id = uuid4().hex
        self.server = RedisServer(dir=dir, appendonly=True).start()

    @property
    def status(self) -> str:
        return "running" if self.server.running else "exited"

    @property
    def attrs(self) -> dict:
        return {"Config": {"Hostname": "127.0.0.1"}}

    @property
    def celeryconfig(self) -> dict:
        url = self.server.url
        return {"url": url, "host_url": url, "hostname": "127.0.0.1", "port": self.server.port, "vhost": "0"}

    @property
    def client(self) -> Any:
        return self.server.client(decode_responses=True)

    @property
    def port(self) -> int:
        return int(self.server.port or 0)

    @property
    def hostname(self) -> str:
        return "127.0.0.1"

    def get_addr(self, port: str) -> tuple[str, int]:
        return "127.0.0.1", int(self.server.port or 0)

    def ready(self) -> bool:
        return self.server.running

    def logs(self) -> str:
        return self.server.read_log()

    def exec_run(self, cmd: str | list[str], **kwargs: Any) -> tuple[int, bytes]:
        """Run ``cmd`` as ``docker exec`` would in a Redis container: ``redis-cli`` reaches this
        server (its host and port are added); (exit code, output)."""
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        if argv and Path(argv[0]).name == "redis-cli":
            argv[1:1] = ["-h", "127.0.0.1", "-p", str(self.port)]
        done = subprocess.run(argv, capture_output=True, timeout=60)
        return done.returncode, done.stdout + done.stderr

    def kill(self, signal: str | int = "SIGKILL") -> None:
        number = _signal_number(signal)
        if number == signals.SIGKILL:
            self.server.kill()
        elif self.server.process is not None:
            self.server.process.send_signal(number)

    def reload(self) -> None:
        """Nothing to refresh: the status is read from the process each time."""

    def restart(self, timeout: float | None = None) -> None:
        self.server.restart()

    def teardown(self) -> None:
        self.server.cleanup()


class LocalWorkerContainer:
    """A leased ``celery worker`` subprocess that pytest-celery's worker node drives.

    ``content`` is pytest-celery's worker volume (``default_worker_initial_content``:
    file name -> bytes), written to a directory of its own; ``env`` is
    ``default_worker_env`` (broker and backend URLs); ``conf`` more settings of
    the worker app (the lease store's among them).
    """

    def __init__(self, content: dict, env: dict, conf: dict, workdir: Path, *, worker_name: str,
                 queue: str, log_level: str = "INFO", pool: str | None = None,
                 concurrency: int | None = None, args: list[str] | tuple[str, ...] = (),
                 install: bool | str = True) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for filename, data in content.items():
            path = self.workdir / filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data if isinstance(data, bytes) else str(data).encode())
        self.id = uuid4().hex[:12]
        self._worker_name, self._queue, self._log_level = worker_name, queue, log_level
        self.name = f"{worker_name}-{self.id}"
        self.env = {key: str(value) for key, value in env.items() if key != "PYTHONPATH"}
        self.worker = Worker("app", name=self.name, conf=conf, env=self.env, pool=pool or "prefork",
                             concurrency=concurrency or 1, loglevel=log_level, args=["-Q", queue, *args],
                             log_dir=self.workdir, cwd=self.workdir, pythonpath=[str(self.workdir)],
                             node=f"{worker_name}@{self.id}", install=install)
        # As in pytest-celery's container, the pool and concurrency are the worker app's
        # (worker_pool, worker_concurrency from the test's default_worker_app) unless given.
        self.worker.command = _without_options(self.worker.command, {"-P": pool is None,
                                                                     "-c": concurrency is None})
        self.worker.start(WORKER_START_TIMEOUT)

    # -- what every node calls ----------------------------------------------

    @property
    def status(self) -> str:
        return "running" if self.worker.running else "exited"

    @property
    def celeryconfig(self) -> dict:
        return {"name": self._worker_name, "queue": self._queue}

    def ready(self) -> bool:
        return self.worker.running

    def logs(self) -> str:
        return self.worker.log()

    def kill(self, signal: str | int = "SIGKILL") -> None:
        """SIGKILL: the whole worker, returning once it is gone (as ``docker kill`` does);
        any other signal goes to the main process only, and returns after
        :data:`SIGNAL_SETTLE` seconds: Python runs a signal handler between bytecodes, and two
        signals sent back to back (a test's SIGQUIT, SIGQUIT) would reach it as one."""
        number = _signal_number(signal)
        if number == signals.SIGKILL:
            self.worker.kill()
        else:
            self.worker.signal(number, main_only=True)
            time.sleep(SIGNAL_SETTLE)

    def reload(self) -> None:
        """Nothing to refresh: the status is read from the process each time."""

    def restart(self, timeout: float | None = None) -> None:
        self.worker.stop(timeout or 15.0)
        self.worker.start(WORKER_START_TIMEOUT)

    def teardown(self) -> None:
        self.worker.kill()

    # -- what a worker node also calls ----------------------------------------

    def version(self) -> str:
        import celery
        return celery.__version__

    def log_level(self) -> str:
        return self._log_level

    def worker_name(self) -> str:
        return self._worker_name

    def worker_queue(self) -> str:
        return self._queue

    def exec_run(self, cmd: str | list[str], **kwargs: Any) -> tuple[int, bytes]:
        """Run ``cmd`` in the worker's directory, with its environment: (exit code, output).

        pytest-celery's ``get_running_processes_info()`` (psutil in the container) sees this
        worker's processes only, the main process and its pool children, named ``celery``
        as in a container whose command is ``celery worker``."""
        if "get_running_processes_info" in str(cmd):
            return 0, json.dumps(self._processes(str(cmd))).encode()
        done = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=self.workdir, capture_output=True,
                              env=self.worker.env, timeout=60)
        return done.returncode, done.stdout + done.stderr

    def _processes(self, cmd: str) -> list[dict]:
        import psutil

        match = re.search(r"get_running_processes_info\((.*)\)\)", cmd)
        columns = (ast.literal_eval(match.group(1)) if match and match.group(1) else None) or [
            "pid", "name", "username", "cmdline", "cpu_percent", "memory_percent", "create_time"]
        out = []
        for proc in psutil.process_iter([*columns, "pid"]):
            try:
                if not self.worker.running or os.getpgid(proc.pid) != self.worker.pid:
                    continue
            except ProcessLookupError:
                continue
            info = {key: proc.info.get(key) for key in columns}
            if "name" in info:
                info["name"] = "celery"
            out.append(info)
        return out

    # -- leases -----------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.worker.pid


def _without_options(command: list[str], drop: dict[str, bool]) -> list[str]:
    """``command`` without the options (each with its value) whose ``drop`` flag is set."""
    out, skip = [], False
    for index, part in enumerate(command):
        if skip:
            skip = False
        elif drop.get(part) and index + 1 < len(command):
            skip = True
        else:
            out.append(part)
    return out


#: Options of pytest-celery's worker command the adapter sets itself (the node name must be
#: unique per worker; the app, log level and queue come from the container class).
_OWN_OPTIONS = {"-A": True, "--app": True, "-n": True, "--hostname": True, "-Q": True, "--queues": True,
                "-l": True, "--loglevel": True}


def worker_command_args(command: list[str]) -> list[str]:
    """The ``celery worker`` options of a pytest-celery worker command (``default_worker_command``,
    ``CeleryWorkerContainer.command()``) beyond the ones the adapter sets: ``--pool=solo``, ``-c 4``,
    ``--autoscale`` and the like. A debugpy wrapper is dropped."""
    command = list(command)
    if "worker" in command:
        command = command[command.index("worker") + 1:]
    command = [part for part in command if part.split("=", 1)[0] not in _OWN_OPTIONS or "=" not in part]
    return _without_options(command, _OWN_OPTIONS)


# -- fixtures: pytest-celery's, on local processes ---------------------------------


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


def local_worker_container(container_cls: Any, content: dict, env: dict, conf: dict, workdir: Path,
                           install: bool | str = True, command: list[str] | None = None) -> LocalWorkerContainer:
    """A started local worker with the names of pytest-celery worker container class ``container_cls``
    (``worker_name()``, ``worker_queue()``, ``log_level()``) and the further options of ``command``
    (``default_worker_command``; default: the class's ``command()``); ``install="all"`` leases
    every task."""
    args = worker_command_args(container_cls.command() if command is None else command)
    return LocalWorkerContainer(content, env, conf, workdir / f"worker-{uuid4().hex[:6]}",
                                worker_name=container_cls.worker_name(), queue=container_cls.worker_queue(),
                                log_level=container_cls.log_level(), args=args, install=install)


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
