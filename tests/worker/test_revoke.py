"""Revokes on real `celery worker` processes: every revoke path Celery 5.7 has reaches the
lease (celery_leases/worker/revokes.py), and a revoked task never runs again.

Each scenario puts a task in one state (queued in the broker, prefetched, held for its
ETA, running, finished), revokes it, checks what Celery and the lease say, then (where
the scenario says) SIGKILLs the worker, runs a recovery pass and starts a fresh worker
(one that never heard of the revoke: ``--without-mingle``), and checks the task was not
run again, its waiter sees REVOKED and its link callback never fired.
"""
from __future__ import annotations

import time

import pytest
from celery.exceptions import TaskRevokedError

import celery_leases
from celery_leases.testing import wait_for, wait_for_lease
from tests.support.workers import starts

TASKS = "tests.support.apps.leased_app"
POOLS = ["prefork", "threads"]


def sleeper(app, value, seconds, **options):
    callback = app.signature(f"{TASKS}.note_callback")
    return app.signature(f"{TASKS}.sleep_then_echo", (value, seconds)).apply_async(link=callback, **options)


def started(start_worker, app, name, **kwargs):
    """A worker that takes remote-control commands: a broadcast sent before its pidbox
    queue is bound (just after "ready") never reaches it."""
    worker = start_worker(name, **kwargs)
    wait_for(lambda: app.control.ping(timeout=0.5), 15, what=f"worker {name} to answer a ping")
    return worker


def callbacks(history, value) -> list:
    return [h for h in history() if h[0] == "callback" and h[3].get("value") == value]


def status(app, result) -> str:
    return app.backend.get_task_meta(result.id)["status"]


def crash_and_recover(worker, store, start_worker, pool, wait: float = 4.0):
    """SIGKILL the worker, let its leases run out, recover them, start a fresh worker."""
    worker.kill()
    time.sleep(2.2)  # the test app's ttl is 2 s
    store.recover()
    fresh = start_worker("fresh", pool=pool, concurrency=1)
    time.sleep(wait)
    return fresh


def assert_revoked_for_good(app, store, history, result, value, runs: int) -> None:
    """The task ran ``runs`` times (before its revoke) and never after; REVOKED stands."""
    wait_for(lambda: status(app, result) == "REVOKED", 15, what="REVOKED in the backend")
    with pytest.raises(TaskRevokedError):
        result.get(timeout=5)
    assert len(starts(history, result.id)) == runs
    assert store.get(result.id).state == "revoked"
    assert callbacks(history, value) == []


@pytest.mark.parametrize("pool", POOLS)
def test_revoke_of_a_queued_task_holds_on_a_fresh_worker(pool, client_app, start_worker, history):
    # Given a busy worker: one task running, one prefetched, the target still in the broker
    a = started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    first = sleeper(client_app, "first", 3.0)
    wait_for(lambda: starts(history, first.id), 10, what="the first task to start")
    second = sleeper(client_app, "second", 0.0)
    wait_for_lease(client_app, second.id, 10)  # prefetched: leased at receipt
    target = sleeper(client_app, "queued", 0.0)
    time.sleep(0.5)
    assert store.get(target.id).state == "queued"  # recorded at publish, not delivered yet
    # When the queued target is revoked
    client_app.control.revoke(target.id)
    # Then its lease ends revoked before any worker received it, and REVOKED is stored
    wait_for(lambda: store.get(target.id).state == "revoked", 5, what="the revoke to reach the lease")
    assert status(client_app, target) == "REVOKED"
    # And when the worker dies before the target is delivered and a fresh worker takes over
    crash_and_recover(a, store, start_worker, pool)
    # Then the fresh worker (which never heard of the revoke) does not run it
    assert_revoked_for_good(client_app, store, history, target, "queued", runs=0)
    assert first.get(timeout=15) == "first" and second.get(timeout=15) == "second"


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("crash", [False, True], ids=["worker-lives", "worker-killed"])
def test_revoke_of_a_prefetched_task(pool, crash, client_app, start_worker, history):
    # Given a worker running one task and holding the target prefetched (leased, not started)
    a = started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    first = sleeper(client_app, "first", 6.0)
    wait_for(lambda: starts(history, first.id), 10, what="the first task to start")
    target = sleeper(client_app, "prefetched", 0.0)
    wait_for_lease(client_app, target.id, 10)  # prefetched: leased at receipt
    # When it is revoked (Celery's revoke command stores REVOKED without announcing it)
    client_app.control.revoke(target.id)
    # Then the lease ends revoked at once, long before the target's turn comes
    wait_for(lambda: store.get(target.id).state == "revoked", 3, what="the lease to end revoked")
    assert not first.ready()
    assert status(client_app, target) == "REVOKED"
    if crash:
        # And a crash, a recovery pass and a fresh worker do not bring it back
        crash_and_recover(a, store, start_worker, pool)
    else:
        # And when its turn comes on the same worker, its body does not run (threads too)
        assert first.get(timeout=15) == "first"
        time.sleep(2.0)
    assert_revoked_for_good(client_app, store, history, target, "prefetched", runs=0)


@pytest.mark.parametrize("pool", POOLS)
def test_revoke_of_an_eta_task(pool, client_app, start_worker, history):
    # Given a worker holding the target until its ETA (leased at receipt)
    a = started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    eta = time.monotonic() + 8
    target = sleeper(client_app, "eta", 0.0, countdown=8)
    wait_for_lease(client_app, target.id, 10)  # held for its ETA: leased at receipt
    # When it is revoked
    client_app.control.revoke(target.id)
    # Then its lease ends revoked at once, long before its ETA
    wait_for(lambda: store.get(target.id).state == "revoked", 3, what="the lease to end revoked")
    assert status(client_app, target) == "REVOKED"
    # And the worker killed, a recovery pass and a fresh worker past the ETA never run it
    crash_and_recover(a, store, start_worker, pool, wait=0.0)
    time.sleep(max(0.0, eta - time.monotonic()) + 3.0)
    assert_revoked_for_good(client_app, store, history, target, "eta", runs=0)


@pytest.mark.parametrize("pool", POOLS)
def test_a_plain_revoke_lets_the_running_task_finish(pool, client_app, start_worker, history):
    # Given a running task
    started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    target = sleeper(client_app, "running", 2.0)
    wait_for(lambda: starts(history, target.id), 10, what="the target to start")
    # When it is revoked without terminate (Celery does not stop it)
    client_app.control.revoke(target.id)
    # Then it runs to the end, its outcome stands and its callback fires, once
    assert target.get(timeout=15) == "running"
    assert store.get(target.id).state == "succeeded"
    wait_for(lambda: callbacks(history, "running"), 10, what="the callback")
    assert len(starts(history, target.id)) == 1


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("terminate", [False, True], ids=["revoke", "terminate"])
def test_a_task_revoked_while_running_is_not_run_again_after_its_worker_died(
        pool, terminate, client_app, start_worker, history):
    # Given a running task (threads cannot terminate: a terminate is then a plain revoke)
    a = started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    target = sleeper(client_app, "running", 6.0)
    wait_for(lambda: starts(history, target.id), 10, what="the target to start")
    # When it is revoked while it runs, and its worker dies before it finished
    client_app.control.revoke(target.id, terminate=terminate)
    time.sleep(0.5)
    crash_and_recover(a, store, start_worker, pool)
    # Then no worker runs it again: its waiter gets REVOKED and no callback fires
    assert_revoked_for_good(client_app, store, history, target, "running", runs=1)


def test_terminate_on_prefork_is_a_revoke_not_a_refused_failure(client_app, start_worker, history):
    # Given a running task on prefork
    a = started(start_worker, client_app, "a", pool="prefork", concurrency=1)
    store = celery_leases.store(client_app)
    target = sleeper(client_app, "terminated", 6.0)
    wait_for(lambda: starts(history, target.id), 10, what="the target to start")
    # When it is revoked with terminate (its pool process is killed)
    client_app.control.revoke(target.id, terminate=True)
    # Then the lease ends revoked and the waiter gets REVOKED at once
    wait_for(lambda: store.get(target.id).state == "revoked", 5, what="the lease to end revoked")
    with pytest.raises(TaskRevokedError):
        target.get(timeout=5)
    # And the worker goes on with the next task once its pool settled the terminated one
    assert sleeper(client_app, "next", 0.0).get(timeout=20) == "next"
    # And the child's death was handled as the revoke it is, never as a refused outcome
    time.sleep(0.5)
    log = a.log()
    assert "refused" not in log and "pool process lost" not in log, log
    assert store.stats().get("refused", 0) == 0
    assert_revoked_for_good(client_app, store, history, target, "terminated", runs=1)


@pytest.mark.parametrize("pool", POOLS)
def test_revoke_of_a_finished_task_leaves_its_result(pool, client_app, start_worker, history):
    # Given a task that failed (FAILURE stored) and one whose result is ignored (nothing stored)
    started(start_worker, client_app, "a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    failed = client_app.signature(f"{TASKS}.tsum", ([1, "x"],)).delay()
    with pytest.raises(TypeError):
        failed.get(timeout=15)
    ignored = client_app.signature(f"{TASKS}.add_ignored", (1, 2)).delay()
    wait_for(lambda: getattr(store.get(ignored.id), "state", None) == "succeeded", 10,
             what="the ignored-result task to succeed")
    # When both are revoked, and a late copy of the failed one is delivered to the revoking worker
    client_app.control.revoke([failed.id, ignored.id])
    time.sleep(1.0)
    client_app.signature(f"{TASKS}.tsum", ([1, "x"],)).apply_async(task_id=failed.id)
    time.sleep(2.0)
    # Then neither stored result was touched, and the leases still say how they finished
    assert status(client_app, failed) == "FAILURE"
    assert status(client_app, ignored) == "PENDING"
    assert store.get(failed.id).state == "failed"
    assert store.get(ignored.id).state == "succeeded"
    assert len(starts(history, failed.id)) == 1


@pytest.mark.parametrize("pool", POOLS)
def test_a_revoke_while_the_lease_store_is_unreachable_reaches_the_lease_later(
        pool, celery_env, start_worker, history, tmp_path):
    import os
    import signal

    from tests.support.apps.leased_app import create_app
    from celery_leases.testing.servers import RedisServer

    # Given a lease store on its own Redis, and a worker holding a task for its ETA
    lease_redis = RedisServer(dir=tmp_path / "leases").start()
    try:
        env = {**celery_env, "LEASES_TEST_LEASES_URL": lease_redis.url,
               "LEASES_TEST_HISTORY_URL": celery_env["LEASES_TEST_BROKER"],
               "LEASES_TEST_UNAVAILABLE_DELAY": "1"}
        app = create_app(env)
        store = celery_leases.store(app)
        a = started(start_worker, app, "a", pool=pool, concurrency=1,
                    **{k: v for k, v in env.items() if k.startswith("LEASES_TEST_")})
        eta = sleeper(app, "eta", 0.0, countdown=25)
        wait_for_lease(app, eta.id, 10)  # held for its ETA: leased at receipt
        early = f"revoked-before-delivery-{os.urandom(4).hex()}"
        # When the lease store stops answering (SIGSTOP) while the ETA task is revoked, and
        # a task is revoked before it is sent, then sent (found revoked at receipt)
        os.kill(lease_redis.process.pid, signal.SIGSTOP)
        try:
            app.control.revoke([eta.id, early])
            time.sleep(0.5)
            late = app.signature(f"{TASKS}.sleep_then_echo", ("late", 0.0)).apply_async(task_id=early)
            # Then Celery revokes both as usual: REVOKED stored, nothing run, the worker alive
            wait_for(lambda: status(app, eta) == "REVOKED" and status(app, late) == "REVOKED", 30,
                     what="Celery to store REVOKED for both")
            assert a.proc.poll() is None
        finally:
            os.kill(lease_redis.process.pid, signal.SIGCONT)
        # And once the store answers, the held-back revoke reaches the lease, before the ETA
        wait_for(lambda: store.get(eta.id).state == "revoked", 10, what="the held revoke to be applied")
        # (the publish record of ``early`` may reach the store after the revoke was held, in
        # either order: the record ends revoked all the same)
        wait_for(lambda: getattr(store.get(early), "state", None) == "revoked", 10,
                 what="the other held revoke to be applied")
        # (the worker logs it once every held revoke is applied: after the store shows them)
        a.wait_for_log("held-back revoke(s) applied", 10)
        log = a.log()
        assert "lease store unreachable during a revoke" in log
        assert "Traceback" not in log, log
        assert starts(history, eta.id) == [] and starts(history, early) == []
        app.close()
    finally:
        lease_redis.stop()


@pytest.mark.parametrize("terminate", [False, True], ids=["revoke", "terminate"])
def test_solo_takes_the_revoke_of_its_running_task_after_it_finished(terminate, client_app,
                                                                    start_worker, history):
    # Given a running task on solo (its main process runs the body: commands wait for it)
    a = started(start_worker, client_app, "a", pool="solo", concurrency=1)
    store = celery_leases.store(client_app)
    target = sleeper(client_app, "solo", 2.0)
    wait_for(lambda: starts(history, target.id), 10, what="the target to start")
    # When it is revoked (with terminate) while it runs
    client_app.control.revoke(target.id, terminate=terminate)
    # Then, as in Celery, it finishes: its outcome stands, its callback fires once
    assert target.get(timeout=15) == "solo"
    wait_for(lambda: callbacks(history, "solo"), 10, what="the callback")
    time.sleep(1.0)
    assert status(client_app, target) == "SUCCESS" and store.get(target.id).state == "succeeded"
    # And a late copy is dropped without touching the result, nothing crashed in Celery
    client_app.signature(f"{TASKS}.sleep_then_echo", ("solo", 0.0)).apply_async(task_id=target.id)
    time.sleep(1.5)
    assert status(client_app, target) == "SUCCESS" and len(starts(history, target.id)) == 1
    assert "Traceback" not in a.log()
