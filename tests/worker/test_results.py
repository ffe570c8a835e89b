"""A leased success and its result record written by one script (celery_leases/results.py)."""
from __future__ import annotations

import threading
import uuid
import time

import pytest
import redis

import celery_leases
from celery_leases import LeaseLost, LeaseStore

TASKS = "tests.support.apps.leased_app"


# -- the store: finish(..., write=...) ---------------------------------------------


def test_an_accepted_outcome_writes_and_publishes_the_record_with_it(redis_server_url, key_prefix):
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    listener = store.client.pubsub()
    channel = f"{key_prefix}:result:a"
    listener.subscribe(channel)
    listener.get_message(timeout=1)  # the subscribe confirmation
    lease = store.acquire("a", "w")

    store.finish("a", "w", lease.token, "succeeded", write=(channel, b"the-result", 60))

    assert store.client.get(channel) == b"the-result"
    assert 55 <= store.client.ttl(channel) <= 60
    message = listener.get_message(timeout=2)
    assert message is not None and message["data"] == b"the-result"
    assert store.get("a").state == "succeeded"
    listener.close()


def test_a_refused_outcome_writes_no_record(redis_server_url, key_prefix):
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=0.05)
    old = store.acquire("a", "w1")
    time.sleep(0.1)
    store.recover(publish=lambda claim: None)
    new = store.acquire("a", "w2", generation=1)
    key = f"{key_prefix}:result:a"

    with pytest.raises(LeaseLost):
        store.finish("a", "w1", old.token, "succeeded", write=(key, b"stale", 0))

    assert store.client.exists(key) == 0
    store.finish("a", "w2", new.token, "succeeded", write=(key, b"fresh", 0))
    assert store.client.get(key) == b"fresh"
    assert store.client.ttl(key) == -1  # 0: no expiry


def test_a_retry_hand_over_cannot_carry_a_record(redis_server_url, key_prefix):
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    lease = store.acquire("a", "w")
    with pytest.raises(ValueError, match="task a"):
        store.finish("a", "w", lease.token, "retry", next_attempt=1, write=("k", b"v", 0))
    assert store.get("a").state == "active"


# -- the worker ---------------------------------------------------------------------


class Monitor:
    """Every command the server runs, as (client type, command line), from MONITOR.

    The monitor connection has no read timeout: redis-py drops a connection whose
    read timed out, and a new one would no longer be monitoring. It is woken to
    stop by a marker command sent from another connection.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.lines: list[tuple[str, str]] = []
        self._marker = f"monitor-stop-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self._ready.set()
            while True:
                entry = monitor.next_command()
                if self._marker in entry["command"]:
                    return
                self.lines.append((entry.get("client_type", ""), entry["command"]))

    def __enter__(self) -> "Monitor":
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        waker = redis.Redis.from_url(self.url)
        try:
            waker.echo(self._marker)
        finally:
            waker.close()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the monitor did not see its stop marker"
        self.client.close()

    def touching(self, key: str) -> list[tuple[str, str]]:
        return [(kind, line) for kind, line in self.lines if key in line]


def test_a_leased_success_is_stored_by_the_finish_script(client_app, start_worker, redis_server_url):
    # Given a worker whose result backend is the lease store's own Redis
    start_worker("a")
    key = client_app.backend.get_key_for_task("x").decode()[:-1]
    # When a leased task succeeds
    with Monitor(redis_server_url) as monitor:
        result = client_app.signature(f"{TASKS}.add", (2, 3)).delay()
        assert result.get(timeout=20) == 5
    # Then its record was written only inside the finish script (a Lua client), in one SET
    writes = [(kind, line) for kind, line in monitor.touching(key + result.id)
              if line.upper().startswith(("SET", "SETEX", "PUBLISH"))]
    assert writes and all(kind == "lua" for kind, _ in writes), writes
    assert sum(1 for _, line in writes if line.upper().startswith("SET")) == 1
    # And it is the record Celery itself would write, with Celery's result expiry
    meta = client_app.backend.get_task_meta(result.id)
    assert meta["status"] == "SUCCESS" and meta["result"] == 5 and meta["task_id"] == result.id
    assert meta["date_done"] is not None and meta["children"] == []
    assert 3590 <= redis.Redis.from_url(redis_server_url).ttl(key + result.id) <= 3600
    assert celery_leases.store(client_app).get(result.id).state == "succeeded"


def test_callbacks_and_ignored_results_keep_celerys_own_write(client_app, start_worker, redis_server_url):
    # Given a worker, a task with a link callback and a task that ignores its result
    start_worker("a")
    key = client_app.backend.get_key_for_task("x").decode()[:-1]
    callback = client_app.signature(f"{TASKS}.note_callback")
    with Monitor(redis_server_url) as monitor:
        linked = client_app.signature(f"{TASKS}.add", (1, 1)).apply_async(link=callback)
        assert linked.get(timeout=20) == 2
        ignored = client_app.signature(f"{TASKS}.add_ignored", (1, 2)).delay()
        store = celery_leases.store(client_app)
        wait = time.monotonic() + 20
        while time.monotonic() < wait and (store.get(ignored.id) is None
                                           or store.get(ignored.id).state != "succeeded"):
            time.sleep(0.05)
    # Then the linked task's record is Celery's (a top-level SET) and lists the callback as a child
    sets = [kind for kind, line in monitor.touching(key + linked.id) if line.upper().startswith("SET")]
    assert sets and "lua" not in sets, sets
    children = client_app.backend.get_task_meta(linked.id)["children"]
    assert len(children) == 1
    # And the ignored one has no record at all, though its lease finished
    assert store.get(ignored.id).state == "succeeded"
    assert redis.Redis.from_url(redis_server_url).exists(key + ignored.id) == 0
