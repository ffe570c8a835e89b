"""Helpers of the tests on a real local Redis Cluster (tests/deployments/test_*cluster.py).

The ``cluster`` and ``client`` fixtures are in tests/deployments/conftest.py.
"""
from __future__ import annotations

from uuid import uuid4

from celery_leases.protocol.keys import Keys
from celery_leases.testing import wait_for

#: Shards of the cluster tests' stores: enough for every master to hold some.
SHARDS = 6


def master_port(client, key: str) -> int:
    """Port of the master serving ``key``'s slot, as the cluster client maps it."""
    return client.get_node_from_key(key).port


def spread_prefix(client, shards: int = SHARDS) -> str:
    """A fresh key prefix whose shards land on every master (so the tests exercise all three).

    A shard's keys share one hash tag (records, messages, deadline and queued indexes):
    placing one of them places them all.
    """
    masters = {n.port for n in client.get_primaries()}
    for _ in range(200):
        prefix = f"t{uuid4().hex[:10]}"
        keys = Keys(prefix, shards)
        if {master_port(client, s.deadlines) for s in keys.all_shards()} == masters:
            return prefix
    raise AssertionError("no prefix spreads its shards over every master")


def task_ids_on_every_shard(keys: Keys, per_shard: int) -> list[str]:
    """``per_shard`` task ids for each shard of ``keys``, shard by shard."""
    ids: dict[int, list[str]] = {i: [] for i in range(keys.shards)}
    n = 0
    while any(len(v) < per_shard for v in ids.values()):
        task_id = f"task-{n}"
        n += 1
        if len(ids[keys.shard_of(task_id)]) < per_shard:
            ids[keys.shard_of(task_id)].append(task_id)
    return [t for v in ids.values() for t in v]


def wait_replicated(client, master, replica) -> None:
    """WAIT on the connection the store wrote with, then check the replica's offset."""
    node = client.get_node(host="127.0.0.1", port=master.port)
    assert client.get_redis_connection(node).execute_command("WAIT", 1, 5000) >= 1
    wait_for(lambda: _replicated(master, replica), 10, "the replica to hold every write")


def _replicated(master, replica) -> bool:
    with master.client() as m, replica.client() as r:
        return int(r.info("replication")["slave_repl_offset"]) >= int(m.info("replication")["master_repl_offset"])
