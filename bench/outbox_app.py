"""The Celery app of ``bench/outbox.py``: one leased task that notes when it started.

Workers import it as ``bench.outbox_app`` (``PYTHONPATH`` = the repository root); the
benchmark builds its client side with ``create_app(env)`` from the same variables:

OUTBOX_BENCH_REDIS: Redis URL (broker db 0, results db 1, lease store db 2);
OUTBOX_BENCH_PREFIX: lease key prefix, also the queue name;
OUTBOX_BENCH_URL: leases_outbox_url (the worker relays it; unset: no relay);
OUTBOX_BENCH_TABLE / OUTBOX_BENCH_POLL: leases_outbox_table and leases_outbox_poll_interval.
"""
from __future__ import annotations

import os
import time
from typing import Mapping

import redis
from celery import Celery

import celery_leases
from celery_leases import LeasedTask


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    base = get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379").rstrip("/")
    prefix = get("OUTBOX_BENCH_PREFIX", "outbox-bench")
    app = Celery("outbox_app", broker=f"{base}/0", backend=f"{base}/1")
    app.conf.update(task_default_queue=prefix, leases_redis_url=f"{base}/2", leases_key_prefix=prefix,
                    leases_worker_recovery=False, worker_prefetch_multiplier=1, task_ignore_result=True,
                    worker_hijack_root_logger=False, leases_outbox_table=get("OUTBOX_BENCH_TABLE",
                                                                             "celery_leases_outbox"))
    if get("OUTBOX_BENCH_URL"):
        app.conf.leases_outbox_url = get("OUTBOX_BENCH_URL")
        app.conf.leases_outbox_poll_interval = float(get("OUTBOX_BENCH_POLL", "1"))
    celery_leases.install(app)
    sink = redis.Redis.from_url(f"{base}/2")

    @app.task(base=LeasedTask, bind=True, name="bench.outbox.started", shared=False)
    def started(self, n: int = 0) -> None:
        sink.hset(f"{prefix}:started", self.request.id, repr(time.time()))

    return app


app = create_app(os.environ)
