"""Settling a finish whose reply was lost (celery_leases/protocol/settle.py), on a real redis-server.

What must hold: a finish that times out is sent again until the store answers,
and the answer (not an assumption) says whether it applied; the wait is
bounded; once the caller gives up, no copy the server still holds can apply
the outcome; the bounds on the server's clock hold.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from celery_leases import LeaseStore
from celery_leases.exceptions import LeaseLost, LeaseUnavailable
from celery_leases.testing.servers import RedisServer
from celery_leases.protocol.clock import MARGIN, ServerClock
from celery_leases.protocol.settle import settle_finish


@pytest.fixture
def stalled(tmp_path, key_prefix):
    """A store on its own server (socket timeout 0.5 s), its scripts cached, and a function
    that stops the server for some seconds in the background."""
    server = RedisServer(dir=tmp_path).start()
    client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    store = LeaseStore(client, prefix=key_prefix, ttl=30)
    warm = store.acquire("warm", "w")
    store.finish("warm", "w", warm.token, "succeeded")  # the server now holds finish.lua

    def stop_for(seconds: float) -> threading.Thread:
        os.kill(server.process.pid, signal.SIGSTOP)
        thread = threading.Timer(seconds, os.kill, (server.process.pid, signal.SIGCONT))
        thread.start()
        return thread

    yield store, stop_for
    os.kill(server.process.pid, signal.SIGCONT)
    server.cleanup()


def finish_call(store: LeaseStore, task_id: str, token: int, sent: list):
    def send(not_after: int) -> None:
        sent.append(not_after)
        store.finish(task_id, "w", token, "succeeded", not_after=not_after)
    return send


def test_a_lost_reply_is_settled_by_asking_again_when_the_store_returns(stalled):
    store, stop_for = stalled
    acq = store.acquire("t1", "w")
    clock = ServerClock(store)
    clock.read()
    sent: list = []
    # When the store stops for 2 s while the finish is sent (bound 10 s)
    resume = stop_for(2.0)
    started = time.monotonic()
    settle_finish(store, finish_call(store, "t1", acq.token, sent), bound=10, task_id="t1",
                  token=acq.token, server=clock)
    waited = time.monotonic() - started
    resume.join()
    # Then it returned once the store answered: accepted, applied once, several copies sent
    assert 1.5 < waited < 5, waited
    assert len(sent) >= 2 and len(set(sent)) == 1, sent  # every copy carries one not-after
    assert store.get("t1").state == "succeeded"
    assert store.stats()["succeeded"] == 2  # the warm-up and t1, once
    assert store.stats().get("late_finishes", 0) == 0


def test_past_its_bound_a_finish_gives_up_and_no_buffered_copy_applies(stalled):
    store, stop_for = stalled
    acq = store.acquire("t1", "w")
    clock = ServerClock(store)
    clock.read()
    sent: list = []
    # When the store stays stopped well past the bound (1 s)
    resume = stop_for(4.0)
    started = time.monotonic()
    with pytest.raises(LeaseLost) as gave_up:
        settle_finish(store, finish_call(store, "t1", acq.token, sent), bound=1, task_id="t1",
                      token=acq.token, server=clock)
    waited = time.monotonic() - started
    assert "unconfirmed" in gave_up.value.reason and str(sent[0]) in gave_up.value.reason
    assert waited < 3.5, waited  # bound + margin + one socket timeout, not the whole outage
    resume.join()
    time.sleep(0.3)
    # Then the copies the server held ran on resume and were refused: the lease is still
    # the caller's, active, for recovery to take after its ttl; nothing was applied
    record = store.get("t1")
    assert (record.state, record.token, record.owner) == ("active", acq.token, "w")
    assert store.stats().get("late_finishes", 0) >= 1
    assert store.stats()["succeeded"] == 1


def test_with_no_reading_of_the_server_clock_nothing_is_sent(stalled):
    store, stop_for = stalled
    acq = store.acquire("t1", "w")
    sent: list = []
    resume = stop_for(2.5)
    with pytest.raises(LeaseLost) as gave_up:
        settle_finish(store, finish_call(store, "t1", acq.token, sent), bound=1, task_id="t1",
                      token=acq.token, server=ServerClock(store))
    resume.join()
    assert sent == [] and "no finish was sent" in gave_up.value.reason
    assert store.get("t1").state == "active"


def test_the_server_clock_bounds_hold(stalled):
    store, _ = stalled
    clock = ServerClock(store)
    clock.read()
    for _ in range(20):
        before = time.monotonic()
        actual = store.server_time_ms()
        after = time.monotonic()
        # The server's clock never reads later than the upper bound at the moment it was read,
        assert actual <= clock.upper_ms(after)
        # and from past(x) on it surely reads more than x, no later than the reading's own
        # width allows (the server may have read its clock anywhere in that round trip:
        # a loaded machine once took 0.25 s over it)
        _, t0, t1 = clock.reading
        assert clock.past(actual - 1) <= after + (t1 - t0) + 0.002 + MARGIN
        assert clock.past(actual + 50) >= before + 0.04
        time.sleep(0.01)


def test_copies_back_off_and_the_last_goes_out_once_the_not_after_has_passed():
    # Given a driven clock, a store that never answers, and a reading taken at t=0
    now = [0.0]
    sleeps: list = []

    class Store:
        def server_time_ms(self) -> int:
            return 1_000_000 + int(now[0] * 1000)

    clock = ServerClock(Store(), clock=lambda: now[0])
    clock.read()
    sent: list = []

    def send(not_after: int) -> None:
        sent.append((now[0], not_after))
        now[0] += 0.5  # each copy waits a socket timeout
        raise LeaseUnavailable("timed out")

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    with pytest.raises(LeaseLost):
        settle_finish(Store(), send, bound=5, task_id="t", token=1, clock=lambda: now[0],
                      sleep=sleep, server=clock)
    # Then the pauses grow and stay capped, the not-after is one moment for every copy,
    # and the last copy left only once the server's clock was surely past it
    assert sleeps[:3] == [0.25, 0.5, 1.0] and max(sleeps) <= 2.0
    not_after = sent[0][1]
    assert {n for _, n in sent} == {not_after}
    assert not_after >= 1_000_000 + 5000
    last_sent_at = sent[-1][0]
    assert 1_000_000 + int(last_sent_at * 1000 * (1 - 1e-3)) > not_after
    assert now[0] < 5 + 0.5 + 2.0 + MARGIN + 0.1  # bound, a socket timeout, a pause, the margin
