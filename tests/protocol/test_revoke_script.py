"""revoke.lua against a real redis-server: one test per branch (LeaseStore.revoke).

The Celery side (every revoke path of a real worker) is tests/worker/test_revoke.py.
"""
from __future__ import annotations

import time

import pytest

import redis

from celery_leases import Code, CorruptRecord, LeaseLost, LeaseStore
from tests.protocol.scripts_support import A, B, SHORT, TTL, Recorder, acquire, fields, indexed, pttl, wait_out


def message_exists(store, task_id: str) -> bool:
    return bool(store.client.exists(store.keys.message(task_id)))


def test_revoke_of_a_task_never_seen_creates_a_terminal_record_that_refuses_deliveries(store):
    # Given no record for the task (its message still waits in the broker)
    # When it is revoked
    assert store.revoke("queued", name="proj.add") is Code.OK
    # Then a terminal revoked record exists, kept for the retention period only
    rec = store.get("queued")
    assert (rec.state, rec.token, rec.name) == ("revoked", 0, "proj.add")
    assert 0 < pttl(store, "queued") <= store.settings.retention * 1000
    assert indexed(store) == {}
    # And the delivery that comes later (or a fresh worker's) is refused, not run
    acq = acquire(store, "queued", B)
    assert (acq.code, acq.state) == (Code.FINISHED, "revoked")
    assert store.stats()["revoked"] == 1


def test_revoke_of_a_recovering_task_drops_its_message_and_refuses_the_recovered_copy(store):
    # Given a task whose owner died and that recovery re-published (generation 1)
    acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    [claim] = store.claim_expired()
    assert store.get("t1").state == "recovering"
    # When it is revoked
    assert store.revoke("t1") is Code.OK
    # Then it is terminal, out of the index, its message gone
    assert store.get("t1").state == "revoked"
    assert indexed(store) == {} and not message_exists(store, "t1")
    # And the re-published copy is refused, as is any later recovery pass
    assert acquire(store, "t1", B, generation=claim.generation).code is Code.FINISHED
    assert store.recover(publish=Recorder().publish).recovered == 0


@pytest.mark.parametrize("expired", [False, True])
def test_revoke_of_an_owner_that_stopped_renewing_ends_the_lease(store, expired):
    # Given an active lease whose owner stopped renewing (deadline passed, not yet recovered)
    acq = acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    # When it is revoked, or a copy of its message expired
    assert store.revoke("t1", expired=expired) is Code.OK
    # Then nobody runs it again and the late owner's outcome is refused
    assert store.get("t1").state == "revoked" and indexed(store) == {}
    assert acquire(store, "t1", B).code is Code.FINISHED
    with pytest.raises(LeaseLost):
        store.finish("t1", A, acq.token, "succeeded")
    assert store.get("t1").state == "revoked"


@pytest.mark.parametrize("expired", [False, True])
def test_the_owner_revokes_its_own_live_lease(store, expired):
    # Given A holds a live lease (its delivery is discarded or terminated by Celery)
    acq = acquire(store, "t1", A)
    # When A revokes it with its own token
    assert store.revoke("t1", expired=expired, owner=A, token=acq.token) is Code.OK
    # Then the lease ends revoked under A's token
    rec = store.get("t1")
    assert (rec.state, rec.token, rec.owner) == ("revoked", acq.token, A)
    assert indexed(store) == {} and not message_exists(store, "t1")
    # And revoking again (Celery's announce after a backend mark) is OK, changing nothing
    before = fields(store, "t1")
    assert store.revoke("t1", owner=A, token=acq.token) is Code.OK
    assert fields(store, "t1") == before
    assert store.stats()["revoked"] == 1


def test_a_wrong_token_or_owner_is_not_the_holder(store):
    # Given A holds a live lease
    acq = acquire(store, "t1", A)
    # When someone else, or A with an older token, revokes as if it held it
    for owner, token in ((B, acq.token), (A, acq.token - 1)):
        # Then it is BUSY: the live owner keeps running
        assert store.revoke("t1", expired=True, owner=owner, token=token) is Code.BUSY
    assert store.get("t1").state == "active"


def test_an_expiry_while_another_owner_runs_changes_nothing(store):
    # Given A runs the task with a live lease
    acq = acquire(store, "t1", A)
    before = fields(store, "t1")
    # When a copy of its message is found expired elsewhere
    assert store.revoke("t1", expired=True) is Code.BUSY
    # Then nothing changed: A started in time and its outcome stands
    assert fields(store, "t1") == before
    store.finish("t1", A, acq.token, "succeeded")
    assert store.get("t1").state == "succeeded"


def test_a_revoke_while_another_owner_runs_lets_its_outcome_stand(store):
    # Given A runs the task with a live lease
    acq = acquire(store, "t1", A)
    # When it is revoked (Celery does not stop a running task on a plain revoke)
    assert store.revoke("t1") is Code.BUSY
    # Then A keeps its lease, renews it and its outcome is accepted
    rec = store.get("t1")
    assert rec.state == "active" and rec.revoke_requested > 0
    assert store.renew_many(A, {"t1": acq.token}) == {}
    store.finish("t1", A, acq.token, "succeeded")
    assert store.get("t1").state == "succeeded"


@pytest.mark.parametrize("how", ["take-over", "recovery", "release", "retry"])
def test_a_task_revoked_while_running_is_never_run_after_its_owner(store, how):
    # Given A runs the task and a revoke was remembered (BUSY)
    acq = acquire(store, "t1", A, ttl=SHORT if how in ("take-over", "recovery") else TTL)
    assert store.revoke("t1") is Code.BUSY
    generation, attempt = 0, 0
    # When A dies (its lease runs out, or is recovered), is released, or hands over to a retry
    if how in ("take-over", "recovery"):
        wait_out()
        if how == "recovery":
            [claim] = store.claim_expired()
            generation = claim.generation
    elif how == "release":
        store.release(A, {"t1": acq.token})
    else:
        store.finish("t1", A, acq.token, "retry", next_attempt=1)
        attempt = 1
    # Then the delivery that would have been the next owner ends the lease revoked instead
    acq2 = acquire(store, "t1", B, generation=generation, attempt=attempt)
    assert (acq2.code, acq2.state) == (Code.FINISHED, "revoked")
    rec = store.get("t1")
    assert rec.state == "revoked" and rec.finished_at > 0
    assert indexed(store) == {} and not message_exists(store, "t1")
    assert 0 < pttl(store, "t1") <= store.settings.retention * 1000
    # And every later copy too
    assert acquire(store, "t1", B, generation=generation + 1).code is Code.FINISHED


def test_a_copy_that_finds_the_revoked_task_still_running_is_busy(store):
    # Given A runs the task and it was revoked meanwhile
    acquire(store, "t1", A)
    assert store.revoke("t1") is Code.BUSY
    # When a duplicate delivery arrives while A's lease is live
    # Then it is BUSY (A's run is not disturbed), not a revoked end
    assert acquire(store, "t1", B).code is Code.BUSY
    assert store.get("t1").state == "active"


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "dead"])
def test_revoke_of_a_finished_task_changes_nothing(make_store, outcome):
    # Given a task that finished (or died after its recoveries)
    store = make_store(max_recoveries=0)
    acq = acquire(store, "t1", A, ttl=SHORT if outcome == "dead" else TTL)
    if outcome == "dead":
        wait_out()
        assert store.recover(publish=Recorder().publish).dead == 1
    else:
        store.finish("t1", A, acq.token, outcome)
    before, ttl_before = fields(store, "t1"), pttl(store, "t1")
    stats = store.stats()
    # When it is revoked, by anyone, or a copy expired
    for kwargs in ({}, {"expired": True}, {"owner": A, "token": acq.token}):
        # Then the answer is FINISHED and the record is byte-for-byte unchanged
        assert store.revoke("t1", **kwargs) is Code.FINISHED
    assert fields(store, "t1") == before
    assert abs(pttl(store, "t1") - ttl_before) < 2000
    assert store.stats() == stats


def test_a_corrupt_record_is_reported_and_left_as_it_was(store):
    # Given a record whose state is not one the protocol writes
    store.client.hset(store.keys.record("t1"), mapping={"state": "bogus", "token": "3"})
    # When it is revoked, Then the error names the key and nothing was written
    with pytest.raises(CorruptRecord, match=store.keys.record("t1")):
        store.revoke("t1")
    assert fields(store, "t1") == {"state": b"bogus", "token": b"3"}


# -- revokes held while the store is unreachable (celery_leases/worker/revokes.py) ----


def test_held_revokes_reach_the_store_once_it_answers_and_are_bounded(tmp_path, caplog):
    import logging

    from celery_leases.exceptions import LeaseUnavailable
    from celery_leases.worker.revokes import HeldRevokes
    from celery_leases.testing.servers import RedisServer

    # Given a store whose server is down
    server = RedisServer(dir=tmp_path, appendonly=True).start()
    client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    lease_store = LeaseStore(client, prefix="held", ttl=TTL)
    held = HeldRevokes(lease_store.revoke, delay=0.2, limit=2)
    try:
        server.stop()
        # When three revokes cannot reach it (at most two are held)
        caplog.set_level(logging.WARNING, logger="celery_leases.worker")
        for task_id in ("t1", "t2", "t3"):
            with pytest.raises(LeaseUnavailable) as info:
                lease_store.revoke(task_id)
            held.add(task_id, info.value, expired=False, owner="", token=0, name="proj.add")
        # Then the oldest is dropped, named in an error, and one warning says revokes are held
        assert len(held) == 2 and "t1" not in held
        assert any("t1" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
        assert sum("lease store unreachable during a revoke" in r.getMessage()
                   for r in caplog.records) == 1
        # And while the store stays down, nothing is lost
        assert held.retry() == 2
        # When the store answers again, Then the held revokes are applied (by the retry thread)
        server.start()
        deadline = time.monotonic() + 10
        while len(held) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(held) == 0
        assert lease_store.get("t2").state == lease_store.get("t3").state == "revoked"
        assert lease_store.get("t1") is None
        assert any("held-back revoke(s) applied" in r.getMessage() for r in caplog.records)
    finally:
        held.stop()
        client.close()
        server.stop()
