"""Misuse and misconfiguration at worker start: refused loudly, once, and no leased body runs.

Real ``celery worker`` subprocesses of tests/support/apps/misuse_app.py. Each case
queues a task *before* the worker starts, so a worker that started anyway
would run it; the refusal is checked by exit status, by the one log line
naming what to fix, and by the task still waiting in its queue.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import celery_leases
from celery_leases.testing.servers import free_port
from celery_leases.testing.servers import RedisServer
from celery_leases.testing import wait_for
from tests.support.workers import ROOT, Worker

APP = "tests.support.apps.misuse_app"
#: What a refused worker exits with (celery_leases/worker/startup.py).
EX_CONFIG, EX_UNAVAILABLE = os.EX_CONFIG, os.EX_UNAVAILABLE


@pytest.fixture
def env(redis_server_url, key_prefix) -> dict:
    return {"MISUSE_BROKER": redis_server_url, "MISUSE_PREFIX": key_prefix}


def client(env: dict):
    from tests.support.apps.misuse_app import create_app
    return create_app(env)


def ran(redis_client, prefix: str) -> list[str]:
    """Task bodies that ran (tests/support/apps/misuse_app.py records each start)."""
    return [r.decode() for r in redis_client.lrange(f"{prefix}:ran", 0, -1)]


def queued(redis_client, prefix: str) -> int:
    return redis_client.llen(prefix)


def refused(env: dict, tmp_path, timeout: float = 30.0) -> tuple[int, str]:
    """Start a worker that must refuse to start: its exit status and its whole output."""
    worker = Worker("refused", env, app=APP, concurrency=1, log_dir=tmp_path)
    with pytest.raises(RuntimeError):
        worker.start(timeout=timeout)
    assert worker.proc is not None
    code = worker.proc.wait(10)
    worker.kill()
    return code, worker.log()


def launch(worker: Worker) -> Worker:
    """Start ``worker`` without waiting for it to be ready (Worker.start waits)."""
    return worker.launch()


def queue_leased_task(env: dict, name: str = "leased") -> str:
    """Send a leased task from a client without the broken task options (those fail a
    publisher at @app.task time: tests/ops/test_config.py)."""
    app = client({k: v for k, v in env.items() if not k.endswith("_OPTIONS")})
    result = app.signature(f"{APP}.{name}", (7,)).delay()
    app.close()
    return result.id


def assert_refused_once(code: int, log: str, expected_code: int, *messages: str) -> None:
    assert code == expected_code, log
    assert log.count("worker not started") == 1, log
    for message in messages:
        assert log.count(message) == 1, (message, log)
    assert "Traceback" not in log, log
    assert " ready." not in log, log


# -- install(app) forgotten ---------------------------------------------------------------------


def test_a_worker_without_install_refuses_to_start_and_runs_nothing(env, redis_client, key_prefix, tmp_path):
    # Given an app with LeasedTasks whose module never calls celery_leases.install(app),
    # and a leased task waiting in its queue
    env = {**env, "MISUSE_INSTALL": "0"}
    queue_leased_task(env)
    # When a worker starts, Then it exits with EX_CONFIG, naming the call that is missing, once
    code, log = refused(env, tmp_path)
    assert_refused_once(code, log, EX_CONFIG, "celery_leases.install(app) was not called")
    assert f"{APP}.leased" in log and f"{APP}.configured" in log
    # and no body ran: the task still waits in the queue
    assert ran(redis_client, key_prefix) == []
    assert queued(redis_client, key_prefix) == 1


def test_a_leased_task_run_by_a_worker_without_a_lease_fails_and_its_body_never_runs(redis_server_url):
    # The fallback where the start-up check cannot know (a LeasedTask registered after start,
    # a hook that failed at receipt): the worker's tracer runs the task with no lease token.
    from celery.app.trace import build_tracer
    from celery import Celery

    bodies = []
    for installed in (False, True):
        app = Celery("late", broker=redis_server_url, backend=redis_server_url, set_as_current=False)
        if installed:
            celery_leases.install(app)

        @app.task(base=celery_leases.LeasedTask, bind=True, shared=False, name=f"late.t{installed}")
        def late(self):
            bodies.append(self.request.id)
            return "ran"

        task = app.tasks[late.name]
        tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
        request = {"id": f"id-{installed}", "delivery_info": {}, "headers": {}, "hostname": "w@h"}
        result = tracer(request["id"], (), {}, request)
        state = app.backend.get_task_meta(request["id"])
        assert state["status"] == "FAILURE", state
        expected = ("celery_leases.install(app) was not called" if not installed
                    else "no lease was taken when the worker received it")
        assert expected in str(state["result"]) and task.name in str(state["result"]), state
        assert result.retval is not None
        app.close()
    assert bodies == []


def test_celerys_in_process_test_worker_without_install_fails_the_task_unrun(redis_server_url, key_prefix):
    # Celery's in-process test worker sends no celeryd_after_setup, and without install(app)
    # there is no Leases bootstep: the start-up check cannot run, the fallback must hold.
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    app = Celery("inproc", broker=redis_server_url, backend=redis_server_url, set_as_current=False)
    app.conf.update(task_default_queue=key_prefix, broker_connection_retry_on_startup=True)
    bodies = []

    @app.task(base=celery_leases.LeasedTask, bind=True, shared=False, name="inproc.charge")
    def charge(self):
        bodies.append(self.request.id)
        return "charged"

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = charge.delay()
        with pytest.raises(celery_leases.ConfigurationError,
                           match=r"task inproc\.charge\[.*\] not run: .*celery_leases\.install\(app\) was not called"):
            result.get(timeout=20)
    assert bodies == []
    app.close()


# -- task options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"MISUSE_TASK_OPTIONS": {"lease_ttl": -5}},
     f"task {APP}.configured: lease_ttl must be a positive number of seconds, got -5"),
    ({"MISUSE_TASK_OPTIONS": {"lease_ttl": "30"}},
     f"task {APP}.configured: lease_ttl must be a positive number of seconds, got '30'"),
    ({"MISUSE_TASK_OPTIONS": {"lease_tll": 3}},
     f"task {APP}.configured: lease_tll: unknown option; did you mean lease_ttl?"),
    # the app's leases_ttl is 5 (tests/support/apps/misuse_app.py)
    ({"MISUSE_TASK_OPTIONS": {"lease_heartbeat_interval": 9}},
     f"task {APP}.configured: lease_heartbeat_interval (9) must be below leases_ttl (5)"),
    ({"MISUSE_PLAIN_OPTIONS": {"lease_ttl": 60}},
     f"task {APP}.plain: lease_ttl=60 is set but the task is not leased"),
], ids=["negative-ttl", "ttl-as-string", "unknown-option", "interval-above-ttl", "not-leased"])
def test_a_worker_refuses_to_start_naming_the_task_option_and_value(env, redis_client, key_prefix,
                                                                     tmp_path, options, message):
    env = {**env, **{k: json.dumps(v) for k, v in options.items()}}
    queue_leased_task(env)
    code, log = refused(env, tmp_path)
    assert_refused_once(code, log, EX_CONFIG, message)
    # the prefix is not repeated ("task x: lease_task x: lease_ttl")
    assert log.count(f"task {APP}.") == 1, log
    assert ran(redis_client, key_prefix) == [] and queued(redis_client, key_prefix) == 1


# -- settings: the worker refuses, a publisher is not broken ----------------------------------------


@pytest.mark.parametrize("settings, message", [
    ({"leases_heartbeat_interval": 9}, "leases_heartbeat_interval (9) must be below leases_ttl (5)"),
    ({"leases_recovery_interval": -1}, "leases_recovery_interval must be a positive number of seconds, got -1"),
    ({"leases_on_lost": "explode"}, "leases_on_lost must be 'flag' or 'terminate', got 'explode'"),
    ({"leases_tll": 3}, "leases_tll: unknown setting; did you mean leases_ttl?"),
], ids=["heartbeat-interval", "recovery-interval", "on-lost", "misspelt"])
def test_a_worker_only_setting_error_stops_the_worker_but_not_a_publisher(env, redis_client, key_prefix,
                                                                          tmp_path, settings, message):
    env = {**env, "MISUSE_SETTINGS": json.dumps(settings)}
    # Given a process that only publishes (the web tier): import proj and send a task work
    publisher = subprocess.run(
        [sys.executable, "-c", f"from {APP} import app; print(app.signature('{APP}.leased', (7,)).delay().id)"],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert publisher.returncode == 0, publisher.stderr
    assert queued(redis_client, key_prefix) == 1
    # When a worker starts with the same settings, Then it refuses, naming the setting once
    code, log = refused(env, tmp_path)
    assert_refused_once(code, log, EX_CONFIG, message)
    assert ran(redis_client, key_prefix) == [] and queued(redis_client, key_prefix) == 1


def test_a_publisher_setting_error_fails_at_import_naming_it(env):
    env = {**env, "MISUSE_SETTINGS": json.dumps({"leases_key_prefix": "orders\t"})}
    publisher = subprocess.run([sys.executable, "-c", f"import {APP}"],
                               env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                               capture_output=True, text=True, timeout=60)
    assert publisher.returncode != 0
    assert ("leases_key_prefix must be a non-empty string without whitespace, braces or control "
            "characters, got 'orders\\t'") in publisher.stderr


# -- lease store down at start ------------------------------------------------------------------------


def test_a_worker_waits_for_its_lease_store_and_runs_nothing_until_it_answers(env, redis_client,
                                                                             key_prefix, tmp_path):
    # Given a lease store URL with no server behind it yet, and a leased task in the queue
    port = free_port()
    env = {**env, "MISUSE_LEASES_URL": f"redis://127.0.0.1:{port}/0"}
    task_id = queue_leased_task(env)
    worker = launch(Worker("waits", env, app=APP, concurrency=1, log_dir=tmp_path))
    server = RedisServer(port=port, dir=tmp_path / "leases")
    try:
        # When the worker starts, Then it logs Celery-style retry lines and runs nothing
        wait_for(lambda: worker.log().count("Trying again in") >= 2, 30, what="two retry lines")
        log = worker.log()
        assert f"Cannot connect to redis://127.0.0.1:{port}/0 (leases_redis_url)" in log
        assert "Trying again in 2.00 seconds... (1/100)" in log and "(2/100)" in log, log
        assert worker.proc.poll() is None and " ready." not in log
        assert ran(redis_client, key_prefix) == [] and queued(redis_client, key_prefix) == 1
        # When the store comes up, Then the worker becomes ready and runs the task under a lease
        server.start()
        wait_for(lambda: " ready." in worker.log(), 40, what="the worker to be ready")
        app = client(env)
        assert app.AsyncResult(task_id).get(timeout=20) == 7
        assert celery_leases.store(app).get(task_id).state == "succeeded"
        [entry] = ran(redis_client, key_prefix)
        assert entry.startswith(f"leased|{task_id}|") and not entry.endswith("|None")
        log = worker.log()
        # nothing was received before the store answered
        assert log.index(" ready.") > log.rindex("Trying again in") and "Traceback" not in log
        app.close()
    finally:
        worker.kill()
        server.stop()


@pytest.mark.parametrize("settings, expected", [
    ({"broker_connection_max_retries": 1}, "still unreachable after 1 retries (broker_connection_max_retries)"),
    ({"broker_connection_retry_on_startup": False}, "(broker_connection_retry_on_startup is off)"),
], ids=["max-retries", "retry-off"])
def test_a_worker_whose_lease_store_never_answers_exits_with_one_line(env, redis_client, key_prefix,
                                                                     tmp_path, settings, expected):
    port = free_port()
    env = {**env, "MISUSE_LEASES_URL": f"redis://:s3cret@127.0.0.1:{port}/0",
           "MISUSE_SETTINGS": json.dumps(settings)}
    code, log = refused(env, tmp_path)
    assert_refused_once(code, log, EX_UNAVAILABLE, expected)
    assert f"lease store redis://:***@127.0.0.1:{port}/0 (leases_redis_url)" in log
    assert "s3cret" not in log
    assert ran(redis_client, key_prefix) == []


def test_a_lease_store_url_that_does_not_parse_stops_the_worker_in_one_line(env, redis_client, key_prefix,
                                                                          tmp_path):
    # (set after install(app), as a later config_from_object brings it: install() would refuse it
    # at import, tests/ops/test_redis_urls.py)
    queue_leased_task(env)
    env = {**env, "MISUSE_LATE_SETTINGS": json.dumps({"leases_redis_url": "redis://:s3cret@127.0.0.1:port/0"})}
    code, log = refused(env, tmp_path)
    assert_refused_once(code, log, EX_CONFIG, "leases_redis_url must be a Redis URL (",
                        "the port must be a number from 1 to 65535", "got 'redis://:***@127.0.0.1:port/0'")
    assert "s3cret" not in log
    assert ran(redis_client, key_prefix) == [] and queued(redis_client, key_prefix) == 1


def test_a_worker_waiting_for_its_lease_store_stops_on_sigterm(env, tmp_path):
    env = {**env, "MISUSE_LEASES_URL": f"redis://127.0.0.1:{free_port()}/0"}
    worker = launch(Worker("sigterm", env, app=APP, concurrency=1, log_dir=tmp_path))
    try:
        wait_for(lambda: "Trying again in" in worker.log(), 30, what="a retry line")
        started = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.wait(10)
        assert time.monotonic() - started < 5
        assert " ready." not in worker.log()
    finally:
        worker.kill()
