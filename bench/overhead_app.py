"""The Celery app of ``bench/overhead.py``: one no-op task plain, one leased, same app.

Workers import it as ``bench.overhead_app`` (``PYTHONPATH`` = the repository
root); the benchmark builds its client side with ``create_app(env)`` from the
same variables:

LEASES_BENCH_BROKER: Redis URL of the broker, the result backend and the leases;
LEASES_BENCH_PREFIX: lease key prefix, also the queue name;
LEASES_BENCH_TTL / LEASES_BENCH_HEARTBEAT_INTERVAL: lease ttl and heartbeat, seconds.

Everything else is Celery's default (prefetch multiplier 4, results stored,
acks early), except ``leases_worker_recovery=False`` (no recovery loop runs in
the worker, so the only lease calls are the ones measured) and
``worker_enable_remote_control=False`` (see below).
"""
from __future__ import annotations

import os
import time
from typing import Mapping

from celery import Celery
from celery.signals import worker_ready

from bench._common import bench_app, client_for
from celery_leases import LeasedTask

#: Written to the worker's stderr (its log) once it consumes; the benchmark waits for it.
READY_LINE = b"overhead-bench worker ready.\n"


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    app = bench_app(
        "overhead_app", env,
        leases_ttl=float(get("LEASES_BENCH_TTL", "600")),
        leases_heartbeat_interval=float(get("LEASES_BENCH_HEARTBEAT_INTERVAL", "200")),
        leases_worker_recovery=False,
        # No remote control: its reply queues expire, and kombu then refreshes their
        # bindings with Lua scripts of its own every few seconds, which would be
        # counted with the lease scripts. Nothing per task changes.
        worker_enable_remote_control=False,
    )
    prefix, broker = app.conf["leases_key_prefix"], app.conf["leases_redis_url"]
    stop_key = f"{{{prefix}}}:bench-stop"

    @app.task(name="bench.noop", shared=False)
    def noop():
        return None

    @app.task(name="bench.leased_noop", base=LeasedTask, shared=False)
    def leased_noop():
        return None

    @app.task(name="bench.leased_hold", base=LeasedTask, shared=False)
    def leased_hold(max_seconds=60.0):
        """Holds its lease until the benchmark sets the stop key (or max_seconds pass)."""
        client = client_for(broker)
        deadline = time.monotonic() + max_seconds
        while time.monotonic() < deadline and not client.exists(stop_key):
            time.sleep(0.2)

    return app


@worker_ready.connect
def _announce_ready(**kwargs) -> None:
    # At the default log level Celery's own "ready." line is not logged.
    os.write(2, READY_LINE)


app = create_app(os.environ)
