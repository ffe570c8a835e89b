"""Local stand-ins for pytest-celery's containers: a ``redis-server`` and a ``celery worker``
process that pytest-celery's nodes drive as they would a Docker container
(``celery_leases.testing.pytest_celery`` builds them in its fixtures).

``CONTAINER_API`` lists what a node calls on its container; the contract test
(tests/plugin/test_pytest_celery_contract.py) fails, naming the method, when a
pytest-celery release calls something else.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal as signals
import subprocess
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

from .servers import RedisServer
from .workers import Worker

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
