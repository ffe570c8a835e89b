"""acquire.lua: a fresh task, a live owner, finished and stale copies, take-overs, tokens.

Against a real redis-server. Each test reads Given / When / Then. Times are the
Redis server's clock; short ttls (0.1 s) and sleeps of ttl + 50 ms make a lease
"expired" by a margin. Shared helpers: tests/protocol/scripts_support.py; the
``store`` and ``make_store`` fixtures: tests/protocol/conftest.py.
"""
from __future__ import annotations

import json
import time

import pytest

from celery_leases import Code, LeaseLost
from tests.protocol.scripts_support import (
    A, B, BODY, C, ENVELOPE, MARGIN, SHORT, acquire, fields, indexed, pttl, wait_out,
)


# -- acquire -------------------------------------------------------------------


def test_acquire_fresh_task_gives_an_active_lease_with_server_clock_deadline(store):
    # Given no record for the task
    before = store.server_time_ms()

    # When a worker acquires it
    acq = acquire(store, "t1", ttl=2.0)
    after = store.server_time_ms()

    # Then it owns a new lease whose deadline is server time + ttl
    assert acq.code is Code.ACQUIRED and acq.owned
    assert acq.token > 0 and acq.generation == 0 and acq.recoveries == 0
    assert acq.state == "active"
    rec = store.get("t1")
    assert (rec.state, rec.owner, rec.token, rec.name) == ("active", A, acq.token, "proj.add")
    assert before + 2000 <= rec.deadline <= after + 2000
    assert rec.ttl == 2000 and rec.has_message
    message = store.client.hgetall(store.keys.message("t1"))
    assert json.loads(message[b"envelope"]) == ENVELOPE and message[b"body"] == BODY
    # (the message lives beside the record, which stays small)
    assert "envelope" not in fields(store, "t1") and "body" not in fields(store, "t1")
    # And it is indexed by that deadline and has no TTL of its own
    assert indexed(store) == {"t1": rec.deadline}
    assert pttl(store, "t1") == -1


def test_acquire_while_a_live_owner_holds_the_lease_is_busy(store):
    # Given a live lease held by A
    first = acquire(store, "t1", A)

    # When B (and a duplicate delivery to A itself) try to acquire it
    busy_b = acquire(store, "t1", B)
    busy_a = acquire(store, "t1", A)

    # Then both are BUSY, told the holder's token, and the record is untouched
    for busy in (busy_b, busy_a):
        assert busy.code is Code.BUSY and not busy.owned
        assert busy.token == first.token
    rec = store.get("t1")
    assert (rec.owner, rec.token, rec.recoveries) == (A, first.token, 0)


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "revoked"])
def test_acquire_of_a_finished_task_is_finished(store, outcome):
    # Given a task whose owner finished it
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, outcome)

    # When a late duplicate delivery arrives (any generation or attempt)
    late = acquire(store, "t1", B)
    later = acquire(store, "t1", B, generation=5, attempt=5)

    # Then it is FINISHED and told which state; the record keeps A's outcome
    assert late.code is Code.FINISHED and late.state == outcome and late.token == acq.token
    assert later.code is Code.FINISHED
    assert store.get("t1").state == outcome


def test_acquire_of_an_older_generation_or_attempt_is_stale(store):
    # Given a task on generation 2, attempt 1
    acq = acquire(store, "t1", A, generation=2, attempt=1)
    assert acq.code is Code.ACQUIRED and acq.generation == 2

    # When older copies of the message are delivered
    old_gen = acquire(store, "t1", B, generation=1, attempt=1)
    old_attempt = acquire(store, "t1", B, generation=2, attempt=0)

    # Then both are STALE and A keeps the lease
    assert old_gen.code is Code.STALE and old_attempt.code is Code.STALE
    assert store.get("t1").owner == A
    assert store.stats()["stale_deliveries"] == 2


def test_acquire_of_an_expired_lease_is_a_take_over_counted_as_a_recovery(make_store):
    # Given A's lease expired and no recovery pass claimed it
    store = make_store(max_recoveries=3)
    first = acquire(store, "t1", A, ttl=SHORT)
    wait_out()

    # When a redelivery of the same generation reaches B
    before = store.server_time_ms()
    took = acquire(store, "t1", B, ttl=2.0)

    # Then B takes it over with a greater token; the generation stays, recoveries + 1
    assert took.code is Code.TAKEN_OVER and took.owned
    assert took.token > first.token
    assert (took.generation, took.recoveries) == (0, 1)
    rec = store.get("t1")
    assert (rec.owner, rec.recoveries, rec.generation) == (B, 1, 0)
    assert rec.deadline >= before + 2000
    assert store.stats()["taken_over"] == 1
    # And A, still running somewhere, can no longer renew, report progress or finish
    assert store.renew_many(A, {"t1": first.token}) == {"t1": Code.LOST}
    with pytest.raises(LeaseLost):
        store.progress("t1", A, first.token)
    with pytest.raises(LeaseLost) as lost:
        store.finish("t1", A, first.token, "succeeded")
    assert lost.value.reason == "lost"
    store.finish("t1", B, took.token, "succeeded")


def test_acquire_take_over_past_max_recoveries_makes_the_task_dead(make_store):
    # Given a task that already used its one allowed recovery (by a take-over)
    store = make_store(max_recoveries=1, retention=60)
    acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    assert acquire(store, "t1", B, ttl=SHORT).code is Code.TAKEN_OVER
    wait_out()

    # When its lease expires again and a redelivery arrives
    dead = acquire(store, "t1", C)

    # Then acquire answers DEAD, and the record is dead, unindexed, kept for retention
    assert dead.code is Code.DEAD and not dead.owned and dead.state == "dead"
    assert dead.recoveries == 1
    rec = store.get("t1")
    assert rec.state == "dead" and rec.owner == "" and not rec.has_message
    assert indexed(store) == {}
    assert 0 < pttl(store, "t1") <= 60_000
    # And any later delivery is FINISHED
    assert acquire(store, "t1", C).code is Code.FINISHED


def test_tokens_strictly_increase_across_successive_owners(make_store):
    # Given a task handed from owner to owner by every route the protocol has
    store = make_store(max_recoveries=10)
    tokens = [acquire(store, "t1", A, ttl=SHORT).token]
    wait_out()
    tokens.append(acquire(store, "t1", B, ttl=SHORT).token)            # take-over
    wait_out()
    (claim,) = store.claim_expired()                                    # recovery
    tokens.append(acquire(store, "t1", C, generation=claim.generation).token)
    tokens.append(acquire(store, "t1", A, generation=claim.generation, attempt=1).token)  # retry
    store.finish("t1", A, tokens[-1], "retry", next_attempt=2)
    tokens.append(acquire(store, "t1", B, generation=claim.generation, attempt=2).token)

    # Then every owner got a strictly greater token, and the history lists them in order
    assert tokens == sorted(set(tokens))
    rec = store.get("t1")
    assert rec.token == tokens[-1]
    assert [t for t, _owner, _at in rec.history] == tokens


def test_tokens_keep_increasing_after_a_finished_record_expired(make_store):
    # Given a finished task whose record outlived its retention
    store = make_store(retention=0.1)
    first = acquire(store, "t1", A)
    store.finish("t1", A, first.token, "succeeded")
    time.sleep(0.1 + MARGIN)
    assert store.get("t1") is None

    # When the id is acquired again
    again = acquire(store, "t1", B)

    # Then the new token is still greater than the forgotten one
    assert again.code is Code.ACQUIRED and again.token > first.token




def test_only_a_first_attempt_of_a_new_publish_runs_a_finished_task_again(store):
    # Given a task that succeeded under publish p1
    acq = store.acquire("t-rerun", "w1", publish="p1")
    store.finish("t-rerun", "w1", acq.token, "succeeded")
    # When old copies of a retry or of a recovery arrive, their publish ids long forgotten
    for copy in ({"attempt": 1}, {"generation": 1}):
        # Then they never start the finished task again
        assert store.acquire("t-rerun", "w2", publish="forgotten", **copy).code is Code.FINISHED
    # And a copy of p1 itself is refused, while a new publish (p2) runs it again
    assert store.acquire("t-rerun", "w2", publish="p1").code is Code.FINISHED
    again = store.acquire("t-rerun", "w2", publish="p2")
    assert again.owned and again.token > acq.token
