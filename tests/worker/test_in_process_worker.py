"""Leased tasks under Celery's in-process test worker (``celery.contrib.testing.worker``).

This is how most users test their tasks (the ``celery_worker`` fixtures of
``celery.contrib.pytest`` use it), and how Celery's own integration suite runs
(``make celery-suite``). Celery 5.7 copies the request into a new Context on
every call of the task; whatever the lease keeps per execution must survive
that copy and never leak into the headers a retry re-publishes.
"""
from __future__ import annotations

import time
from collections import Counter
from uuid import uuid4

import pytest
from celery import Celery, chain
from celery.contrib.testing.worker import start_worker
from celery.exceptions import ImproperlyConfigured
from kombu.serialization import dumps

import celery_leases
from celery_leases.publishing.publish_id import PUBLISH_HEADER, new_publish_id
from celery_leases.recovery.messages import publish_raw
from celery_leases.signals import delivery_refused
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

    runs: Counter = Counter()
    app.runs = runs  # runs of each task id (the in-process worker shares this process)

    @app.task(bind=True, shared=False, name="inproc.count")
    def count(self, *_):
        runs[self.request.id] += 1
        return runs[self.request.id]

    @app.task(bind=True, shared=False, name="inproc.boom")
    def boom(self, *_):
        runs[self.request.id] += 1
        raise Flaky(f"run {runs[self.request.id]}")

    @app.task(shared=False, name="inproc.errback_old_style")
    def errback_old_style(task_id):
        runs[f"errback:{task_id}"] += 1

    @app.task(shared=False, name="inproc.errback_new_style")
    def errback_new_style(request, exc, traceback):
        runs[f"errback:{request.id}"] += 1

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


def _stored(app, task_id):
    """The backend's record now (AsyncResult answers a ready result from the backend's cache)."""
    return app.backend.get_task_meta(task_id, cache=False)


def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- the same task id published again (issue #16) ---------------------------------------------
# Plain Celery runs every publish of a task id: a frozen signature, chain or chord applied
# twice runs twice. The lease refuses only copies of one publish (restored, redelivered,
# recovered), never a new publish of a task whose record is finished. (A frozen chord
# applied again is Celery's test_reapplying_frozen_chord_dispatches_body_again, run by
# make celery-suite; here it is flaky in plain Celery too, see docs/celery.md.)

def test_a_frozen_signature_applied_again_runs_again(app):
    store = celery_leases.store(app)
    with _worker(app):
        sig = app.tasks["inproc.count"].s()
        sig.freeze()
        assert sig.apply_async().get(timeout=10) == 1
        first = store.get(sig.id)
        # (get() would answer at once with the first run's stored result, as in plain Celery.)
        sig.apply_async()
        _until(lambda: _stored(app, sig.id)["result"] == 2)
        second = store.get(sig.id)
        assert second.state == "succeeded" and second.token > first.token
        assert app.runs[sig.id] == 2


@pytest.mark.parametrize("errback", ["inproc.errback_old_style", "inproc.errback_new_style"])
def test_a_failed_task_published_again_fails_again_and_calls_its_errback_again(app, errback):
    """A frozen failing step reused in a second canvas (Celery's test_mutable_errback_* tests)."""
    with _worker(app):
        fail = app.tasks["inproc.boom"].s()
        fail.link_error(app.tasks[errback].s())
        fail.freeze()
        for run in (1, 2):
            fail.apply_async()
            _until(lambda: app.runs[f"errback:{fail.id}"] == run)
            assert app.runs[fail.id] == run
            _until(lambda: f"run {run}" in str(_stored(app, fail.id)["result"]))
        assert celery_leases.store(app).get(fail.id).state == "failed"


def test_copies_of_one_publish_run_once_even_after_the_id_ran_again(app):
    """The duplicate guarantee stands: a copy of a publish that already ran (kombu's restore,
    a redelivery) is refused, before and after a new publish of the same id ran."""
    queue = app.conf.task_default_queue
    refused: list = []

    def on_refused(sender=None, task_id=None, reason=None, **_):
        refused.append((task_id, reason))

    delivery_refused.connect(on_refused, weak=False)
    try:
        with _worker(app):
            task_id = uuid4().hex
            headers, properties, body, _ = app.amqp.as_task_v2(task_id, "inproc.count", args=(), kwargs={})
            headers[PUBLISH_HEADER] = new_publish_id()
            envelope = {"exchange": "", "routing_key": queue, "properties": properties,
                        "content_type": "application/json", "content_encoding": "utf-8"}
            _, _, raw = dumps(body, serializer="json")

            def copy():
                publish_raw(app, raw, envelope, dict(headers), declare=[app.amqp.queues[queue]])

            copy()
            _until(lambda: app.runs[task_id] == 1)
            copy()  # a second copy of the same publish, after it finished
            _until(lambda: len(refused) == 1)
            assert app.AsyncResult(task_id).get(timeout=10) == 1
            # A new publish of the id runs again ...
            app.tasks["inproc.count"].apply_async(task_id=task_id)
            _until(lambda: _stored(app, task_id)["result"] == 2)
            # ... and a copy of the first publish is still refused after it.
            copy()
            _until(lambda: len(refused) == 2)
            time.sleep(0.5)
            assert app.runs[task_id] == 2
            assert [r[0] for r in refused] == [task_id, task_id]
    finally:
        delivery_refused.disconnect(on_refused)
