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
