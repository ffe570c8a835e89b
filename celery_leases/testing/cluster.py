"""A throwaway Redis Cluster on loopback ports, whose masters can be killed to force a failover.

Built of :class:`celery_leases.testing.servers.RedisServer` nodes; used by the
Redis Cluster tests, ``bench/scale.py --cluster`` and users' own cluster tests
(docs/cluster.md). Importing it starts nothing.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .servers import RedisServer, RedisServerError, free_port, wait_for

if TYPE_CHECKING:
    import redis.cluster

__all__ = ["RedisClusterServer"]


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
        from ..protocol.connection import connect
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
