"""A throwaway Redis Sentinel group on loopback ports: master, replicas, Sentinels.

For the suite's Sentinel failover tests (tests/deployments/test_sentinel.py).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from celery_leases.testing.servers import RedisServer, RedisServerError, wait_for

__all__ = ["RedisSentinelGroup"]


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

    def wait_replicated(self, timeout_ms: int = 5000) -> None:
        """Wait until the replica has every write the master acknowledged so far.

        WAIT covers the writes of the connection that issues it, so a marker
        write comes first: the replication stream is ordered, so once the replica
        has the marker it has every earlier write, from any client.
        """
        client: Any = self.master().client(socket_timeout=5)
        try:
            client.incr("sentinel-test:marker")
            assert client.wait(1, timeout_ms) == 1, "the replica did not acknowledge the writes"
        finally:
            client.close()

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
