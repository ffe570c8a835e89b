"""An acquire with finishes riding in its write (``LeaseStore.acquire_with_finishes``), as the
solo pool sends the finishes nobody waits for.

A real server: the finishes and the acquire go in one write (one round trip), each answers
what it answers alone, a refused finish is its own answer and the acquire's is untouched,
a server that lost its script cache gets the sources again, and a server that does not
answer makes both answers LeaseUnavailable (both are safe to send again).
"""
from __future__ import annotations

import os
import signal

import pytest

from celery_leases import LeaseStore
from celery_leases.exceptions import LeaseLost, LeaseUnavailable
from celery_leases.protocol.records import Acquisition
from celery_leases.protocol.transitions import AcquireRequest, FinishRequest


@pytest.fixture
def store(redis_client, key_prefix):
    return LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)


def held(store: LeaseStore, *task_ids: str, owner: str = "w") -> dict[str, int]:
    return {t: store.acquire(t, owner, name="proj.add", body=b"b").token for t in task_ids}


def state(store: LeaseStore, task_id: str) -> str:
    return store.client.hget(store.keys.record(task_id), "state").decode()


def writes(store: LeaseStore) -> int:
    direct = store.calls.direct
    return -1 if direct is None else direct.writes


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("direct", [True, False], ids=["own-connection", "redis-py"])
def test_the_finishes_and_the_acquire_go_in_one_write_and_each_lands(store, n, direct):
    # Given n leases held whose finishes are queued (the solo pool's unread successes)
    tokens = held(store, *(f"done{i}" for i in range(n)))
    if not direct:
        store.calls.direct = None  # redis-py's pipeline carries them instead
    store.finish_many([FinishRequest("warm", "w", 0, "succeeded")] * 2)  # (the scripts cached)
    before = writes(store)

    # When the next task's acquire goes with them
    acq, answers = store.acquire_with_finishes(
        AcquireRequest("next", "w", name="proj.add", body=b"b"),
        [FinishRequest(t, "w", token, "succeeded") for t, token in tokens.items()])

    # Then one write carried them all; each finish is accepted and the acquire owns its lease
    if direct:
        assert writes(store) - before == 1
    assert answers == [None] * n
    assert isinstance(acq, Acquisition) and acq.owned
    assert {state(store, t) for t in tokens} == {"succeeded"}
    assert state(store, "next") == "active"


def test_a_refused_finish_is_its_own_answer_and_the_acquire_is_untouched(store):
    # Given one lease held and one another owner took over
    tokens = held(store, "mine", "taken")
    store.release("w", {"taken": tokens["taken"]})
    held(store, "taken", owner="other")

    # When both finishes ride with an acquire that finds its task busy
    held(store, "busy", owner="other")
    acq, answers = store.acquire_with_finishes(
        AcquireRequest("busy", "w", name="proj.add", body=b"b"),
        [FinishRequest("mine", "w", tokens["mine"], "succeeded"),
         FinishRequest("taken", "w", tokens["taken"], "succeeded")])

    # Then each answers as alone: accepted, lost; the acquire answers BUSY
    assert answers[0] is None and isinstance(answers[1], LeaseLost)
    assert isinstance(acq, Acquisition) and not acq.owned and acq.code.name == "BUSY"
    assert state(store, "mine") == "succeeded" and state(store, "taken") == "active"


def test_no_finish_is_a_plain_acquire(store):
    acq, answers = store.acquire_with_finishes(AcquireRequest("alone", "w", name="proj.add", body=b"b"), [])
    assert answers == [] and acq.owned and state(store, "alone") == "active"


def test_a_server_that_lost_its_scripts_gets_the_sources_again(own_server, key_prefix):
    # Given a server of this test whose script cache was flushed after both scripts ran
    server = own_server("leases")
    client = server.client()
    store = LeaseStore(client, prefix=key_prefix, ttl=5, retention=60)
    tokens = held(store, "a", "b")
    store.finish("a", "w", tokens["a"], "succeeded")
    client.script_flush()

    # When a finish rides with an acquire, Then both land (NOSCRIPT: each source sent again)
    acq, answers = store.acquire_with_finishes(AcquireRequest("c", "w", name="proj.add", body=b"b"),
                                               [FinishRequest("b", "w", tokens["b"], "succeeded")])
    assert answers == [None] and acq.owned
    assert state(store, "b") == "succeeded" and state(store, "c") == "active"
    client.close()


def test_a_server_that_does_not_answer_makes_both_unavailable(own_server, key_prefix):
    # Given a server of this test, frozen (SIGSTOP) once a lease is held
    server = own_server("leases")
    client = server.client(socket_timeout=0.5)
    store = LeaseStore(client, prefix=key_prefix, ttl=5, retention=60)
    tokens = held(store, "a")
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        # When a finish rides with an acquire
        acq, answers = store.acquire_with_finishes(AcquireRequest("b", "w", name="proj.add", body=b"b"),
                                                   [FinishRequest("a", "w", tokens["a"], "succeeded")])
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    # Then neither has an answer: both are LeaseUnavailable, and each is safe to send again
    assert isinstance(acq, LeaseUnavailable) and isinstance(answers, LeaseUnavailable)
    # (the frozen server runs the commands in its socket when it resumes: the next acquire
    # is another task's)
    acq, answers = store.acquire_with_finishes(AcquireRequest("c", "w", name="proj.add", body=b"b"),
                                               [FinishRequest("a", "w", tokens["a"], "succeeded")])
    assert answers == [None] and acq.owned and state(store, "a") == "succeeded"
    client.close()
