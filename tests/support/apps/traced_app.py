"""A Celery app whose pool processes trace with OpenTelemetry (tests/ops/test_tracing.py).

Each pool process sets up the SDK, the Celery instrumentor and
``celery_leases.ops.tracing.enable(app)`` at ``worker_process_init``, and exports every
finished span as one JSON line to ``$TRACED_SPANS_FILE`` (the worker is a subprocess:
the test reads the file).
"""
from __future__ import annotations

import json
import os
import time

from celery import Celery
from celery.signals import worker_process_init

import celery_leases
from celery_leases import LeasedTask

app = Celery("traced_app")
celery_leases.install(app)


@app.task(base=LeasedTask, bind=True, name="traced_app.slow")
def slow(self, seconds: float) -> int:
    time.sleep(seconds)
    return self.lease.token


@worker_process_init.connect(weak=False)
def init_tracing(*args, **kwargs) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    import celery_leases.ops.tracing

    class JsonLines(SpanExporter):
        def export(self, spans):
            with open(os.environ["TRACED_SPANS_FILE"], "a", encoding="utf-8") as f:
                for s in spans:
                    f.write(json.dumps({
                        "name": s.name, "pid": os.getpid(), "attributes": dict(s.attributes),
                        "span_id": s.context.span_id, "trace_id": s.context.trace_id,
                        "parent": s.parent.span_id if s.parent else None,
                        "events": [{"name": e.name, "attributes": dict(e.attributes)} for e in s.events],
                        "links": [{"span_id": link.context.span_id, "trace_id": link.context.trace_id,
                                   "attributes": dict(link.attributes)} for link in s.links],
                    }) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLines()))
    CeleryInstrumentor().instrument(tracer_provider=provider)
    celery_leases.ops.tracing.enable(app)
