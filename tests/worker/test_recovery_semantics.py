"""Recovery semantics on real workers (issue #14 items 3, 4, 7; #15 item 10).

- A poison pill that kills its whole worker is charged for it; tasks the worker
  had only prefetched are not (start marks, docs/recovery.md).
- An accepted success whose callbacks meet a dead broker sends them once the
  broker is back; the backend holds SUCCESS, never a FAILURE the lease contradicts.
- A prefetched request whose lease was taken over while its worker was paused
  never starts its body after the resume.
- Quiet when healthy: no INFO line from celery-leases over several recovery
  intervals; a store outage is logged once when it starts and once when it ends.
"""
from __future__ import annotations

import re
import signal
import time

import pytest

from celery import chain

import celery_leases
from celery_leases import LeaseExpired
from celery_leases.testing.servers import RedisServer
from celery_leases.testing import wait_for
from tests.support.workers import Worker, starts

APP = "tests.support.apps.semantics_app"
#: Seconds the broker stays down after the success was accepted: longer than Celery's
#: own publish retries last with LEASES_TEST_PUBLISH_RETRIES=1 (about 12 s here).
OUTAGE = 20.0


@pytest.fixture
def workers(tmp_path):
    started: list[Worker] = []

    def start(name: str, env: dict, pool: str = "prefork", concurrency: int = 1) -> Worker:
        worker = Worker(name, env, pool=pool, concurrency=concurrency, app=APP, log_dir=tmp_path)
        started.append(worker)
        return worker.start(timeout=60)

    yield start
    for worker in started:
        worker.kill()


def client(env: dict):
    from tests.support.apps.semantics_app import create_app
    return create_app(env)


# -- #14.3: a poison pill takes only itself down ---------------------------------------


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_poison_pill_dies_alone_and_its_prefetched_neighbours_all_succeed(
        pool, celery_env, workers, history):
    # Given a worker (one slot, eight prefetched) restarted whenever it dies, a
    # poison pill that kills the whole worker each time it runs, and innocent
    # tasks queued right behind it (prefetched by the same worker each time)
    env = {**celery_env, "LEASES_TEST_MAX_RECOVERIES": "2", "LEASES_TEST_PREFETCH": "8",
           "LEASES_TEST_WORKER_RECOVERY": "1", "LEASES_TEST_TTL": "2",
           "LEASES_TEST_RECOVERY_INTERVAL": "0.5"}
    app = client(env)
    tasks = app.tasks
    store = celery_leases.store(app)
    pill = tasks["tests.support.apps.leased_app.kill_own_worker"].delay()
    innocents = [tasks["tests.support.apps.leased_app.add"].delay(i, i) for i in range(6)]
    ids = [r.id for r in innocents]

    def settled() -> bool:
        records = [store.get(i) for i in [pill.id, *ids]]
        return all(r is not None and r.state in ("succeeded", "dead", "failed") for r in records)

    # When the worker dies and is restarted, again and again (a supervisor)
    lives = 0
    deadline = time.monotonic() + 150
    worker = None
    while not settled():
        assert time.monotonic() < deadline, f"not settled after {lives} worker lives: " + \
            repr({i: store.get(i) and (store.get(i).state, store.get(i).recoveries) for i in [pill.id, *ids]})
        if worker is None or worker.proc.poll() is not None:
            lives += 1
            assert lives <= 12, "the pill was recovered without end"
            worker = workers(f"{pool}-{lives}", env, pool=pool, concurrency=1)
        time.sleep(0.2)

    # Then the pill is dead after leases_max_recoveries (2) recoveries, its waiter
    # released with LeaseExpired, having run 3 times (once per counted death + 1)
    pill_record = store.get(pill.id)
    assert (pill_record.state, pill_record.recoveries) == ("dead", 2)
    with pytest.raises(LeaseExpired):
        pill.get(timeout=10)
    assert len(starts(history, pill.id)) == 3
    # And every innocent ran and succeeded, none declared dead, none charged a recovery
    assert [r.get(timeout=10) for r in innocents] == [2 * i for i in range(6)]
    for task_id in ids:
        rec = store.get(task_id)
        assert (rec.state, rec.recoveries) == ("succeeded", 0), (task_id, rec)
        assert len(starts(history, task_id)) == 1, task_id
    app.close()


def test_a_pill_that_kills_its_worker_before_its_start_mark_still_ends(celery_env, workers, history):
    # Given a poison pill that kills its whole worker the instant it starts (its start
    # mark never reaches the store), max_recoveries 0 (unstarted bound 4 * (0 + 1) = 4),
    # and a worker restarted whenever it dies
    env = {**celery_env, "LEASES_TEST_MAX_RECOVERIES": "0", "LEASES_TEST_WORKER_RECOVERY": "1",
           "LEASES_TEST_TTL": "1", "LEASES_TEST_RECOVERY_INTERVAL": "0.3"}
    app = client(env)
    store = celery_leases.store(app)
    pill = app.tasks["tests.support.apps.semantics_app.instant_pill"].delay()

    # When it runs, kills, and is recovered again and again
    lives, worker = 0, None
    deadline = time.monotonic() + 120
    while not ((r := store.get(pill.id)) and r.state == "dead"):
        assert time.monotonic() < deadline, f"not dead after {lives} worker lives: {store.get(pill.id)}"
        if worker is None or worker.proc.poll() is not None:
            lives += 1
            # Then it is never recovered without end: at most 1 + 4 deaths
            assert lives <= 6, f"the pill was recovered past its bound: {store.get(pill.id)}"
            worker = workers(f"instant-{lives}", env, pool="threads", concurrency=1)
        time.sleep(0.1)

    # And it ends dead with LeaseExpired, within the unstarted bound
    record = store.get(pill.id)
    assert record.recoveries + record.unstarted_recoveries <= 4
    assert 1 <= len(starts(history, pill.id)) <= 5
    with pytest.raises(LeaseExpired):
        pill.get(timeout=10)
    app.close()


# -- #14.4: callbacks of an accepted success survive a broker outage --------------------


@pytest.mark.parametrize("pool, kind", [("prefork", "link"), ("threads", "chain")])
def test_callbacks_of_an_accepted_success_are_sent_once_the_broker_is_back(
        pool, kind, celery_env, workers, history, redis_server_url, tmp_path):
    # Given a broker on its own redis-server, the lease store and the backend on another
    broker = RedisServer(dir=tmp_path / "broker")
    broker.start()
    try:
        env = {**celery_env, "LEASES_TEST_BROKER": broker.url, "LEASES_TEST_BACKEND": redis_server_url,
               "LEASES_TEST_LEASES_URL": redis_server_url, "LEASES_TEST_TTL": "5",
               "LEASES_TEST_PUBLISH_RETRIES": "1"}
        app = client(env)
        store = celery_leases.store(app)
        workers(f"cb-{pool}-{kind}", env, pool=pool, concurrency=1)
        body = app.tasks["tests.support.apps.leased_app.sleep_then_echo"]
        callback = app.tasks["tests.support.apps.leased_app.note_callback"]
        if kind == "link":
            result = body.apply_async(("v", 1.5), link=callback.s())
        else:
            result = chain(body.s("v", 1.5), callback.s()).apply_async().parent
        task_id = result.id
        wait_for(lambda: starts(history, task_id), 30, what="the body to start")

        # When the broker stops while the body runs, so that its success is accepted
        # (the lease store is up) and its callback meets no broker
        broker.stop()
        wait_for(lambda: (store.get(task_id) or None) and store.get(task_id).state == "succeeded", 15,
                 what="the success to be accepted")
        # (longer than Celery's own publish retries last)
        time.sleep(OUTAGE)
        assert not [h for h in history() if h[0] == "callback"]
        # And comes back
        broker.start()

        # Then the callback runs exactly once, and the backend holds SUCCESS
        wait_for(lambda: [h for h in history() if h[0] == "callback"], 60, what="the callback to run")
        time.sleep(1.0)
        callbacks = [h for h in history() if h[0] == "callback"]
        assert len(callbacks) == 1 and callbacks[0][3]["value"] == "v"
        assert app.AsyncResult(task_id).state == "SUCCESS"
        assert app.AsyncResult(task_id).get(timeout=5) == "v"
        app.close()
    finally:
        broker.stop()


# -- #14.7: a prefetched request whose lease was taken over never starts -------------


def test_prefetched_requests_taken_over_while_the_worker_was_paused_never_start(
        celery_env, workers, history):
    # Given a prefork worker P (one process) running a long task, with short tasks
    # prefetched behind it (their leases acquired at receipt)
    env = {**celery_env, "LEASES_TEST_PREFETCH": "4", "LEASES_TEST_TTL": "2"}
    app = client(env)
    store = celery_leases.store(app)
    p = workers("paused", env, pool="prefork", concurrency=1)
    long = app.tasks["tests.support.apps.leased_app.sleep_then_echo"].delay("long", 8.0)
    wait_for(lambda: starts(history, long.id), 30, what="the long task to start")
    short = [app.tasks["tests.support.apps.leased_app.add"].delay(i, 1) for i in range(3)]
    wait_for(lambda: all(store.get(r.id) and store.get(r.id).owner for r in short), 10,
             what="P to acquire the prefetched leases")

    # When P's main process is paused past the ttl (its pool process runs on), the
    # leases are recovered, and another worker runs the short tasks to success
    p.signal(signal.SIGSTOP, main_only=True)
    try:
        workers("other", {**env, "LEASES_TEST_WORKER_RECOVERY": "1"}, pool="threads", concurrency=2)
        wait_for(lambda: all(store.get(r.id).state == "succeeded" for r in short), 40,
                 what="the other worker to run the short tasks")
    finally:
        p.signal(signal.SIGCONT, main_only=True)
    # And P resumes, its long task ends, and its pool process is free for the prefetched ones
    p_child = starts(history, long.id)[0][2]
    wait_for(lambda: [h for h in history() if h[0] == "end" and h[1] == long.id and h[2] == p_child],
             30, what="the long task to end in P")
    wait_for(lambda: p.log().count("Task tests.support.apps.leased_app.add") >= 2 * len(short), 15,
             what="P to hand the prefetched requests to its pool")
    time.sleep(1.0)

    # Then no short task's body ran twice: P never started the requests it had held
    for i, r in enumerate(short):
        assert len(starts(history, r.id)) == 1, (r.id, starts(history, r.id))
        assert r.get(timeout=5) == i + 1
        assert store.get(r.id).state == "succeeded"
    assert p.log().count("body not started") == len(short)
    app.close()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_wedged_event_loop_gives_up_the_tasks_only_it_could_start(pool, celery_env, workers, history):
    # Given a worker W (one pool slot) running a long task, with short tasks prefetched
    # behind it (leased at receipt)
    env = {**celery_env, "LEASES_TEST_PREFETCH": "4", "LEASES_TEST_TTL": "2"}
    app = client(env)
    store = celery_leases.store(app)
    w = workers("wedged", env, pool=pool, concurrency=1)
    long = app.tasks["tests.support.apps.leased_app.sleep_then_echo"].delay("long", 6.0)
    wait_for(lambda: starts(history, long.id), 30, what="the long task to start")
    short = [app.tasks["tests.support.apps.leased_app.add"].delay(i, 1) for i in range(3)]
    wait_for(lambda: all(store.get(r.id) and store.get(r.id).owner for r in short), 10,
             what="W to acquire the prefetched leases")
    owner = store.get(short[0].id).owner

    # When W's main thread, its event loop, is blocked for 19 s while its heartbeat thread and
    # its pool run on, and another worker runs recovery meanwhile
    app.control.broadcast("leases_test_wedge", arguments={"seconds": 19.0}, reply=False)
    time.sleep(0.5)
    workers("other", {**env, "LEASES_TEST_WORKER_RECOVERY": "1"}, pool="threads", concurrency=2)
    if pool == "prefork":
        # Then the tasks only the loop could start (not yet written to a child) are no longer
        # renewed once the stall passed 5 s (the floor; ttl 2 s): they expire and the other
        # worker runs them while W is still wedged
        wait_for(lambda: all(store.get(r.id).state == "succeeded" for r in short), 14,
                 what="the other worker to run the prefetched tasks during the wedge")
        assert all(store.get(r.id).owner != owner for r in short)
        w.wait_for_log("event loop has not run for", 5)
    else:
        # Then the tasks already given to a pool thread (which starts them without the loop)
        # keep their leases, and run on W once its thread is free
        time.sleep(10.0)
        assert all(store.get(r.id).owner == owner for r in short)
    # And W says, once the stall passed 15 s, that it consumes nothing, whatever leases wait
    w.wait_for_log("receives, starts and acknowledges no message", 15)
    # And the long task kept its lease through the wedge; no body ran twice
    assert long.get(timeout=30) == "long"
    assert [r.get(timeout=30) for r in short] == [1, 2, 3]
    wait_for(lambda: "event loop runs again after a stall" in w.log(), 20, what="W's loop to run again")
    assert w.log().count("event loop runs again") == 1 + (pool == "prefork")
    time.sleep(1.0)
    for r in [long, *short]:
        assert len(starts(history, r.id)) == 1, (r.id, starts(history, r.id))
    if pool == "prefork":
        assert w.log().count("body not started") == len(short)
    app.close()


def test_a_solo_worker_busy_with_a_long_body_keeps_the_leases_of_its_eta_tasks(celery_env, workers, history):
    # Given a solo worker S (its loop runs the bodies) holding a task for its ETA, then busy
    # with a body longer than the ttl, and another worker running recovery
    env = {**celery_env, "LEASES_TEST_TTL": "2"}
    app = client(env)
    store = celery_leases.store(app)
    s = workers("solo", env, pool="solo", concurrency=1)
    eta = app.tasks["tests.support.apps.leased_app.add"].apply_async((1, 1), countdown=20)
    wait_for(lambda: store.get(eta.id) and store.get(eta.id).owner, 10, what="S to hold the ETA task")
    owner = store.get(eta.id).owner
    long = app.tasks["tests.support.apps.leased_app.sleep_then_echo"].delay("long", 12.0)
    wait_for(lambda: starts(history, long.id), 30, what="the long task to start")
    began = time.monotonic()
    workers("other", {**env, "LEASES_TEST_WORKER_RECOVERY": "1"}, pool="threads", concurrency=2)
    # When the body keeps S's loop from going round past the ttl, and past the 5 s floor
    time.sleep(max(0.0, 10.0 - (time.monotonic() - began)))
    # Then S is busy, not wedged: the ETA task keeps its lease, and runs once, on S
    assert store.get(eta.id).owner == owner and store.get(eta.id).state == "active"
    assert long.get(timeout=30) == "long" and eta.get(timeout=30) == 2
    assert len(starts(history, eta.id)) == 1 and store.get(eta.id).owner == owner
    assert "event loop has not run" not in s.log()
    app.close()


# -- #15.10: quiet when healthy, one line per outage edge ---------------------------------

LINE = re.compile(r"^\[[^\]]*: (?P<level>[A-Z]+)/[^\]]*\] (?P<logger>[\w.]+): (?P<message>.*)$")


def lines(log: str, after: str = " ready.") -> list[tuple[str, str, str]]:
    """(level, logger, message) of the log lines after the line holding ``after``."""
    text = log.split(after, 1)[1] if after and after in log else log
    out = []
    for raw in text.splitlines():
        m = LINE.match(raw)
        if m:
            out.append((m["level"], m["logger"], m["message"]))
    return out


def test_a_healthy_worker_logs_nothing_at_info_and_an_outage_logs_its_start_and_end(
        celery_env, workers, history, tmp_path):
    # Given a worker whose lease store has a server of its own, with fallback recovery
    # every 0.3 s, and the default beat setting (no beat entry while workers recover)
    store_server = RedisServer(dir=tmp_path / "store")
    store_server.start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": store_server.url,
               "LEASES_TEST_WORKER_RECOVERY": "1", "LEASES_TEST_RECOVERY_INTERVAL": "0.3",
               "LEASES_TEST_TTL": "1.5", "LEASES_TEST_HISTORY_URL": celery_env["LEASES_TEST_BROKER"]}
        app = client(env)
        assert "celery_leases.recover" not in (app.conf.beat_schedule or {})
        w = workers("quiet", env, pool="threads", concurrency=2)
        # When it runs a long leased task over several recovery intervals and heartbeats
        running = app.tasks["tests.support.apps.leased_app.sleep_then_echo"].delay("x", 12.0)
        wait_for(lambda: starts(history, running.id), 20, what="the task to start")
        time.sleep(3.0)
        # Then nothing from celery-leases (nor a recover task) was logged at INFO or above
        healthy = [line for line in lines(w.log()) if line[0] != "DEBUG"
                   and (line[1].startswith("celery_leases") or "celery_leases.recover" in line[2])]
        assert healthy == [], healthy

        # When the lease store goes away for several heartbeats and recovery intervals
        mark = len(w.log())
        store_server.stop()
        time.sleep(4.0)
        store_server.start()
        # Then, once it is back, the heartbeat and the fallback recovery each logged one
        # line when the outage started and one when it ended, with the count of failures
        wait_for(lambda: len([1 for _, _, m in lines(w.log()[mark:], after="") if "works again" in m]) >= 2,
                 20, what="both to log the end of the outage")
        outage = [line for line in lines(w.log()[mark:], after="")
                  if line[1].startswith("celery_leases") and line[0] != "DEBUG"]
        for what in ("lease heartbeat", "fallback recovery pass"):
            mine = [line for line in outage if what in line[2]]
            failed = [line for line in mine if " failed" in line[2] and "works again" not in line[2]]
            back = [line for line in mine if "works again" in line[2]]
            assert len(failed) == 1 and failed[0][0] == "ERROR", (what, outage)
            assert len(back) == 1 and re.search(r"after (\d+) failed attempt\(s\)", back[0][2]), (what, outage)
            assert int(re.search(r"after (\d+) failed", back[0][2])[1]) >= 2, back
        assert "Traceback" not in w.log()[mark:]
        app.close()
    finally:
        store_server.stop()


def test_a_callback_that_cannot_be_sent_is_reported_naming_task_and_callback(caplog):
    # Given a task whose broker refuses connections, with a link callback and a chain step
    from celery import Celery
    from celery.app.task import Context

    from celery_leases.task.callbacks import send_callbacks
    from celery_leases.testing.servers import free_port
    from celery_leases.signals import callbacks_failed
    app = Celery("unsent", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    app.conf.task_publish_retry = False   # Celery's own retries would only make this slow
    app.conf.broker_connection_max_retries = 1
    app.conf.broker_connection_retry = False

    @app.task(name="proj.parent")
    def parent():
        return 1

    request = Context(id="t-1", root_id="t-1", delivery_info={},
                      callbacks=[app.signature("proj.after", immutable=True)],
                      chain=[app.signature("proj.next")])
    reported = []

    def on_failed(sender=None, task_id=None, callback=None, error=None, **kwargs):
        reported.append((task_id, callback, type(error).__name__))

    callbacks_failed.connect(on_failed)
    slept = []
    try:
        caplog.set_level("WARNING", logger="celery_leases.task")
        # When they are sent, with 2 tries each (each refused publish takes redis-py ~6 s)
        failed = send_callbacks(parent, request, 1, sleep=slept.append, attempts=2)
    finally:
        callbacks_failed.disconnect(on_failed)
        app.close()

    # Then both are reported (log and signal), after 2 tries with a delay in between,
    # and the tracer is left nothing to send (and so no failure to store)
    assert failed == 2 and slept == [0.5] * 2
    assert [(t, c.split()[0]) for t, c, _ in reported] == [("t-1", "link"), ("t-1", "next")]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2
    assert "proj.parent[t-1]" in errors[0] and "link callback proj.after" in errors[0]
    assert "next chain step proj.next" in errors[1] and "after 2 try(s)" in errors[1]
    assert request.callbacks is None and request.chain is None


def test_the_recovery_task_logs_a_store_outage_once_when_it_starts_and_once_when_it_ends(
        tmp_path, caplog):
    # Given the recovery task of an app whose lease store has a server of its own
    from celery import Celery
    store_server = RedisServer(dir=tmp_path / "store")
    store_server.start()
    app = Celery("outage", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(leases_redis_url=store_server.url, leases_recovery_interval=0.1,
                    leases_key_prefix="outage")
    celery_leases.install(app)
    recover = app.tasks["celery_leases.recover"]
    caplog.set_level("DEBUG", logger="celery_leases.recovery")
    try:
        assert "failed" not in recover()
        # When the store goes away for three runs
        store_server.stop()
        results = [recover() for _ in range(3)]
        # Then each run fails quietly, and the outage is logged once, without a traceback
        assert all("failed" in r for r in results)
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "recovery task failed" in errors[0].getMessage()
        assert not errors[0].exc_info
        # And when it is back, the next run logs the end of the outage with the count
        store_server.start()
        time.sleep(0.15)
        assert "failed" not in recover()
        back = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(back) == 1 and "works again after 3 failed attempt(s)" in back[0]
        assert not [r for r in caplog.records if r.levelname == "INFO"]
    finally:
        store_server.stop()
        app.close()
