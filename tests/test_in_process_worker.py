"""Leased tasks under Celery's in-process test worker (``celery.contrib.testing.worker``).

This is how most users test their tasks (the ``celery_worker`` fixtures of
``celery.contrib.pytest`` use it), and how Celery's own integration suite runs
(``make celery-suite``). Celery 5.7 copies the request into a new Context on
every call of the task; whatever the lease keeps per execution must survive
that copy and never leak into the headers a retry re-publishes.
"""
from __future__ import annotations

import time
from uuid import uuid4

import pytest
from celery import Celery, chain
from celery.contrib.testing.worker import start_worker
from celery.exceptions import ImproperlyConfigured

import celery_leases
from celery_leases.testing import make_stale, wait_for_lease

POOLS = ("solo", "threads")


class Flaky(Exception):
    pass


@pytest.fixture(params=POOLS)
def app(request, redis_server_url: str, key_prefix: str):
    app = Celery(f"inproc{uuid4().hex[:6]}", broker=redis_server_url, backend=redis_server_url,
                 task_cls="celery_leases:LeasedTask")
    app.conf.update(task_default_queue=f"{key_prefix}:q", result_extended=True,
                    leases_key_prefix=key_prefix, leases_ttl=2, leases_recovery_interval=1)
    celery_leases.install(app)
    app.pool_name = request.param
    attempts: dict = {}

    @app.task(bind=True, shared=False, name="inproc.flaky", max_retries=3)
    def flaky(self, succeed_on: int):
        attempts[self.request.id] = self.request.retries
        if self.request.retries < succeed_on:
            raise self.retry(exc=Flaky(f"attempt {self.request.retries}"), countdown=0.5)
        return {"token": self.lease.token, "retries": self.request.retries}

    @app.task(bind=True, shared=False, name="inproc.identity")
    def identity(self, x):
        return x

    @app.task(bind=True, shared=False, name="inproc.replace_empty")
    def replace_empty(self, *_):
        return self.replace(chain())

    @app.task(bind=True, shared=False, name="inproc.replace_with")
    def replace_with(self, x):
        return self.replace(identity.s(x * 10))

    @app.task(bind=True, shared=False, name="inproc.slow")
    def slow(self, seconds):
        time.sleep(seconds)
        return self.lease.token

    yield app
    app.close()


def _worker(app):
    return start_worker(app, pool=app.pool_name, concurrency=2, perform_ping_check=False,
                        loglevel="WARNING", shutdown_timeout=10)


def test_a_retry_is_visible_as_retry_and_the_task_then_completes(app):
    with _worker(app):
        result = app.tasks["inproc.flaky"].delay(2)
        seen = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and result.status not in ("SUCCESS", "FAILURE"):
            seen.add(result.status)
            time.sleep(0.05)
        assert "RETRY" in seen
        value = result.get(timeout=10)
        assert value["retries"] == 2
        record = celery_leases.store(app).get(result.id)
        assert record.state == "succeeded" and record.token == value["token"]


def test_retries_used_up_store_the_tasks_own_exception(app):
    app.tasks["inproc.flaky"].max_retries = 1
    with _worker(app):
        result = app.tasks["inproc.flaky"].delay(5)
        with pytest.raises(Flaky):
            result.get(timeout=10)
        assert celery_leases.store(app).get(result.id).state == "failed"


def test_replace_with_an_empty_chain_fails_as_in_plain_celery(app):
    with _worker(app):
        result = app.tasks["inproc.replace_empty"].delay()
        with pytest.raises(ImproperlyConfigured, match="Cannot replace with an empty chain"):
            result.get(timeout=10)
        assert celery_leases.store(app).get(result.id).state == "failed"


def test_replace_hands_the_lease_to_the_replacement(app):
    with _worker(app):
        result = app.tasks["inproc.replace_with"].delay(4)
        assert result.get(timeout=10) == 40
        assert celery_leases.store(app).get(result.id).state == "succeeded"


def test_the_heartbeat_renews_a_task_longer_than_its_ttl(app):
    with _worker(app):
        result = app.tasks["inproc.slow"].delay(5)  # ttl 2 s
        token = result.get(timeout=20)
        record = celery_leases.store(app).get(result.id)
        assert record.state == "succeeded" and record.token == token and record.recoveries == 0


def test_a_task_taken_from_its_owner_is_run_again_and_only_the_new_outcome_stands(app):
    with _worker(app):
        result = app.tasks["inproc.slow"].delay(2)
        first = wait_for_lease(app, result.id)
        report = make_stale(app, result.id)  # expire and recover: re-published, generation + 1
        assert report.recovered == 1
        token = result.get(timeout=20)
        record = celery_leases.store(app).get(result.id)
        assert token > first.token
        assert record.state == "succeeded" and record.token == token and record.generation == 1
