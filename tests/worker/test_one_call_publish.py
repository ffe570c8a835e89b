"""One-call publish: with the lease store on the broker's server and database (the default),
a leased task's publish record and its message's LPUSH are one script call (one_call.py).

Given a publisher whose ``leases_redis_url`` is unset (the store falls back to the Redis
broker), when it publishes leased tasks (plain, with a priority, with an ETA), then the
server sees one EVALSHA per task from the publisher and no LPUSH of its own (the push runs
inside the script, after the record), every task is recorded and delivered, and a worker
runs each once. With the store apart, the two-call publish stays.
"""
from __future__ import annotations

import threading
import time

import pytest
import redis

import celery_leases
from tests.support.apps.leased_app import create_app
from tests.support.workers import starts

TASKS = "tests.support.apps.leased_app"
pytestmark = pytest.mark.slow


@pytest.fixture
def server(own_server):
    return own_server("broker-and-leases")


@pytest.fixture
def celery_env(server, key_prefix, redis_server_url):
    """One server for the broker and the leases (leases_redis_url unset); the results and the
    tasks' history on the session's server, which outlives every waiter (and ``history`` reads)."""
    return {"LEASES_TEST_BROKER": server.url, "LEASES_TEST_BACKEND": redis_server_url,
            "LEASES_TEST_HISTORY_URL": redis_server_url, "LEASES_TEST_PREFIX": key_prefix,
            "LEASES_TEST_TTL": "2", "LEASES_TEST_RECOVERY_INTERVAL": "1"}


class Monitor:
    """The commands clients send to a server (MONITOR), without those scripts run inside."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.lines: list[str] = []
        self._conn = self.client.connection_pool.get_connection()
        self._conn.send_command("MONITOR")
        assert self._conn.read_response() in (b"OK", "OK")
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                if self._conn.can_read(timeout=0.2):
                    self.lines.append(self._conn.read_response().decode("utf-8", "replace"))
            except Exception:  # noqa: BLE001 - the connection closed at stop
                return

    def stop(self) -> list[str]:
        time.sleep(0.3)
        self._stop = True
        self._thread.join(2)
        self._conn.disconnect()
        self.client.close()
        return self.lines

    @staticmethod
    def from_clients(lines: list[str], command: str) -> int:
        return sum(1 for line in lines if f'"{command}"' in line.upper() and " lua]" not in line)

    @staticmethod
    def in_scripts(lines: list[str], command: str) -> int:
        return sum(1 for line in lines if f'"{command}"' in line.upper() and " lua]" in line)


def test_record_and_message_go_out_in_one_call(client_app, server, key_prefix, start_worker, history):
    # A warm-up publish (connections, script loads), whose result nobody waits for
    client_app.signature(f"{TASKS}.add", (0, 0)).apply_async(ignore_result=True)
    monitor = Monitor(server.url)
    # When it publishes 20 leased tasks: plain, with a priority, with an ETA
    results = [client_app.signature(f"{TASKS}.add", (n, 1)).delay() for n in range(18)]
    results.append(client_app.signature(f"{TASKS}.add", (100, 1)).apply_async(priority=5))
    results.append(client_app.signature(f"{TASKS}.add", (200, 1)).apply_async(countdown=1))
    lines = monitor.stop()
    # Then the publisher sent one EVALSHA per task and no LPUSH; each LPUSH ran in a script
    assert Monitor.from_clients(lines, "EVALSHA") == 20, lines[:40]
    assert Monitor.from_clients(lines, "LPUSH") == 0, lines[:40]
    assert Monitor.in_scripts(lines, "LPUSH") == 20
    store = celery_leases.store(client_app)
    assert all(store.get(r.id).state == "queued" for r in results)
    # And a worker runs each once, the priority and the ETA task included
    start_worker("a", pool="threads", concurrency=4)
    assert [r.get(timeout=30) for r in results] == [n + 1 for n in range(18)] + [101, 201]
    time.sleep(0.5)
    assert all(len(starts(history, r.id)) == 1 for r in results)


def test_a_groups_and_a_chords_members_go_out_as_one_pipeline(client_app, server, key_prefix, start_worker,
                                                               history, monkeypatch):
    from celery import chord, group

    from celery_leases.protocol.queued import PendingEnqueue, QueuedTasks
    # Given the order in which the publisher writes records and reads their answers
    events: list[str] = []
    real_send, real_result = QueuedTasks.send_on, PendingEnqueue.result

    def send_on(self, conn, task, **kw):
        events.append("push" if kw.get("push") else "record")
        return real_send(self, conn, task, **kw)

    def result(self):
        events.append("read")
        return real_result(self)

    monkeypatch.setattr(QueuedTasks, "send_on", send_on)
    monkeypatch.setattr(PendingEnqueue, "result", result)
    client_app.signature(f"{TASKS}.add", (0, 0)).apply_async(ignore_result=True)  # warm-up
    events.clear()
    monitor = Monitor(server.url)
    # When it publishes a group of 12 leased tasks and a chord of 6
    members = group(client_app.signature(f"{TASKS}.add", (n, 1)) for n in range(12)).apply_async()
    header = [client_app.signature(f"{TASKS}.add", (n, 10)) for n in range(6)]
    body = chord(header, client_app.signature(f"{TASKS}.tsum")).apply_async()
    lines = monitor.stop()
    # Then each member's record and message went out in one call, and every call of a group was
    # written before the first answer was read: one pipeline per group, not a round trip a member
    assert Monitor.from_clients(lines, "LPUSH") == 0, lines[:40]
    assert Monitor.in_scripts(lines, "LPUSH") == 12 + 6
    assert events[:12] == ["push"] * 12 and events[12:24] == ["read"] * 12, " ".join(events)
    assert events[24:30] == ["push"] * 6 and events[30:36] == ["read"] * 6, events
    store = celery_leases.store(client_app)
    assert all(store.get(r.id).state == "queued" for r in members.results)
    # And a worker runs each once
    start_worker("a", pool="threads", concurrency=4)
    assert members.get(timeout=30) == [n + 1 for n in range(12)]
    assert body.get(timeout=30) == sum(n + 10 for n in range(6))
    time.sleep(0.5)
    assert all(len(starts(history, r.id)) == 1 for r in members.results)


def test_a_group_whose_answers_are_lost_loses_no_member_and_runs_each_once(client_app, server, start_worker,
                                                                            history, monkeypatch):
    from celery import group

    from celery_leases.protocol.queued import PendingEnqueue
    # Given a group's pipeline whose connection breaks after every call was written, before
    # the first answer is read (unknown to the publisher whether each script pushed its message)
    real_result = PendingEnqueue.result
    broken: list = []

    def result(self):
        if not broken:
            broken.append(self.conn)
            self.conn.disconnect()
        return real_result(self)

    client_app.signature(f"{TASKS}.add", (0, 0)).apply_async(ignore_result=True)  # warm-up
    monkeypatch.setattr(PendingEnqueue, "result", result)
    # When it publishes a group of 8
    members = group(client_app.signature(f"{TASKS}.add", (n, 1)) for n in range(8)).apply_async()
    monkeypatch.setattr(PendingEnqueue, "result", real_result)
    assert broken
    # Then every member is delivered (kombu pushed a copy of those whose answer was lost, which
    # the acquire refuses as a copy of the same publish) and runs once
    start_worker("a", pool="threads", concurrency=4)
    assert members.get(timeout=30) == [n + 1 for n in range(8)]
    time.sleep(1.0)
    assert all(len(starts(history, r.id)) == 1 for r in members.results)


def test_a_store_apart_keeps_the_two_call_publish(server, own_server, key_prefix, redis_server_url):
    # Given the lease store on a server of its own
    leases = own_server("leases")
    app = create_app({"LEASES_TEST_BROKER": server.url, "LEASES_TEST_LEASES_URL": leases.url,
                      "LEASES_TEST_BACKEND": redis_server_url, "LEASES_TEST_PREFIX": key_prefix})
    try:
        app.signature(f"{TASKS}.add", (0, 0)).apply_async(ignore_result=True)
        monitor = Monitor(server.url)
        result = app.signature(f"{TASKS}.add", (1, 1)).apply_async(ignore_result=True)
        lines = monitor.stop()
        # Then the broker got kombu's own LPUSH, and the record went to the store
        assert Monitor.from_clients(lines, "LPUSH") == 1 and Monitor.from_clients(lines, "EVALSHA") == 0
        assert celery_leases.store(app).get(result.id).state == "queued"
    finally:
        app.close()
