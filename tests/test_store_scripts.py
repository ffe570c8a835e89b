"""The lease store against a real redis-server: one section per Lua script.

Each test reads Given / When / Then. Times are the Redis server's clock; short
ttls (0.1 s) and sleeps of ttl + 50 ms make a lease "expired" by a margin.

Tests named ``test_bug_*`` show bugs found in the store while writing this
suite; they fail until the store is fixed (select them with ``-k bug``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_leases import (Claim, Code, CorruptRecord, LeaseError, LeaseLost, LeaseStore,
                           LeaseUnavailable)
from tests.redis_server import free_port
from tests.skew import skewed_env

TTL = 5.0          #: seconds; long enough that a lease is live for the whole test
SHORT = 0.1        #: seconds; a ttl the test waits out
MARGIN = 0.05      #: seconds slept past a deadline before calling it passed
A, B, C = "worker-a", "worker-b", "worker-c"
BODY = b'[["x"], {}, {}]'
ENVELOPE = {"routing_key": "celery", "headers": {"task": "proj.add"}}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def make_store(redis_server_url, key_prefix):
    """Build LeaseStores on the test's prefix, each with its own client."""
    clients = []

    def make(**kwargs) -> LeaseStore:
        client = redis.Redis.from_url(redis_server_url)
        clients.append(client)
        kwargs.setdefault("ttl", TTL)
        return LeaseStore(client, prefix=key_prefix, **kwargs)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def store(make_store) -> LeaseStore:
    return make_store()


def wait_out(ttl: float = SHORT) -> None:
    """Let a lease acquired or renewed with ``ttl`` pass its deadline (server clock)."""
    time.sleep(ttl + MARGIN)


def acquire(store: LeaseStore, task_id: str, owner: str = A, *, started: bool = True, **kwargs):
    """Acquire, and (``started``) send the start mark the worker sends when the body starts."""
    kwargs.setdefault("name", "proj.add")
    kwargs.setdefault("body", BODY)
    kwargs.setdefault("envelope", ENVELOPE)
    acq = store.acquire(task_id, owner, **kwargs)
    if started and acq.owned:
        assert store.mark_started(owner, {task_id: acq.token}) == 1
    return acq


def fields(store: LeaseStore, task_id: str) -> dict:
    raw = store.client.hgetall(store.keys.record(task_id))
    return {k.decode(): v for k, v in raw.items()}


def pttl(store: LeaseStore, task_id: str) -> int:
    return store.client.pttl(store.keys.record(task_id))


def indexed(store: LeaseStore) -> dict:
    return dict(store.active())


class Recorder:
    """A publish / on_dead pair that records the claims it is handed."""

    def __init__(self, fail: bool = False):
        self.published: list[Claim] = []
        self.dead: list[Claim] = []
        self.fail = fail

    def publish(self, claim: Claim) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.published.append(claim)

    def on_dead(self, claim: Claim) -> None:
        self.dead.append(claim)


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
    assert record.deadline == 0 and 0 < redis_client.pttl(store.keys.record("t1")) <= store.retention * 1000
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


# -- renew_many ----------------------------------------------------------------


def script_calls(client) -> int:
    """EVALSHA + EVAL calls the server has run, from every client (INFO commandstats)."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def test_renew_many_renews_every_lease_in_one_call_and_returns_the_lost_ones(
        redis_server_url, key_prefix):
    # Given A believes it holds seven leases: three fine, and one of each way to lose one
    client = redis.Redis.from_url(redis_server_url)
    store = LeaseStore(client, prefix=key_prefix, ttl=TTL)
    fine = {t: acquire(store, t, A, ttl=1.0).token for t in ("ok1", "ok2", "ok3")}
    lost = acquire(store, "lost", A).token
    acquire(store, "lost", B, attempt=1)                       # a newer owner
    finished = acquire(store, "finished", A).token
    store.finish("finished", A, finished, "succeeded")
    stalled = acquire(store, "stalled", A, progress_timeout=SHORT).token
    wait_out()
    store.renew_many(A, {"ok1": fine["ok1"]}, ttl=1.0)         # load the script once
    held = {**fine, "lost": lost, "finished": finished, "missing": 7, "stalled": stalled}

    # When A renews them all, enforcing progress deadlines
    before = store.server_time_ms()
    calls = script_calls(client)
    result = store.renew_many(A, held, ttl=1.0, check_progress=True)

    # Then the server ran one script call, and only the lost leases came back, each with why
    assert script_calls(client) - calls == 1
    assert result == {"lost": Code.LOST, "finished": Code.FINISHED,
                      "missing": Code.MISSING, "stalled": Code.STALLED}
    # And the fine ones got server time + the ttl
    for task_id in fine:
        rec = store.get(task_id)
        assert before + 1000 <= rec.deadline <= store.server_time_ms() + 1000
        assert indexed(store)[task_id] == rec.deadline
    client.close()


def test_renewal_keeps_a_lease_alive_past_its_original_ttl(store):
    # Given a lease with a 0.4 s ttl
    acq = acquire(store, "t1", A, ttl=0.4)

    # When A renews it every 0.1 s for 0.8 s
    for _ in range(8):
        time.sleep(0.1)
        assert store.renew_many(A, {"t1": acq.token}, ttl=0.4) == {}

    # Then it is still live twice its ttl later, and not recoverable
    assert store.expired() == [] and store.claim_expired() == []
    assert store.get("t1").deadline > store.server_time_ms()
    # And once renewals stop, it expires after the ttl
    wait_out(0.4)
    assert store.expired() == ["t1"]


def test_renew_many_by_a_wrong_owner_or_token_does_not_extend_the_lease(store):
    # Given A holds a lease
    acq = acquire(store, "t1", A)
    deadline = store.get("t1").deadline

    # When B, or A with an older token, renews it
    by_b = store.renew_many(B, {"t1": acq.token})
    by_old = store.renew_many(A, {"t1": acq.token - 1})

    # Then both are told LOST and the deadline did not move
    assert by_b == by_old == {"t1": Code.LOST}
    assert store.get("t1").deadline == deadline


def test_renew_many_after_a_recovery_claim_is_lost(store):
    # Given A's lease expired and recovery claimed it
    acq = acquire(store, "t1", A, ttl=SHORT)
    wait_out()
    store.claim_expired()

    # When A's heartbeat renews it
    # Then it is LOST (the record is recovering), not resurrected
    assert store.renew_many(A, {"t1": acq.token}) == {"t1": Code.LOST}
    assert store.get("t1").state == "recovering"


def test_renew_many_of_nothing_is_a_no_op(store):
    assert store.renew_many(A, {}) == {}


# -- progress ------------------------------------------------------------------


def test_progress_timeout_stalls_a_renewed_lease_and_makes_it_claimable(store):
    # Given a lease with a long ttl but a 0.1 s progress timeout, renewed by the heartbeat
    acq = acquire(store, "t1", A, ttl=TTL, progress_timeout=SHORT)
    assert store.renew_many(A, {"t1": acq.token}, check_progress=True) == {}

    # When the body stops reporting progress past the timeout
    wait_out()
    unchecked = store.renew_many(A, {"t1": acq.token})
    result = store.renew_many(A, {"t1": acq.token}, check_progress=True)

    # Then a renewal that enforces progress deadlines is told STALLED although
    # the ttl is far off (one that does not, as documented, renews it)
    assert unchecked == {}
    assert result == {"t1": Code.STALLED}
    rec = store.get("t1")
    assert rec.owner == "" and rec.deadline <= store.server_time_ms()
    assert store.stats()["stalled"] == 1
    # And the lease is due at once: recovery claims it and A is out
    (claim,) = store.claim_expired()
    assert (claim.task_id, claim.code) == ("t1", Code.RECOVERED)
    with pytest.raises(LeaseLost):
        store.progress("t1", A, acq.token)
    with pytest.raises(LeaseLost):
        store.finish("t1", A, acq.token, "succeeded")


def test_progress_keeps_a_lease_with_a_progress_timeout(store):
    # Given a lease with a 0.3 s progress timeout
    acq = acquire(store, "t1", A, progress_timeout=0.3)

    # When the body reports progress every 0.1 s for 0.5 s while the heartbeat renews
    for _ in range(5):
        time.sleep(0.1)
        before = store.server_time_ms()
        store.progress("t1", A, acq.token)
        # Then progress pushes both deadlines from the server clock
        rec = store.get("t1")
        assert rec.progress_deadline >= before + 300
        assert rec.deadline >= before + int(TTL * 1000)
        assert store.renew_many(A, {"t1": acq.token}, check_progress=True) == {}

    assert store.get("t1").owner == A


def test_progress_by_anyone_but_the_owner_is_refused(store):
    # Given A holds t1, and t2 is finished
    acq = acquire(store, "t1", A)
    done = acquire(store, "t2", A)
    store.finish("t2", A, done.token, "succeeded")

    # When others report progress
    # Then each is refused with the reason
    for task_id, owner, token, reason in [("t1", B, acq.token, "lost"),
                                          ("t1", A, acq.token + 1, "lost"),
                                          ("t2", A, done.token, "finished"),
                                          ("t3", A, 1, "missing")]:
        with pytest.raises(LeaseLost) as refused:
            store.progress(task_id, owner, token)
        assert refused.value.reason == reason, (task_id, owner, token)


# -- release -------------------------------------------------------------------


def test_release_makes_a_lease_due_at_once(store):
    # Given A holds two leases with a long ttl, and B holds one
    a1, a2 = acquire(store, "a1", A), acquire(store, "a2", A)
    acquire(store, "b1", B)

    # When A's pool child dies and A releases its leases
    released = store.release(A, {"a1": a1.token, "a2": a2.token})

    # Then both are due now, by the server clock, and unowned; B's is untouched
    assert released == 2
    assert sorted(store.expired()) == ["a1", "a2"]
    assert store.get("a1").owner == "" and store.get("b1").owner == B
    # And A can no longer finish them; recovery claims them right away
    with pytest.raises(LeaseLost):
        store.finish("a1", A, a1.token, "succeeded")
    assert sorted(c.task_id for c in store.claim_expired()) == ["a1", "a2"]


def test_release_lets_a_requeued_delivery_take_over_at_once(store):
    # Given A released its lease at warm shutdown
    acq = acquire(store, "t1", A)
    store.release(A, {"t1": acq.token})

    # When the broker redelivers the same message to B
    took = acquire(store, "t1", B)

    # Then B takes it over without waiting out the ttl
    assert took.code is Code.TAKEN_OVER and took.token > acq.token


def test_leases_released_unstarted_count_no_recovery(make_store):
    # Given a task that already used its only recovery, and one never recovered,
    # both prefetched by A and released unstarted at A's warm shutdown
    store = make_store(max_recoveries=1)
    acquire(store, "used", A, ttl=SHORT)
    wait_out()
    used = acquire(store, "used", A)
    assert used.recoveries == 1
    fresh = acquire(store, "fresh", A)
    assert store.release(A, {"used": used.token, "fresh": fresh.token}, unstarted=True) == 2

    # When a redelivery takes one over and a recovery pass claims the other
    took = acquire(store, "used", B)
    (claim,) = store.claim_expired()

    # Then neither counts a recovery, and the used-up task is not dead
    assert (took.code, took.recoveries) == (Code.TAKEN_OVER, 1)
    assert (claim.task_id, claim.code, claim.recoveries) == ("fresh", Code.RECOVERED, 0)


def test_only_leases_marked_started_count_a_recovery(make_store):
    # Given a dead worker A held two leases: one whose body had started (its start
    # mark is in), one it had only prefetched (never marked)
    store = make_store(max_recoveries=3)
    ran = acquire(store, "ran", A, ttl=SHORT)
    acquire(store, "prefetched", A, ttl=SHORT, started=False)
    acquire(store, "restored", A, ttl=SHORT, started=False)
    assert (store.get("ran").started, store.get("prefetched").started) == (True, False)
    wait_out()

    # When a recovery pass claims two of them and a restored copy takes the third over
    claims = {c.task_id: c for c in store.claim_expired(ids=["ran", "prefetched"])}
    took = acquire(store, "restored", B, started=False)

    # Then only the started one counts a recovery; the others count an unstarted one
    assert claims["ran"].recoveries == 1 and claims["prefetched"].recoveries == 0
    assert (took.code, took.recoveries) == (Code.TAKEN_OVER, 0)
    assert store.get("prefetched").unstarted_recoveries == 1
    assert store.get("restored").unstarted_recoveries == 1
    assert store.get("ran").unstarted_recoveries == 0 and ran.recoveries == 0


def test_unstarted_recoveries_have_a_bound_of_their_own(make_store):
    # Given a task whose start mark never reaches the store (a body that kills its
    # worker at once), with max_recoveries 1: unstarted_limit is 4 * (1 + 1) = 8
    store = make_store(max_recoveries=1)
    limit = 4 * (1 + 1)
    generation = 0
    codes = []
    # When its worker dies again and again, each recovered copy acquired, never marked
    for _ in range(limit + 1):
        acq = acquire(store, "pill", A, ttl=SHORT, generation=generation, started=False)
        assert acq.owned
        wait_out()
        (claim,) = store.claim_expired(ids=["pill"])
        codes.append(claim.code)
        generation = claim.generation
        if claim.code is Code.DEAD:
            break
        store.mark_published([claim])

    # Then it is recovered `limit` times, never counted as a recovery, then dead:
    # bounded, though larger than max_recoveries
    assert codes == [Code.RECOVERED] * limit + [Code.DEAD]
    assert store.get("pill").state == "dead" and store.get("pill").recoveries == 0
    # And the dead claim counts every abandonment (LeaseExpired names it)
    assert claim.recoveries == limit + 1


def test_an_unmarked_take_over_past_the_unstarted_bound_makes_the_task_dead(make_store):
    # Given a lease acquired, then taken over unmarked as often as the unstarted
    # bound allows (max_recoveries 0: 4 times)
    store = make_store(max_recoveries=0)
    for owner in [A, B, A, B, A]:
        acq = acquire(store, "pill", owner, ttl=SHORT, started=False, max_recoveries=0)
        assert acq.owned
        wait_out()
    # When one more delivery finds it expired
    last = acquire(store, "pill", C, started=False, max_recoveries=0)
    # Then the task is dead
    assert last.code is Code.DEAD and store.get("pill").state == "dead"


def test_mark_started_marks_only_the_callers_live_lease(store):
    # Given A holds t1, B held t2 once, t3 is finished
    t1 = acquire(store, "t1", A, started=False)
    t2 = acquire(store, "t2", B, started=False)
    t3 = acquire(store, "t3", A, started=False)
    store.finish("t3", A, t3.token, "succeeded")

    # When A marks t1 with a wrong token, t2 (not its own), t3 (finished) and an unknown id
    marked = store.mark_started(A, {"t1": t1.token + 1, "t2": t2.token, "t3": t3.token, "t4": 1})

    # Then nothing is marked, and no record is created
    assert marked == 0
    assert not store.get("t1").started and not store.get("t2").started
    assert store.get("t4") is None
    # And A's own mark on t1 lands
    assert store.mark_started(A, {"t1": t1.token}) == 1 and store.get("t1").started


def test_release_of_leases_the_caller_does_not_own_does_nothing(store):
    # Given A holds t1, and t2 is finished
    acq = acquire(store, "t1", A)
    done = acquire(store, "t2", A)
    store.finish("t2", A, done.token, "succeeded")
    deadline = store.get("t1").deadline

    # When B, A with a wrong token, and A on a finished task release
    released = (store.release(B, {"t1": acq.token}) + store.release(A, {"t1": acq.token + 1})
                + store.release(A, {"t2": done.token}) + store.release(A, {"t3": 1})
                + store.release(A, {}))

    # Then nothing was released
    assert released == 0
    assert (store.get("t1").owner, store.get("t1").deadline) == (A, deadline)
    assert store.get("t2").state == "succeeded"


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


# -- clock skew ------------------------------------------------------------------

SKEW_CHILD = r"""
import json, sys, time
import redis
from celery_leases import LeaseStore

url, prefix = sys.argv[1], sys.argv[2]
store = LeaseStore(redis.Redis.from_url(url), prefix=prefix, ttl=0.6)
out = {"local_ms": int(time.time() * 1000), "monotonic": time.monotonic()}
acq = store.acquire("t1", "skewed-worker")
out["token"] = acq.token
out["server_ms"] = store.server_time_ms()
out["deadline"] = store.get("t1").deadline
out["expired_at_once"] = store.expired()
time.sleep(0.3)
out["expired_before_ttl"] = store.expired()
assert store.renew_many("skewed-worker", {"t1": acq.token}) == {}
out["renew_server_ms"] = store.server_time_ms()
out["renewed_deadline"] = store.get("t1").deadline
time.sleep(0.3)
out["expired_before_renewed_ttl"] = store.expired()
time.sleep(0.45)
out["expired_after_ttl"] = store.expired()
print(json.dumps(out))
"""


@pytest.mark.parametrize("offset", ["-5h", "+7h"])
def test_a_worker_whose_clock_is_hours_off_gets_server_clock_deadlines(
        redis_server_url, key_prefix, offset):
    # Given a worker process whose clock is hours off (libfaketime; tests/skew.py)
    env = skewed_env(offset, {**os.environ, "PYTHONPATH": str(REPO)})

    # When it acquires, renews and then stops renewing a 0.6 s lease
    done = subprocess.run([sys.executable, "-c", SKEW_CHILD, redis_server_url, key_prefix],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)

    # Then its clock really was hours off
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    assert abs(out["local_ms"] - store.server_time_ms()) > 3600_000
    # And its deadlines are server time + ttl, to within a second
    assert abs(out["deadline"] - (out["server_ms"] + 600)) < 1000
    assert abs(out["renewed_deadline"] - (out["renew_server_ms"] + 600)) < 1000
    # And the lease expired only after the real ttl from its last renewal
    assert out["expired_at_once"] == out["expired_before_ttl"] == []
    assert out["expired_before_renewed_ttl"] == []
    assert out["expired_after_ttl"] == ["t1"]
    store.client.close()


@pytest.mark.parametrize("offset_s", [-6 * 3600, 9 * 3600])
def test_a_skewed_local_clock_in_process_changes_nothing(store, monkeypatch, offset_s):
    # Given this process's clocks are hours off
    real_time, real_monotonic = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + offset_s)
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset_s)

    # When it acquires and renews a lease
    acq = acquire(store, "t1", A, ttl=0.3)
    server = store.server_time_ms()
    deadline = store.get("t1").deadline
    store.renew_many(A, {"t1": acq.token}, ttl=0.3)
    renewed_at = store.server_time_ms()
    renewed = store.get("t1").deadline

    # Then its deadlines come from the server clock
    assert abs(deadline - (server + 300)) < 1000
    assert abs(renewed - (renewed_at + 300)) < 1000
    # And it expires after the real ttl, not before
    assert store.expired() == []
    wait_out(0.3)
    assert store.expired() == ["t1"]


# -- errors --------------------------------------------------------------------------


def test_a_key_of_the_wrong_type_is_a_corrupt_record_naming_the_key(store):
    # Given a string where t1's record hash should be
    key = store.keys.record("t1")
    store.client.set(key, b"not a hash")

    # When the store touches that record, Then each call names the key
    for call in (lambda: store.get("t1"),
                 lambda: store.acquire("t1", A),
                 lambda: store.finish("t1", A, 1, "succeeded"),
                 lambda: store.progress("t1", A, 1)):
        with pytest.raises(CorruptRecord) as corrupt:
            call()
        assert key in str(corrupt.value)


def test_a_non_numeric_token_is_a_corrupt_record_naming_key_and_field(store):
    # Given a record whose token is not a number
    acquire(store, "t1", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")

    # When a script reads it, Then the error names the key and the field
    for call in (lambda: store.acquire("t1", B),
                 lambda: store.finish("t1", A, 1, "succeeded"),
                 lambda: store.progress("t1", A, 1)):
        with pytest.raises(CorruptRecord) as corrupt:
            call()
        assert key in str(corrupt.value) and "token" in str(corrupt.value)


def test_reading_a_non_numeric_token_names_key_and_field(store):
    """(Was a bug: get() did not name the field and check() raised a bare ValueError.)"""
    # Given a record whose token is not a number
    acq = acquire(store, "t1", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")

    # When it is read
    errors = {}
    for name, call in (("get", lambda: store.get("t1")),
                       ("check", lambda: store.check("t1", A, acq.token))):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test reports what came out
            errors[name] = exc

    # Then each call raises CorruptRecord naming the key and the field
    assert {n: type(e).__name__ for n, e in errors.items()} == \
        {"get": "CorruptRecord", "check": "CorruptRecord"}
    for name, exc in errors.items():
        assert key in str(exc) and "token" in str(exc), (name, str(exc))


def test_release_skips_a_non_numeric_token_and_names_key_and_field(store, caplog):
    """release cannot check ownership of a corrupt record: it leaves it alone and says so,
    naming key and field (one bad record affects one task: the others are released).
    renew_many deliberately reads only 'holder' and 'state' (a 10,000-lease renewal stays
    under 50 ms), so a corrupt token field alone is not its concern."""
    # Given a record whose token is not a number, and a healthy one
    acq = acquire(store, "t1", A)
    other = acquire(store, "t2", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")
    before = store.client.dump(key)

    # When the worker releases both
    released = store.release(A, {"t1": acq.token, "t2": other.token})

    # Then the healthy one is released, the corrupt one left as it was and reported
    assert released == 1
    assert store.client.dump(key) == before
    assert any(key in r.getMessage() and "token" in r.getMessage() for r in caplog.records)


def test_batch_scripts_name_a_key_of_the_wrong_type_and_go_on(store, caplog):
    """(Was a bug: the batch scripts' errors named neither the key nor the task; then
    one such record failed the whole batch.)"""
    # Given a string where t1's record hash should be, t1 due in the deadline index,
    # and a healthy live lease t2
    key = store.keys.record("t1")
    store.client.set(key, b"not a hash")
    store.client.zadd(store.keys.deadlines, {"t1": 0})
    t2 = acquire(store, "t2", A)

    # When the batch scripts touch both
    renewed = store.renew_many(A, {"t1": 1, "t2": t2.token})
    released = store.release(A, {"t1": 1})
    claims = store.claim_expired()

    # Then each reports t1 alone, naming the key, and goes on with t2
    assert renewed == {"t1": Code.CORRUPT}
    assert released == 0
    (claim,) = claims
    assert claim.task_id == "t1" and claim.code is Code.CORRUPT
    assert isinstance(claim.error, CorruptRecord) and claim.error.key == key and key in str(claim.error)
    assert [r for r in caplog.records if "t1" in r.getMessage() and key not in r.getMessage()] == []
    assert store.client.get(key) == b"not a hash"


def test_a_corrupt_envelope_is_a_corrupt_record_naming_the_key(store):
    # Given an expired lease whose stored envelope is not JSON
    acquire(store, "t1", A, ttl=SHORT)
    key = store.keys.message("t1")
    store.client.hset(key, "envelope", b"{not json")
    wait_out()

    # When a recovery pass claims it without an on_corrupt handler, Then it reports a
    # CorruptRecord naming the key (and claims it again after the publish grace)
    report = store.recover(publish=Recorder().publish)
    assert report.publish_failed == 1
    [(task_id, error)] = report.errors
    assert task_id == "t1" and isinstance(error, CorruptRecord) and key in str(error)


def test_a_corrupt_envelope_is_parked_once_with_an_on_corrupt_handler(make_store):
    # Given an expired lease whose stored envelope is not JSON
    store = make_store(publish_grace=SHORT)
    acquire(store, "t1", A, ttl=SHORT)
    key = store.keys.message("t1")
    store.client.hset(key, "envelope", b"{not json")
    wait_out()
    # When recovery passes run with an on_corrupt handler (the Celery side parks)
    parked, rec = [], Recorder()
    report = store.recover(publish=rec.publish, on_corrupt=parked.append)
    wait_out()
    again = store.recover(publish=rec.publish, on_corrupt=parked.append)
    # Then it is handed over once, naming the key and field, and leaves the index
    assert (report.corrupt, report.publish_failed, again.corrupt) == (1, 0, 0)
    (claim,) = parked
    assert claim.error.key == key and claim.error.field == "envelope" and claim.body == BODY
    assert rec.published == [] and store.client.zscore(store.keys.deadlines, "t1") is None


def test_a_corrupt_envelope_does_not_starve_the_healthy_leases_of_its_batch(make_store):
    """(Was a bug: one corrupt envelope stopped the whole batch from being published.)"""
    # Given two expired leases, one with a corrupt envelope
    store = make_store(publish_grace=SHORT)
    acquire(store, "healthy", A, ttl=SHORT)
    acquire(store, "corrupt", A, ttl=SHORT)
    store.client.hset(store.keys.message("corrupt"), "envelope", b"{not json")
    wait_out()

    # When two recovery passes run
    rec = Recorder()
    reported = []
    for _ in range(2):
        try:
            report = store.recover(publish=rec.publish)
            reported += [str(exc) for _task, exc in report.errors]
        except CorruptRecord as exc:
            reported.append(str(exc))
        wait_out()

    # Then the corrupt record is reported by key, and the healthy lease re-published
    assert any(store.keys.message("corrupt") in r for r in reported)
    assert [c.task_id for c in rec.published] == ["healthy"]


def test_an_unreachable_server_is_lease_unavailable_naming_the_address():
    # Given a store pointing at a closed port
    port = free_port()
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0))
    store = LeaseStore(client, prefix="unreachable")

    # When any call is made, Then it raises LeaseUnavailable naming host and port
    for call in (lambda: store.acquire("t1", A),
                 lambda: store.renew_many(A, {"t1": 1}),
                 lambda: store.get("t1"),
                 lambda: store.recover(publish=Recorder().publish)):
        with pytest.raises(LeaseUnavailable) as unavailable:
            call()
        assert f"127.0.0.1:{port}" in str(unavailable.value)


def test_finish_with_an_unknown_outcome_is_a_value_error_naming_the_task(store):
    # Given A holds a lease
    acq = acquire(store, "t1", A)

    # When A finishes with an outcome that does not exist
    with pytest.raises(ValueError, match="t1") as bad:
        store.finish("t1", A, acq.token, "exploded")

    # Then the error names the outcome, and the lease is untouched
    assert "exploded" in str(bad.value)
    assert store.get("t1").state == "active"


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
