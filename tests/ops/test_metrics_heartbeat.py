"""The metrics of issue #20: renew latency and failures, leases held, recovery passes by
result, and the label values exported at 0 from the start (real Redis)."""
from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="pip install -e '.[test]' installs prometheus-client")

import celery_leases  # noqa: E402
from celery_leases.exceptions import LeaseUnavailable  # noqa: E402
from celery_leases.ops.metrics import LOST_REASONS  # noqa: E402
from celery_leases.protocol.codes import OUTCOMES  # noqa: E402
from celery_leases.recovery.fallback import FallbackRecovery  # noqa: E402
from celery_leases.worker.heartbeat import Heartbeat, Held  # noqa: E402


def value(registry, name, **labels) -> float | None:
    return registry.get_sample_value(f"celery_leases_{name}", labels)


def test_known_label_values_are_exported_at_zero_before_any_event(registry, metrics):
    # rate() and increase() see a first increment only on a series that existed before it
    assert value(registry, "acquired_total", taken_over="true") == 0
    assert value(registry, "acquired_total", taken_over="false") == 0
    for reason in LOST_REASONS:
        assert value(registry, "lost_total", reason=reason) == 0, reason
    for outcome in OUTCOMES:
        assert value(registry, "refused_total", outcome=outcome) == 0, outcome
    for result in ("ran", "skipped", "failed"):
        assert value(registry, "recovery_passes_total", result=result) == 0, result
    assert value(registry, "renew_failures_total") == 0
    assert value(registry, "held") == 0


def test_a_tick_observes_its_renew_latency_and_sets_leases_held(client_app, registry, metrics):
    # Given a heartbeat holding two leases
    store = celery_leases.store(client_app)
    heartbeat = Heartbeat(store, "w", 1.0, on_lost=lambda *args: None, sender=client_app)
    for task_id in ("a", "b"):
        heartbeat.add(task_id, Held(store.acquire(task_id, "w").token))
    # When it ticks twice
    heartbeat.tick()
    heartbeat.tick()
    # Then two renew calls were timed, and the worker holds two leases
    assert value(registry, "renew_seconds_count") == 2
    assert 0 < value(registry, "renew_seconds_sum") < 2
    assert value(registry, "held") == 2
    assert value(registry, "renew_failures_total") == 0
    # And once it holds none, the gauge says so
    heartbeat.forget("a")
    heartbeat.forget("b")
    heartbeat.tick()
    assert value(registry, "held") == 0
    assert value(registry, "renew_seconds_count") == 2   # no call, nothing timed


def test_a_failed_renew_call_is_counted(client_app, registry, metrics, monkeypatch):
    # Given a heartbeat whose store does not answer
    store = celery_leases.store(client_app)
    heartbeat = Heartbeat(store, "w", 1.0, on_lost=lambda *args: None, sender=client_app)
    heartbeat.add("a", Held(store.acquire("a", "w").token))

    def down(*args, **kwargs):
        raise LeaseUnavailable("store down (test)")

    monkeypatch.setattr(store, "renew_many", down)
    # When it ticks
    heartbeat.tick()
    # Then the failed tick is counted and timed, and the lease is still held
    assert value(registry, "renew_failures_total") == 1
    assert value(registry, "renew_seconds_count") == 1
    assert value(registry, "held") == 1


def test_recovery_passes_are_counted_by_result(client_app, registry, metrics, monkeypatch):
    # Given two fallback recoverers of the same store
    store = celery_leases.store(client_app)
    first = FallbackRecovery(store, "w1", 0.05, sender=client_app)
    second = FallbackRecovery(store, "w2", 0.05, sender=client_app)
    # When each runs one interval (the first wins the turn, the second skips)
    for recoverer in (first, second):
        recoverer._stop.wait = _once(recoverer)
        recoverer._run()
    # And the store then fails a pass
    monkeypatch.setattr(store, "try_recovery_turn", lambda *a: (_ for _ in ()).throw(LeaseUnavailable("x")))
    third = FallbackRecovery(store, "w3", 0.05, sender=client_app)
    third._stop.wait = _once(third)
    third._run()
    # Then each result was counted once
    assert value(registry, "recovery_passes_total", result="ran") == 1
    assert value(registry, "recovery_passes_total", result="skipped") == 1
    assert value(registry, "recovery_passes_total", result="failed") == 1


def test_the_beat_recovery_task_reports_its_passes(client_app, registry, metrics):
    recover = client_app.tasks["celery_leases.recover"]
    recover.apply()          # wins the turn
    recover.apply()          # within the interval: skipped
    assert value(registry, "recovery_passes_total", result="ran") == 1
    assert value(registry, "recovery_passes_total", result="skipped") == 1


def _once(recoverer):
    """A ``_stop.wait`` that lets ``_run`` go round exactly once."""
    calls = []

    def wait(timeout):
        calls.append(timeout)
        return len(calls) > 1
    return wait
