"""The app of tests/ops/test_health.py: leased_app.py's app (same environment), with the
worker's health endpoint, the documented Prometheus call, and a way to wedge the event loop.

LEASES_TEST_HTTP_PORT: ``leases_http_port``; LEASES_TEST_HEALTH_FILE: ``leases_health_file``.
"""
from __future__ import annotations

import os
import time

from celery.signals import task_received

from celery_leases.ops.metrics import enable_prometheus
from tests.support.apps.leased_app import create_app

app = create_app(os.environ)
app.conf.leases_http_port = os.environ.get("LEASES_TEST_HTTP_PORT")
app.conf.leases_health_file = os.environ.get("LEASES_TEST_HEALTH_FILE")
enable_prometheus(app)   # as docs/operations.md says: in the app module, next to install(app)

WEDGE_TASK = "health_app.wedge_loop"


@app.task(name=WEDGE_TASK, shared=False)
def wedge_loop(release_path: str) -> str:
    return "released"


@task_received.connect
def _wedge(sender=None, request=None, **kwargs) -> None:
    """Blocks the thread that sent ``task_received``, the worker's main thread running the event
    loop (the consumer's message handler sends it), until ``release_path`` exists (60 s at most)."""
    if getattr(request, "name", None) != WEDGE_TASK:
        return
    release_path = request.args[0]
    deadline = time.monotonic() + 60
    while not os.path.exists(release_path) and time.monotonic() < deadline:
        time.sleep(0.1)
