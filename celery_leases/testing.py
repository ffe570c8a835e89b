"""pytest plugin: test your own leased tasks on real workers, without Docker.

Installed with the package and loaded by pytest automatically (entry point
``pytest11``, name ``celery_leases``; disable with ``-p no:celery_leases``).
Every fixture starts with ``leases_`` so none collides with pytest-celery's
(``celery_app``, ``celery_worker``, ...) or your own.

Fixtures:

- ``leases_redis_url`` (session): ``$LEASES_TEST_REDIS_URL``, or a throwaway
  ``redis-server`` on a free loopback port.
- ``leases_key_prefix``: a key prefix unique to the test.
- ``leases_conf``: the settings that point an app at this test's Redis,
  key prefix and queue.
- ``leases_worker``: a factory that starts a real ``celery worker``
  subprocess for your app and stops it after the test.

Helpers (plain functions): ``configure``, ``wait_for_lease``,
``expire_lease``, ``make_stale``, ``run_recovery``; and, from
:mod:`celery_leases.processes` (importable without pytest), ``RedisServer``,
``find_redis_server`` and ``wait_for``.

Importing this module starts nothing and imports neither Celery nor redis-py
beyond what ``celery_leases`` itself imports: fixtures do their work only
when a test asks for them. See docs/testing.md.
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
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence
from uuid import uuid4

import pytest

from .processes import (  # noqa: F401 - re-exported, the plugin's public names
    REDIS_SERVER_ENV, REDIS_URL_ENV, START_TIMEOUT, RedisServer, RedisServerError,
    find_redis_server, free_port, wait_for,
)

if TYPE_CHECKING:
    from .store import LeaseRecord, LeaseStore, RecoveryReport

__all__ = [
    "leases_redis_url", "leases_key_prefix", "leases_conf", "leases_worker",
    "Worker", "WorkerFactory", "configure", "wait_for_lease", "expire_lease", "make_stale",
    "run_recovery", "find_redis_server", "RedisServer", "wait_for",
]

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


# -- a throwaway redis-server: celery_leases.processes ---------------------------

#: The plugin's former private names of the helpers now in ``celery_leases.processes``.
_RedisServer = RedisServer
_free_port = free_port
_wait = wait_for


# -- fixtures -------------------------------------------------------------------


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


_WORKERS = pytest.StashKey[list]()


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
    request.node.stash[_WORKERS] = factory.started
    try:
        yield factory
    finally:
        for worker in factory.started:
            worker.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """Attach the logs of a failed test's workers to its report."""
    outcome = yield
    workers = item.stash.get(_WORKERS, None)
    if not workers:
        return
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when in ("call", "setup"):
        for worker in workers:
            report.sections.append((f"celery-leases worker {worker.name} log", worker.log_tail()))


# -- workers --------------------------------------------------------------------


class Worker:
    """A ``celery worker`` subprocess (its own process group) started by ``leases_worker``.

    ``pause()`` and ``resume()`` stop and continue the main process and its
    pool children (SIGSTOP/SIGCONT): a paused worker neither runs nor renews
    its leases, as in a long GC pause or a frozen VM. ``kill()`` is a SIGKILL
    of all of them (an OOM kill, a lost host); ``stop()`` a warm shutdown.
    """

    def __init__(self, app: str, *, name: str, conf: Mapping[str, Any], env: Mapping[str, str],
                 pool: str, concurrency: int, loglevel: str, args: Sequence[str],
                 log_dir: Path, cwd: str, pythonpath: Sequence[str], client_app: Any = None) -> None:
        self.name = name
        #: The app in the test process, configured like the worker's (None if not imported).
        self.app = client_app
        self.log_path = Path(log_dir) / f"worker-{name}.log"
        self._ready_path = Path(log_dir) / f"worker-{name}.ready"
        self.cwd = cwd
        node = f"{name}-{os.urandom(3).hex()}@%h"
        self.command = [sys.executable, "-m", "celery_leases.testing", app, "worker",
                        "-P", pool, "-c", str(concurrency), "-n", node, "-l", loglevel,
                        "--without-mingle", "--without-gossip", *args]
        existing = os.environ.get("PYTHONPATH")
        paths = list(dict.fromkeys([*pythonpath, *([existing] if existing else [])]))
        spec = {"conf": dict(conf), "ready": str(self._ready_path), "parent": os.getpid()}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **env,
                    _SPEC_ENV: json.dumps(spec)}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = WORKER_START_TIMEOUT) -> "Worker":
        """Start the worker and wait until it consumes (its ``worker_ready`` signal)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         start_new_session=True)
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

    def _signal_group(self, sig: int) -> None:
        try:
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
        self._signal_group(signal.SIGSTOP)
        if settle > 0:
            time.sleep(settle)

    def resume(self) -> None:
        """SIGCONT what ``pause()`` stopped."""
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, as a crash would."""
        if not self.running:
            return
        self._signal_group(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM): running tasks finish, held leases are released.
        Killed if it has not exited after ``timeout`` seconds."""
        if not self.running:
            return
        assert self.proc is not None
        self._signal_group(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
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
        worker = Worker(app, name=name, conf=merged, env=dict(env or {}), pool=pool,
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


# -- helpers --------------------------------------------------------------------


def configure(app: Any, conf: Mapping[str, Any]) -> Any:
    """Apply ``conf`` to ``app.conf`` and drop what celery-leases cached for the app.

    celery-leases reads its settings once per app and keeps one LeaseStore per
    app and process; after a change of ``leases_*`` settings (a new test's key
    prefix) both must be built again. Call it before the app's first broker
    connection if ``conf`` changes the broker. Returns ``app``.
    """
    from . import config, runtime

    app.conf.update(dict(conf))
    config._configs.pop(app, None)
    entry = runtime._stores.pop(app, None)
    if entry is not None:
        try:
            entry[1].client.close()
        except Exception:  # noqa: BLE001 - an old connection we no longer use
            pass
    return app


def _store(app: Any) -> "LeaseStore":
    from .install import store
    return store(app)


def wait_for_lease(app: Any, task_id: str, timeout: float = 10.0) -> "LeaseRecord":
    """Wait until a worker owns ``task_id``'s lease; return the record (``.token``, ``.owner``).

    A worker acquires the lease when it receives the message, just before the
    body starts. AssertionError after ``timeout`` seconds.
    """
    store = _store(app)

    def owned() -> Any:
        record = store.get(task_id)
        return record if record is not None and record.state == "active" and record.owner else None

    return wait_for(owned, timeout, f"a worker to own the lease of task {task_id} "
                                 f"(prefix {store.keys.prefix})")


def expire_lease(app: Any, task_id: str) -> bool:
    """Make ``task_id``'s lease due now, as if its ttl had run out; False if it is not indexed.

    Uses ``LeaseStore.expire_now``: the next recovery pass (or a redelivered
    copy) takes the lease. An owner whose heartbeat still runs renews it at its
    next tick, so expire the lease of a paused or killed worker, or use
    :func:`make_stale` to expire and claim it at once.
    """
    return _store(app).expire_now(task_id)


def run_recovery(app: Any) -> "RecoveryReport":
    """Run one recovery pass for ``app`` now and return its report (``recovered``, ``dead``)."""
    return _store(app).recover()


def make_stale(app: Any, task_id: str, attempts: int = 5) -> "RecoveryReport":
    """Take ``task_id``'s lease from its current owner: expire it and run a recovery pass.

    The task is re-published under the same id with a new generation (or
    declared dead past its max recoveries); the owner keeps running but is now
    stale: its outcome will be refused and its ``self.lease.lost`` becomes
    True. Works on a running owner too: if its heartbeat renews the lease
    between the two steps, both are repeated (up to ``attempts`` times).
    Returns the report of the pass(es). LookupError when there is no lease,
    ValueError when it is not active (nobody owns it).
    """
    from .store import RecoveryReport

    store = _store(app)
    before = store.get(task_id)
    if before is None:
        raise LookupError(f"make_stale: no lease for task {task_id} under prefix "
                          f"{store.keys.prefix!r}; no worker received it yet (wait_for_lease)")
    if before.state != "active":
        raise ValueError(f"make_stale: the lease of task {task_id} is {before.state!r}; only an "
                         "active lease has an owner to make stale")
    # A running owner's body is charged a recovery only once the store knows it
    # started (the start mark its worker's heartbeat sends within milliseconds);
    # a lease still not marked after a moment belongs to a task that only waits.
    started_by = time.monotonic() + 2.0
    while not before.started and time.monotonic() < started_by:
        time.sleep(0.01)
        current = store.get(task_id)
        if current is None or current.state != "active" or current.token != before.token:
            break
        before = current
    report = RecoveryReport()
    for _ in range(attempts):
        store.expire_now(task_id)
        report += store.recover()
        after = store.get(task_id)
        if (after is None or after.state != "active" or after.token != before.token
                or after.generation != before.generation):
            return report
    raise AssertionError(f"make_stale: task {task_id} kept its lease through {attempts} "
                         "expire-and-recover attempts (its owner renewed it each time)")


# -- the worker process -----------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """Kill this worker's process group once the test process is gone (no orphans)."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="celery-leases-testing-parent", daemon=True).start()


def _worker_main(argv: Sequence[str]) -> int:
    """``python -m celery_leases.testing APP worker ...``: configure APP, then run the worker."""
    from celery.app.utils import find_app
    from celery.signals import worker_ready

    spec = json.loads(os.environ.pop(_SPEC_ENV, "{}") or "{}")
    app_path, *celery_argv = argv
    app = find_app(app_path)
    configure(app, spec.get("conf") or {})
    ready = spec.get("ready")
    if ready:
        def mark_ready(**kwargs: Any) -> None:
            Path(ready).write_text(str(os.getpid()))
        worker_ready.connect(mark_ready, weak=False)
    if spec.get("parent"):
        _watch_parent(int(spec["parent"]))
    return app.worker_main(celery_argv) or 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
