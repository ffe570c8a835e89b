"""Several acquires in one script call, with start marks riding along (acquire_many.lua).

A real server: each acquire of the call must answer exactly what it answers
alone, an acquire's own error must be its answer alone (the others still
run), the marks must land only on leases their owner holds, and the command
the acquirer packs piece by piece must be the one redis-py would send.
"""
from __future__ import annotations

import pytest
from redis.exceptions import NoScriptError

from celery_leases import Code, LeaseStore
from celery_leases.exceptions import CorruptRecord, LeaseError
from celery_leases.protocol.queued import QueuedTask, QueuedTasks
from celery_leases.protocol.scripts import scripts
from celery_leases.protocol.store import ACQUIRE_ARGS
from celery_leases.protocol.transitions import acquire_many_call as many_call
from celery_leases.protocol.transport.resp import pack, parse

ENVELOPE = {"headers": {}, "routing_key": "q"}


@pytest.fixture
def store(redis_client, key_prefix):
    store = LeaseStore(redis_client, prefix=key_prefix, ttl=5, retention=60)
    store.acquire_many([call("warm-up")])  # loaded: each call below is one EVALSHA
    return store


def call(task_id, **kw):
    return {"task_id": task_id, "owner": "w", "name": "proj.add", "body": b"b-" + task_id.encode(),
            "envelope": ENVELOPE, **kw}


def script_calls(client) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def test_each_acquire_of_one_call_answers_what_it_answers_alone(store, redis_client):
    # Given a lease held, a finished one, and a record one generation ahead
    held = store.acquire("busy", "other")
    done = store.acquire("done", "other")
    store.finish("done", "other", done.token, "succeeded")
    store.acquire("ahead", "other", generation=2)

    # When five acquires go in one call
    before = script_calls(redis_client)
    results, marked = store.acquire_many([call("fresh"), call("busy"), call("done"),
                                          call("ahead", generation=1), call("fresh2")])

    # Then it was one script call, and each acquire got its own answer, in order
    assert script_calls(redis_client) - before == 1
    assert [r.code for r in results] == [Code.ACQUIRED, Code.BUSY, Code.FINISHED, Code.STALE,
                                         Code.ACQUIRED]
    assert results[1].token == held.token and results[2].state == "succeeded"
    assert marked == 0
    # And the acquired leases are live, with their own message and distinct tokens
    for task_id, acq in (("fresh", results[0]), ("fresh2", results[4])):
        record = store.get(task_id)
        assert (record.state, record.token, record.owner) == ("active", acq.token, "w")
        assert redis_client.hget(store.keys.message(task_id), "body") == b"b-" + task_id.encode()
    assert results[0].token != results[4].token


def test_a_corrupt_record_fails_its_own_acquire_alone_and_writes_nothing(store, redis_client):
    # Given a record key that is not a hash
    redis_client.set(store.keys.record("bad"), "x")

    results, _ = store.acquire_many([call("a"), call("bad"), call("b")])

    # Then that acquire names the key, the others hold their leases
    assert isinstance(results[1], CorruptRecord) and store.keys.record("bad") in str(results[1])
    assert [results[0].code, results[2].code] == [Code.ACQUIRED, Code.ACQUIRED]
    assert redis_client.get(store.keys.record("bad")) == b"x"
    assert not redis_client.exists(store.keys.message("bad"))


def test_a_server_error_raised_half_way_is_that_acquires_answer_and_the_others_still_run(
        store, redis_client):
    # Given three acquires, the second with a ttl no deadline can be (ZADD refuses NaN,
    # raised inside the script after the record was written)
    calls = [call("a"), call("nan"), call("b")]
    keys, args = many_call(store, calls, "", None)
    args[3 + ACQUIRE_ARGS + 2] = "nan"  # the second acquire's ARGV[3], its ttl
    raw = store.calls.run(scripts.acquire_many, keys, args, "test")

    results, _ = store.acquire_many_reply(raw, calls)

    # Then the second alone failed, naming the server's error; the others hold their leases
    assert isinstance(results[1], LeaseError) and "float" in str(results[1])
    assert [results[0].code, results[2].code] == [Code.ACQUIRED, Code.ACQUIRED]
    assert store.get("b").state == "active"


def test_start_marks_ride_along_only_on_leases_their_owner_holds(store, redis_client):
    # Given two leases of w and one of another worker
    mine = store.acquire_many([call("m1"), call("m2")])[0]
    theirs = store.acquire("t", "other")
    before = int(store.stats().get("started", 0))

    # When the next call carries their start marks (the other's under w's name)
    results, marked = store.acquire_many(
        [call("next")], owner="w", starts={"m1": mine[0].token, "m2": mine[1].token, "t": theirs.token})

    # Then w's two leases are marked started and counted, the other's is not
    assert marked == 2 and results[0].code is Code.ACQUIRED
    assert [redis_client.hget(store.keys.record(t), "started") for t in ("m1", "m2", "t")] == \
        [b"1", b"1", b"0"]
    assert int(store.stats()["started"]) == before + 2


@pytest.mark.parametrize("corrupt", ["list", "not-a-number"])
def test_start_marks_with_a_corrupt_stats_key_mark_and_acquire_all_the_same(store, redis_client, corrupt):
    # Given a lease of w, and the shard's stats key of the wrong type (or its counter not a number)
    acq = store.acquire("m", "w")
    redis_client.delete(store.keys.stats)
    if corrupt == "list":
        redis_client.rpush(store.keys.stats, "not", "a", "hash")
    else:
        redis_client.hset(store.keys.stats, "started", "12x")
    # When its start mark rides along with the next acquire, and then goes alone
    results, marked = store.acquire_many([call("n")], owner="w", starts={"m": acq.token})
    alone = store.mark_started("w", {"m": acq.token})
    # Then the mark and the acquire are made; counters are best effort (the helper count())
    assert results[0].code is Code.ACQUIRED and marked == 1 and alone == 1
    assert redis_client.hget(store.keys.record("m"), "started") == b"1"


def test_a_stale_token_is_not_marked(store, redis_client):
    acq = store.acquire("m", "w")
    _, marked = store.acquire_many([call("n")], owner="w", starts={"m": acq.token - 1})
    assert marked == 0 and redis_client.hget(store.keys.record("m"), "started") == b"0"


def test_the_packed_command_is_the_one_redis_py_would_send(store):
    calls = [call("p1", generation=1, publish="x"), call("p2", attempt=2)]
    starts = {"s1": 7, "s2": 9}
    parts = [store.acquire_parts(**c) for c in calls]

    packed = store.acquire_many_command(parts, "w", starts)

    keys, args = many_call(store, calls, "w", starts)
    assert packed == pack("EVALSHA", scripts.acquire_many.sha, len(keys), *keys, *args)


def test_the_packed_command_runs_and_its_reply_parses(store, redis_client):
    # As the worker's acquirer does it: its own socket, the reply read by wire.parse
    calls = [call("w1"), call("w2")]
    command = store.acquire_many_command([store.acquire_parts(**c) for c in calls])
    conn = redis_client.connection_pool.get_connection()
    try:
        conn._sock.sendall(command)
        data = b""
        while True:
            data += conn._sock.recv(65536)
            try:
                raw, end = parse(data)
                break
            except Exception:  # noqa: BLE001 - incomplete: read more
                continue
    finally:
        redis_client.connection_pool.release(conn)
    results, marked = store.acquire_many_reply(raw, calls)
    assert [r.code for r in results] == [Code.ACQUIRED, Code.ACQUIRED] and marked == 0


def test_arguments_that_do_not_match_the_counts_are_refused_naming_them(store, redis_client):
    keys, args = many_call(store, [call("c")], "", None)
    with pytest.raises(LeaseError, match="do not match 1 acquire"):
        store.calls.run(scripts.acquire_many, keys[:-1], args, "test")
    assert not redis_client.exists(store.keys.record("c"))


def test_a_server_without_the_script_loads_it_and_answers(store, redis_client):
    redis_client.script_flush()
    calls = [call("f1")]
    results, _ = store.acquire_many_reply(NoScriptError("NOSCRIPT No matching script"), calls)
    assert results[0].code is Code.ACQUIRED
    assert redis_client.script_exists(scripts.acquire_many.sha) == [True]


def test_a_recorded_acquire_without_its_message_in_the_store_is_sent_again_with_it(store, redis_client):
    # Given t1 recorded at publish p1, and t2 claimed recorded but never recorded
    QueuedTasks(store, 30).enqueue(QueuedTask("t1", "proj.add", b"recorded", ENVELOPE, publish="p1"))
    results, _ = store.acquire_many([call("t1", publish="p1", recorded=True),
                                     call("t2", publish="p2", recorded=True)])
    # Then both hold a lease; t1 kept its recorded message, t2's was sent in a second call
    assert [r.code for r in results] == [Code.ACQUIRED, Code.ACQUIRED]
    assert redis_client.hget(store.keys.message("t1"), "body") == b"recorded"
    assert redis_client.hget(store.keys.message("t2"), "body") == b"b-t2"


def test_a_reassert_cannot_share_the_call(store):
    with pytest.raises(ValueError, match="re-assert"):
        store.acquire_parts(**call("r", reassert=5))
