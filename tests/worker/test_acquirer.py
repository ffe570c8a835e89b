"""The acquire at receipt, sent without waiting (celery_leases/worker/acquirer.py), on a real Redis.

The event loop is stood in for by a table of readers and ``select``: what the
worker's hub does with the acquirer's socket is to call ``on_readable`` when
it turns readable, which is what these tests do.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time
import uuid
from typing import Any

import celery
import kombu
import pytest
import redis

import celery_leases

from celery_leases.worker.delivery import lease_delivery
from celery_leases import Code, LeasedTask, LeaseStore, install
from celery_leases.config import get_config
from celery_leases.exceptions import CorruptRecord, LeaseUnavailable
from celery_leases.testing.servers import RedisServer
from celery_leases.protocol.records import Acquisition
from celery_leases.protocol.transport.resp import pack
from celery_leases.testing import wait_for
from celery_leases.worker.acquirer import Acquirer, Job
from celery_leases.worker.heartbeat import START_MARK_DELAY, START_MARK_FALLBACK, Heartbeat, Held
from celery_leases.worker.delivery import MalformedMessage
from celery_leases.worker.service import LeaseWorker


class Hub:
    """The part of kombu's Hub the acquirer uses."""

    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}
        self.timers: list[Timer] = []
        self.on_tick: set = set()

    def add_reader(self, fd: int, callback: Any, *args: Any) -> None:
        self.readers[fd] = (callback, args)

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def call_later(self, delay: float, callback: Any, *args: Any) -> "Timer":
        timer = Timer(delay, callback)
        self.timers.append(timer)
        return timer


class Timer:
    """A timer entry of the stand-in hub: fired by the test, cancellable like kombu's."""

    def __init__(self, delay: float, callback: Any) -> None:
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.callback()


def wait_readable(hub: Hub, timeout: float = 5.0) -> None:
    (fd,) = hub.readers
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, f"no reply within {timeout}s"
    callback, args = hub.readers[fd]
    callback(*args)


def job(results: list, task_id: str, owner: str = "w1") -> Job:
    return Job({"task_id": task_id, "owner": owner, "name": "t", "body": b"body",
                "envelope": {"headers": {"id": task_id}}},
               lambda j, result: results.append((j.call["task_id"], result)))


@pytest.fixture
def store(redis_server_url, key_prefix):
    return LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)


def test_pack_is_the_resp_encoding_redis_py_sends():
    args = ("EVALSHA", "abc", 2, "k1", b"\x00bin\r\n", 0, -5, "é")
    conn = redis.Connection()
    assert pack(*args) == b"".join(conn.pack_command(*args))
    # Again from its cache of packed strings, and past the cache's size (cleared and refilled)
    assert pack(*args) == b"".join(conn.pack_command(*args))
    for i in range(5000):
        ids = (f"id-{i}", f"{{p}}:lease:id-{i}", "owner", i, bytearray(b"x"), "r" * (100 + i))
        assert pack(*ids) == b"".join(conn.pack_command(*ids))
    assert pack(*args) == b"".join(conn.pack_command(*args))
    # The cache holds a bounded number of short strings only (a result may be megabytes)
    from celery_leases.protocol.transport import resp as wire
    assert len(wire._packed) <= wire._PACKED_MAX
    assert max(map(len, wire._packed)) <= wire._PACKED_LEN


def test_replies_come_back_in_order_and_later_acquires_go_out_together(store):
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    ids = [f"t{i}-{uuid.uuid4()}" for i in range(10)]
    acquirer.submit(job(results, ids[0]))
    # The first goes out at once; the next ones wait for its reply, then go out in one write.
    for task_id in ids[1:]:
        acquirer.submit(job(results, task_id))
    assert (acquirer.sent, acquirer.writes) == (1, 1)
    while len(results) < len(ids):
        wait_readable(hub)
    assert (acquirer.sent, acquirer.writes) == (10, 2)
    assert [task_id for task_id, _ in results] == ids
    acquisitions = [result for _, result in results]
    assert all(isinstance(a, Acquisition) and a.code is Code.ACQUIRED for a in acquisitions)
    tokens = [a.token for a in acquisitions]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert [store.get(t).token for t in ids] == tokens
    assert acquirer.pending == 0


def test_while_the_pool_is_busy_acquires_wait_and_go_out_in_one_write(store):
    # Given an acquirer told the pool has enough tasks ready to start
    hub, results, busy = Hub(), [], [True]
    acquirer = Acquirer(store, hub, busy=lambda: busy[0], max_hold=60)
    ids = [f"h{i}-{uuid.uuid4()}" for i in range(4)]
    # When acquires arrive meanwhile
    for task_id in ids[:3]:
        acquirer.submit(job(results, task_id))
    acquirer.tick()
    # Then none is sent yet, and a timer bounds the wait
    assert (acquirer.sent, acquirer.writes, acquirer.pending) == (0, 0, 3)
    assert [t.delay for t in hub.timers] == [60]
    # When the pool needs work again (a task started), the next loop iteration sends them all at once
    busy[0] = False
    acquirer.tick()
    assert (acquirer.sent, acquirer.writes) == (3, 1)
    assert hub.timers[0].cancelled
    while len(results) < 3:
        wait_readable(hub)
    assert [task_id for task_id, _ in results] == ids[:3]
    assert all(result.owned for _, result in results)
    # And with the pool busy again, the timer alone sends a held acquire when the wait is up
    busy[0] = True
    acquirer.max_hold = 0.05
    acquirer.submit(job(results, ids[3]))
    assert acquirer.sent == 3
    time.sleep(0.06)
    hub.timers[-1].fire()
    assert (acquirer.sent, acquirer.writes) == (4, 2)
    wait_readable(hub)
    assert results[-1][0] == ids[3] and results[-1][1].owned
    # And when the pool is not busy, an acquire goes out at once (an idle worker never waits)
    busy[0] = False
    acquirer.submit(job(results, last := f"idle-{uuid.uuid4()}"))
    assert (acquirer.sent, acquirer.writes) == (5, 3)
    wait_readable(hub)
    assert results[-1][0] == last and results[-1][1].owned


def _script_calls(client) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def _heartbeat(store, *task_ids):
    """A heartbeat (its thread not started) holding a fresh lease of w1 on each task id."""
    beat = Heartbeat(store, "w1", 60.0, lambda *a: None)
    for task_id in task_ids:
        beat.add(task_id, Held(store.acquire(task_id, "w1").token, ttl=30))
    return beat


def test_acquires_that_went_out_together_are_one_script_call(store):
    # Given an acquirer whose first acquire is on its way
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    ids = [f"m{i}-{uuid.uuid4()}" for i in range(8)]
    store.acquire_many([dict(task_id="warm-up", owner="w1")])
    before = _script_calls(store.client)
    acquirer.submit(job(results, ids[0]))
    # When seven more arrive before its reply
    for task_id in ids[1:]:
        acquirer.submit(job(results, task_id))
    while len(results) < len(ids):
        wait_readable(hub)
    # Then the server ran two script calls for the eight, each acquire its own lease
    assert _script_calls(store.client) - before == 2
    assert [task_id for task_id, _ in results] == ids
    _own_tokens(store, results)
    assert all(result.owned for _, result in results)


def test_due_start_marks_ride_along_with_the_next_acquire(store):
    # Given a heartbeat whose two leases' tasks started, one long enough ago, one just now
    old, young = f"old-{uuid.uuid4()}", f"young-{uuid.uuid4()}"
    beat = _heartbeat(store, old, young)
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub, marks=beat)
    beat.started(old, beat.held[old].token)
    time.sleep(START_MARK_DELAY + 0.01)
    beat.started(young, beat.held[young].token)
    before = _script_calls(store.client)
    # When an acquire goes out
    acquirer.submit(job(results, nxt := f"n-{uuid.uuid4()}"))
    wait_readable(hub)
    # Then the due mark went with it: one script call, the old lease marked started,
    # the young one still queued for later (its task may end first and need none)
    assert results[0][0] == nxt and results[0][1].owned
    assert _script_calls(store.client) - before == 1
    assert store.get(old).started and not store.get(young).started
    assert set(beat._starts) == {young} and beat.starts_carried == 1 and beat.start_calls == 0
    # And the thread, left to send what no acquire carried, waits the fallback delay
    assert beat.mark_wait == START_MARK_FALLBACK > START_MARK_DELAY


def test_marks_whose_call_failed_go_back_to_the_heartbeat(tmp_path, key_prefix):
    server = RedisServer(dir=tmp_path).start()
    store = LeaseStore(redis.Redis.from_url(server.url, socket_timeout=2), prefix=key_prefix)
    try:
        task_id = f"s-{uuid.uuid4()}"
        beat = _heartbeat(store, task_id)
        hub, results = Hub(), []
        acquirer = Acquirer(store, hub, marks=beat)
        acquirer.submit(job(results, "first"))
        wait_readable(hub)
        beat.started(task_id, beat.held[task_id].token)
        time.sleep(START_MARK_DELAY + 0.01)
        server.stop()
        # When the call that carries the mark fails
        acquirer.submit(job(results, "second"))
        acquirer.flush(timeout=5)
        assert isinstance(results[-1][1], LeaseUnavailable)
        # Then the mark is queued again, due at once, for the heartbeat to send
        assert beat._starts == {task_id: (beat.held[task_id].token, 0.0)} and beat._starts_due
        server.start()
        store.acquire(task_id, "w1", reassert=beat.held[task_id].token)
        assert beat.send_starts() == 1 and store.get(task_id).started
    finally:
        server.stop()


def test_a_call_the_busy_server_refuses_fails_each_acquire_as_unavailable_and_gives_the_marks_back(
        tmp_path, key_prefix):
    import threading

    # Given a server busy running another script past its time limit (BUSY to everyone else)
    server = RedisServer(dir=tmp_path).start()
    try:
        store = LeaseStore(redis.Redis.from_url(server.url), prefix=key_prefix)
        store.client.config_set("lua-time-limit", 50)
        held = f"s-{uuid.uuid4()}"
        beat = _heartbeat(store, held)
        hub, results = Hub(), []
        acquirer = Acquirer(store, hub, marks=beat)
        beat.started(held, beat.held[held].token)
        time.sleep(START_MARK_DELAY + 0.01)
        spin = threading.Thread(target=redis.Redis.from_url(server.url).eval, args=(
            "local s = tonumber(redis.call('TIME')[1]) "
            "while tonumber(redis.call('TIME')[1]) - s < 2 do end return 1", 0))
        spin.start()
        time.sleep(0.3)
        # When the acquirer's call (two acquires and the due mark) meets it
        acquirer.submit(job(results, "a"))
        acquirer.submit(job(results, "b"))
        while len(results) < 2:
            wait_readable(hub)
        spin.join()
        # Then each acquire fails as "store unavailable" (tried again when due, never parked),
        # naming the server's answer, and the mark is queued again for the heartbeat
        assert [task_id for task_id, _ in results] == ["a", "b"]
        assert all(isinstance(r, LeaseUnavailable) and "BUSY" in str(r) for _, r in results), results
        assert set(beat._starts) == {held} and beat._starts_due
        # And once the server is free, the next call acquires
        acquirer.submit(job(results, "c"))
        wait_readable(hub)
        assert results[-1][0] == "c" and results[-1][1].owned
    finally:
        server.stop()


def test_the_thread_sends_a_mark_no_acquire_carried_after_the_fallback_delay(store):
    task_id = f"f-{uuid.uuid4()}"
    beat = _heartbeat(store, task_id)
    Acquirer(store, Hub(), marks=beat)  # acquires carry the marks; none goes out here
    beat.start()
    try:
        started = time.monotonic()
        beat.started(task_id, beat.held[task_id].token)
        wait_for(lambda: beat.start_calls == 1, 5, what="the start mark")
        assert time.monotonic() - started >= START_MARK_FALLBACK
        assert store.get(task_id).started and beat.starts_carried == 0
    finally:
        beat.stop()


def test_marks_do_not_delay_the_renewal_tick(store):
    # Given marks queued again and again, each taken by an acquire before the thread sends it
    task_ids = [f"r{i}-{uuid.uuid4()}" for i in range(40)]
    beat = _heartbeat(store, *task_ids)
    beat.default_interval = 0.2
    for held in beat.held.values():
        held.interval = 0.2
    Acquirer(store, Hub(), marks=beat)
    beat.start()
    try:
        deadline, n = time.monotonic() + 1.2, 0
        while time.monotonic() < deadline:
            held = beat.held[task_ids[n % len(task_ids)]]
            held.started = False
            beat.started(task_ids[n % len(task_ids)], held.token)
            n += 1
            time.sleep(0.02)
            beat.take_due_starts()
        # Then the thread still renewed about every 0.2 s
        assert beat.ticks >= 3, beat.ticks
    finally:
        beat.stop()


def test_an_error_reply_fails_only_its_own_job(store):
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    bad = f"bad-{uuid.uuid4()}"
    store.client.set(store.keys.record(bad), "not a hash")
    ids = [f"a-{uuid.uuid4()}", bad, f"b-{uuid.uuid4()}"]
    for task_id in ids:
        acquirer.submit(job(results, task_id))
    while len(results) < 3:
        wait_readable(hub)
    by_id = dict(results)
    assert isinstance(by_id[bad], CorruptRecord) and bad in str(by_id[bad])
    assert by_id[ids[0]].owned and by_id[ids[2]].owned


def test_a_server_that_lost_its_scripts_still_answers(store):
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    store.client.script_flush()
    acquirer.submit(job(results, task_id := f"n-{uuid.uuid4()}"))
    wait_readable(hub)
    assert results[0][0] == task_id and results[0][1].owned


def test_a_lost_connection_fails_every_waiting_job_and_the_next_one_reconnects(tmp_path, key_prefix):
    server = RedisServer(dir=tmp_path).start()
    store = LeaseStore(redis.Redis.from_url(server.url, socket_timeout=2), prefix=key_prefix)
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    try:
        acquirer.submit(job(results, "first"))
        wait_readable(hub)
        assert results.pop()[1].owned
        server.stop()
        # The connection is dead; the acquirer learns it sending or reading, whichever comes first.
        for task_id in ("x", "y", "z"):
            acquirer.submit(job(results, task_id))
        acquirer.flush(timeout=5)
        assert [task_id for task_id, _ in results] == ["x", "y", "z"]
        assert all(isinstance(result, LeaseUnavailable) for _, result in results)
        assert acquirer.pending == 0 and not hub.readers
        results.clear()
        # No server: the job fails at once, named, instead of waiting for a reply that never comes.
        acquirer.submit(job(results, "w"))
        assert results[0][0] == "w" and isinstance(results[0][1], LeaseUnavailable)
    finally:
        server.stop()


def _own_tokens(store: LeaseStore, results: list) -> None:
    """Every job handed an Acquisition got its own task's token (never a neighbour's)."""
    for task_id, result in results:
        if isinstance(result, Acquisition):
            assert result.owned and store.get(task_id).token == result.token, (task_id, result)


@pytest.mark.parametrize("bad_id", [None, 1.5, "bad-\ud800", b"\xff", ["a"]],
                         ids=["null", "float", "lone-surrogate", "bytes-not-utf8", "list"])
def test_an_acquire_that_cannot_be_packed_fails_alone_and_later_replies_stay_matched(store, bad_id):
    # Given ordinary acquires around one whose task id the wire cannot carry (issue #14.1)
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    before = [f"b{i}-{uuid.uuid4()}" for i in range(3)]
    after = [f"a{i}-{uuid.uuid4()}" for i in range(4)]
    for task_id in before:
        acquirer.submit(job(results, task_id))
    # When the bad one is submitted (while the first reply is still to come), then more
    acquirer.submit(job(results, bad_id))
    for task_id in after:
        acquirer.submit(job(results, task_id))
    while len(results) < len(before) + len(after) + 1:
        wait_readable(hub)
    # Then the bad job alone fails, at once, as a malformed message naming the id
    bad = [result for task_id, result in results if task_id is bad_id]
    assert len(bad) == 1 and isinstance(bad[0], MalformedMessage) and repr(bad_id) in str(bad[0])
    # ... and every other acquire gets its own record's token, in order, all acquired
    good = [(task_id, result) for task_id, result in results if task_id is not bad_id]
    assert [task_id for task_id, _ in good] == before + after
    _own_tokens(store, good)
    assert acquirer.pending == 0 and acquirer.sent == len(before) + len(after)


def test_an_unpackable_envelope_fails_only_its_own_acquire(store):
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    bad = Job({"task_id": "e-" + str(uuid.uuid4()), "owner": "w1", "body": b"x",
               "envelope": {"headers": {"not json": {1, 2}}}},
              lambda j, result: results.append((j.call["task_id"], result)))
    ids = [f"e{i}-{uuid.uuid4()}" for i in range(3)]
    acquirer.submit(job(results, ids[0]))
    acquirer.submit(bad)
    acquirer.submit(job(results, ids[1]))
    acquirer.submit(job(results, ids[2]))
    while len(results) < 4:
        wait_readable(hub)
    by_id = dict(results)
    assert isinstance(by_id[bad.call["task_id"]], MalformedMessage)
    assert by_id[bad.call["task_id"]].field == "envelope"
    _own_tokens(store, [(t, by_id[t]) for t in ids])
    assert all(by_id[t].owned for t in ids)


def test_a_reply_out_of_step_resets_the_connection_and_hands_out_no_token(store):
    # Given an acquirer whose connection carries a reply no job asked for (a desync)
    hub, results = Hub(), []
    acquirer = Acquirer(store, hub)
    acquirer.submit(job(results, first := f"f-{uuid.uuid4()}"))
    wait_readable(hub)
    assert results.pop()[1].owned and store.get(first)
    acquirer._sock.sendall(pack("PING"))
    # When acquires go out behind it
    ids = [f"o{i}-{uuid.uuid4()}" for i in range(3)]
    for task_id in ids:
        acquirer.submit(job(results, task_id))
    acquirer.flush(timeout=5)
    # Then no job is handed a reply that is not its own: all are "store unreachable"
    # (tried again when due), the connection is reset, nothing is pending
    assert [task_id for task_id, _ in results] == ids
    assert all(isinstance(result, LeaseUnavailable) for _, result in results), results
    assert acquirer.pending == 0 and acquirer._sock is None and not hub.readers
    # ... and the next acquire gets a fresh connection and its own token
    results.clear()
    acquirer.submit(job(results, again := f"g-{uuid.uuid4()}"))
    wait_readable(hub)
    _own_tokens(store, results)
    assert results[0][0] == again and results[0][1].owned


# -- the worker side: deferred hand-over to the pool, dropped requests --------------------------

@pytest.fixture
def lease_worker(redis_server_url, key_prefix):
    app = celery.Celery("acq", broker="memory://", set_as_current=False)
    app.conf.update(leases_redis_url=redis_server_url, leases_key_prefix=key_prefix,
                    leases_worker_recovery=False)
    install(app)

    @app.task(base=LeasedTask, name="acq.noop", shared=False)
    def noop():
        return None

    app.send_task("acq.noop", queue="acq")
    with app.connection_for_read() as conn:
        message = kombu.Queue("acq")(conn.default_channel).get(no_ack=True)
    hub = Hub()
    worker = LeaseWorker(app, get_config(app), hub=hub)
    yield worker, hub, noop, message
    app.close()


class Request:
    """What LeaseWorker reads of a Celery request, and a pool hand-over that records its token."""

    def __init__(self, task: Any, message: Any) -> None:
        self.id, self.task, self.name = str(uuid.uuid4()), task, task.name
        # A message of its own id (the worker checks the headers carry the request's id).
        self.message = kombu.Message(body=message.body, headers={**message.headers, "id": self.id},
                                     properties=message.properties, delivery_info=message.delivery_info,
                                     content_type=message.content_type,
                                     content_encoding=message.content_encoding)
        self.request_dict: dict = {"retries": 0}
        self.executed_with: list = []
        self.acknowledged = False

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> None:
        self.executed_with.append(self.request_dict.get("lease_token"))

    def acknowledge(self) -> None:
        self.acknowledged = True


def test_a_request_is_handed_to_its_pool_only_once_its_lease_is_held(lease_worker):
    worker, hub, task, message = lease_worker
    request = Request(task, message)
    worker.receipt.on_received(request)
    assert lease_delivery(request).inflight
    # Celery hands the request over while the reply is still on its way: deferred.
    lease_delivery(request).deferred = ("pool", {})
    assert request.executed_with == []
    wait_readable(hub)
    token = worker.store.get(request.id).token
    assert request.executed_with == [token]
    assert request.request_dict["lease_token"] == token
    assert worker.heartbeat.held[request.id].token == token


def test_acquires_under_way_when_the_consumer_drops_its_requests_are_released(lease_worker):
    worker, hub, task, message = lease_worker
    requests = [Request(task, message) for _ in range(3)]
    for request in requests:
        worker.receipt.on_received(request)
        lease_delivery(request).deferred = ("pool", {})
    # A broker reconnect: Celery drops the requests it had not started.
    worker.release_dropped()
    assert all(request.executed_with == [] for request in requests)
    assert worker.heartbeat.held == {}
    due = set(worker.store.expired())
    for request in requests:
        record = worker.store.get(request.id)
        assert record.state == "active" and request.id in due, record


def test_parse_decodes_what_a_script_reply_holds_and_waits_for_the_rest():
    from redis.exceptions import BusyLoadingError, NoScriptError, ResponseError

    from celery_leases.protocol.transport.resp import Incomplete, parse

    wire = (b"*5\r\n:1\r\n:42\r\n:0\r\n:-3\r\n$6\r\nactive\r\n"
            b"-NOSCRIPT No matching script.\r\n-LOADING loading\r\n-CORRUPT k field x\r\n"
            b"*2\r\n$-1\r\n_\r\n+OK\r\n*0\r\n")
    replies, pos = [], 0
    while pos < len(wire):
        reply, pos = parse(wire, pos)
        replies.append(reply)
    assert replies[0] == [1, 42, 0, -3, b"active"]
    assert isinstance(replies[1], NoScriptError) and isinstance(replies[2], BusyLoadingError)
    assert type(replies[3]) is ResponseError and "CORRUPT k field x" in str(replies[3])
    assert replies[4:] == [[None, None], b"OK", []]
    # A reply cut anywhere is not decoded until the rest is there.
    first = wire[:wire.index(b"-NOSCRIPT")]
    for cut in range(len(first)):
        with pytest.raises(Incomplete):
            parse(first[:cut])
    with pytest.raises(ResponseError, match="unexpected reply type"):
        parse(b"!oops\r\n")


# -- a real worker -------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_stalled_lease_store_stalls_only_the_leased_tasks(pool, celery_env, start_worker, history,
                                                            tmp_path):
    import os
    import signal
    import time

    from tests.support.apps.leased_app import create_app

    # Given a lease store on its own Redis (broker, results and the history elsewhere)
    lease_redis = RedisServer(dir=tmp_path).start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url,
               "LEASES_TEST_HISTORY_URL": celery_env["LEASES_TEST_BROKER"]}
        app = create_app(env)
        start_worker("a", pool=pool, **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        # When the lease store stops answering (SIGSTOP) and a leased, then a plain task arrive
        os.kill(lease_redis.process.pid, signal.SIGSTOP)
        try:
            leased = app.signature("tests.support.apps.leased_app.sleep_then_echo", ("L",)).delay()
            plain = app.signature("tests.support.apps.leased_app.plain_sleep", ("P",)).delay()
            # Then the plain task runs at once: the worker's event loop does not wait for the
            # leased task's acquire (a blocking acquire held it for the socket timeout, 2 s+)
            assert plain.get(timeout=1.5) == "P"
            # ... and the leased task's body has not run without its lease
            time.sleep(0.5)
            assert leased.id not in {task_id for event, task_id, *_ in history() if event == "start"}
        finally:
            os.kill(lease_redis.process.pid, signal.SIGCONT)
        # Once the store answers, the leased task runs under its lease, once
        assert leased.get(timeout=15) == "L"
        record = celery_leases.store(app).get(leased.id)
        assert record.state == "succeeded" and record.recoveries == 0
        assert [e for e, task_id, *_ in history() if task_id == leased.id].count("start") == 1
        app.close()
    finally:
        lease_redis.stop()


def test_a_prefork_worker_draining_a_backlog_shares_its_acquire_calls(celery_env, start_worker, history,
                                                                     tmp_path):
    from tests.support.apps.leased_app import create_app

    # Given a backlog of leased tasks queued before the worker starts, and a lease store
    # on a server of its own (so its calls can be counted)
    lease_redis = RedisServer(dir=tmp_path).start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url, "LEASES_TEST_PREFETCH": "4",
               "LEASES_TEST_HISTORY_URL": celery_env["LEASES_TEST_BROKER"]}
        app = create_app(env)
        n = 150
        results = [app.signature("tests.support.apps.leased_app.add", (i, 1)).delay() for i in range(n)]
        client = redis.Redis.from_url(lease_redis.url)
        before = _script_calls(client)
        # When a prefork worker drains it
        start_worker("a", pool="prefork", **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        assert [r.get(timeout=60) for r in results] == [i + 1 for i in range(n)]
        calls = _script_calls(client) - before
        # Then every task ran once, under a lease of its own
        starts = [(task_id, fields["token"]) for event, task_id, _, fields in history() if event == "start"]
        assert sorted(task_id for task_id, _ in starts) == sorted(r.id for r in results)
        assert len({token for _, token in starts}) == n and "None" not in {token for _, token in starts}
        # ... and its acquires shared calls: one finish per task, far fewer acquire calls than
        # tasks (a few more calls for the heartbeat's ticks and start marks)
        assert calls <= 1.75 * n + 10, calls
        client.close()
    finally:
        lease_redis.stop()


# -- prefork: the finishes nobody waits for ride in the acquirer's writes ---------------------


def carrying(store: LeaseStore, hub: Hub, gather: float = 0.002):
    """An acquirer whose writes carry a loop-driven BackgroundFinishes (as prefork's main
    process wires them: worker/background.py for_pool)."""
    from celery_leases.worker.background import BackgroundFinishes
    acquirer = Acquirer(store, hub)
    finishes = BackgroundFinishes(store, hub=hub, gather=gather)
    finishes.carrier = acquirer
    acquirer.finishes = finishes
    finishes.start()
    return acquirer, finishes


def held_leases(store: LeaseStore, n: int) -> dict[str, int]:
    return {t: store.acquire(t, "w1", name="t").token for t in (f"f{i}-{uuid.uuid4()}" for i in range(n))}


def queue(finishes, leases: dict[str, int], reports: dict) -> None:
    for task_id, token in leases.items():
        assert finishes.add(task_id, "w1", token, "succeeded", 30,
                            lambda exc, task_id=task_id: reports.__setitem__(task_id, exc))


def test_queued_finishes_ride_in_the_next_acquire_write(store):
    hub, results, reports = Hub(), [], {}
    acquirer, finishes = carrying(store, hub)
    store.finish_many([celery_leases.protocol.transitions.FinishRequest("warm", "w1", 0, "succeeded")] * 2)
    leases = held_leases(store, 3)
    queue(finishes, leases, reports)
    task_id = f"next-{uuid.uuid4()}"
    acquirer.submit(job(results, task_id))
    # One write: the three finishes' call first, then the acquire; their replies in that order
    assert acquirer.writes == 1 and finishes.queued == 0
    while not results:
        wait_readable(hub)
    assert finishes.accepted == 3 and finishes.carried == 3 and reports == {}
    assert {store.get(t).state for t in leases} == {"succeeded"}
    assert results[0][0] == task_id and results[0][1].code is Code.ACQUIRED


def test_finishes_with_no_acquire_to_ride_with_go_alone_after_the_gathering_delay(store):
    hub, reports = Hub(), {}
    acquirer, finishes = carrying(store, hub, gather=0.01)
    leases = held_leases(store, 2)
    queue(finishes, leases, reports)
    acquirer.tick()  # (every loop iteration) too soon: they wait for company
    assert acquirer.writes == 0 and len(hub.timers) == 1
    time.sleep(0.02)
    hub.timers[0].fire()
    assert acquirer.writes == 1
    wait_readable(hub)
    assert finishes.accepted == 2 and finishes.carried == 0
    assert {store.get(t).state for t in leases} == {"succeeded"}


def test_a_refused_finish_in_the_write_is_reported_and_the_acquire_stands(store):
    hub, results, reports = Hub(), [], {}
    acquirer, finishes = carrying(store, hub)
    leases = held_leases(store, 2)
    stale = next(iter(leases))
    queue(finishes, {**leases, stale: leases[stale] + 100}, reports)
    acquirer.submit(job(results, f"next-{uuid.uuid4()}"))
    while not results:
        wait_readable(hub)
    assert finishes.accepted == 1 and list(reports) == [stale]
    assert isinstance(results[0][1], Acquisition) and results[0][1].owned
    assert store.get(stale).state == "active"


def test_finishes_of_a_write_the_connection_lost_are_sent_again(own_server, key_prefix):
    server = own_server("leases")
    store = LeaseStore(server.client(socket_timeout=1), prefix=key_prefix, ttl=30)
    hub, results, reports = Hub(), [], {}
    acquirer, finishes = carrying(store, hub, gather=0.01)
    leases = held_leases(store, 2)
    queue(finishes, leases, reports)
    # The connection breaks before the replies come (the server frozen meanwhile): the
    # acquire fails over (tried again by receipt), the finishes go back to the queue with
    # their backoff
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        acquirer.submit(job(results, f"next-{uuid.uuid4()}"))
        acquirer._sock.shutdown(socket.SHUT_RDWR)
        wait_readable(hub)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert isinstance(results[0][1], LeaseUnavailable)
    assert finishes.queued == 2 and finishes.accepted == 0 and reports == {}
    # Then the loop sends them again once due (the finish is idempotent for its own copy)
    def resent() -> bool:
        for timer in list(hub.timers):
            timer.fire()
        return acquirer.writes >= 2

    wait_for(resent, 10, "the finishes sent again")
    while finishes.accepted < 2:
        wait_readable(hub)
    assert {store.get(t).state for t in leases} == {"succeeded"} and reports == {}


def test_stop_sends_the_finishes_still_queued(store):
    hub, reports = Hub(), {}
    acquirer, finishes = carrying(store, hub, gather=5.0)
    leases = held_leases(store, 3)
    queue(finishes, leases, reports)
    acquirer.stop()
    finishes.stop()
    assert finishes.accepted == 3 and {store.get(t).state for t in leases} == {"succeeded"}


def test_a_finishes_reply_that_cannot_be_read_leaves_no_finish_unsettled(store, monkeypatch):
    """(A bug reading the reply: each finish is asked again alone, and answers OK to its own
    copy; none is dropped unreported.)"""
    hub, results, reports = Hub(), [], {}
    acquirer, finishes = carrying(store, hub)
    leases = held_leases(store, 2)
    queue(finishes, leases, reports)
    from celery_leases.worker import acquirer as module
    monkeypatch.setattr(module.renewals, "finishes_reply",
                        lambda *args: (_ for _ in ()).throw(ValueError("unexpected shape")))
    acquirer.submit(job(results, f"next-{uuid.uuid4()}"))
    while not results:
        wait_readable(hub)
    assert results[0][1].owned
    assert finishes.accepted == 2 and finishes.queued == 0 and reports == {}
    assert {store.get(t).state for t in leases} == {"succeeded"}
