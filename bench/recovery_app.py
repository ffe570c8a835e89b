"""The Celery app of ``bench/recovery.py``: one leased task that notes when it starts.

Workers import it as ``bench.recovery_app`` (``PYTHONPATH`` = the repository
root); the benchmark builds its client side with ``create_app(env)`` from the
same variables:

LEASES_BENCH_BROKER: Redis URL of the broker, the result backend and the leases;
LEASES_BENCH_PREFIX: lease key prefix, also the queue name;
LEASES_BENCH_TTL / LEASES_BENCH_RECOVERY_INTERVAL: seconds (default 2 and 1);
LEASES_BENCH_WORKER_RECOVERY: "1" to run the workers' fallback recovery thread.

Everything else is Celery's default (prefork, acks early, prefetch multiplier
4), except ``worker_prefetch_multiplier=1`` (a worker holds only the task it
runs, so the one it is killed with is the only lease it leaves behind) and
``leases_beat_schedule=False`` (no beat runs; recovery is the workers' thread).
"""
from __future__ import annotations

import json
import os
import time
from typing import Mapping

from celery import Celery

from bench._common import bench_app, client_for
from celery_leases import LeasedTask

HOLD = "bench.recovery.hold"
NOOP = "bench.recovery.noop"


def starts_key(prefix: str, task_id: str) -> str:
    """The Redis list each start of ``task_id`` is appended to (one JSON object per start)."""
    return f"{{{prefix}}}:bench-starts:{task_id}"


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    app = bench_app(
        "recovery_app", env,
        leases_ttl=float(get("LEASES_BENCH_TTL", "2")),
        leases_recovery_interval=float(get("LEASES_BENCH_RECOVERY_INTERVAL", "1")),
        leases_worker_recovery=get("LEASES_BENCH_WORKER_RECOVERY", "1") == "1",
        worker_prefetch_multiplier=1,
    )
    prefix, broker = app.conf["leases_key_prefix"], app.conf["leases_redis_url"]

    @app.task(name=HOLD, base=LeasedTask, bind=True, shared=False)
    def hold(self, max_seconds=30.0):
        """Notes its start; the first run then holds (until killed), a re-run returns at once."""
        start = time.time()
        client = client_for(broker)
        entry = {"t": start, "pid": os.getpid(), "ppid": os.getppid(),
                 "token": self.lease.token, "generation": self.request.get("lease_generation")}
        runs = client.rpush(starts_key(prefix, self.request.id), json.dumps(entry))
        if runs == 1:
            deadline = time.monotonic() + max_seconds
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return runs

    @app.task(name=NOOP, base=LeasedTask, shared=False)
    def noop(*args):
        """The task of the parked messages: nobody runs it in the benchmark."""
        return None

    return app


app = create_app(os.environ)
