"""Real ``celery worker`` subprocesses: the launcher behind ``leases_worker``.

:class:`Worker` is one worker process (start, pause, kill, logs);
:class:`WorkerFactory` is what the ``leases_worker`` fixture returns. The
worker side, ``python -m celery_leases.testing APP worker ...``, is
:func:`worker_main`. Importing this module imports neither pytest nor Celery.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .helpers import configure
from .servers import wait_for

__all__ = ["Worker", "WorkerFactory", "worker_main"]

#: Seconds a worker may take to become ready.
WORKER_START_TIMEOUT = 30.0
#: Seconds ``Worker.pause()`` waits after stopping the worker: a blocking read it
#: already sent (kombu's Redis transport: BRPOP with a 1 s server-side timeout)
#: would still take the next message, and nobody could run it until the resume.
PAUSE_SETTLE = 1.5
#: How much of a worker's log a failed test's report shows.
LOG_TAIL_CHARS = 20_000
#: Environment variable carrying the worker bootstrap's instructions (JSON).
_SPEC_ENV = "CELERY_LEASES_TESTING_WORKER"


class Worker:
    """A ``celery worker`` subprocess of ``app`` (its own process group).

    What ``leases_worker`` starts, and the one launcher of the project's own
    suite, chaos runs and benchmarks. It runs ``python -m celery_leases.testing
    APP worker ...``: ``conf`` is applied to the app before the worker starts,
    ``start()`` returns at its ``worker_ready`` signal, and the worker kills
    itself if the process that started it is gone. ``node`` overrides its
    ``-n`` node name (default: ``name``, a random suffix, ``@%h``);
    ``install=True`` calls ``celery_leases.install(app)`` in the worker first
    (for an app module that does not, such as pytest-celery's); ``"all"``
    with ``all_tasks=True``, so every task the worker then defines is leased.

    ``pause()`` and ``resume()`` stop and continue the main process and its
    pool children (SIGSTOP/SIGCONT): a paused worker neither runs nor renews
    its leases, as in a long GC pause or a frozen VM. ``kill()`` is a SIGKILL
    of all of them (an OOM kill, a lost host); ``stop()`` a warm shutdown.
    """

    def __init__(self, app: str, *, name: str, log_dir: Path, conf: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, pool: str = "prefork", concurrency: int = 2,
                 loglevel: str = "info", args: Sequence[str] = (), cwd: str | os.PathLike | None = None,
                 pythonpath: Sequence[str] = (), client_app: Any = None, node: str | None = None,
                 install: bool | str = False) -> None:
        self.name, self.pool, self.concurrency = name, pool, concurrency
        #: The app in the test process, configured like the worker's (None if not imported).
        self.app = client_app
        self.log_path = Path(log_dir) / f"worker-{name}.log"
        self._ready_path = Path(log_dir) / f"worker-{name}.ready"
        self.cwd = str(cwd or os.getcwd())
        # A unique node name: RabbitMQ keeps a dead node's exclusive pidbox queue for a while.
        node = node or f"{name}-{os.urandom(3).hex()}@%h"
        self.command = [sys.executable, "-m", "celery_leases.testing", app, "worker",
                        "-P", pool, "-c", str(concurrency), "-n", node, "-l", loglevel,
                        "--without-mingle", "--without-gossip", *args]
        existing = os.environ.get("PYTHONPATH")
        paths = list(dict.fromkeys([*pythonpath, *([existing] if existing else [])]))
        spec = {"conf": dict(conf or {}), "ready": str(self._ready_path), "parent": os.getpid(),
                "install": install}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {}),
                    _SPEC_ENV: json.dumps(spec)}
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "Worker":
        """Start the worker process without waiting for it to be ready (``start()`` waits)."""
        self._ready_path.unlink(missing_ok=True)  # a restart waits for its own mark
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         start_new_session=True)
        return self

    def start(self, timeout: float = WORKER_START_TIMEOUT) -> "Worker":
        """Start the worker and wait until it consumes (its ``worker_ready`` signal)."""
        self.launch()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._ready_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery-leases testing: worker {self.name} exited with code "
                                   f"{self.proc.returncode} before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"celery-leases testing: worker {self.name} not ready after "
                                   f"{timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    @property
    def pid(self) -> int:
        """Process id of the worker's main process (also its process group id)."""
        if self.proc is None:
            raise RuntimeError(f"worker {self.name} was not started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        """Process ids of the main process's children (its pool processes)."""
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def signal(self, sig: int, main_only: bool = False) -> None:
        """Send ``sig`` to the whole worker (main process and pool children), or its main process
        only; nothing if it is gone."""
        try:
            if main_only:
                os.kill(self.pid, sig)
            else:
                os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self, settle: float = PAUSE_SETTLE) -> None:
        """SIGSTOP the worker and its pool children: no task runs, no lease is renewed.

        Returns after ``settle`` seconds, once a blocking read the worker sent
        before it stopped (a Redis ``BRPOP``, 1 s) has expired, so messages
        published from then on go to other workers. On RabbitMQ, messages
        within the paused worker's prefetch still go to it.
        """
        self.signal(signal.SIGSTOP)
        if settle > 0:
            time.sleep(settle)

    def resume(self) -> None:
        """SIGCONT what ``pause()`` stopped."""
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, as a crash would."""
        if not self.running:
            return
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM): running tasks finish, held leases are released.
        Killed if it has not exited after ``timeout`` seconds, its threads' stacks logged first."""
        if not self.running:
            return
        assert self.proc is not None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM, main_only=True)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Celery's SIGUSR1 handler logs every thread's stack: why the shutdown hung is then
            # in the worker's log, next to what it logged before.
            self.signal(signal.SIGUSR1, main_only=True)
            time.sleep(1.0)
            self.kill()

    def log(self) -> str:
        """Everything the worker has logged so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log()
        return text if len(text) <= chars else "...\n" + text[-chars:]

    def wait_for_log(self, text: str, timeout: float = 10.0) -> None:
        """Wait until ``text`` appears in the log; AssertionError after ``timeout`` seconds."""
        wait_for(lambda: text in self.log(), timeout, f"{text!r} in the log of worker {self.name}")

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Worker {self.name} pid={self.proc.pid if self.proc else None} {state}>"


class WorkerFactory:
    """What the ``leases_worker`` fixture returns: call it to start a worker."""

    def __init__(self, conf: Mapping[str, Any], log_dir: Path, extra_paths: Sequence[str] = ()) -> None:
        self.conf = dict(conf)
        self.log_dir = Path(log_dir)
        self.extra_paths = list(extra_paths)
        #: Every worker this factory started, in order.
        self.started: list[Worker] = []

    def __call__(self, app: str, *, pool: str = "prefork", concurrency: int = 2,
                 conf: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 name: str | None = None, loglevel: str = "info", args: Sequence[str] = (),
                 cwd: str | os.PathLike | None = None, timeout: float = WORKER_START_TIMEOUT) -> Worker:
        """Start ``celery worker`` for ``app`` and return it once it is ready.

        ``app`` is an import path, ``"proj.celery:app"`` or ``"proj.celery"``.
        The worker gets the ``leases_conf`` settings updated with ``conf`` (a
        value of None keeps the app's own setting), applied after your module
        is imported and before the worker starts; the same settings are applied
        to the app in the test process (``Worker.app``), so what the test sends
        reaches this worker and ``celery_leases.store(app)`` reads this test's
        leases. Settings travel as JSON: plain values only.

        ``pool`` and ``concurrency`` are ``-P`` and ``-c``; ``env`` is added to
        the worker's environment; ``args`` are more ``celery worker`` options
        (``["-Q", "payments"]``). The worker runs in ``cwd`` (default: the
        current directory) with it and the rootdir on ``PYTHONPATH``.
        """
        if not isinstance(app, str):
            raise TypeError(f"leases_worker: app must be an import path such as 'proj.celery:app', "
                            f"got {app!r} (a worker process cannot receive an app object)")
        merged = {**self.conf, **(conf or {})}
        merged = {key: value for key, value in merged.items() if value is not None}
        json.dumps(merged)  # fail here, naming nothing unusual, rather than in the worker
        name = name or f"w{len(self.started) + 1}"
        workdir = str(cwd or os.getcwd())
        paths = [workdir, *self.extra_paths, *_project_paths()]
        client_app = configure(_find_app(app), merged)
        worker = Worker(app, name=name, conf=merged, env=env, pool=pool,
                        concurrency=concurrency, loglevel=loglevel, args=args,
                        log_dir=self.log_dir, cwd=workdir, pythonpath=paths, client_app=client_app)
        self.started.append(worker)
        return worker.start(timeout)


def _project_paths() -> list[str]:
    """Entries of sys.path outside the interpreter's own directories (the project's)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if not any(real == p or real.startswith(p + os.sep) for p in prefixes):
            out.append(entry)
    return out


def _find_app(path: str) -> Any:
    from celery.app.utils import find_app
    try:
        return find_app(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with what was looked for
        raise RuntimeError(f"celery-leases testing: cannot import the app {path!r} in the test "
                           f"process: {exc!r}") from exc


# -- the worker process -----------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Kill this worker's process group once the test process is gone (no orphans)."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="celery-leases-testing-parent", daemon=True).start()


def worker_main(argv: Sequence[str]) -> int:
    """``python -m celery_leases.testing APP worker ...``: configure APP, then run the worker."""
    from celery.app.utils import find_app
    from celery.signals import worker_ready

    spec = json.loads(os.environ.pop(_SPEC_ENV, "{}") or "{}")
    app_path, *celery_argv = argv
    app = find_app(app_path)
    configure(app, spec.get("conf") or {})
    if spec.get("install"):
        import celery_leases
        celery_leases.install(app, all_tasks=spec["install"] == "all")
    ready = spec.get("ready")
    if ready:
        def mark_ready(**kwargs: Any) -> None:
            Path(ready).write_text(str(os.getpid()))
        worker_ready.connect(mark_ready, weak=False)
    if spec.get("parent"):
        _watch_parent(int(spec["parent"]))
    # As `celery worker` runs (not app.worker_main, which drops the worker's exit status):
    # a refused start exits with its EX_ code here too.
    from celery.bin.celery import celery
    celery.params[0].default = app
    return celery.main(args=list(celery_argv), prog_name="celery", standalone_mode=True)
