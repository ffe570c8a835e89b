"""Script calls on the process's own connection (celery_leases/direct.py), on real Redis servers.

What must hold: the replies are the ones redis-py would give, a forked child
never touches its parent's socket, a second thread is never kept waiting, a
connection that went stale is replaced, a timeout is never sent twice, and a
demoted (read-only) server counts as unavailable.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import redis

from celery_leases import Code, LeaseStore
from celery_leases.direct import BUSY, DirectCaller
from celery_leases.exceptions import LeaseUnavailable
from celery_leases.processes import RedisServer
from celery_leases.scripts import scripts


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


@pytest.fixture
def store(redis_server_url, key_prefix):
    return LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)


def lifecycle(store: LeaseStore, task_id: str, owner: str = "w1") -> None:
    acq = store.acquire(task_id, owner)
    assert acq.code is Code.ACQUIRED
    store.finish(task_id, owner, acq.token, "succeeded")
    assert store.get(task_id).state == "succeeded"


def test_the_store_calls_its_scripts_on_one_held_connection(store, redis_client):
    # Given a store on one server: its script calls go through the direct caller
    assert isinstance(store._direct, DirectCaller)
    lifecycle(store, "warm")  # the first calls load the scripts
    conn = store._direct._conn
    before = script_calls(redis_client)
    # When a task's lease is acquired and finished three times over
    for i in range(3):
        lifecycle(store, f"t{i}")
    # Then each transition was one script call, all on the same connection
    assert script_calls(redis_client) - before == 6
    assert conn is not None and store._direct._conn is conn
    # And the replies are redis-py's: a refused finish still names the current owner
    acq = store.acquire("taken", "w1")
    with pytest.raises(Exception) as refused:
        store.finish("taken", "w2", acq.token, "succeeded")
    assert "taken" in str(refused.value)


def _child(store: LeaseStore, queue) -> None:
    try:
        inherited = store._direct._conn
        for i in range(50):
            lifecycle(store, f"child-{i}", owner="child")
        queue.put(("ok", store._direct._conn is not inherited))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(exc)))


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_alone(store):
    # Given a parent whose direct connection is open
    lifecycle(store, "parent-0")
    parent_conn = store._direct._conn
    # When a forked child makes its own calls
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(store, queue))
    child.start()
    status, detail = queue.get(timeout=30)
    child.join(10)
    # Then the child succeeded on a connection of its own
    assert (status, detail) == ("ok", True)
    # And the parent's connection still answers its own calls in order
    assert store._direct._conn is parent_conn
    for i in range(1, 20):
        lifecycle(store, f"parent-{i}")


def test_a_second_thread_is_not_kept_waiting_for_the_connection(store):
    # Given the direct connection held by one caller
    direct = store._direct
    direct._lock.acquire()
    try:
        # Then another caller is told to use redis-py instead of waiting
        assert direct.call(scripts.release.sha, ["k"], []) is BUSY
        # And the store's calls still succeed meanwhile (through redis-py)
        lifecycle(store, "while-busy")
    finally:
        direct._lock.release()
    # And many threads at once all get their own, correct answers
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(40):
                lifecycle(store, f"thread-{n}-{i}", owner=f"w{n}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_a_connection_the_server_dropped_is_replaced_and_the_call_succeeds(store, redis_client):
    # Given a held direct connection
    lifecycle(store, "before")
    old = store._direct._conn
    assert old is not None
    # When the server drops every client connection (as a restart would)
    redis_client.client_kill_filter(_type="normal", skipme=True)
    # Then the next call succeeds, on a new direct connection
    lifecycle(store, "after")
    assert store._direct._conn is not None


def test_a_timeout_is_not_sent_twice_and_the_store_reports_it_unavailable(tmp_path, key_prefix):
    # Given a store with a short socket timeout on a server that stops answering
    server = RedisServer(dir=tmp_path).start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5)
        store = LeaseStore(client, prefix=key_prefix, ttl=30)
        lifecycle(store, "warm")
        admin = redis.Redis.from_url(server.url)
        before = script_calls(admin)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            # When an acquire times out
            started = time.monotonic()
            with pytest.raises(LeaseUnavailable) as exc_info:
                store.acquire("stalled", "w1")
            waited = time.monotonic() - started
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        # Then it is reported as unavailable after one timeout, naming the call
        assert "acquire" in str(exc_info.value)
        assert waited < 1.5
        # And the server ran the command once, not twice (the reply was lost with the connection)
        time.sleep(0.2)
        assert script_calls(admin) - before == 1
        # And the store works again once the server answers
        lifecycle(store, "resumed")
    finally:
        server.stop()
        server.cleanup()


def test_a_read_only_server_counts_as_unavailable(tmp_path, key_prefix):
    # Given a store pointed at a replica (a master demoted by a failover looks the same)
    primary = RedisServer(dir=tmp_path / "primary").start()
    replica = RedisServer(dir=tmp_path / "replica").start()
    try:
        replica.client().replicaof("127.0.0.1", primary.port)
        store = LeaseStore(redis.Redis.from_url(replica.url), prefix=key_prefix, ttl=30)
        # When a task tries to take its lease there, through redis-py (script not cached)
        # and then directly (cached)
        for cached in (False, True):
            if cached:
                replica.client().script_load(scripts.acquire.source)
            with pytest.raises(LeaseUnavailable) as exc_info:
                store.acquire("t", "w1")
            # Then it is unavailable (a failover under way), not a bad call, and says why
            assert "read only replica" in str(exc_info.value)
        # And the direct connection was dropped: the next call connects anew
        assert store._direct._conn is None
        # And every other path that writes says the same (errors.py): a pipeline of
        # script calls over two shards, a plain write, a finish
        # (the leases are taken on the primary and have expired: claiming them must write)
        ids = [f"t{i}" for i in range(6)]
        on_primary = LeaseStore(redis.Redis.from_url(primary.url), prefix=key_prefix, shards=2)
        for task_id in ids:
            on_primary.acquire(task_id, "w0", ttl=0.05)
        sharded = LeaseStore(redis.Redis.from_url(replica.url), prefix=key_prefix, shards=2)
        deadline = time.monotonic() + 10
        while len(sharded.expired()) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.05)  # replicated and expired
        assert len(sharded.expired()) == len(ids)
        for name, call in {"pipeline": lambda: sharded.claim_expired(ids=ids),
                           "write": lambda: store.try_recovery_turn("w1", 1.0),
                           "finish": lambda: store.finish("t", "w1", 1, "succeeded")}.items():
            with pytest.raises(LeaseUnavailable) as exc_info:
                call()
            assert "read only replica" in str(exc_info.value), name
    finally:
        for server in (replica, primary):
            server.stop()
            server.cleanup()


def test_a_flushed_script_cache_is_reloaded(store, redis_client):
    # Given a server that lost its scripts
    lifecycle(store, "before")
    redis_client.script_flush()
    # Then the next call still works (redis-py sends the source) and the direct path resumes
    lifecycle(store, "after")
    lifecycle(store, "again")
