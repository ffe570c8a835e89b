"""finish.lua and hand_over.lua: the owner's outcome, refusals, re-sent finishes, retries.

Against a real redis-server. Each test reads Given / When / Then. Times are the
Redis server's clock; short ttls (0.1 s) and sleeps of ttl + 50 ms make a lease
"expired" by a margin. Shared helpers: tests/protocol/scripts_support.py; the
``store`` and ``make_store`` fixtures: tests/protocol/conftest.py.
"""
from __future__ import annotations

import pytest

from celery_leases import Code, LeaseLost
from tests.protocol.scripts_support import A, B, SHORT, Recorder, acquire, indexed, pttl, wait_out


# -- finish --------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "revoked"])
def test_finish_by_the_owner_records_the_outcome_and_keeps_it_for_retention(make_store, outcome):
    # Given A holds the lease
    store = make_store(retention=30)
    acq = acquire(store, "t1", A)

    # When A finishes with the outcome
    store.finish("t1", A, acq.token, outcome)

    # Then the record is terminal under A's token, unindexed, without the message
    rec = store.get("t1")
    assert (rec.state, rec.token, rec.owner) == (outcome, acq.token, A)
    assert rec.finished_at >= rec.acquired_at > 0
    assert not rec.has_message
    assert not store.client.exists(store.keys.message("t1"))
    assert indexed(store) == {}
    # And it expires after the retention period
    assert 29_000 < pttl(store, "t1") <= 30_000
    assert store.stats()[outcome] == 1


def test_finish_by_a_wrong_owner_or_token_is_refused(store):
    # Given A holds the lease
    acq = acquire(store, "t1", A)

    # When B (with A's token) and A (with a wrong token) try to finish
    with pytest.raises(LeaseLost) as wrong_owner:
        store.finish("t1", B, acq.token, "succeeded")
    with pytest.raises(LeaseLost) as wrong_token:
        store.finish("t1", A, acq.token + 1, "succeeded")

    # Then both are refused as lost, and A's lease is untouched
    assert wrong_owner.value.reason == wrong_token.value.reason == "lost"
    assert wrong_owner.value.task_id == "t1"
    rec = store.get("t1")
    assert (rec.state, rec.owner) == ("active", A)
    assert store.stats()["refused"] == 2
    store.finish("t1", A, acq.token, "succeeded")


def test_finish_of_a_finished_record_is_refused_and_the_first_outcome_stands(store):
    # Given A finished the task as failed
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "failed")

    # When A (or anyone) tries to finish again
    with pytest.raises(LeaseLost) as again:
        store.finish("t1", A, acq.token, "succeeded")

    # Then it is refused as already finished, and the record still says failed
    assert again.value.reason == "already finished (failed)"
    assert store.get("t1").state == "failed"


def test_finish_repeated_by_the_owner_with_the_same_outcome_is_accepted(store):
    # Given A finished the task
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "succeeded")

    # When A's finish is repeated (a retried Redis call), Then it is accepted again
    store.finish("t1", A, acq.token, "succeeded")
    assert store.get("t1").state == "succeeded"


def test_finish_with_token_0_forces_nothing(store):
    # Given one task running under A, and one recovering
    acquire(store, "running", A)
    acquire(store, "waiting", A, ttl=SHORT)
    wait_out()
    store.claim_expired()

    # When someone finishes them with token 0 (the forced revoke that revoke.lua replaced)
    for task_id, outcome in (("running", "revoked"), ("waiting", "revoked"), ("running", "succeeded")):
        with pytest.raises(LeaseLost):
            store.finish(task_id, "operator", 0, outcome)

    # Then neither record changed
    assert store.get("running").state == "active"
    assert store.get("waiting").state == "recovering"


def test_finish_of_a_missing_record_reasserts_the_holders_token(store, redis_client):
    # Given A holds token T of t1, and the store then loses everything (restarted empty)
    acq = acquire(store, "t1", A)
    redis_client.delete(store.keys.record("t1"), store.keys.shard_for("t1").sequence)

    # When A finishes: the record is re-created, terminal, under A's token
    store.finish("t1", A, acq.token, "succeeded")
    record = store.get("t1")
    assert (record.state, record.token, record.owner) == ("succeeded", acq.token, A)
    assert record.deadline == 0 and 0 < redis_client.pttl(store.keys.record("t1")) <= store.settings.retention * 1000
    # And the same finish again answers OK (idempotent), another owner's is refused
    store.finish("t1", A, acq.token, "succeeded")
    with pytest.raises(LeaseLost):
        store.finish("t1", B, acq.token, "succeeded")
    # And no later acquire, of this task or another, is handed T or below again
    assert int(redis_client.get(store.keys.shard_for("t1").sequence)) >= acq.token
    assert acquire(store, "t2", B).token > acq.token
    # And a retry hand-over re-asserts as a record waiting for the next attempt
    retried = acquire(store, "t3", A)
    redis_client.delete(store.keys.record("t3"))
    store.finish("t3", A, retried.token, "retry", next_attempt=1)
    assert store.get("t3").state == "recovering"
    assert acquire(store, "t3", B, attempt=0).code is Code.STALE
    assert acquire(store, "t3", B, attempt=1).token > retried.token
    # But a forced revoke (token 0) re-creates nothing
    with pytest.raises(LeaseLost) as missing:
        store.finish("nope", "operator", 0, "revoked")
    assert missing.value.reason == "missing"
    assert store.get("nope") is None


def test_the_same_finish_sent_again_answers_ok_and_changes_nothing(store, redis_client):
    # Given A's finish was applied but its reply lost (A cannot tell)
    acq = acquire(store, "t1", A)
    store.finish("t1", A, acq.token, "succeeded", write=("res:t1", b"first", 0))
    before = store.stats()
    # When A sends it again, even with another result value
    store.finish("t1", A, acq.token, "succeeded", write=("res:t1", b"second", 0))
    # Then it answers OK and writes nothing: the first copy's result stands
    assert redis_client.get("res:t1") == b"first"
    assert store.stats() == before
    # And a different outcome, or the same outcome by another owner, is still refused
    for owner, outcome in ((A, "failed"), (B, "succeeded")):
        with pytest.raises(LeaseLost):
            store.finish("t1", owner, acq.token, outcome)
    # And a retry hand-over sent again answers OK too
    r = acquire(store, "t2", A)
    store.finish("t2", A, r.token, "retry", next_attempt=1)
    store.finish("t2", A, r.token, "retry", next_attempt=1)
    assert store.get("t2").state == "recovering"


def test_a_finish_reaching_the_server_after_its_not_after_changes_nothing(store, redis_client):
    # Given A holds t1, and a finish whose not-after moment has passed by the server clock
    acq = acquire(store, "t1", A)
    past = store.server_time_ms() - 1
    # When it reaches the server (a command buffered by a stalled server, run on resume)
    for outcome in ("succeeded", "failed", "retry"):
        with pytest.raises(LeaseLost) as late:
            store.finish("t1", A, acq.token, outcome, next_attempt=1, not_after=past)
        assert late.value.reason.startswith("late")
    # Then the lease is untouched: still A's, active, renewable; no result written
    assert store.get("t1").state == "active" and store.renew_many(A, {"t1": acq.token}) == {}
    redis_client.delete(store.keys.record("t2"))
    with pytest.raises(LeaseLost):
        store.finish("t2", A, 99, "succeeded", write=("res:t2", b"x", 0), not_after=past)
    assert store.get("t2") is None and redis_client.get("res:t2") is None
    # And one within its not-after is accepted; sent again later, it still answers OK
    store.finish("t1", A, acq.token, "succeeded", not_after=store.server_time_ms() + 5000)
    store.finish("t1", A, acq.token, "succeeded", not_after=past)
    assert store.stats()["late_finishes"] == 4


def test_finish_of_an_expired_lease_nobody_took_is_still_accepted(store):
    # Given A's lease expired but no recovery or redelivery took it
    acq = acquire(store, "t1", A, ttl=SHORT)
    wait_out()

    # When A finishes after all
    store.finish("t1", A, acq.token, "succeeded")

    # Then its outcome is accepted: it was still the newest owner
    assert store.get("t1").state == "succeeded"


def test_finish_after_the_lease_was_recovered_is_refused(store):
    # Given A's lease expired and a recovery pass claimed it
    acq = acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    assert len(store.claim_expired()) == 1

    # When A, still running, finishes
    with pytest.raises(LeaseLost) as lost:
        store.finish("t1", A, acq.token, "succeeded")

    # Then it is refused and the record stays recovering
    assert lost.value.reason == "lost"
    assert store.get("t1").state == "recovering"


def test_finish_retry_hands_the_lease_to_the_next_attempt(make_store):
    # Given A holds attempt 0
    store = make_store(publish_grace=30)
    acq = acquire(store, "t1", A, attempt=0)

    # When A retries (Celery has published attempt 1, due within 20 s)
    before = store.server_time_ms()
    store.finish("t1", A, acq.token, "retry", next_attempt=1, retry_grace=20)

    # Then the record waits for attempt 1: unowned, indexed at the retry grace
    rec = store.get("t1")
    assert (rec.state, rec.owner, rec.attempt, rec.token) == ("recovering", "", 1, acq.token)
    assert before + 20_000 <= indexed(store)["t1"] <= store.server_time_ms() + 20_000
    assert store.claim_expired() == []
    # And a copy of attempt 0 is stale, while attempt 1 acquires with a greater token
    assert acquire(store, "t1", B, attempt=0).code is Code.STALE
    nxt = acquire(store, "t1", B, attempt=1)
    assert nxt.code is Code.ACQUIRED and nxt.token > acq.token
    assert (nxt.recoveries, nxt.generation) == (0, 0)
    assert pttl(store, "t1") == -1
    # And A's outcome is now refused while B's is accepted
    with pytest.raises(LeaseLost):
        store.finish("t1", A, acq.token, "succeeded")
    store.finish("t1", B, nxt.token, "succeeded")
    assert store.get("t1").state == "succeeded"


def test_a_retry_whose_next_attempt_never_arrives_is_recovered_after_its_grace(make_store):
    # Given A retried, but attempt 1 does not acquire within the 0.1 s retry grace
    store = make_store(max_recoveries=0)
    acq = acquire(store, "t1", A, attempt=0)
    store.finish("t1", A, acq.token, "retry", next_attempt=1, retry_grace=SHORT)
    wait_out()

    # When a recovery pass runs
    rec = Recorder()
    report = store.recover(publish=rec.publish, on_dead=rec.on_dead)

    # Then the task is re-published with a new generation, counting no recovery
    # (even with max_recoveries=0: nobody abandoned it)
    assert report.as_dict() == {"recovered": 1, "dead": 0, "publish_failed": 0, "corrupt": 0}
    (claim,) = rec.published
    assert (claim.task_id, claim.generation, claim.recoveries) == ("t1", 1, 0)
    # And the late attempt-1 copy is stale, the recovered copy acquires
    assert acquire(store, "t1", B, attempt=1).code is Code.STALE
    assert acquire(store, "t1", B, generation=1, attempt=1).code is Code.ACQUIRED


def test_next_attempt_acquires_while_the_previous_attempt_is_still_live(store):
    # Given A holds attempt 0, still live
    old = acquire(store, "t1", A, attempt=0)

    # When attempt 1 (published by self.retry()) reaches B before A finished
    nxt = acquire(store, "t1", B, attempt=1)

    # Then B is the rightful owner at once
    assert nxt.code is Code.ACQUIRED and nxt.token > old.token
    # And A's retry hand-over, renewal and any outcome are refused
    with pytest.raises(LeaseLost):
        store.finish("t1", A, old.token, "retry", next_attempt=1)
    with pytest.raises(LeaseLost):
        store.finish("t1", A, old.token, "failed")
    assert store.renew_many(A, {"t1": old.token}) == {"t1": Code.LOST}
    rec = store.get("t1")
    assert (rec.state, rec.owner, rec.token, rec.attempt) == ("active", B, nxt.token, 1)


def test_check_passes_only_for_the_current_owner(store):
    # Given A holds t1, and t2 is finished
    acq = acquire(store, "t1", A)
    done = acquire(store, "t2", A)
    store.finish("t2", A, done.token, "succeeded")

    # When each asks whether it still holds its lease
    store.check("t1", A, acq.token)

    # Then only A on t1 passes; the others learn why not
    for task_id, owner, token, reason in [("t1", B, acq.token, "lost"),
                                          ("t1", A, acq.token - 1, "lost"),
                                          ("t2", A, done.token, "finished"),
                                          ("t3", A, 1, "missing")]:
        with pytest.raises(LeaseLost) as lost:
            store.check(task_id, owner, token)
        assert lost.value.reason == reason, (task_id, owner, token)


