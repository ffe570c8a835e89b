"""Outcomes under lease-store faults, on real workers and a real redis-server of its own.

What must hold (issue #14, items 2 and 6):

- The store stalls (SIGSTOP) while tasks finish, long enough for their finish
  calls to time out, then resumes: every waiter gets its result, each link
  callback runs once, a chord's callback fires once, and no record says
  ``succeeded`` without a result in the backend. A finish whose reply was
  lost is settled by asking again, never assumed to have failed.
- Stalled past the finish's bound: the outcome is withheld and no buffered
  copy applies it later; recovery re-runs the task, and the same holds.
- The store restarted empty just before a task finishes: the outcome is
  accepted (the finish re-asserts the holder's token), the result stored,
  nothing runs twice.

The broker, the result backend (unless the fused path is under test) and the
tasks' history live on the session's server, which never stalls; only the
lease store does. Its socket timeout is shortened to 1 s through the URL.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from celery import chord

import celery_leases
from celery_leases.testing.servers import RedisServer
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"
#: Seconds the lease store is stopped: several socket timeouts of the worker's calls.
STALL = 7.0


@pytest.fixture
def store_server(tmp_path):
    server = RedisServer(dir=tmp_path / "store").start()
    yield server
    if server.process is not None and server.process.poll() is None:
        os.kill(server.process.pid, signal.SIGCONT)
    server.cleanup()


def fault_env(celery_env: dict, store_server: RedisServer, redis_server_url: str, *,
              ttl: float, fused: bool = False, **extra: str) -> dict:
    url = store_server.url + "?socket_timeout=1&socket_connect_timeout=1"
    env = {**celery_env, "LEASES_TEST_LEASES_URL": url, "LEASES_TEST_HISTORY_URL": redis_server_url,
           "LEASES_TEST_TTL": str(ttl), **extra}
    if fused:
        # Celery's Redis backend on the lease store's server and db: the finish writes the result.
        env["LEASES_TEST_BACKEND"] = store_server.url
    return env


@pytest.fixture
def make_app():
    apps = []

    def make(env: dict):
        from tests.support.apps.leased_app import create_app
        app = create_app(env)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


def started(history, task_ids) -> int:
    return sum(1 for h in history() if h[0] == "start" and h[1] in task_ids)


def submit(app):
    """Two tasks with a link callback each, and a chord of two members: all running ~2 s.

    A warm-up task first: the store then holds the scripts (as any server that ran tasks
    does), so a finish buffered by the stalled server runs when it resumes, not NOSCRIPT.
    """
    assert app.signature(f"{TASKS}.add", (1, 1)).delay().get(timeout=30) == 2
    callback = app.signature(f"{TASKS}.note_callback")
    linked = [app.signature(f"{TASKS}.sleep_then_echo", (f"v{i}", 2.0)).apply_async(link=callback)
              for i in range(2)]
    members = [app.signature(f"{TASKS}.sleep_then_echo", (10 + i, 2.0)) for i in range(2)]
    joined = chord(members, app.signature(f"{TASKS}.tsum")).delay()
    return linked, joined


def stall_while_finishing(store_server: RedisServer, history, app, linked, seconds: float) -> None:
    """SIGSTOP the store once all four bodies run (they finish ~2 s later), for ``seconds``."""
    wait_for(lambda: started(history, {r.id for r in linked}) == 2
             and sum(1 for h in history() if h[0] == "start" and h[3].get("value") in ("10", "11")) == 2,
             30, what="all four bodies to start")
    os.kill(store_server.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(store_server.process.pid, signal.SIGCONT)


def check_every_outcome(app, history, linked, joined, timeout: float = 60) -> None:
    """Waiters get their results, each callback runs once, the chord fires once, and no
    record says succeeded without the result in the backend."""
    assert [r.get(timeout=timeout) for r in linked] == ["v0", "v1"]
    assert joined.get(timeout=timeout) == 21
    wait_for(lambda: sum(1 for h in history() if h[0] == "callback") >= 2, 20, what="both callbacks")
    time.sleep(1.0)  # a second copy of a callback or of the chord's would show by now
    callbacks = sorted(h[3]["value"] for h in history() if h[0] == "callback")
    assert callbacks == ["v0", "v1"], callbacks
    assert started(history, {joined.id}) == 1, "the chord's callback ran more than once"
    store = celery_leases.store(app)
    members = [h[1] for h in history() if h[0] == "start" and h[3].get("value") in ("10", "11")]
    for task_id in {r.id for r in linked} | set(members) | {joined.id}:
        record = store.get(task_id)
        assert record is not None and record.state == "succeeded", (task_id, record)
        meta = app.backend.get_task_meta(task_id)
        assert meta["status"] == "SUCCESS", (task_id, meta)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_finish_whose_reply_was_lost_is_settled_when_the_store_returns(
        pool, celery_env, store_server, redis_server_url, make_app, start_worker, history):
    # Given a worker whose lease store stalls while its tasks finish (ttl 20 s: the finish
    # waits for the store up to that long)
    env = fault_env(celery_env, store_server, redis_server_url, ttl=20)
    app = make_app(env)
    worker = start_worker("a", pool=pool, concurrency=4, **env)
    linked, joined = submit(app)
    # When the store is stopped for several of the finish's socket timeouts, then resumes
    stall_while_finishing(store_server, history, app, linked, STALL)
    # Then every outcome was settled by asking again: nothing lost, nothing twice
    check_every_outcome(app, history, linked, joined)
    # And no body ran twice: the settled outcomes were the first runs'
    assert started(history, {r.id for r in linked}) == 2
    assert int(celery_leases.store(app).stats().get("late_finishes", 0)) == 0
    log = worker.log()
    assert "no answer to the finish" in log, "no finish timed out: the stall proved nothing"
    assert "lease unconfirmed" not in log and "refused" not in log


def test_on_the_fused_path_a_settled_finish_still_counts_for_the_chord(
        celery_env, store_server, redis_server_url, make_app, start_worker, history):
    # Given the result backend on the lease store's own server (the finish writes the result)
    env = fault_env(celery_env, store_server, redis_server_url, ttl=20, fused=True)
    app = make_app(env)
    start_worker("a", pool="prefork", concurrency=4, **env)
    linked, joined = submit(app)
    # When the store (and so the backend) stalls while the chord's members finish
    stall_while_finishing(store_server, history, app, linked, STALL)
    # Then the members' results were written by their finish and the chord still fired once
    check_every_outcome(app, history, linked, joined)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_finish_given_up_can_no_longer_apply_and_recovery_reruns_the_task(
        pool, celery_env, store_server, redis_server_url, make_app, start_worker, history):
    # Given a ttl of 2 s: a finish waits about that long for the store, then gives up
    env = fault_env(celery_env, store_server, redis_server_url, ttl=2,
                    LEASES_TEST_WORKER_RECOVERY="1")
    app = make_app(env)
    worker = start_worker("a", pool=pool, concurrency=4, **env)
    linked, joined = submit(app)
    # When the store stays stopped well past that, so every finish gives up
    stall_while_finishing(store_server, history, app, linked, STALL)
    # Then the copies Redis still held were refused as late, not applied behind the
    # workers' backs; recovery re-ran the tasks, and every outcome arrived exactly once
    check_every_outcome(app, history, linked, joined)
    assert started(history, {r.id for r in linked}) >= 3, "no finish gave up: the test proves nothing"
    assert "unconfirmed, store unreachable" in worker.log()
    if pool == "prefork":
        # A copy sent on a connection held from the warm-up was buffered and refused on
        # resume (a copy on a new connection stops at its handshake and is never sent; the
        # threads pool's copies may all be such).
        assert int(celery_leases.store(app).stats().get("late_finishes", 0)) >= 1


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_an_outcome_finishing_just_after_the_store_restarted_empty_is_accepted(
        pool, celery_env, store_server, redis_server_url, make_app, start_worker, history):
    # Given a running task whose heartbeat is far off (ttl 60 s: a tick every 20 s)
    env = fault_env(celery_env, store_server, redis_server_url, ttl=60)
    app = make_app(env)
    worker = start_worker("a", pool=pool, concurrency=2, **env)
    callback = app.signature(f"{TASKS}.note_callback")
    result = app.signature(f"{TASKS}.sleep_then_echo", ("kept", 3.0)).apply_async(link=callback)
    wait_for(lambda: started(history, {result.id}) == 1, 20, what="the body to start")
    store = celery_leases.store(app)
    token = store.get(result.id).token
    # When the store restarts empty (no persistence) just before the body returns
    time.sleep(2.2)
    store_server.kill()
    store_server.start()
    assert store.get(result.id) is None
    # Then its outcome is accepted: result stored, callback sent, under the same token
    assert result.get(timeout=30) == "kept"
    wait_for(lambda: any(h[0] == "callback" for h in history()), 20, what="the callback")
    record = store.get(result.id)
    assert (record.state, record.token) == ("succeeded", token)
    # And nothing ran twice, and no later acquire can be handed that token again
    time.sleep(1.5)
    assert started(history, {result.id}) == 1
    assert [h[3]["value"] for h in history() if h[0] == "callback"] == ["kept"]
    assert int(redis.Redis.from_url(store_server.url).get(store.keys.shard_for(result.id).sequence)) >= token
    assert "refused" not in worker.log()


def test_a_main_process_outcome_whose_reply_was_lost_is_settled_too(
        celery_env, store_server, redis_server_url, make_app, start_worker, history):
    # Given a task killed by its hard time limit (1 s): the worker's main process records
    # its FAILURE, and the store stalls just then
    env = fault_env(celery_env, store_server, redis_server_url, ttl=20)
    app = make_app(env)
    worker = start_worker("a", pool="prefork", concurrency=1, **env)
    assert app.signature(f"{TASKS}.add", (1, 1)).delay().get(timeout=30) == 2  # scripts cached
    result = app.signature(f"{TASKS}.hard_limited").delay()
    wait_for(lambda: started(history, {result.id}) == 1, 20, what="the body to start")
    time.sleep(0.7)
    os.kill(store_server.process.pid, signal.SIGSTOP)
    try:
        time.sleep(1.6)  # past the limit and the first copy's 1 s socket timeout
    finally:
        os.kill(store_server.process.pid, signal.SIGCONT)
    # Then the main process's finish was settled by asking again: the failure is stored
    from celery.exceptions import TimeLimitExceeded
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30)
    assert celery_leases.store(app).get(result.id).state == "failed"
    log = worker.log()
    assert "no answer to the finish" in log and "settled by copy" in log
    assert "refused" not in log


@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.parametrize("step", ["retry", "replace"])
def test_a_hand_over_withheld_in_a_store_outage_leaves_the_task_to_recovery_never_finished(
        pool, step, celery_env, start_worker, history, redis_server_url, tmp_path):
    # Given a lease store on its own Redis, a worker without recovery, and a task that retries
    # itself (or is replaced) once its body has run 1 s
    import signal as signals
    import celery_leases
    from celery_leases.testing import wait_for
    from celery_leases.testing.servers import RedisServer
    from tests.support.apps.leased_app import create_app
    from tests.support.workers import starts
    lease_redis = RedisServer(dir=tmp_path).start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url,
               "LEASES_TEST_HISTORY_URL": redis_server_url}
        app = create_app(env)
        store = celery_leases.store(app)
        worker = start_worker("w", pool=pool, **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        r = app.tasks["tests.support.apps.leased_app.retry_or_replace_after"].delay(step, 1.0)
        wait_for(lambda: starts(history, r.id), 30, what="the first run to start")
        # When the store stops answering before the hand-over, until the worker withholds it
        os.kill(lease_redis.process.pid, signals.SIGSTOP)
        try:
            worker.wait_for_log("outcome 'retry' of token", 30)
        finally:
            os.kill(lease_redis.process.pid, signals.SIGCONT)
        # Then the lease was not finished under that token (the task never returned), and
        # only one refusal was logged for it
        time.sleep(1.0)
        record = store.get(r.id)
        assert record.state not in ("succeeded", "failed"), record
        assert worker.log().count(f"[{r.id}]: outcome ") == 1, worker.log()
        # And recovery re-runs it once its lease expires: the waiter gets its result
        deadline = time.monotonic() + 30
        while app.backend.get_task_meta(r.id)["status"] != "SUCCESS":
            assert time.monotonic() < deadline, (store.get(r.id), history())
            store.recover()
            time.sleep(0.5)
        assert r.get(timeout=10) == 3
        record = store.get(r.id)
        assert record.state == "succeeded"
        if pool == "prefork":  # the lease expired with its body run: one recovery
            assert (record.recoveries, record.unstarted_recoveries) == (1, 0)
        else:  # its process runs other tasks too (threads): the blame is uncertain
            assert (record.recoveries, record.unstarted_recoveries) == (0, 1)
        app.close()
    finally:
        lease_redis.stop()


def test_a_requeue_whose_release_is_unconfirmed_stays_a_reject_and_recovery_runs_the_task(
        celery_env, start_worker, history, redis_server_url, tmp_path):
    # Given a lease store on its own Redis, an acks_late worker without recovery, and a task
    # that rejects its message with requeue once its body has run 1 s
    import signal as signals
    from tests.support.apps.leased_app import create_app
    from tests.support.workers import starts
    lease_redis = RedisServer(dir=tmp_path).start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url,
               "LEASES_TEST_HISTORY_URL": redis_server_url, "LEASES_TEST_ACKS_LATE": "1"}
        app = create_app(env)
        store = celery_leases.store(app)
        worker = start_worker("w", pool="threads", **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        r = app.tasks["tests.support.apps.leased_app.reject_requeue_after"].delay(1.0)
        wait_for(lambda: starts(history, r.id), 30, what="the first run to start")
        # When the store stops answering before the release that lets the requeued copy in
        os.kill(lease_redis.process.pid, signals.SIGSTOP)
        try:
            wait_for(lambda: "not released for its requeued copy" in worker.log()
                     or app.backend.get_task_meta(r.id)["status"] != "PENDING", 30,
                     what="the release to fail")
        finally:
            os.kill(lease_redis.process.pid, signals.SIGCONT)
        # Then the Reject stood (no failure stored, the waiter still waits), and recovery runs
        # the task once the lease, no longer renewed, expires
        assert app.backend.get_task_meta(r.id)["status"] == "PENDING", app.backend.get_task_meta(r.id)
        assert "not released for its requeued copy" in worker.log()
        deadline = time.monotonic() + 30
        while app.backend.get_task_meta(r.id)["status"] == "PENDING":
            assert time.monotonic() < deadline, (store.get(r.id), history())
            store.recover()
            time.sleep(0.5)
        assert r.get(timeout=10) == "again"
        assert len(starts(history, r.id)) == 2
        app.close()
    finally:
        lease_redis.stop()
