"""The quick-start project: one Celery app, one leased task.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A app worker -l info    # from this directory

Everything a project adds for celery-leases is ``celery_leases.install(app)``
and ``base=LeasedTask``. The settings below are short on purpose so the demo
(``demo.py``) shows a recovery within seconds; in production keep the defaults
(``leases_ttl`` 30 s, ``leases_recovery_interval`` 5 s).

Environment: REDIS_URL (broker, result backend and lease store);
QUICKSTART_PREFIX (lease key prefix and queue name, so several runs can share
one Redis; default "quickstart").
"""
from __future__ import annotations

import os
import socket
import time

from celery import Celery

import celery_leases
from celery_leases import LeasedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("QUICKSTART_PREFIX", "quickstart")

app = Celery("quickstart", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=PREFIX,       # one queue per prefix: runs sharing a Redis stay apart
    leases_key_prefix=PREFIX,
    leases_ttl=2.0,                  # a lease lives 2 s without a heartbeat (default 30 s)
    leases_recovery_interval=1.0,    # a recovery pass every second (default 5 s)
    # A worker takes only the messages it is running (acknowledged when they
    # finish), so the demo's batch spreads evenly over its workers.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
celery_leases.install(app)  # worker hooks, heartbeat, recovery in the workers (no beat needed)


@app.task(base=LeasedTask, bind=True)
def crunch(self, n: int, seconds: float = 3.0) -> dict:
    """Work for ``seconds``, then return who did it and under which fencing token."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    # The node name (``-n A@%h``) without the host: "A", "B", "C".
    worker = (self.request.hostname or socket.gethostname()).split("@")[0]
    return {"n": n, "square": n * n, "worker": worker, "token": self.lease.token}
