"""Publish tracking through a Sentinel-addressed lease store (``leases_redis_url = "sentinel://..."``).

A real group on loopback (one master, one replica, three Sentinels); the broker is a
redis-server of its own without persistence, results and the tasks' history live on the
session's Redis. Queued records are written on the master Sentinel names, replicate like
active ones, and the undelivered step re-publishes them through Sentinel, across a failover.
"""
from __future__ import annotations

import json

import pytest

import celery_leases
from celery_leases.protocol.keys import Keys
from tests.support.workers import assert_ran_once_with_a_lease

TASKS = "tests.support.apps.leased_app"
#: leases_delivery_timeout of these tests: short, so re-publishing fits in the test's time.
TIMEOUT = 3.0


@pytest.fixture
def celery_env(celery_env, sentinel_group, broker_server, redis_server_url):
    return {**celery_env, "LEASES_TEST_BROKER": broker_server.url, "LEASES_TEST_BACKEND": redis_server_url,
            "LEASES_TEST_LEASES_URL": sentinel_group.url,
            "LEASES_TEST_LEASES_TRANSPORT": json.dumps(sentinel_group.transport_options),
            "LEASES_TEST_HISTORY_URL": redis_server_url, "LEASES_TEST_WORKER_RECOVERY": "1",
            "LEASES_TEST_DELIVERY_TIMEOUT": str(TIMEOUT)}


def queued_on(server, keys: Keys, task_ids: list[str]) -> dict[str, tuple]:
    """Read on one data node, not through Sentinel: each task's (state, message kept, indexed)."""
    with server.client() as node:
        return {t: (node.hget(keys.record(t), "state"), node.exists(keys.message(t)) == 1,
                    node.zscore(keys.shard_for(t).queued, t) is not None) for t in task_ids}


def test_queued_records_follow_a_sentinel_failover_and_lost_tasks_run_once(
        sentinel_group, broker_server, client_app, key_prefix, start_worker, history):
    group = sentinel_group
    keys = Keys(key_prefix)
    store = celery_leases.store(client_app)
    assert store.description.startswith("Sentinel master leases/0")
    queued = (b"queued", True, True)
    # Given 6 tasks published while no worker runs: each recorded queued on the master
    first = [client_app.signature(f"{TASKS}.add", (i, i)).delay() for i in range(6)]
    master = group.master()
    assert queued_on(master, keys, [r.id for r in first]) == dict.fromkeys((r.id for r in first), queued)
    # When the broker forgets them, and the master is SIGKILLed once its replica has every write
    broker_server.client().flushdb()
    group.wait_ready()
    group.wait_replicated()
    old = group.kill_master()
    promoted = group.wait_for_failover(old.port)
    # Then the promoted master holds every queued record, message and index entry
    assert queued_on(promoted, keys, [r.id for r in first]) == dict.fromkeys((r.id for r in first), queued)
    # And tasks published after the failover are recorded on the promoted master, through Sentinel
    second = [client_app.signature(f"{TASKS}.add", (i, 100)).delay() for i in range(4)]
    assert queued_on(promoted, keys, [r.id for r in second]) == dict.fromkeys((r.id for r in second), queued)
    broker_server.client().flushdb()
    # And a worker whose store is the same Sentinel URL re-publishes every lost task after the
    # delivery timeout: each runs once, with a lease, from its recorded message
    start_worker("a", pool="threads", concurrency=2)
    assert [r.get(timeout=40) for r in first] == [2 * i for i in range(6)]
    assert [r.get(timeout=20) for r in second] == [i + 100 for i in range(4)]
    assert_ran_once_with_a_lease(history, first + second)
    records = store.records([r.id for r in first + second])
    assert {(r.state, r.generation) for r in records} == {("succeeded", 1)}
    assert store.stats()["undelivered_republished"] == 10
