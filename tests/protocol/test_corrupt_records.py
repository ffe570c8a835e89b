"""One bad record affects one task, on real workers and a real redis-server.

(Was a bug: one corrupt record, a non-number ``generation``, an unknown
``state`` or a key of the wrong type, made claim_expired and renew_many raise
for the whole batch: after a worker died none of its other tasks was
recovered, and a live worker's heartbeat failed for all its leases.)
"""
from __future__ import annotations

import time

import pytest

import celery_leases
from celery_leases import DeliveryParked
from celery_leases.testing import wait_for
from tests.support.workers import starts

TASKS = "tests.support.apps.leased_app"
KINDS = ["generation", "state", "type"]


def corrupt(client, store, task_id: str, kind: str) -> str:
    key = store.keys.record(task_id)
    if kind == "generation":
        client.hset(key, "generation", "not-a-number")
    elif kind == "state":
        client.hset(key, "state", "bogus")
    else:  # a list where the record hash should be
        client.delete(key)
        client.rpush(key, "not", "a", "hash")
    return key


def five_running(client_app, history, seconds: float) -> list:
    results = [client_app.signature(f"{TASKS}.sleep_then_echo", (f"v{i}", seconds)).delay()
               for i in range(5)]
    wait_for(lambda: all(starts(history, r.id) for r in results), 20, what="all five tasks to start")
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_worker_with_one_corrupt_record_the_other_four_rerun_and_it_is_parked(
        kind, client_app, start_worker, history, redis_client):
    # Given five leased tasks running on worker A (ttl 2 s), and worker B running recovery passes
    a = start_worker("a", concurrency=5)
    results = five_running(client_app, history, seconds=60)
    start_worker("b", concurrency=5, LEASES_TEST_WORKER_RECOVERY="1")
    store = celery_leases.store(client_app)
    bad, good = results[0], results[1:]
    # And one record corrupted
    key = corrupt(redis_client, store, bad.id, kind)
    before = redis_client.dump(key)

    # When A is SIGKILLed (its four healthy tasks now re-run for 60 s: give them a short life)
    a.kill()
    killed_at = time.monotonic()

    # Then the other four start again on B within ttl + a few recovery intervals
    wait_for(lambda: all(len(starts(history, r.id)) == 2 for r in good), 2 + 4 * 1 + 6,
             what="the four healthy tasks to be re-run")
    assert time.monotonic() - killed_at <= 2 + 4 * 1 + 6
    # And the corrupt one is parked, listed with the key and the field, and never re-run
    entry = wait_for(lambda: next((p for p in store.parked() if p.task_id == bad.id), None), 15,
                     what="the corrupt task to be parked")
    assert entry.key == key and entry.field == ("type" if kind == "type" else kind)
    assert entry.name == f"{TASKS}.sleep_then_echo" and entry.body_size > 0
    with pytest.raises(DeliveryParked) as err:
        bad.get(timeout=10)
    assert bad.id in str(err.value) and key in str(err.value)
    # And the record is left as it was, for an operator to inspect; it was run only once
    assert redis_client.dump(key) == before
    assert len(starts(history, bad.id)) == 1
    assert redis_client.zscore(store.keys.deadlines, bad.id) is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_live_worker_with_one_corrupt_record_keeps_renewing_the_others(
        kind, client_app, start_worker, history, redis_client):
    # Given five leased tasks running on one worker (ttl 2 s: a heartbeat every ~0.67 s)
    start_worker("a", concurrency=5)
    results = five_running(client_app, history, seconds=6)
    store = celery_leases.store(client_app)
    bad, good = results[0], results[1:]
    # When one record is corrupted
    corrupt(redis_client, store, bad.id, kind)
    first = {r.id: redis_client.zscore(store.keys.deadlines, r.id) for r in good}

    # Then the deadlines of the other four keep moving, tick after tick, past the ttl
    for _ in range(3):
        time.sleep(1.0)
        now = {r.id: redis_client.zscore(store.keys.deadlines, r.id) for r in good}
        assert all(now[t] is not None and now[t] > first[t] for t in first), (first, now)
        first = now
    # And the four finish normally, each run once
    assert [r.get(timeout=20) for r in good] == ["v1", "v2", "v3", "v4"]
    assert all(len(starts(history, r.id)) == 1 for r in good)
    # And a corruption the heartbeat reads (the state, the key's type) made that one lease
    # lost, for its task alone; a corrupt generation is not the heartbeat's concern
    (end,) = wait_for(lambda: [h for h in history() if h[0] == "end" and h[1] == bad.id], 10,
                      what="the corrupt task's body to end")
    assert end[3]["lost"] == ("False" if kind == "generation" else "True")
    assert all(h[3]["lost"] == "False" for h in history() if h[0] == "end" and h[1] != bad.id)


@pytest.mark.parametrize("kind", ["type", "counter"])
def test_a_corrupt_stats_key_does_not_stop_any_task(kind, client_app, start_worker, history, redis_client):
    """(Was a bug: a stats key of the wrong type failed the acquire of every leased task.)
    Counters are best effort; reading them names the key (test_scripts_validation.py)."""
    # Given the shard's stats key is a list (or one counter is not a number)
    store = celery_leases.store(client_app)
    if kind == "type":
        redis_client.rpush(store.keys.stats, "not", "a", "hash")
    else:
        redis_client.hset(store.keys.stats, "acquired", "12x")
    before = redis_client.dump(store.keys.stats)
    start_worker("a", concurrency=2)
    # When tasks run, Then each runs once, with a lease, and succeeds
    results = [client_app.signature(f"{TASKS}.sleep_then_echo", (f"v{i}", 0.1)).delay() for i in range(4)]
    assert [r.get(timeout=20) for r in results] == [f"v{i}" for i in range(4)]
    for r in results:
        (start,) = starts(history, r.id)
        assert start[3]["token"] not in ("", "None")
        assert store.get(r.id).state == "succeeded"
    # And the corrupt key (or counter) is as it was; the other counters still count
    if kind == "type":
        assert redis_client.dump(store.keys.stats) == before
    else:
        assert redis_client.hget(store.keys.stats, "acquired") == b"12x"
        assert int(redis_client.hget(store.keys.stats, "succeeded")) == 4
