"""OpenTelemetry: the lease on the task span, on Celery's in-process worker (threads pool)
with the real instrumentor and the SDK's in-memory exporter."""
from __future__ import annotations

import ast
import json
import importlib
import sys
import time
from pathlib import Path
from uuid import uuid4

import pytest

pytest.importorskip("opentelemetry.sdk", reason="pip install -e '.[test]' installs opentelemetry-sdk")
pytest.importorskip("opentelemetry.instrumentation.celery")
from celery import Celery  # noqa: E402
from celery.contrib.testing.worker import start_worker  # noqa: E402
from opentelemetry.instrumentation.celery import CeleryInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import celery_leases  # noqa: E402
from celery_leases.ops import tracing  # noqa: E402
from celery_leases.testing import make_stale, wait_for_lease  # noqa: E402
from tests.support.source import parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    yield exporter
    instrumentor.uninstrument()
    tracing.disable()


@pytest.fixture
def app(redis_server_url: str, key_prefix: str):
    app = Celery(f"traced{uuid4().hex[:6]}", broker=redis_server_url, backend=redis_server_url,
                 task_cls="celery_leases:LeasedTask")
    app.conf.update(task_default_queue=f"{key_prefix}:q", leases_key_prefix=key_prefix,
                    leases_ttl=2, leases_recovery_interval=1, leases_worker_recovery=False)
    celery_leases.install(app)

    @app.task(bind=True, shared=False, name="traced.slow")
    def slow(self, seconds):
        time.sleep(seconds)
        return self.lease.token

    yield app
    app.close()


def _worker(app, concurrency=2):
    return start_worker(app, pool="threads", concurrency=concurrency, perform_ping_check=False,
                        loglevel="WARNING", shutdown_timeout=10)


def runs(exporter, task_id):
    """The finished run spans of ``task_id``, oldest first."""
    spans = [s for s in exporter.get_finished_spans()
             if s.name == "run/traced.slow" and s.attributes.get("messaging.message.id") == task_id]
    return sorted(spans, key=lambda s: s.start_time)


def _until(check, timeout=15.0, exporter=None):
    deadline = time.monotonic() + timeout
    while not check():
        spans = [(s.name, dict(s.attributes)) for s in exporter.get_finished_spans()] if exporter else None
        assert time.monotonic() < deadline, f"timed out; finished spans: {spans}"
        time.sleep(0.05)


def test_a_run_span_carries_its_lease(app, exporter):
    tracing.enable(app)
    with _worker(app):
        result = app.tasks["traced.slow"].delay(0.1)
        token = result.get(timeout=15)
        _until(lambda: runs(exporter, result.id), exporter=exporter)
    (span,) = runs(exporter, result.id)
    assert span.attributes["celery_leases.token"] == token
    assert span.attributes["celery_leases.generation"] == 0
    assert span.attributes["celery_leases.recovered"] is False
    assert not span.events and not span.links


def test_a_recovered_run_links_to_the_run_it_replaces_whose_loss_and_refusal_are_events(app, exporter):
    tracing.enable(app)
    # One run at a time: the instrumentor keys the spans under way by task and task id, so
    # two runs of one id at once in one process would end each other's span (docs: Tracing).
    app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1)
    with _worker(app, concurrency=1):
        # Given a run taken from its owner mid-body (expired and recovered: re-published)
        result = app.tasks["traced.slow"].delay(2.5)
        first = wait_for_lease(app, result.id)
        assert make_stale(app, result.id).recovered == 1
        token = result.get(timeout=20)
        # When both runs ended (the first one's outcome refused)
        _until(lambda: len(runs(exporter, result.id)) == 2, exporter=exporter)
    old, new = runs(exporter, result.id)
    # Then the first run's span says it lost the lease and its outcome was refused
    assert old.attributes["celery_leases.token"] == first.token
    assert old.attributes["celery_leases.recovered"] is False
    names = [e.name for e in old.events]
    assert names.count("celery_leases.lease_lost") == 1 and "celery_leases.refused" in names, names
    refused = next(e for e in old.events if e.name == "celery_leases.refused")
    assert refused.attributes["celery_leases.outcome"] == "succeeded"
    # And the recovered run carries its own lease and links to the run it replaces
    assert new.attributes["celery_leases.token"] == token > first.token
    assert new.attributes["celery_leases.generation"] == 1
    assert new.attributes["celery_leases.recovered"] is True
    (link,) = new.links
    assert link.context.span_id == old.context.span_id and link.context.trace_id == old.context.trace_id
    assert link.attributes["celery_leases.relation"] == "replaces"
    # And both runs are children of the one publish (recovery re-publishes its traceparent)
    assert old.parent is not None and new.parent is not None
    assert new.parent.span_id == old.parent.span_id


def test_without_enable_spans_carry_nothing_and_the_store_is_not_asked(app, exporter, redis_client,
                                                                       key_prefix):
    with _worker(app):
        result = app.tasks["traced.slow"].delay(0.05)
        result.get(timeout=15)
        _until(lambda: runs(exporter, result.id))
    (span,) = runs(exporter, result.id)
    assert "celery_leases.token" not in span.attributes
    assert not list(redis_client.scan_iter(match=f"{{{key_prefix}}}:spans:*"))


def test_only_tracing_py_imports_opentelemetry_and_only_when_enabled():
    # No module of the package imports opentelemetry at module level (tracing.py: in enable())
    for path in (ROOT / "celery_leases").rglob("*.py"):
        tree = parse(path)
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("opentelemetry") for n in names), f"{path} imports {names}"


def test_enable_without_opentelemetry_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    module = importlib.reload(tracing)
    with pytest.raises(ImportError, match=r"pip install 'celery-leases\[opentelemetry\]'"):
        module.enable()


def test_under_prefork_each_pool_process_links_the_recovered_run(leases_worker, tmp_path):
    # Given a prefork worker whose pool processes trace (tests/support/apps/traced_app.py)
    spans_file = tmp_path / "spans.jsonl"
    worker = leases_worker("tests.support.apps.traced_app:app", pool="prefork", concurrency=2,
                           conf={"leases_ttl": 2, "leases_recovery_interval": 1},
                           env={"TRACED_SPANS_FILE": str(spans_file)})
    app = worker.app
    # When a run is taken from its owner mid-body and the other pool process runs the copy
    result = app.tasks["traced_app.slow"].delay(2.5)
    first = wait_for_lease(app, result.id)
    assert make_stale(app, result.id).recovered == 1
    token = result.get(timeout=20)

    def run_spans():
        if not spans_file.exists():
            return []
        spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
        return sorted((s for s in spans if s["name"] == "run/traced_app.slow"
                       and s["attributes"].get("messaging.message.id") == result.id),
                      key=lambda s: s["attributes"]["celery_leases.token"])

    _until(lambda: len(run_spans()) == 2, timeout=20)
    old, new = run_spans()
    # Then the stale run's span has its loss and refusal, the recovered one links to it
    assert old["attributes"]["celery_leases.token"] == first.token and old["pid"] != new["pid"]
    assert [e["name"] for e in old["events"]] == ["celery_leases.lease_lost", "celery_leases.refused"]
    assert new["attributes"]["celery_leases.token"] == token
    assert new["attributes"]["celery_leases.recovered"] is True
    assert [(link["span_id"], link["trace_id"]) for link in new["links"]] == [(old["span_id"], old["trace_id"])]
