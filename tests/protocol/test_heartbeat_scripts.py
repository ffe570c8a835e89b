"""renew_many.lua, progress.lua, release.lua and mark_started.lua: what the heartbeat sends.

Against a real redis-server. Each test reads Given / When / Then. Times are the
Redis server's clock; short ttls (0.1 s) and sleeps of ttl + 50 ms make a lease
"expired" by a margin. Shared helpers: tests/protocol/scripts_support.py; the
``store`` and ``make_store`` fixtures: tests/protocol/conftest.py.
"""
from __future__ import annotations

import time

import pytest
import redis

from celery_leases import Code, LeaseLost, LeaseStore
from tests.protocol.scripts_support import A, B, SHORT, TTL, acquire, indexed, wait_out


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


def test_a_renewal_racing_the_owners_own_retry_hand_over_is_finished_not_lost(store):
    # Given two leases of A: one A hands over to its next attempt (self.retry()), and one
    # recovery took from A after it expired (both now recovering under A's token)
    handed = acquire(store, "handed", A, ttl=TTL).token
    store.finish("handed", A, handed, "retry", next_attempt=1)
    taken = acquire(store, "taken", A, ttl=SHORT).token
    wait_out()
    assert [c.task_id for c in store.claim_expired()] == ["taken"]
    # When A's heartbeat, not yet told of the hand-over, renews both
    result = store.renew_many(A, {"handed": handed, "taken": taken}, ttl=TTL)
    # Then the hand-over is nothing lost (its owner gave it up), the claimed one is lost
    assert result == {"handed": Code.FINISHED, "taken": Code.LOST}
    assert store.get("handed").state == "recovering"


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


def test_the_progress_timeout_runs_from_the_start_mark_not_from_the_acquire(store):
    # Given a lease with a 0.1 s progress timeout whose body has not started (prefetched)
    acq = acquire(store, "t1", A, ttl=TTL, progress_timeout=SHORT, started=False)
    assert store.get("t1").progress_deadline == 0
    # When it waits past the timeout, renewed by a heartbeat that enforces progress
    wait_out()
    # Then it keeps its lease: the timeout bounds a running body, not the wait before it
    assert store.renew_many(A, {"t1": acq.token}, check_progress=True) == {}
    # And once its start mark says the body started, the timeout runs from the mark
    before = store.server_time_ms()
    assert store.mark_started(A, {"t1": acq.token}) == 1
    assert store.get("t1").progress_deadline >= before + int(SHORT * 1000)
    wait_out()
    assert store.renew_many(A, {"t1": acq.token}, check_progress=True) == {"t1": Code.STALLED}


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
    # both prefetched by A (never marked started) and released at A's warm shutdown
    store = make_store(max_recoveries=1)
    acquire(store, "used", A, ttl=SHORT)
    wait_out()
    used = acquire(store, "used", A, started=False)
    assert used.recoveries == 1
    fresh = acquire(store, "fresh", A, started=False)
    assert store.release(A, {"used": used.token, "fresh": fresh.token}) == 2

    # When a redelivery takes one over and a recovery pass claims the other
    took = acquire(store, "used", B)
    (claim,) = store.claim_expired()

    # Then neither counts a recovery, and the used-up task is not dead
    assert (took.code, took.recoveries) == (Code.TAKEN_OVER, 1)
    assert (claim.task_id, claim.code, claim.recoveries) == ("fresh", Code.RECOVERED, 0)


def test_the_record_decides_what_a_release_costs_and_a_riding_start_mark_counts(make_store):
    # Given A holds three leases: one marked started, one whose start mark has not reached the
    # store yet (it rides with the release), and one prefetched that never started
    store = make_store(max_recoveries=3)
    ran = acquire(store, "ran", A)
    riding = acquire(store, "riding", A, started=False)
    waiting = acquire(store, "waiting", A, started=False)

    # When A's pool process dies and A releases them all, naming the start it knows of
    assert store.release(A, {"ran": ran.token, "riding": riding.token, "waiting": waiting.token},
                         started={"riding"}) == 3

    # Then the two that started cost a recovery when taken over; the prefetched one none
    taken = {t: acquire(store, t, B) for t in ("ran", "riding", "waiting")}
    assert {t: (a.code, a.recoveries) for t, a in taken.items()} == {
        "ran": (Code.TAKEN_OVER, 1), "riding": (Code.TAKEN_OVER, 1), "waiting": (Code.TAKEN_OVER, 0)}


def test_a_hand_back_costs_no_recovery_though_the_body_started(make_store):
    # Given a task whose body started and gave the task back (Reject(requeue=True))
    store = make_store(max_recoveries=1)
    acq = acquire(store, "t1", A)
    assert store.release(A, {"t1": acq.token}, hand_back=True) == 1

    # When its requeued copy takes it over, twice over
    first = acquire(store, "t1", B)
    assert store.release(B, {"t1": first.token}, hand_back=True) == 1
    second = acquire(store, "t1", A)

    # Then neither hand-back counted a recovery: the task is not dead
    assert (first.code, first.recoveries) == (Code.TAKEN_OVER, 0)
    assert (second.code, second.recoveries) == (Code.TAKEN_OVER, 0)


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


def test_a_task_never_marked_started_is_isolated_then_bounded_by_its_waited_deaths(make_store):
    # Given a task whose start mark never reaches the store, with max_recoveries 0: two
    # uncertain deaths isolate it; an isolated body runs only after its own mark, so each
    # later unmarked death is a waited one (another task's), bounded by 4 * 4 * (0 + 1) = 16
    store = make_store(max_recoveries=0)
    limit = 2 + 16
    generation = 0
    codes = []
    # When its worker dies again and again, each recovered copy acquired, never marked
    for _ in range(limit + 1):
        acq = acquire(store, "t", A, ttl=SHORT, generation=generation, started=False)
        assert acq.owned
        wait_out()
        (claim,) = store.claim_expired(ids=["t"])
        codes.append(claim.code)
        generation = claim.generation
        if claim.code is Code.DEAD:
            break
        store.mark_published([claim])

    # Then it is recovered `limit` times, never counted as a recovery, then dead:
    # bounded, though larger than max_recoveries
    assert codes == [Code.RECOVERED] * limit + [Code.DEAD]
    record = store.get("t")
    assert (record.state, record.recoveries, record.unstarted_recoveries, record.waited_deaths) == (
        "dead", 0, 2, 17)
    # And the dead claim counts every abandonment (LeaseExpired names it)
    assert claim.recoveries == limit + 1


def test_an_unmarked_take_over_past_the_waited_bound_makes_the_task_dead(make_store):
    # Given a lease acquired, then taken over unmarked again and again (max_recoveries 0:
    # two uncertain deaths, then 16 waited ones)
    store = make_store(max_recoveries=0)
    take_overs = 0
    acq = acquire(store, "t", A, ttl=SHORT, started=False, max_recoveries=0)
    while acq.owned and take_overs < 30:
        wait_out()
        acq = acquire(store, "t", (B, A)[take_overs % 2], ttl=SHORT, started=False, max_recoveries=0)
        take_overs += acq.owned
    # Then the task is dead at the delivery past the bound
    assert acq.code is Code.DEAD and store.get("t").state == "dead"
    assert take_overs == 2 + 16


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


