"""Fixtures of the deployment tests: a real local Redis Cluster for a module, a Sentinel group."""
from __future__ import annotations

import pytest

from celery_leases.testing.cluster import RedisClusterServer
from celery_leases.testing.servers import RedisServerError
from tests.support.sentinel import RedisSentinelGroup


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """Three masters with one replica each on loopback ports; a low ``cluster-node-timeout``
    so a killed master's replica is promoted in about two seconds. One cluster a module:
    a module that fails masters over does not leave its cluster to the next."""
    try:
        server = RedisClusterServer(masters=3, replicas=1, node_timeout=1500,
                                    dir=tmp_path_factory.mktemp("cluster"))
        server.start()
    except RedisServerError as exc:
        pytest.fail(f"could not start a local Redis Cluster: {exc}")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def client(cluster):
    """A cluster client of the test's own."""
    client = cluster.client(socket_timeout=5, socket_connect_timeout=2)
    yield client
    client.close()


@pytest.fixture
def sentinel_group(tmp_path):
    """A Sentinel group (one master, one replica, three Sentinels), not yet ready to fail
    over: the test starts its worker meanwhile, then calls ``wait_ready()``."""
    group = RedisSentinelGroup("leases", dir=tmp_path / "sentinel")
    try:
        yield group.start(wait=False)
    finally:
        group.cleanup()
