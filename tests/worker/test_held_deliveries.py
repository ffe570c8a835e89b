"""Lease-held deliveries on a Redis broker: kombu's unacked copy kept in memory for recorded tasks.

A task recorded at publish is held by the lease store from its publish to its finish, so a
leased worker keeps kombu's ack emulation in memory only for its message (worker/held.py):
no ``unacked`` hash entry. What kombu's copy did is still done: a warm shutdown and a
``Reject(requeue=True)`` put the message back at once, and a worker killed between taking
the message and acquiring its lease loses nothing (the queued record brings it back).
Messages without a publish record (a plain task, tracking off) keep kombu's bookkeeping.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

import celery_leases
from celery_leases.testing import wait_for
from tests.support.apps.leased_app import create_app
from tests.support.workers import starts

TASKS = "tests.support.apps.leased_app"
pytestmark = pytest.mark.slow


@pytest.fixture
def celery_env(redis_server_url, key_prefix, own_server):
    """The broker and results on the session's server; the lease store on a server of the
    test's own (a test stops it without stopping the broker); a short delivery timeout."""
    leases = own_server("leases")
    return {"LEASES_TEST_BROKER": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
            "LEASES_TEST_LEASES_URL": f"redis://127.0.0.1:{leases.port}/0",
            "LEASES_TEST_HISTORY_URL": redis_server_url,
            "LEASES_TEST_TTL": "2", "LEASES_TEST_RECOVERY_INTERVAL": "1",
            "LEASES_TEST_DELIVERY_TIMEOUT": "3"}


def unacked_ids(redis_client) -> set[str]:
    """Task ids of the messages in kombu's unacked hash (the broker's db)."""
    out = set()
    for raw in redis_client.hvals("unacked"):
        payload = json.loads(raw)[0]
        out.add(payload["headers"].get("id"))
    return out


def test_only_messages_without_a_publish_record_get_an_unacked_entry(
        start_worker, client_app, celery_env, redis_client, history):
    # Given a threads worker with acks_late (a message is unacked until its task ends), and
    # three 2 s tasks at once: leased and recorded at publish, leased from a publisher with
    # tracking off, and plain
    start_worker("a", pool="threads", concurrency=4, LEASES_TEST_ACKS_LATE="1")
    untracked_app = create_app({**celery_env, "LEASES_TEST_DELIVERY_TIMEOUT": "0"})
    try:
        tracked = client_app.signature(f"{TASKS}.sleep_then_echo", ("t", 2.0)).delay()
        untracked = untracked_app.signature(f"{TASKS}.sleep_then_echo", ("u", 2.0)).delay()
        plain = client_app.signature(f"{TASKS}.plain_sleep", ("p", 2.0)).delay()
        # When all three run
        wait_for(lambda: all(starts(history, r.id) for r in (tracked, untracked, plain)), 20,
                 what="the three tasks to start")
        # Then kombu's hash holds the two without a publish record, not the recorded one
        held = unacked_ids(redis_client)
        assert {untracked.id, plain.id} <= held, held
        assert tracked.id not in held
        # And each succeeds, leaving no entry behind
        assert [r.get(timeout=20) for r in (tracked, untracked, plain)] == ["t", "u", "p"]
        wait_for(lambda: not unacked_ids(redis_client) & {tracked.id, untracked.id, plain.id}, 10,
                 what="the unacked entries to go")
    finally:
        untracked_app.close()


def test_a_warm_shutdown_puts_every_prefetched_message_back_at_once(
        start_worker, client_app, redis_client, key_prefix, history):
    # Given a one-process worker running a 1.5 s task with 20 recorded tasks prefetched behind it
    a = start_worker("a", pool="prefork", concurrency=1, LEASES_TEST_PREFETCH="25")
    first = client_app.signature(f"{TASKS}.sleep_then_echo", ("first", 1.5)).delay()
    wait_for(lambda: starts(history, first.id), 20, what="the first task to start")
    rest = [client_app.signature(f"{TASKS}.sleep_then_echo", (n, 0.0)).delay() for n in range(20)]
    store = celery_leases.store(client_app)
    wait_for(lambda: all(getattr(store.get(r.id), "state", None) == "active" for r in rest), 20,
             what="the 20 to be acquired (prefetched)")
    assert redis_client.llen(key_prefix) == 0 and not unacked_ids(redis_client) & {r.id for r in rest}

    # When it shuts down warmly
    a.signal(signal.SIGTERM, main_only=True)
    wait_for(lambda: not a.running, 30, what="the warm shutdown to end")

    # Then all 20 are back in the queue as soon as it ended, and the next worker runs each once
    assert redis_client.llen(key_prefix) == 20
    assert first.get(timeout=10) == "first"
    start_worker("b", pool="threads", concurrency=4)
    assert [r.get(timeout=30) for r in rest] == list(range(20))
    time.sleep(1)
    assert all(len(starts(history, r.id)) == 1 for r in rest)


def test_a_reject_with_requeue_puts_the_message_back_at_once(start_worker, client_app, history):
    # Given a recorded acks_late task whose first run rejects its message with requeue
    start_worker("a", pool="threads", concurrency=2, LEASES_TEST_ACKS_LATE="1")
    result = client_app.signature(f"{TASKS}.reject_requeue_after", (0.1,)).delay()
    # Then its copy comes back at once (not after the delivery timeout) and runs again
    began = time.monotonic()
    assert result.get(timeout=20) == "again"
    assert time.monotonic() - began < 3
    assert len(starts(history, result.id)) == 2


def test_a_worker_killed_between_taking_the_message_and_its_acquire_loses_nothing(
        start_worker, client_app, redis_client, key_prefix, history, celery_env):
    # Given a recorded task, and a lease store that stops answering (SIGSTOP) before worker A
    # takes the message from the broker: A's acquire waits
    store_port = int(celery_env["LEASES_TEST_LEASES_URL"].rsplit(":", 1)[1].split("/")[0])
    a = start_worker("a", pool="threads", concurrency=2)
    a.signal(signal.SIGSTOP)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("once", 0.0)).delay()
    store_pid = _pid_of_port(store_port)
    os.kill(store_pid, signal.SIGSTOP)
    try:
        a.signal(signal.SIGCONT)
        wait_for(lambda: redis_client.llen(key_prefix) == 0, 10, what="A to take the message")
        time.sleep(0.5)
        # When A is killed before its acquire is answered
        a.signal(signal.SIGKILL)
        wait_for(lambda: not a.running, 10, what="A to die")
    finally:
        os.kill(store_pid, signal.SIGCONT)
    # Then the message is neither in the queue nor in kombu's hash (it was lease-held)...
    assert redis_client.llen(key_prefix) == 0 and result.id not in unacked_ids(redis_client)
    assert not starts(history, result.id)
    # ...and its queued record brings it back after the delivery timeout: it runs once
    start_worker("b", pool="threads", concurrency=2, LEASES_TEST_WORKER_RECOVERY="1")
    assert result.get(timeout=30) == "once"
    time.sleep(1)
    assert len(starts(history, result.id)) == 1


def test_an_eta_task_survives_a_warm_shutdown(start_worker, client_app, redis_client, key_prefix, history):
    # Given a recorded task due in 4 s, received and held by worker A for its ETA
    a = start_worker("a", pool="threads", concurrency=2)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("later", 0.0)).apply_async(countdown=4)
    store = celery_leases.store(client_app)
    wait_for(lambda: getattr(store.get(result.id), "state", None) == "active", 10, what="A to acquire it")
    # When A shuts down warmly before the ETA
    a.signal(signal.SIGTERM, main_only=True)
    wait_for(lambda: not a.running, 30, what="the warm shutdown to end")
    # Then the message is back in the queue, and worker B runs it once, not before its ETA
    assert redis_client.llen(key_prefix) == 1
    start_worker("b", pool="threads", concurrency=2)
    assert result.get(timeout=30) == "later"
    time.sleep(1)
    assert len(starts(history, result.id)) == 1


def test_held_deliveries_can_be_turned_off(start_worker, client_app, redis_client, history):
    # Given leases_held_deliveries = False: kombu keeps its copy of recorded tasks too
    start_worker("a", pool="threads", concurrency=2, LEASES_TEST_ACKS_LATE="1", LEASES_TEST_HELD="0")
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("k", 1.5)).delay()
    wait_for(lambda: starts(history, result.id), 20, what="the task to start")
    assert result.id in unacked_ids(redis_client)
    assert result.get(timeout=20) == "k"


def _pid_of_port(port: int) -> int:
    """The pid of the redis-server listening on ``port`` (it reports it itself)."""
    import redis
    client = redis.Redis(port=port)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()
