"""Kept results (finish.lua, claim_unwritten.lua, results_written.lua): an accepted outcome
whose result Celery writes afterwards is kept until confirmed, and handed to recovery if
nobody confirms it.

Against a real redis-server; due times are on its clock.
"""
from __future__ import annotations

import time

import pytest

from celery_leases import CorruptRecord, LeaseLost
from celery_leases.protocol import unwritten
from tests.protocol.scripts_support import A, B, acquire

#: When the kept results of these tests were kept (any fixed moment: it travels as written).
KEPT_AT = 1_700_000_000.5
KEPT = unwritten.pack("SUCCESS", "proj.add", None, b'{"x": 1}', at=KEPT_AT)


def kept_ids(store) -> dict[str, float]:
    shard = store.keys.shard_for("t1")
    return {k.decode(): v for k, v in store.client.zrange(shard.unwritten, 0, -1, withscores=True)}


def test_an_accepted_finish_keeps_its_result_until_due_then_recovery_gets_it(store):
    # Given A holds t1, and finishes it keeping its result, due 0.3 s later
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "succeeded", kept=KEPT, kept_due=0.3)

    # Then the result is kept, and nobody is handed it before it is due
    assert list(kept_ids(store)) == ["t1"]
    assert unwritten.count(store) == 1
    assert unwritten.claim(store) == []
    # When it is due and nobody confirmed it
    time.sleep(0.35)
    claimed = unwritten.claim(store)

    # Then recovery gets exactly what was kept, and when
    [item] = claimed
    assert (item.task_id, item.state, item.name, item.traceback, item.encoded) == (
        "t1", "SUCCESS", "proj.add", None, b'{"x": 1}')
    assert item.kept_at == KEPT_AT
    # And a second pass at once is not handed it again (its due time moved ahead)
    assert unwritten.claim(store) == []


def test_a_confirmation_drops_the_kept_result_and_counts_what_recovery_wrote(store):
    # Given a kept result, handed to recovery
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "failed", kept=KEPT, kept_due=0.001)
    time.sleep(0.01)
    [item] = unwritten.claim(store)

    # When recovery confirms it wrote it
    unwritten.confirm(store, [item.task_id], wrote=1)

    # Then nothing is kept any more, and the stats count the write
    assert kept_ids(store) == {}
    assert unwritten.count(store) == 0
    assert not store.client.hexists(store.keys.shard_for("t1").unwritten_results, "t1")
    assert store.stats()["results_written"] == 1


def test_confirmations_ride_along_a_later_finish_even_a_refused_one(store):
    # Given t1 and t2 finished with kept results
    for task_id in ("t1", "t2"):
        acq = acquire(store, task_id, A)
        store.finish(task_id, A, acq.token, "succeeded", kept=KEPT, kept_due=60)
    assert set(kept_ids(store)) == {"t1", "t2"}
    # When a finish of t3 carries the confirmation of t1, and one refused for t4 carries t2's
    acq3 = acquire(store, "t3", A)
    store.finish("t3", A, acq3.token, "succeeded", written=["t1"])
    acq4 = acquire(store, "t4", A)
    with pytest.raises(LeaseLost):
        store.finish("t4", B, acq4.token + 100, "succeeded", written=["t2"])

    # Then both kept results are gone, and nothing new was kept
    assert kept_ids(store) == {}


def test_a_refused_finish_keeps_nothing(store):
    # Given B took over t1 from A
    acquire(store, "t1", A)
    store.client.zadd(store.keys.shard_for("t1").deadlines, {"t1": 0})
    taken = acquire(store, "t1", B)
    # When A's stale finish arrives with a result to keep
    with pytest.raises(LeaseLost):
        store.finish("t1", A, taken.token - 1, "succeeded", kept=KEPT, kept_due=0.001)
    # Then nothing is kept for recovery to write
    time.sleep(0.01)
    assert unwritten.claim(store) == []


def test_the_same_finish_sent_again_keeps_one_result(store):
    # Given A's finish was applied but its reply lost
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "succeeded", kept=KEPT, kept_due=0.001)
    # When A sends it again
    store.finish("t1", A, acq.token, "succeeded", kept=KEPT, kept_due=0.001)
    time.sleep(0.01)
    # Then recovery is handed one kept result
    assert [c.task_id for c in unwritten.claim(store)] == ["t1"]


def test_a_kept_result_and_a_result_written_by_the_finish_exclude_each_other(store):
    acq = acquire(store, "t1", A)
    with pytest.raises(ValueError, match="not kept too"):
        store.finish("t1", A, acq.token, "succeeded", write=("k", "v", 0), kept=KEPT)


def test_a_finish_that_writes_its_result_may_keep_its_follow_ups(store):
    # Given a finish writing the result itself and keeping only what follows it (a chord part)
    acq = acquire(store, "t1", A)
    kept = unwritten.pack("SUCCESS", "proj.add", None, b"5", write=False,
                          follow_ups={"chord": {"group": "g"}})
    store.finish("t1", A, acq.token, "succeeded", write=("result-of-t1", "v", 0),
                 kept=kept, kept_due=0.001)
    time.sleep(0.01)
    # Then recovery is handed the follow-ups, not a result to write
    (item,) = unwritten.claim(store)
    assert (item.task_id, item.write, item.follow_ups) == ("t1", False, {"chord": {"group": "g"}})


def test_a_corrupt_unwritten_index_is_named(store):
    # Given the index of kept results is not a sorted set
    store.client.set(store.keys.shard_for("t1").unwritten, "junk")
    # Then claiming names the key, and a finish writes nothing
    with pytest.raises(CorruptRecord, match="unwritten"):
        unwritten.claim(store)
    acq = acquire(store, "t1", A)
    with pytest.raises(CorruptRecord, match="unwritten"):
        store.finish("t1", A, acq.token, "succeeded", kept=KEPT, kept_due=1)
    assert store.get("t1").state == "active"


def test_confirmations_ride_only_with_a_finish_of_their_shard(make_store):
    # Given a store of 8 shards and ids of two different shards
    store = make_store(shards=8)
    ids = [f"t{i}" for i in range(40)]
    same = [t for t in ids if store.keys.shard_of(t) == store.keys.shard_of("t0")]
    other = [t for t in ids if store.keys.shard_of(t) != store.keys.shard_of("t0")]
    # Then a finish of t0 carries only its own shard's confirmations
    assert unwritten.riding(store, "t0", ids) == same
    assert other and not set(other) & set(unwritten.riding(store, "t0", ids))


def test_a_kept_result_records_when_it_was_kept():
    # Given a result packed now, and one with its moment given
    before = time.time()
    now = unwritten.UnwrittenResult.unpack("t", unwritten.pack("FAILURE", "n", "Traceback ...", b"{}"))
    # Then each carries its moment, and its fields, through the store's opaque value
    assert before - 0.01 <= now.kept_at <= time.time() + 0.01
    assert (now.state, now.name, now.traceback, now.encoded) == ("FAILURE", "n", "Traceback ...", b"{}")
    assert unwritten.UnwrittenResult.unpack("t", KEPT).kept_at == KEPT_AT
