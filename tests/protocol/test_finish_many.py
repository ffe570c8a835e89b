"""Several finishes in one script call (finish_many.lua), as the background finishes send them.

A real server: each finish of the call must answer exactly what it answers
alone, an error of one finish must be its answer alone (the others still
apply, and the batch is safe to send again), and a finish with finish.lua's
optional tail must still be sent as finish.lua.
"""
from __future__ import annotations

import pytest

from celery_leases import LeaseStore
from celery_leases.exceptions import LeaseError, LeaseLost
from celery_leases.protocol import renewals, unwritten
from celery_leases.protocol.scripts import scripts
from celery_leases.protocol.transitions import FinishRequest, finish_call, finish_many_call


@pytest.fixture
def store(redis_client, key_prefix):
    return LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)


def script_calls(client, name: str = "evalsha") -> int:
    return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)


def held(store: LeaseStore, *task_ids: str, owner: str = "w") -> dict[str, int]:
    return {t: store.acquire(t, owner, name="proj.add", body=b"b").token for t in task_ids}


def state(store: LeaseStore, task_id: str) -> str:
    return store.client.hget(store.keys.record(task_id), "state").decode()


def test_finishes_of_one_call_land_together_in_one_script_call(store, redis_client):
    # Given eight leases held, and finish_many loaded
    tokens = held(store, *(f"t{i}" for i in range(8)))
    store.finish_many([FinishRequest("warm", "w", 0, "succeeded"), FinishRequest("warm2", "w", 0, "failed")])

    # When their finishes go together
    before = script_calls(redis_client)
    answers = store.finish_many([FinishRequest(t, "w", token, "succeeded" if i % 2 else "failed")
                                 for i, (t, token) in enumerate(tokens.items())])

    # Then it was one script call, each accepted and terminal, its deadline and message gone
    assert script_calls(redis_client) - before == 1
    assert answers == [None] * 8
    for i, task_id in enumerate(tokens):
        assert state(store, task_id) == ("succeeded" if i % 2 else "failed")
        assert store.client.zscore(store.keys.shard_for(task_id).deadlines, task_id) is None
        assert not store.client.exists(store.keys.message(task_id))
        assert 0 < store.client.pttl(store.keys.record(task_id)) <= 60_000


def test_each_finish_of_one_call_answers_what_it_answers_alone(store):
    # Given a lease held, one taken over by another owner, one already finished, and one
    # whose finish comes too late
    tokens = held(store, "mine", "taken", "done", "late")
    store.release("w", {"taken": tokens["taken"]})
    store.finish("done", "w", tokens["done"], "succeeded")

    # When their finishes go in one call (the one already finished sent again: a lost reply)
    answers = store.finish_many([
        FinishRequest("mine", "w", tokens["mine"], "succeeded"),
        FinishRequest("taken", "w", tokens["taken"], "succeeded"),
        FinishRequest("done", "w", tokens["done"], "succeeded"),
        FinishRequest("late", "w", tokens["late"], "succeeded", not_after=1),
        FinishRequest("never", "w", 0, "failed"),
    ])

    # Then each answers as alone: accepted, lost, accepted again (idempotent), late, missing
    assert answers[0] is None and answers[2] is None
    assert isinstance(answers[1], LeaseLost) and isinstance(answers[3], LeaseLost)
    assert answers[3].reason.startswith("late") and isinstance(answers[4], LeaseLost)
    assert state(store, "mine") == "succeeded" and state(store, "done") == "succeeded"
    # And the refused ones changed nothing
    assert state(store, "late") != "succeeded" and state(store, "taken") != "succeeded"
    assert not store.client.exists(store.keys.record("never"))


def test_an_error_of_one_finish_is_its_own_and_the_batch_is_safe_to_send_again(store):
    # Given three leases, the middle one's finish carrying an outcome finish.lua refuses with
    # an error reply (an error of that finish alone)
    tokens = held(store, "a", "b", "c")
    reqs = [FinishRequest(t, "w", token, "succeeded") for t, token in tokens.items()]
    calls = [finish_call(store, req)[1:] for req in reqs]
    calls[1][1][3] = "vanished"

    # When the three go in one call: it raises for the batch, naming the error
    with pytest.raises(LeaseError, match="finish_many.*task b.*unknown outcome vanished"):
        keys, args = finish_many_call(calls)
        renewals._many_replies(store, reqs, store.calls.run(scripts.finish_many, keys, args, "3 finishes"),
                               "3 finishes")

    # Then its neighbours were applied all the same, and it changed nothing
    assert state(store, "a") == "succeeded" and state(store, "c") == "succeeded"
    assert state(store, "b") == "active"
    # And the batch sent again answers OK for all three (the applied ones: their own copy)
    assert store.finish_many(reqs) == [None, None, None]
    assert state(store, "b") == "succeeded"


def test_a_finish_with_its_optional_tail_is_sent_as_finish_lua(store, redis_client):
    # Given a lease whose finish confirms a kept result, and one plain finish
    kept = held(store, "kept")
    store.finish("kept", "w", kept["kept"], "failed", kept=unwritten.pack("FAILURE", "x", None, b"{}"),
                 kept_due=60)
    tokens = held(store, "riding", "plain")
    reqs = [FinishRequest("riding", "w", tokens["riding"], "succeeded", written=["kept"]),
            FinishRequest("plain", "w", tokens["plain"], "succeeded")]
    assert len(finish_call(store, reqs[0])[1]) > 5

    # When they are finished together
    before = script_calls(redis_client)
    assert store.finish_many(reqs) == [None, None]

    # Then each went as its own finish.lua call (pipelined), and the confirmation landed
    assert script_calls(redis_client) - before == 2
    assert state(store, "riding") == "succeeded" and state(store, "plain") == "succeeded"
    shard = store.keys.shard_for("kept")
    assert store.client.zscore(shard.unwritten, "kept") is None


def test_the_script_refuses_keys_and_arguments_that_are_not_whole_finishes(store):
    # Given finish_many's own layout: 5 keys and 6 arguments a finish, after the count
    keys, args = finish_call(store, FinishRequest("x", "w", 1, "succeeded"))[1:]
    # When the count does not match what was sent, Then nothing runs and the error says why
    with pytest.raises(LeaseError, match="do not match 2 finish"):
        store.calls.run(scripts.finish_many, keys, [2, *args], "test")
    assert not store.client.exists(store.keys.record("x"))


def test_a_server_that_lost_its_scripts_is_sent_the_source_again(own_server, key_prefix):
    # Given a server of this test, its script cache flushed after finish_many was loaded
    server = own_server("leases")
    client = server.client()
    store = LeaseStore(client, prefix=key_prefix, ttl=5, retention=60)
    first = held(store, "a", "b")
    assert store.finish_many([FinishRequest(t, "w", token, "succeeded") for t, token in first.items()]) == \
        [None, None]
    client.script_flush()
    # When the next finishes go together, Then they land (NOSCRIPT: the source is sent again)
    tokens = held(store, "c", "d")
    assert store.finish_many([FinishRequest(t, "w", token, "failed") for t, token in tokens.items()]) == \
        [None, None]
    assert state(store, "c") == "failed" and state(store, "d") == "failed"
    client.close()
