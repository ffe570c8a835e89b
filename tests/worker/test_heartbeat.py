"""The heartbeat thread: one call per tick, lost leases flagged, Redis errors survived."""
from __future__ import annotations

import logging

import redis

from celery_leases import Code, LeaseStore
from celery_leases.worker.heartbeat import Heartbeat, Held
from celery_leases.testing.servers import RedisServer
from celery_leases.testing import wait_for


def test_one_renew_call_per_tick_and_lost_leases_flagged(redis_server_url, key_prefix):
    # Given a heartbeat holding 50 leases, one of which another owner takes over
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=1)
    lost = []
    beat = Heartbeat(store, "w1", 0.2, lambda task_id, held, code: lost.append((task_id, code)))
    for n in range(50):
        acq = store.acquire(f"t{n}", "w1", ttl=1)
        beat.add(f"t{n}", Held(acq.token, ttl=1))
    calls = []
    real = store.renew_many
    store.renew_many = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    store.release("w1", {"t7": beat.held["t7"].token})
    store.acquire("t7", "w2", ttl=1)
    # When it ticks
    beat.tick()
    # Then one call renewed the 49 and reported t7 lost; the task can see it
    assert len(calls) == 1
    assert lost == [("t7", Code.LOST)]
    assert beat.is_lost("t7", beat.held["t7"].token) and not beat.is_lost("t8", beat.held["t8"].token)


def test_redis_errors_are_logged_counted_and_retried(tmp_path, key_prefix, caplog):
    # Given a heartbeat thread on a Redis that goes away for a while
    server = RedisServer(dir=tmp_path)
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        store = LeaseStore(client, prefix=key_prefix, ttl=30)
        beat = Heartbeat(store, "w1", 0.1, lambda *a: None)
        acq = store.acquire("t1", "w1", ttl=30)
        beat.add("t1", Held(acq.token, ttl=30))
        caplog.set_level(logging.WARNING, logger="celery_leases.heartbeat")
        beat.start()
        wait_for(lambda: beat.ticks >= 2, 5, what="healthy ticks")
        # When Redis stops, ticks fail: counted, the thread keeps going, and the
        # outage is logged once however many ticks fail
        server.stop()
        wait_for(lambda: beat.consecutive_failures >= 3, 10, what="failed ticks")
        assert beat._thread.is_alive()
        failing = [r for r in caplog.records if "lease heartbeat failed" in r.getMessage()]
        assert len(failing) == 1 and failing[0].levelno == logging.ERROR
        assert "1 lease(s) not renewed" in failing[0].getMessage()
        # And when Redis is back (AOF off: the lease is gone), the next tick works again,
        # logged once, with the number of failed ticks
        server.start()
        store.acquire("t1", "w1", ttl=30)
        wait_for(lambda: beat.consecutive_failures == 0, 10, what="a successful tick")
        failed = beat.failures
        back = [r for r in caplog.records if "works again" in r.getMessage()]
        assert len(back) == 1 and f"after {failed} failed attempt(s)" in back[0].getMessage()
        assert failed >= 3
        # (celery-leases' own lines: another test's result consumer, garbage-collected here,
        # may log Celery's reconnect attempts to its stopped server meanwhile)
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING
                    and r.name.startswith("celery_leases")]) == 2
        beat.stop()
        assert not beat._thread.is_alive()
    finally:
        server.stop()


def test_start_marks_wake_the_thread_once_per_batch_and_are_still_sent_after_an_empty_one(
        redis_server_url, key_prefix):
    # Given a running heartbeat (long interval: only start marks make it work) holding leases
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)
    beat = Heartbeat(store, "w1", 60.0, lambda *a: None)
    tokens = {}
    for n in range(6):
        tokens[f"t{n}"] = store.acquire(f"t{n}", "w1", ttl=30).token
        beat.add(f"t{n}", Held(tokens[f"t{n}"], ttl=30))
    wakes = []
    real_set = beat._wake.set
    beat._wake.set = lambda: wakes.append(1) or real_set()
    beat.start()
    try:
        # When three tasks start together and end before their marks go out
        for n in range(3):
            beat.started(f"t{n}", tokens[f"t{n}"])
            beat.forget(f"t{n}", tokens[f"t{n}"])
        # Then the thread was woken once for the three, and sends nothing for them
        assert len(wakes) == 1
        wait_for(lambda: not beat._starts_due, 5, what="the thread to take the (empty) batch")
        assert beat.start_calls == 0
        # And when three more start later, one wake-up sends all three marks in one call
        for n in range(3, 6):
            beat.started(f"t{n}", tokens[f"t{n}"])
        assert len(wakes) == 2
        wait_for(lambda: beat.start_calls == 1, 5, what="the start marks")
        assert all(store.get(f"t{n}").started for n in range(3, 6))
        assert not any(store.get(f"t{n}").started for n in range(3))
    finally:
        beat.stop()


def test_a_tick_is_one_renewal_call_whatever_marks_are_queued_and_the_marks_go_out_after_it(
        redis_server_url, key_prefix):
    # Given a heartbeat holding leases whose tasks just started (their marks queued)
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)
    beat = Heartbeat(store, "w1", 0.2, lambda *a: None)
    tokens = {f"t{n}": store.acquire(f"t{n}", "w1", ttl=30).token for n in range(3)}
    for task_id, token in tokens.items():
        beat.add(task_id, Held(token, ttl=30, interval=0.2))
    calls = []
    for name in ("renew_many", "mark_started"):
        real = getattr(store, name)
        setattr(store, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    for task_id, token in tokens.items():
        beat.started(task_id, token)
    # When it ticks, Then the tick is the renewal alone, and the marks are still queued
    beat.tick()
    assert calls == ["renew_many"] and set(beat._starts) == set(tokens)
    # And the running thread sends them once they have waited their delay, in one call
    beat.start()
    try:
        wait_for(lambda: "mark_started" in calls, 5, what="the start marks")
        assert calls.count("mark_started") == 1
        assert all(store.get(task_id).started for task_id in tokens)
        wait_for(lambda: beat.ticks >= 3, 5, what="later ticks")
    finally:
        beat.stop()


class _StalledLoop:
    """The event loop's watch (worker/loop.py), its stall set by the test."""

    runs_bodies = False

    def __init__(self) -> None:
        self.stalled = 0.0

    def stalled_for(self) -> float:
        return self.stalled


def test_a_wedged_loop_is_logged_once_with_no_lease_held_and_again_when_it_runs(
        redis_server_url, key_prefix, caplog):
    # Given a heartbeat holding no lease, on a loop that goes round
    from celery_leases.worker.loop import LOOP_WEDGED_AFTER
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)
    loop = _StalledLoop()
    beat = Heartbeat(store, "w1", 10.0, lambda *a: None, loop=loop)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="celery_leases.heartbeat")

    def lines(text):
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    # When the loop stalls, first less than the wedge bound, then past it for three ticks
    for stalled in (2.0, LOOP_WEDGED_AFTER - 1, LOOP_WEDGED_AFTER + 1, LOOP_WEDGED_AFTER + 5, 31.0):
        loop.stalled = stalled
        beat.tick()
    # Then one WARNING says so, naming what the worker no longer does, although no lease waits
    wedged = lines("receives, starts and acknowledges no message")
    assert len(wedged) == 1 and f"{LOOP_WEDGED_AFTER + 1:.1f}s" in wedged[0]
    assert not lines("lease(s) of tasks it has not started")
    assert beat.loop_wedged_for == 31.0
    # And when the loop goes round again, one line says so with the longest stall seen
    for stalled in (0.3, 0.5):
        loop.stalled = stalled
        beat.tick()
    assert lines("runs again after a stall of at least 31.0s") and len(lines("runs again")) == 1
    assert beat.loop_wedged_for == 0.0


def test_start_marks_wait_their_delay_on_the_heartbeat_clock(redis_server_url, key_prefix):
    # Given a heartbeat on a clock the test drives, holding a lease whose task just started
    from celery_leases.worker.heartbeat import START_MARK_DELAY
    now = [100.0]
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=5)
    beat = Heartbeat(store, "w1", 1.0, lambda *a: None, clock=lambda: now[0])
    acq = store.acquire("t1", "w1", ttl=5)
    beat.add("t1", Held(acq.token, ttl=5))
    beat.started("t1", acq.token)
    # Then its mark is not due before START_MARK_DELAY has passed on that clock, and is after
    now[0] += START_MARK_DELAY / 2
    assert beat.take_due_starts() == {}
    now[0] += START_MARK_DELAY
    assert beat.take_due_starts() == {"t1": acq.token}
    # And a renewal records when it was sent, on that clock too
    beat.tick()
    assert beat.last_renewed_at == now[0]
