"""A Celery app for the misuse tests (tests/worker/test_misuse.py), configured from the environment.

MISUSE_BROKER / MISUSE_LEASES_URL: URLs; MISUSE_PREFIX: key prefix and queue;
MISUSE_INSTALL: "0" leaves out celery_leases.install(app);
MISUSE_SETTINGS: JSON of extra app.conf settings (e.g. a broken leases_* one);
MISUSE_LATE_SETTINGS: JSON of app.conf settings set after install(app), as a later
config_from_object (Django settings) brings them: install() cannot see them, the worker does;
MISUSE_TASK_OPTIONS: JSON of options for the ``configured`` LeasedTask;
MISUSE_PLAIN_OPTIONS: JSON of options for the ``plain`` task (not leased).
Every task body records its start in the ``{prefix}:ran`` list, so a test can
assert that no body ran.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import redis
from celery import Celery

import celery_leases
from celery_leases import LeasedTask


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    prefix = get("MISUSE_PREFIX", "misuse")
    broker = get("MISUSE_BROKER", "redis://127.0.0.1:1/0")
    app = Celery("misuse_app", broker=broker, backend=broker)
    app.conf.update({
        "task_default_queue": prefix,
        "leases_redis_url": get("MISUSE_LEASES_URL", broker),
        "leases_key_prefix": prefix,
        "leases_ttl": 5,
        "leases_worker_recovery": False,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        **json.loads(get("MISUSE_SETTINGS", "{}")),
    })
    if get("MISUSE_INSTALL", "1") == "1":
        celery_leases.install(app)
    app.conf.update(json.loads(get("MISUSE_LATE_SETTINGS", "{}")))
    sink = redis.Redis.from_url(broker)

    def ran(name: str, task_id: str, token: object = None) -> None:
        sink.rpush(f"{prefix}:ran", f"{name}|{task_id}|{token}")

    @app.task(base=LeasedTask, bind=True, shared=False)
    def leased(self, x):
        ran("leased", self.request.id, self.lease.token)
        return x

    @app.task(base=LeasedTask, bind=True, shared=False, **json.loads(get("MISUSE_TASK_OPTIONS", "{}")))
    def configured(self, x):
        ran("configured", self.request.id, self.lease.token)
        return x

    @app.task(bind=True, shared=False, **json.loads(get("MISUSE_PLAIN_OPTIONS", "{}")))
    def plain(self, x):
        ran("plain", self.request.id)
        return x

    return app


app = create_app(os.environ)
