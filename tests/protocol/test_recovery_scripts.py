"""claim_expired.lua and mark_published.lua: recovery passes, and their races with other transitions.

Against a real redis-server. Each test reads Given / When / Then. Times are the
Redis server's clock; short ttls (0.1 s) and sleeps of ttl + 50 ms make a lease
"expired" by a margin. Shared helpers: tests/protocol/scripts_support.py; the
``store`` and ``make_store`` fixtures: tests/protocol/conftest.py.
"""
from __future__ import annotations

import pytest

from celery_leases import Code, LeaseError, LeaseLost
from tests.protocol.scripts_support import (
    A, B, BODY, C, ENVELOPE, SHORT, Recorder, acquire, indexed, pttl, wait_out,
)


# -- claim_expired / recover / mark_published ---------------------------------------


def test_recover_republishes_an_expired_lease_with_a_new_generation(make_store):
    # Given A's lease expired
    store = make_store(retention=30)
    acq = acquire(store, "t1", A, ttl=SHORT, attempt=2)
    live = acquire(store, "live", A)
    wait_out()
    rec = Recorder()

    # When a recovery pass runs
    report = store.recover(publish=rec.publish, on_dead=rec.on_dead)

    # Then only the expired lease is published, generation and recoveries bumped
    assert report.as_dict() == {"recovered": 1, "dead": 0, "publish_failed": 0, "corrupt": 0}
    (claim,) = rec.published
    assert (claim.task_id, claim.code, claim.generation, claim.recoveries) == \
        ("t1", Code.RECOVERED, 1, 1)
    assert (claim.name, claim.body, claim.envelope) == ("proj.add", BODY, ENVELOPE)
    record = store.get("t1")
    assert (record.state, record.owner, record.generation, record.recoveries) == \
        ("recovering", "", 1, 1)
    # And the confirmed claim left the index and waits for its delivery for retention
    assert indexed(store) == {"live": store.get("live").deadline}
    assert 0 < pttl(store, "t1") <= 30_000
    assert store.stats()["recovered"] == 1
    # And the old generation's copy is stale, while the recovered copy acquires
    assert acquire(store, "t1", B, generation=0, attempt=2).code is Code.STALE
    again = acquire(store, "t1", B, generation=1, attempt=2)
    assert again.code is Code.ACQUIRED and again.token > acq.token
    assert (again.generation, again.recoveries) == (1, 1)
    # And a duplicate of the recovered copy is busy, A is refused, B is accepted
    assert acquire(store, "t1", C, generation=1, attempt=2).code is Code.BUSY
    with pytest.raises(LeaseLost):
        store.finish("t1", A, acq.token, "succeeded")
    store.finish("t1", B, again.token, "succeeded")
    assert live.owned


def test_recover_leaves_live_leases_alone(store):
    # Given only live leases
    acquire(store, "t1", A)

    # When a recovery pass runs
    rec = Recorder()
    report = store.recover(publish=rec.publish)

    # Then nothing is claimed
    assert report.as_dict() == {"recovered": 0, "dead": 0, "publish_failed": 0, "corrupt": 0}
    assert rec.published == [] and store.get("t1").state == "active"


def test_recover_past_max_recoveries_makes_the_task_dead(make_store):
    # Given a task recovered once, with max_recoveries=1, whose re-run expired again
    store = make_store(max_recoveries=1, retention=30)
    rec = Recorder()
    acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    store.recover(publish=rec.publish, on_dead=rec.on_dead)
    acquire(store, "t1", B, ttl=SHORT, generation=1)
    wait_out()

    # When the next recovery pass runs
    report = store.recover(publish=rec.publish, on_dead=rec.on_dead)

    # Then the task is dead: on_dead gets Code.DEAD with the message, nothing is published
    assert report.as_dict() == {"recovered": 0, "dead": 1, "publish_failed": 0, "corrupt": 0}
    assert len(rec.published) == 1
    (dead,) = rec.dead
    assert (dead.task_id, dead.code, dead.recoveries, dead.generation) == ("t1", Code.DEAD, 1, 1)
    assert dead.body == BODY and dead.envelope == ENVELOPE
    record = store.get("t1")
    assert (record.state, record.owner, record.has_message) == ("dead", "", False)
    assert indexed(store) == {}
    assert 0 < pttl(store, "t1") <= 30_000
    # And later deliveries of any generation are FINISHED
    assert acquire(store, "t1", C, generation=1).code is Code.FINISHED
    assert acquire(store, "t1", C, generation=2).code is Code.FINISHED


def test_a_claim_whose_publish_raised_is_claimed_again_after_the_grace(make_store):
    # Given A's lease expired, and the broker is down during the first recovery pass
    store = make_store(publish_grace=0.2)
    acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    down, up = Recorder(fail=True), Recorder()
    report = store.recover(publish=down.publish)
    assert report.publish_failed == 1 and report.errors[0][0] == "t1"
    assert store.get("t1").recoveries == 1

    # When another pass runs within the grace, and one after it
    within = store.recover(publish=up.publish)
    wait_out(0.2)
    after = store.recover(publish=up.publish)

    # Then the claim is left alone within the grace, then claimed again,
    # with a new generation but without counting another recovery
    assert within.recovered == 0 and after.recovered == 1
    (claim,) = up.published
    assert (claim.generation, claim.recoveries) == (2, 1)
    record = store.get("t1")
    assert (record.state, record.generation, record.recoveries) == ("recovering", 2, 1)
    assert indexed(store) == {}
    # And only the last published generation may run
    assert acquire(store, "t1", B, generation=1).code is Code.STALE
    assert acquire(store, "t1", B, generation=2).code is Code.ACQUIRED


def test_mark_published_removes_the_claim_from_the_index(make_store):
    # Given two claimed leases, one of which was acquired by its recovered delivery meanwhile
    store = make_store(publish_grace=30)
    acquire(store, "t1", A, ttl=SHORT)
    acquire(store, "t2", A, ttl=SHORT)
    wait_out()
    claims = {c.task_id: c for c in store.claim_expired()}
    assert set(indexed(store)) == {"t1", "t2"}
    acquire(store, "t2", B, generation=claims["t2"].generation)

    # When the recoverer confirms both
    confirmed = store.mark_published(claims.values())

    # Then only the one still waiting is confirmed and leaves the index
    assert confirmed == 1
    assert set(indexed(store)) == {"t2"}
    assert store.get("t1").deadline == 0 and store.get("t2").owner == B
    # And confirming again changes nothing
    store.mark_published(claims.values())
    assert set(indexed(store)) == {"t2"} and store.get("t2").owner == B
    assert store.mark_published([]) == 0


def test_a_task_max_recoveries_given_at_acquire_is_what_recovery_applies(make_store):
    # Given a store allowing 3 recoveries, and a task acquired allowing none
    store = make_store(max_recoveries=3)
    acquire(store, "strict", A, ttl=SHORT, max_recoveries=0)
    acquire(store, "lenient", A, ttl=SHORT)
    wait_out()

    # When both expire and a recovery pass runs
    rec = Recorder()
    store.recover(publish=rec.publish, on_dead=rec.on_dead)

    # Then the strict one is dead at its first expiry, the other recovered
    assert [c.task_id for c in rec.dead] == ["strict"]
    assert [c.task_id for c in rec.published] == ["lenient"]


def test_only_one_caller_gets_a_recovery_turn_per_interval(make_store):
    # Given two workers' stores on one prefix
    one, two = make_store(), make_store()

    # When both ask for the recovery turn, and again after the interval
    first, second = one.try_recovery_turn(A, SHORT), two.try_recovery_turn(B, SHORT)
    wait_out()
    later = two.try_recovery_turn(B, SHORT)

    # Then only the first gets it, and the turn comes round again after the interval
    assert (first, second, later) == (True, False, True)


def test_recover_needs_a_publish_callable(store):
    with pytest.raises(LeaseError, match="publish"):
        store.recover()


def test_recover_in_batches_claims_everything_due(make_store):
    # Given more expired leases than one batch
    store = make_store(recover_batch=4)
    for i in range(10):
        acquire(store, f"t{i}", A, ttl=SHORT)
    wait_out()

    # When one pass runs, and another with a limit after more expire
    rec = Recorder()
    report = store.recover(publish=rec.publish)

    # Then every one is published exactly once
    assert report.recovered == 10
    assert sorted(c.task_id for c in rec.published) == sorted(f"t{i}" for i in range(10))
    for i in range(3):
        acquire(store, f"u{i}", A, ttl=SHORT)
    wait_out()
    assert store.recover(publish=rec.publish, limit=2).recovered == 2
    assert store.recover(publish=rec.publish).recovered == 1


# -- races between a recovery pass and other transitions, regressions -----------


def test_get_reads_back_an_owner_id_with_at_signs(store):
    # Given a worker whose instance id is a Celery node name
    acq = acquire(store, "t1", "celery@host1")

    # When the record is read, Then it has that owner, also in its history
    rec = store.get("t1")
    assert rec.owner == "celery@host1"
    assert rec.history[-1][:2] == (acq.token, "celery@host1")


def test_a_pass_that_listed_a_lease_another_pass_recovered_and_confirmed_skips_it(store):
    # (A bug in an earlier claim_expired: deadline 0 after mark_published counted as due.)
    # Given an expired lease, listed as due by pass 2
    acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    listed_by_pass_2 = store.expired()
    assert listed_by_pass_2 == ["t1"]

    # And pass 1 claims, publishes and confirms it
    rec = Recorder()
    assert store.recover(publish=rec.publish).recovered == 1

    # When pass 2 claims what it listed
    claims = store.claim_expired(ids=listed_by_pass_2)

    # Then it is skipped: claimed by another recoverer since it was listed
    assert claims == []
    assert store.get("t1").generation == 1


def test_a_recovery_pass_that_listed_a_lease_before_its_retry_leaves_the_hand_over_alone(store):
    # Given A's lease expired and a recovery pass listed it
    acq = acquire(store, "t1", A, ttl=SHORT, attempt=0)
    wait_out()
    assert store.expired() == ["t1"]

    # And A, still running, retries (accepted: nobody took the lease)
    store.finish("t1", A, acq.token, "retry", next_attempt=1)

    # When the recovery pass claims what it listed
    claims = store.claim_expired(ids=["t1"])

    # Then the hand-over stands: nothing claimed, and attempt 1 acquires
    assert claims == []
    assert acquire(store, "t1", B, attempt=1).code is Code.ACQUIRED


