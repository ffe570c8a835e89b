"""A beat schedule with a leased periodic task, and the recovery entry install() adds.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A app worker -l info   # from this directory
    REDIS_URL=redis://127.0.0.1:6379/0 celery -A app beat -l info

``beat_schedule`` holds the project's own entry, ``send-report``. After
``celery_leases.install(app)`` the schedule also holds ``celery_leases.recover``
every ``leases_recovery_interval`` seconds: the recovery pass that re-publishes
tasks whose worker died. Nothing else to add to the schedule.

Environment: REDIS_URL (broker, result backend and lease store);
BEAT_EXAMPLE_PREFIX (lease key prefix and queue name; default "beat-example").
"""
from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_leases
from celery_leases import LeasedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BEAT_EXAMPLE_PREFIX", "beat-example")

app = Celery("beat_example", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=PREFIX,
    leases_key_prefix=PREFIX,
    leases_recovery_interval=2.0,    # short for the example (default 5 s)
    # Beat runs the recovery passes here, so that every pass you see is beat's. Left on (the
    # default), each worker also runs passes when none ran within the interval, which keeps
    # recovery going while beat is down; the two share one guard, so there is still about
    # one pass per interval.
    leases_worker_recovery=False,
    beat_schedule={
        "send-report": {"task": "app.send_report", "schedule": 2.0},
    },
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
celery_leases.install(app)   # adds the "celery_leases.recover" entry to beat_schedule

_reports = redis.Redis.from_url(REDIS_URL)


@app.task(base=LeasedTask, bind=True)
def send_report(self) -> dict:
    """The periodic job. Leased: if its worker dies mid-run, recovery runs it again."""
    self.lease.check()   # still the owner? (raises LeaseLost otherwise)
    run = {"task_id": self.request.id, "token": self.lease.token, "at": round(time.time(), 3)}
    # Where the report "goes": a list the run.py operator reads back.
    _reports.rpush(f"{PREFIX}:reports", f"{run['task_id']} {run['token']} {run['at']}")
    return run
