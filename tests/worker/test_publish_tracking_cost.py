"""Publish tracking's cheap path: one connection held per process for the records, on real servers.

The broker and the lease store are redis-servers of their own (no persistence),
so a test can stop and restart the store under a publisher and count the
commands each one received.
"""
from __future__ import annotations

import base64
import json
import logging
import multiprocessing
import threading
import time
import uuid

import pytest
from kombu.exceptions import OperationalError

import celery_leases
from celery_leases.testing import run_recovery
from celery_leases.publishing.tracking import PublishOutage, queued_tasks

TASKS = "tests.support.apps.leased_app"
#: What enqueue.lua calls inside the script (commandstats counts those too), and the test's own reads.
NOT_SENT = {"cmdstat_hmget", "cmdstat_type", "cmdstat_time", "cmdstat_hset", "cmdstat_zadd",
            "cmdstat_hincrby", "cmdstat_config|resetstat", "cmdstat_info"}


def sent_commands(server) -> dict:
    """Commands clients sent the server since CONFIG RESETSTAT, by name."""
    return {k: v["calls"] for k, v in server.info("commandstats").items() if k not in NOT_SENT}


@pytest.fixture
def broker(own_server):
    return own_server("broker")


@pytest.fixture
def lease_server(own_server):
    return own_server("leases")


@pytest.fixture
def make_app(broker, lease_server, key_prefix, redis_server_url):
    from tests.support.apps.leased_app import create_app
    apps = []

    def make(**conf):
        app = create_app({"LEASES_TEST_BROKER": broker.url, "LEASES_TEST_BACKEND": redis_server_url,
                          "LEASES_TEST_LEASES_URL": lease_server.url, "LEASES_TEST_PREFIX": key_prefix,
                          "LEASES_TEST_HISTORY_URL": redis_server_url, "LEASES_TEST_DELIVERY_TIMEOUT": "600"})
        app.conf.update(task_ignore_result=True, **conf)
        apps.append(app)
        return app
    yield make
    for app in apps:
        app.close()


def publish(app, *args, **options):
    return app.signature(f"{TASKS}.add", args or (1, 2)).apply_async(**options).id


def broker_messages(broker, queue) -> dict:
    """The messages in the broker's queue as kombu's Redis transport stores them, by task id."""
    out = {}
    client = broker.client()
    for key in client.scan_iter(match=f"{queue}*"):  # one list per priority step
        if client.type(key) == b"list":
            for raw in client.lrange(key, 0, -1):
                payload = json.loads(raw)
                out[payload["headers"]["id"]] = payload
    return out


@pytest.mark.parametrize("conf", [{}, {"task_compression": "zlib"}, {"task_serializer": "pickle"}],
                         ids=["json", "zlib", "pickle"])
def test_the_recorded_message_is_the_one_celery_published(make_app, broker, key_prefix, conf):
    # Given an app with a serializer / compression of its own (defaults read once, as Celery does)
    app = make_app(**conf)
    store = celery_leases.store(app)
    # When tasks are published: the first one synchronously, the next ones on the held line
    ids = [publish(app, 1, 1), publish(app, 2, 3, countdown=30, expires=90, priority=3),
           publish(app, 4, 5, headers={"custom": "x"})]
    # Then each record holds what the broker holds: the body bytes, headers, properties, routing
    published = broker_messages(broker, key_prefix)
    for task_id in ids:
        message = published[task_id]
        raw = store.client.hgetall(store.keys.message(task_id))
        envelope = json.loads(raw[b"envelope"])
        assert raw[b"body"] == base64.b64decode(message["body"])
        assert envelope["headers"] == message["headers"]
        assert (envelope["content_type"], envelope["content_encoding"]) == (
            message["content-type"], message["content-encoding"])
        props = message["properties"]
        assert envelope["routing_key"] == props["delivery_info"]["routing_key"] == key_prefix
        assert envelope["exchange"] == props["delivery_info"]["exchange"]
        for name in ("correlation_id", "reply_to", "delivery_mode"):
            assert envelope["properties"].get(name) == props.get(name), name
        assert (envelope["priority"] or 0) == (props.get("priority") or 0)
    assert json.loads(store.client.hget(store.keys.message(ids[1]), "envelope"))["priority"] == 3


def counting_after_warm_up(app, lease_server):
    """Open the publisher's line (the first record is synchronous), then zero the store's
    command counts: returns a client of the store's server to read them (sent_commands)."""
    publish(app)
    publish(app)
    server = lease_server.client()
    server.config_resetstat()
    return server


class Counted:
    """An argument that counts how often it is pickled."""

    pickled = 0

    def __reduce__(self):
        Counted.pickled += 1
        return (Counted, ())


@pytest.mark.parametrize("tracking", [True, False], ids=["tracked", "untracked"])
def test_a_published_body_is_serialized_once_record_and_message_alike(make_app, broker, key_prefix, tracking):
    # Given a publisher whose tasks go out pickled, with publish tracking on or off
    app = make_app(task_serializer="pickle", accept_content=["pickle", "json"])
    if not tracking:
        app.conf.leases_delivery_timeout = 0
    publish(app)  # the first record is written synchronously; the next ones on the held line
    # When it publishes tasks whose argument counts its serializations
    Counted.pickled = 0
    ids = [publish(app, Counted(), 1) for _ in range(5)]
    # Then each body was serialized once, and the recorded body is the published one
    assert Counted.pickled == 5
    if tracking:
        queued = celery_leases.store(app).client
        messages = broker_messages_raw(broker, key_prefix)
        for task_id in ids:
            assert queued.hget(celery_leases.store(app).keys.message(task_id), "body") == messages[task_id]


def broker_messages_raw(broker, queue) -> dict:
    """The message bodies in the broker's queue, as the bytes kombu published, by task id."""
    return {task_id: base64.b64decode(payload["body"])
            for task_id, payload in broker_messages(broker, queue).items()}


def test_one_store_command_per_published_task(make_app, lease_server):
    # Given a publisher whose line is open (after the first, synchronous record)
    app = make_app()
    server = counting_after_warm_up(app, lease_server)
    # When it publishes 50 tasks one by one
    ids = [publish(app, i, i) for i in range(50)]
    # Then the store got one EVALSHA per task and nothing else: no pool checks, no second call
    assert sent_commands(server) == {"cmdstat_evalsha": 50}
    store = celery_leases.store(app)
    assert {store.get(t).state for t in ids} == {"queued"}


def test_a_store_stopped_under_the_publisher_publishes_untracked_then_records_again(
        make_app, broker, lease_server, key_prefix, caplog):
    # Given a publisher holding its line to the store
    app = make_app()
    first = [publish(app) for _ in range(3)]
    # When the store's server is stopped: the publish still goes out, untracked, and says so
    lease_server.stop()
    with caplog.at_level(logging.WARNING, logger="celery_leases.tracking"):
        lost = publish(app)
    assert lost in broker_messages(broker, key_prefix)
    assert "publish tracking" in caplog.text
    # And when it is back (empty, its scripts gone): the next publish, written first on the
    # line's dead socket, is recorded all the same (sent again on a new connection), and the
    # record the store could not take is written with it
    lease_server.start()
    with caplog.at_level(logging.WARNING, logger="celery_leases.tracking"):
        after = [publish(app) for _ in range(3)]
    store = celery_leases.store(app)
    assert {store.get(t).state for t in after} == {"queued"}
    assert store.get(lost).state == "queued"
    assert "1 task(s) published while the lease store was unreachable are recorded now" in caplog.text
    assert all(store.get(t) is None for t in first)  # the store restarted empty
    assert set(after + [lost]) <= set(broker_messages(broker, key_prefix))


def test_a_store_that_stops_answering_slows_one_publish_not_each(make_app, broker, lease_server, key_prefix,
                                                                 caplog):
    import os
    import signal

    # Given a publisher whose store stops answering (SIGSTOP: each call waits the socket timeout)
    app = make_app()
    first = publish(app)
    os.kill(lease_server.process.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_leases.tracking"):
            began = time.monotonic()
            slow = publish(app)  # finds the store silent: waits its socket timeout (2 s here)
            waited = time.monotonic() - began
            # When it publishes more right after
            began = time.monotonic()
            held = [publish(app) for _ in range(5)]
            quick = time.monotonic() - began
    finally:
        os.kill(lease_server.process.pid, signal.SIGCONT)
    # Then only the first publish waited; the next ones went out at once, their records held
    assert waited >= 1.0 and quick < 1.0, (waited, quick)
    assert set([slow, *held]) <= set(broker_messages(broker, key_prefix))
    # And once the window has passed, the next publish finds the store and writes what was held
    time.sleep(PublishOutage.RETRY_DELAY + 0.2)
    last = publish(app)
    store = celery_leases.store(app)
    assert {store.get(t).state for t in [first, slow, *held, last]} == {"queued"}


#: A publisher in a process of its own: publishes one task, then at each line of stdin one more
#: (printing its id), and exits at EOF without publishing again.
PUBLISHER = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from tests.support.apps.leased_app import create_app
app = create_app(dict(LEASES_TEST_BROKER=sys.argv[1], LEASES_TEST_LEASES_URL=sys.argv[2],
                      LEASES_TEST_PREFIX=sys.argv[3], LEASES_TEST_DELIVERY_TIMEOUT="600"))
app.conf.task_ignore_result = True
add = app.signature("tests.support.apps.leased_app.add", (1, 2))
print(add.apply_async().id, flush=True)
for _ in sys.stdin:
    print(add.apply_async().id, flush=True)
"""


@pytest.mark.parametrize("store_back", [True, False], ids=["store-back", "store-still-away"])
def test_records_held_by_a_publisher_that_publishes_nothing_more_are_written_as_it_exits(
        broker, lease_server, key_prefix, store_back):
    import subprocess
    import sys
    from pathlib import Path

    # Given a publisher whose store stops answering, and a task it then publishes (held)
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, broker.url, lease_server.url, key_prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        proc.stdout.readline()
        lease_server.stop()
        proc.stdin.write("\n")
        proc.stdin.flush()
        held = proc.stdout.readline().strip()
        assert held, proc.stderr.read()
        if store_back:
            lease_server.start()
        # When it exits without publishing again
        proc.stdin.close()
        proc.wait(30)
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, err
    assert held in broker_messages(broker, key_prefix)
    if store_back:
        # Then the held record is written on the way out: the task is tracked
        from tests.support.apps.leased_app import create_app
        app = create_app({"LEASES_TEST_BROKER": broker.url, "LEASES_TEST_LEASES_URL": lease_server.url,
                          "LEASES_TEST_PREFIX": key_prefix})
        assert celery_leases.store(app).get(held).state == "queued"
        assert "1 task(s) published while the lease store was unreachable are recorded now" in err
        app.close()
    else:
        # Then the untracked task is named, not dropped in silence
        assert "exits with 1 record(s) the lease store never took" in err and held in err


def test_a_publish_that_raised_while_the_store_was_away_is_never_recorded_later(
        make_app, broker, lease_server, key_prefix):
    # Given a publisher whose store and broker are both unreachable
    app = make_app()
    publish(app)
    lease_server.stop()
    broker.stop()
    # When a publish raises (the caller is told the task was not sent)
    with pytest.raises(OperationalError):
        publish(app, retry=False)
    # Then, once both are back, the next publish records only itself: the failed one would
    # otherwise run later behind its caller's back
    broker.start()
    lease_server.start()
    task_id = publish(app)
    store = celery_leases.store(app)
    assert store.get(task_id).state == "queued"
    assert store.stats().get("queued") == 1


@pytest.mark.parametrize("outage", [0.0, 1.0], ids=["short", "longer-than-the-delivery-timeout"])
def test_a_task_published_during_a_store_outage_survives_the_broker_losing_it(
        make_app, broker, lease_server, key_prefix, outage):
    # Given a task published while the store was stopped (for longer than the delivery
    # timeout, too), recorded at the next publish the store answers
    app = make_app(leases_delivery_timeout=0.5)
    publish(app)
    lease_server.stop()
    lost = publish(app)
    time.sleep(outage)
    lease_server.start()
    publish(app)
    assert celery_leases.store(app).get(lost).state == "queued"
    # When the broker forgets every message, and a recovery pass runs after the timeout
    broker.client().flushall()
    time.sleep(0.7)
    run_recovery(app)
    # Then it is back in the broker, re-published from its record with the next generation
    copy = broker_messages(broker, key_prefix)[lost]
    assert copy["headers"]["lease_generation"] == 1


def test_a_record_held_longer_than_the_retention_is_dropped_and_named(make_app, lease_server, caplog):
    # Given a store whose finished records are kept 1 s, stopped while a task is published
    app = make_app(leases_delivery_timeout=0.5, leases_retention=1.0)
    publish(app)
    lease_server.stop()
    old = publish(app)
    time.sleep(1.3)
    lease_server.start()
    # When the store answers again, past the retention
    with caplog.at_level("WARNING", logger="celery_leases.tracking"):
        publish(app)
    # Then that record is not written (the task may have run and its record expired), and
    # the warning names the task
    assert celery_leases.store(app).get(old) is None
    assert any("longer than leases_retention" in r.message and old in r.message for r in caplog.records)


def test_a_store_restarted_between_two_publishes_loses_no_record(make_app, lease_server):
    # Given a publisher holding its line, and a store restarted while it is idle
    app = make_app()
    publish(app)
    publish(app)
    lease_server.restart()
    # When it publishes again: the held socket is dead, which the first write may not see
    task_id = publish(app)
    # Then the record is there (the call is sent again once, on a new connection)
    assert celery_leases.store(app).get(task_id).state == "queued"


def test_publishing_threads_each_get_their_record(make_app):
    # Given one app shared by 8 threads (one holds the line at a time, the others use the pool)
    app = make_app()
    publish(app)
    ids: list[str] = []
    errors: list[BaseException] = []

    def run():
        try:
            for i in range(40):
                ids.append(publish(app, i, i))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Then every publish was recorded (no reply read by the wrong thread, none dropped)
    assert not errors
    store = celery_leases.store(app)
    assert len(ids) == 320
    assert {store.get(t).state for t in ids} == {"queued"}


def _child_publishes(app, inherited, out) -> None:
    ids = [publish(app, i, i) for i in range(20)]
    out.put((ids, queued_tasks(app)._line.conn is inherited))


def test_a_forked_child_records_on_its_own_connection(make_app):
    # Given a publisher holding its line, then forked
    app = make_app()
    publish(app)
    parent_first = publish(app)
    inherited = queued_tasks(app)._line.conn
    assert inherited is not None
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_publishes, args=(app, inherited, out))
    child.start()
    # When both publish at once
    parent = [publish(app, i, i) for i in range(20)]
    child_ids, shared = out.get(timeout=60)
    child.join(30)
    # Then the child wrote on a connection of its own, each side's records landed, and the
    # parent's line still works
    assert child.exitcode == 0
    assert not shared
    store = celery_leases.store(app)
    assert {store.get(t).state for t in [parent_first, *parent, *child_ids, publish(app)]} == {"queued"}


def test_a_group_is_written_on_the_held_line_and_read_once(make_app, lease_server):
    from celery import group
    app = make_app()
    server = counting_after_warm_up(app, lease_server)
    result = group(app.signature(f"{TASKS}.add", (i, i)) for i in range(20)).apply_async()
    assert sent_commands(server) == {"cmdstat_evalsha": 20}
    store = celery_leases.store(app)
    assert {store.get(r.id).state for r in result.results} == {"queued"}
    assert uuid.UUID(result.id)


def test_a_store_that_lost_its_scripts_still_records_every_publish(make_app, lease_server):
    # Given a publisher holding its line, and a store whose script cache is then flushed
    app = make_app()
    publish(app)
    publish(app)
    lease_server.client().script_flush()
    # When it publishes: the pipelined EVALSHA is answered NOSCRIPT after the message went out
    ids = [publish(app, i, i) for i in range(3)]
    # Then each record is there all the same (the call is sent again with the script's source)
    store = celery_leases.store(app)
    assert {store.get(t).state for t in ids} == {"queued"}


def test_a_hung_store_delays_a_publish_by_its_timeout_only_and_is_reported(make_app, broker, lease_server,
                                                                            key_prefix, caplog):
    import os
    import signal
    import time
    # Given a publisher holding its line, and a store that stops answering (SIGSTOP)
    app = make_app()
    publish(app)
    publish(app)
    os.kill(lease_server.process.pid, signal.SIGSTOP)
    try:
        # When it publishes: the record is written, its reply never comes
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="celery_leases.tracking"):
            hung = publish(app)
        took = time.monotonic() - began
    finally:
        os.kill(lease_server.process.pid, signal.SIGCONT)
    # Then the message went out after one socket timeout (ttl / 3, at least 2 s), and the
    # outage is logged; the line is closed, so the first publish after the retry window
    # (the store is not asked again within it) is recorded on a new one
    assert hung in broker_messages(broker, key_prefix)
    assert took < 6.0
    assert "publish tracking" in caplog.text
    time.sleep(PublishOutage.RETRY_DELAY + 0.2)
    after = publish(app)
    assert celery_leases.store(app).get(after).state == "queued"


def test_the_tracking_benchmark_runs_end_to_end(tmp_path):
    import os
    import subprocess
    import sys
    from tests.support.workers import ROOT
    # A smoke run (small sizes, its own throwaway redis-server): it prints both tables and the JSON
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "bench/tracking.py", "--tasks", "200", "--runs", "1",
                          "--json", str(tmp_path / "t.json")], cwd=str(ROOT), env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "publisher CPU per task" in out.stdout and "10 KiB (one str)" in out.stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["footprint"]["10 KiB (one str)"]["message"] > 10240 > data["footprint"]["small (one int)"]["message"]


def test_only_a_first_attempt_is_marked_recorded(make_app, broker, key_prefix):
    from celery.app.task import Context

    from celery.signals import before_task_publish

    from celery_leases.publishing.publish_id import RECORDED_HEADER, recorded_headers
    # Given a tracking publisher, with compression (a header kombu adds after the record)
    app = make_app(task_compression="zlib")
    first = publish(app)
    # A retry's record exists already and keeps the first message: a retry is never marked,
    # even when the header came along (a user's headers, an older worker's request headers)
    retry = publish(app, retries=1, headers={RECORDED_HEADER: recorded_headers({})})

    # A receiver connected after the package's adds a header the record cannot hold
    def add_trace(headers=None, **kwargs):
        headers["traceparent"] = "00-abc-def-01"
    before_task_publish.connect(add_trace)
    try:
        traced = publish(app)
    finally:
        before_task_publish.disconnect(add_trace)
    headers = {task_id: m["headers"] for task_id, m in broker_messages(broker, key_prefix).items()}
    # Then a worker receiving the first leaves its message out, and sends the others'
    assert headers[first][RECORDED_HEADER] == recorded_headers(headers[first])
    assert "compression" in headers[first]
    assert RECORDED_HEADER not in headers[retry]
    assert headers[traced][RECORDED_HEADER] != recorded_headers(headers[traced])
    # And a worker's request never hands the header on to retry() (Context declares it)
    assert Context({"id": first, RECORDED_HEADER: "1"}).headers is None


def test_the_recorded_digest_depends_on_header_names_only():
    from celery_leases.publishing.publish_id import RECORDED_HEADER, recorded_headers
    # Values may change on the wire (a tuple arrives as a list): only the names count,
    digest = recorded_headers({"id": "t", "timelimit": (None, None)})
    assert digest == recorded_headers({"id": "t", "timelimit": [None, None], RECORDED_HEADER: "x"})
    # a name more or less is seen, and a name that is not a string does not break it
    assert digest != recorded_headers({"id": "t", "timelimit": None, "traceparent": "00-a-b-01"})
    assert digest != recorded_headers({"id": "t"})
    assert recorded_headers({"id": "t", 1: "x"}) != digest


def test_the_recorded_header_digest_depends_on_the_names_alone():
    """The digest a worker compares at receipt (twice per message, so it is remembered by
    the names' order): the same names in any order, with any values, give one digest; a
    header added after the record gives another; the recorded header itself is left out."""
    from celery_leases.publishing.publish_id import RECORDED_HEADER, recorded_headers
    first = recorded_headers({"id": "1", "task": "t", "retries": 0})
    assert recorded_headers({"retries": 5, "task": "u", "id": "2"}) == first
    assert recorded_headers({"id": "1", "task": "t", "retries": 0, RECORDED_HEADER: first}) == first
    assert recorded_headers({"id": "1", "task": "t", "retries": 0, "traceparent": "x"}) != first
    # (many different header sets: the remembered digests stay bounded and still right)
    for k in range(600):
        assert recorded_headers({f"h{k}": 1, "id": "1"}) == recorded_headers({"id": "1", f"h{k}": 2})
    assert recorded_headers({"task": "t", "id": "1", "retries": 0}) == first
