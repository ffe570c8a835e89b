"""Publish tracking on a real local Redis Cluster: queued records shard like active ones.

Three masters with one replica each (``RedisClusterServer``); a key prefix whose
shards land on every master. The store side (enqueue, claim_undelivered, acquire,
forget) across shards, each batch pipelined per master; then real workers whose
lease store is the cluster recover tasks their broker's Redis forgot (FLUSHDB); last,
queued records replicated before their master dies survive its failover.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest

from celery_leases.protocol.codes import Code
from celery_leases.protocol.queued import QueuedTask, QueuedTasks
from celery_leases.protocol.store import LeaseStore
from tests.support.cluster import SHARDS, master_port, spread_prefix, task_ids_on_every_shard, wait_replicated
from tests.support.workers import assert_ran_once_with_a_lease

TASKS = "tests.support.apps.leased_app"


def message(task_id: str, **kw) -> QueuedTask:
    return QueuedTask(task_id, "job", b"body-" + task_id.encode(),
                      {"exchange": "", "routing_key": "q", "headers": {"id": task_id}}, **kw)


class PipelineCount:
    """Counts the per-master pipelines the cluster client hands out, and lone script calls."""

    def __init__(self, monkeypatch, client, store: LeaseStore) -> None:
        self.pipelines: Counter = Counter()
        self.lone = 0
        get_connection = client.get_redis_connection
        run = store.calls.run

        def counted_connection(node):
            self.pipelines[node.port] += 1
            return get_connection(node)

        def counted_run(*args, **kwargs):
            self.lone += 1
            return run(*args, **kwargs)
        monkeypatch.setattr(client, "get_redis_connection", counted_connection)
        monkeypatch.setattr(store.calls, "run", counted_run)

    def reset(self) -> None:
        self.pipelines.clear()
        self.lone = 0


def test_queued_records_shard_and_recover_across_three_masters(client, monkeypatch):
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30)
    tracked = QueuedTasks(store, delivery_timeout=0.3)
    ids = task_ids_on_every_shard(store.keys, per_shard=3)
    masters = {master_port(client, store.keys.shard(i).queued) for i in range(SHARDS)}
    assert len(masters) == 3
    # (a first batch on every master loads the scripts there: NOSCRIPT repeats calls alone)
    warm = [f"warm-{t}" for t in task_ids_on_every_shard(store.keys, per_shard=1)]
    tracked.enqueue_many([message(t) for t in warm])
    for t in warm:
        assert tracked.forget(t) is Code.OK
    count = PipelineCount(monkeypatch, client, store)

    # enqueue a batch: one pipeline per master, no call repeated alone
    assert tracked.enqueue_many([message(t) for t in ids]) == [(Code.OK, "queued")] * len(ids)
    assert set(count.pipelines) == masters and set(count.pipelines.values()) == {1} and count.lone == 0
    # each record, message and index entry lives in its task's shard, on that shard's master
    for t in ids:
        shard = store.keys.shard_for(t)
        port = master_port(client, shard.queued)
        assert master_port(client, store.keys.record(t)) == port == master_port(client, store.keys.message(t))
        assert client.zscore(shard.queued, t) is not None
        assert store.get(t).state == "queued"
    assert tracked.count() == len(ids)
    # a second publish of a queued id writes nothing
    assert tracked.enqueue(message(ids[0])) == (Code.BUSY, "queued")
    # the publish side's single-round-trip path is not used on a cluster (enqueue is)
    assert tracked.send(message(ids[0])) is None and tracked.send(message(ids[0])) is None

    # acquire at receipt, one task per shard: active, out of its shard's queued index
    acquired = ids[::3]
    for t in acquired:
        assert store.acquire(t, "w1").code is Code.ACQUIRED
        assert client.zscore(store.keys.shard_for(t).queued, t) is None
    # forget (a publish that raised), one task per shard
    forgotten = ids[1::3]
    for t in forgotten:
        assert tracked.forget(t) is Code.OK and store.get(t) is None

    # the rest, never acquired: overdue on every shard after the timeout, re-published
    left = sorted(set(ids) - set(acquired) - set(forgotten))
    time.sleep(0.5)
    republished = []
    report = tracked.recover(republished.append)
    assert report.undelivered == len(left) and sorted(u.task_id for u in republished) == left
    assert all(u.generation == 1 and u.body == b"body-" + u.task_id.encode()
               and u.envelope["routing_key"] == "q" for u in republished)
    # still not acquired a timeout later: one more copy each, listed and claimed in one
    # pipeline per master (the first pass loaded those scripts on every master)
    time.sleep(0.5)
    count.reset()
    republished = []
    report = tracked.recover(republished.append)
    assert sorted(u.task_id for u in republished) == left and {u.generation for u in republished} == {2}
    assert count.lone == 0 and set(count.pipelines) == masters, (count.lone, count.pipelines)
    # the latest copy acquires; the older ones are stale copies
    for u in republished:
        assert store.acquire(u.task_id, "w2", generation=0).code is Code.STALE
        assert store.acquire(u.task_id, "w2", generation=1).code is Code.STALE
        assert store.acquire(u.task_id, "w2", generation=2).code is Code.ACQUIRED
    assert tracked.count() == 0 and store.stats()["undelivered_republished"] == 2 * len(left)
    assert store.stats()["queued"] == len(ids) + len(warm)

def test_queued_tasks_past_their_expires_are_revoked_on_every_shard(client):
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30)
    tracked = QueuedTasks(store, delivery_timeout=0.2)
    ids = task_ids_on_every_shard(store.keys, per_shard=1)
    past = int(time.time() * 1000) - 1000
    tracked.enqueue_many([message(t, expires_ms=past) for t in ids])
    time.sleep(0.4)
    expired = []
    report = tracked.recover(lambda u: pytest.fail(f"{u.task_id} re-published past its expires"),
                             expired.append)
    assert report.undelivered_expired == len(ids) and sorted(u.task_id for u in expired) == sorted(ids)
    assert {store.get(t).state for t in ids} == {"revoked"}
    assert client.exists(*(store.keys.message(t) for t in ids)) == 0


def test_workers_on_a_cluster_store_run_tasks_their_broker_forgot(cluster, client, broker_server, celery_env,
                                                                   redis_server_url, start_worker, history):
    from tests.support.apps.leased_app import create_app
    # Given a broker on its own Redis, leases on the cluster (sharded), results and history on the
    # session's Redis, and 12 tasks published while no worker runs
    env = {"LEASES_TEST_BROKER": broker_server.url, "LEASES_TEST_BACKEND": redis_server_url,
           "LEASES_TEST_LEASES_URL": cluster.url, "LEASES_TEST_HISTORY_URL": redis_server_url,
           "LEASES_TEST_SHARDS": str(SHARDS), "LEASES_TEST_WORKER_RECOVERY": "1",
           "LEASES_TEST_DELIVERY_TIMEOUT": "3"}
    celery_env.update(env)
    app = create_app(celery_env)
    try:
        results = [app.signature(f"{TASKS}.add", (i, i)).delay() for i in range(12)]
        store = LeaseStore(client, celery_env["LEASES_TEST_PREFIX"], shards=SHARDS)
        assert {store.get(r.id).state for r in results} == {"queued"}
        assert len({store.keys.shard_of(r.id) for r in results}) > 1
        # When the broker's database is flushed
        broker_server.client().flushdb()
        start_worker("a", pool="threads", concurrency=2, **env)
        # Then every waiter gets its result, each task ran once with a lease
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(12)]
        assert_ran_once_with_a_lease(history, results)
        assert {store.get(r.id).generation for r in results} == {1}
    finally:
        app.close()


# -- failover (last: the module's cluster has one master without a replica after it) --------


def test_queued_records_replicated_before_a_master_dies_survive_its_failover(cluster, client):
    # Given queued tasks on every shard, and a master with its replica in sync (WAIT)
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30)
    tracked = QueuedTasks(store, delivery_timeout=0.5)
    ids = task_ids_on_every_shard(store.keys, per_shard=3)
    tracked.enqueue_many([message(t) for t in ids])
    victim = next(m for m in cluster.masters() if cluster.replicas_of(m))
    (replica,) = cluster.replicas_of(victim)
    on_victim = [t for t in ids if master_port(client, store.keys.record(t)) == victim.port]
    assert on_victim
    wait_replicated(client, victim, replica)
    # When the master is SIGKILLed and its replica promoted
    assert cluster.kill_master(victim) is replica
    # Then every queued record, its message and its index entry are still there, on every shard
    assert {r.task_id: r.state for r in store.records(ids)} == dict.fromkeys(ids, "queued")
    assert all(client.exists(store.keys.message(t)) and client.zscore(store.keys.shard_for(t).queued, t)
               for t in ids)
    assert tracked.count() == len(ids)
    # and on the promoted master's shards a receipt still acquires one, the undelivered
    # step re-publishes the others once overdue, and the late original is refused as stale
    acquired = on_victim[0]
    assert store.acquire(acquired, "w1").code is Code.ACQUIRED
    time.sleep(0.6)
    republished = []
    assert tracked.recover(republished.append).undelivered == len(ids) - 1
    assert sorted(u.task_id for u in republished) == sorted(set(ids) - {acquired})
    late = on_victim[1]
    assert store.acquire(late, "w2", generation=0).code is Code.STALE
    assert store.acquire(late, "w2", generation=1).code is Code.ACQUIRED
