"""The worker's app module in the Kubernetes example (worker.yaml runs ``celery -A app worker``).

Every setting comes from the environment worker.yaml sets:

- BROKER_URL, RESULT_BACKEND: Celery's broker and result backend;
- LEASES_REDIS_URL: the lease store (a Redis with AOF on and ``maxmemory-policy noeviction``);
- LEASES_HTTP_PORT: where each worker's main process serves /livez, /readyz and /metrics;
- LEASES_HEALTH_FILE (optional): a file the worker touches every second while it is live, for
  an exec probe instead of the HTTP one.

No beat: the workers run the recovery passes themselves (``leases_worker_recovery``, on by
default), so a worker that dies has its tasks re-run by the others.
"""
from __future__ import annotations

import os

from celery import Celery

import celery_leases
from celery_leases.ops.metrics import enable_prometheus

app = Celery("proj", broker=os.environ.get("BROKER_URL", "redis://localhost:6379/0"),
             backend=os.environ.get("RESULT_BACKEND", "redis://localhost:6379/1"))
app.conf.update(
    leases_redis_url=os.environ.get("LEASES_REDIS_URL", "redis://localhost:6379/2"),
    leases_http_port=os.environ.get("LEASES_HTTP_PORT", "9808"),
    leases_health_file=os.environ.get("LEASES_HEALTH_FILE"),   # unset: off
    leases_worker_recovery=True,         # the default, written out: recovery without beat
    broker_connection_retry_on_startup=True,
)
celery_leases.install(app)
# Starts no server, so every process importing this module (the CLI, a web tier) may run it:
# only a worker's main process serves /metrics, on leases_http_port, summed over its pool.
enable_prometheus(app)


@app.task(base=celery_leases.LeasedTask, bind=True)
def process(self, item: str) -> str:
    self.lease.check()   # celery_leases.LeaseLost if another worker took the task over
    return item.upper()
