"""An isolated run's body starts only after its start mark reached the store.

The store charges an isolated task nothing for a death before its mark (a waited
death, docs/recovery.md): that is exact only if no isolated body ever runs unmarked.
The task is called as the worker calls it (a request carrying the lease the acquire
answered with ``isolate``), against a real redis-server that is then stopped.
"""
from __future__ import annotations

from uuid import uuid4

import pytest
from celery import Celery

import celery_leases
from celery_leases import StaleOutcome
from celery_leases.runtime import get_store
from tests.protocol.scripts_support import A, fields


@pytest.fixture
def setup(own_server):
    server = own_server("leases")
    app = Celery(f"isolated{uuid4().hex[:6]}", broker="memory://", task_cls="celery_leases:LeasedTask")
    app.conf.update(leases_redis_url=server.url, leases_key_prefix="iso", leases_ttl=30)
    celery_leases.install(app)
    ran = []

    @app.task(bind=True, shared=False, name="iso.body")
    def body(self):
        ran.append(self.request.id)
        return "done"

    yield app, server, body, ran
    app.close()


def _call_isolated(app, task):
    """Acquire a lease for a new task id, then run the task as the worker runs an isolated run."""
    store = get_store(app)
    task_id = uuid4().hex
    acq = store.acquire(task_id, A, name=task.name, body=b"[[], {}, {}]",
                        envelope={"routing_key": "celery"}, shared=True)
    assert acq.owned
    task.push_request(id=task_id, lease_token=acq.token, lease_owner=A, lease_generation=0,
                      lease_isolate=1)
    try:
        return store, task_id, task()
    finally:
        task.pop_request()


def test_an_isolated_body_runs_after_its_alone_mark(setup):
    app, _, task, ran = setup
    store, task_id, result = _call_isolated(app, task)
    assert (result, ran) == ("done", [task_id])
    record = fields(store, task_id)
    assert (record["started"], record["alone"]) == (b"1", b"1")


def test_an_isolated_body_does_not_run_when_its_mark_cannot_be_taken(setup):
    app, server, task, ran = setup
    store = get_store(app)
    task_id = uuid4().hex
    acq = store.acquire(task_id, A, name=task.name, body=b"[[], {}, {}]",
                        envelope={"routing_key": "celery"}, shared=True)
    # When the store goes away between the acquire and the isolated run's start
    server.stop()
    task.push_request(id=task_id, lease_token=acq.token, lease_owner=A, lease_generation=0,
                      lease_isolate=1)
    try:
        with pytest.raises(StaleOutcome, match="not marked started for its isolated run"):
            task()
    finally:
        task.pop_request()
    # Then the body never ran: a death now would be waited, and that must be true
    assert ran == []
