"""Prometheus metrics: counters move when celery-leases' signals fire (real Redis, real recovery)."""
from __future__ import annotations

import importlib
import sys

import pytest
from celery import Celery

pytest.importorskip("prometheus_client", reason="pip install -e '.[test]' installs prometheus-client")
from prometheus_client import generate_latest  # noqa: E402

import celery_leases  # noqa: E402
from celery_leases.worker.heartbeat import Heartbeat, Held  # noqa: E402
from celery_leases.ops.metrics import enable_prometheus  # noqa: E402

TASKS = "tests.support.apps.leased_app"


def value(registry, name, **labels) -> float:
    return registry.get_sample_value(f"celery_leases_{name}", labels) or 0.0


def test_each_signal_moves_its_counter(client_app, registry, metrics):
    # Given a task of the app (signals are sent with the app or a task as sender)
    task = client_app.tasks[f"{TASKS}.add"]

    # When every signal fires
    celery_leases.lease_acquired.send(sender=task, task_id="t", token=1, owner="w", taken_over=False)
    celery_leases.lease_acquired.send(sender=task, task_id="t", token=2, owner="w", taken_over=True)
    celery_leases.leases_renewed.send(sender=client_app, owner="w", renewed=3, not_renewed=1)
    celery_leases.lease_lost.send(sender=client_app, task_id="t", token=2,
                                  reason="lost")
    celery_leases.lease_recovered.send(sender=client_app, task_id="t", generation=1, recoveries=1,
                                       recovered_after=7.5)
    celery_leases.lease_dead.send(sender=client_app, task_id="t", recoveries=3)
    celery_leases.stale_outcome_rejected.send(sender=task, task_id="t", token=1,
                                              outcome="succeeded", reason="lost")
    celery_leases.delivery_parked.send(sender=task, task_id="t", reason="corrupt", key="k", field="token")
    celery_leases.callbacks_failed.send(sender=task, task_id="t", callback="link callback x",
                                        error=OSError("down"))

    # Then each counter moved by what the signal reported
    assert value(registry, "acquired_total", taken_over="false") == 1
    assert value(registry, "acquired_total", taken_over="true") == 1
    assert value(registry, "renewed_total") == 3
    assert value(registry, "lost_total", reason="lost") == 1
    assert value(registry, "recovered_total") == 1
    assert value(registry, "dead_total") == 1
    assert value(registry, "refused_total", outcome="succeeded") == 1
    assert value(registry, "callbacks_failed_total") == 1
    assert value(registry, "time_to_recovery_seconds_count") == 1
    assert value(registry, "parked_total", field="token") == 1
    assert value(registry, "time_to_recovery_seconds_sum") == 7.5
    assert value(registry, "time_to_recovery_seconds_bucket", le="10.0") == 1
    assert value(registry, "time_to_recovery_seconds_bucket", le="5.0") == 0
    assert b"celery_leases_recovered_total 1.0" in generate_latest(registry)


def test_signals_of_another_app_are_not_counted(registry, metrics):
    other = Celery("other")
    celery_leases.lease_recovered.send(sender=other, task_id="t", generation=1, recoveries=1,
                                       recovered_after=1.0)
    celery_leases.lease_dead.send(sender=other, task_id="t", recoveries=3)
    assert value(registry, "recovered_total") == 0 and value(registry, "dead_total") == 0


def test_enabling_twice_returns_the_same_metrics_and_disable_disconnects(client_app, registry):
    first = enable_prometheus(client_app, registry)
    assert enable_prometheus(client_app, registry) is first
    first.disable()
    celery_leases.lease_dead.send(sender=client_app, task_id="t", recoveries=3)
    assert registry.get_sample_value("celery_leases_dead_total") is None   # unregistered
    enable_prometheus(client_app, registry).disable()   # enabling again works


def test_a_real_recovery_pass_observes_time_to_recovery(client_app, registry, metrics, redis_client,
                                                        key_prefix):
    # Given a lease held for a while by an owner that then vanished (released: due now)
    store = celery_leases.store(client_app)
    envelope = {"exchange": "", "routing_key": key_prefix, "headers": {}, "properties": {},
                "content_type": "application/json", "content_encoding": "utf-8"}
    acq = store.acquire("t1", "w", name=f"{TASKS}.add", body=b"[[1, 2], {}, {}]", envelope=envelope)
    held = store.held_for("t1")
    store.release("w", {"t1": acq.token}, started={"t1"})

    # When a recovery pass re-publishes it
    assert store.recover().recovered == 1

    # Then the recovery was counted and its time since the acquisition observed
    assert value(registry, "recovered_total") == 1
    assert value(registry, "time_to_recovery_seconds_count") == 1
    assert held <= value(registry, "time_to_recovery_seconds_sum") < held + 5
    assert redis_client.llen(key_prefix) == 1   # the copy went to the broker


def test_a_real_dead_task_is_counted(client_app, registry, metrics):
    # Given a task allowed no recovery, whose owner vanished
    store = celery_leases.store(client_app)
    acq = store.acquire("t2", "w", name=f"{TASKS}.add", max_recoveries=0,
                        body=b"[[1, 2], {}, {}]", envelope={"headers": {}, "properties": {}})
    store.release("w", {"t2": acq.token}, started={"t2"})
    # When recovery runs, Then the task is dead and counted
    assert store.recover().dead == 1
    assert value(registry, "dead_total") == 1 and value(registry, "recovered_total") == 0


def test_a_real_corrupt_record_found_by_recovery_is_parked_and_counted(client_app, registry, metrics):
    # Given an expired lease whose record was corrupted (a generation that is not a number)
    store = celery_leases.store(client_app)
    acq = store.acquire("t3", "w", name=f"{TASKS}.add",
                        body=b"[[1, 2], {}, {}]", envelope={"headers": {}, "properties": {}})
    store.release("w", {"t3": acq.token}, started={"t3"})
    store.client.hset(store.keys.record("t3"), "generation", "x")
    # When recovery runs (the app's store parks through the Celery side)
    report = store.recover()
    # Then it is parked, counted by the field that was corrupt, and nothing is recovered
    assert (report.corrupt, report.recovered) == (1, 0)
    assert [p.task_id for p in store.parked()] == ["t3"]
    assert value(registry, "parked_total", field="generation") == 1
    assert value(registry, "recovered_total") == 0


def test_a_heartbeat_tick_counts_the_leases_it_renewed(client_app, registry, metrics):
    # Given a heartbeat holding two live leases and one that was taken from it
    store = celery_leases.store(client_app)
    heartbeat = Heartbeat(store, "w", 1.0, on_lost=lambda *args: None, sender=client_app)
    for task_id in ("a", "b", "c"):
        heartbeat.add(task_id, Held(store.acquire(task_id, "w").token))
    store.revoke("c", owner="w", token=store.get("c").token)   # "c" is no longer renewable
    # When it ticks twice
    heartbeat.tick()
    heartbeat.tick()
    # Then two renewals per tick were counted
    assert value(registry, "renewed_total") == 4


def test_a_missing_prometheus_client_is_an_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "celery_leases.ops.metrics")
    with pytest.raises(ImportError, match=r"pip install 'celery-leases\[prometheus\]'"):
        importlib.import_module("celery_leases.ops.metrics")
