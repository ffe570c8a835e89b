"""The Celery app adversarial workers run, configured from the environment.

ADV_BROKER / ADV_BACKEND / ADV_LEASES   Redis URLs (each scenario decides which server is which)
ADV_PREFIX        key prefix and queue name
ADV_HISTORY_DIR   where every process appends its history (chaos.history: files survive faults)
ADV_WORKER        this worker's name in the history
ADV_TTL, ADV_MAX_RECOVERIES, ADV_PREFETCH, ADV_UNAVAILABLE_DELAY, ADV_ACKS_LATE, ADV_DELIVERY_TIMEOUT
ADV_PUBLISH_RETRIES task_publish_retry_policy max_retries (Celery's default: 3)

Tasks: ``adv.work(seq, seconds)`` returns ``{"seq", "token", "exec"}``; ``adv.callback``
(a link) records which parent result it got; ``adv.poison(seconds=0.3)`` kills its whole worker
after ``seconds``;
``adv.blob(data)`` returns the size and digest of a large argument.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid
from typing import Any, Mapping

from celery import Celery
from celery.signals import task_received, task_success

import celery_leases
from chaos.history import HistoryWriter


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    prefix = get("ADV_PREFIX", "adv")
    broker = get("ADV_BROKER", "redis://127.0.0.1:1/0")
    backend = get("ADV_BACKEND", broker)
    app = Celery("adv", broker=broker, backend=backend)
    ttl = float(get("ADV_TTL", "2"))
    app.conf.update(
        task_default_queue=prefix,
        leases_redis_url=get("ADV_LEASES", backend),
        leases_key_prefix=prefix,
        leases_ttl=ttl,
        leases_recovery_interval=ttl / 2,
        leases_max_recoveries=int(get("ADV_MAX_RECOVERIES", "3")),
        leases_worker_recovery=True,
        leases_beat_schedule=False,
        leases_unavailable_retry_delay=float(get("ADV_UNAVAILABLE_DELAY", "1")),
        leases_delivery_timeout=float(get("ADV_DELIVERY_TIMEOUT", "600")),
        task_acks_late=get("ADV_ACKS_LATE", "0") == "1",
        worker_prefetch_multiplier=int(get("ADV_PREFETCH", "1")),
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"socket_timeout": 5, "socket_connect_timeout": 3,
                                  "retry_on_timeout": True, "health_check_interval": 5},
        task_publish_retry_policy={"max_retries": int(get("ADV_PUBLISH_RETRIES", "3")),
                                   "interval_start": 0, "interval_step": 0.2, "interval_max": 1},
        result_backend_always_retry=True,
        result_backend_max_retries=100,
        result_expires=3600,
        worker_hijack_root_logger=False,
    )
    celery_leases.install(app)
    history = HistoryWriter(get("ADV_HISTORY_DIR"), get("ADV_WORKER", "client"))
    app.adv_history = history

    @app.task(name="adv.work", base=celery_leases.LeasedTask, bind=True, shared=False)
    def work(self, seq: int, seconds: float = 0.0) -> dict:
        execution = uuid.uuid4().hex[:10]
        token = self.lease.token
        history.event("start", self.request.id, exec=execution, token=token, seq=seq)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        history.event("end", self.request.id, exec=execution, token=token, lost=self.lease.lost)
        return {"seq": seq, "token": token, "exec": execution}

    @app.task(name="adv.callback", base=celery_leases.LeasedTask, bind=True, shared=False)
    def callback(self, value: Any, parent: str = "") -> str:
        history.event("callback", parent or self.request.id, exec=uuid.uuid4().hex[:10],
                      token=self.lease.token, got=value)
        return parent

    @app.task(name="adv.poison", base=celery_leases.LeasedTask, bind=True, shared=False)
    def poison(self, seconds: float = 0.3) -> None:
        history.event("start", self.request.id, exec=uuid.uuid4().hex[:10], token=self.lease.token)
        time.sleep(seconds)
        os.kill(os.getppid() if get("ADV_POOL") == "prefork" else os.getpid(), signal.SIGKILL)
        time.sleep(5)

    @app.task(name="adv.blob", base=celery_leases.LeasedTask, bind=True, shared=False)
    def blob(self, data: str) -> dict:
        execution = uuid.uuid4().hex[:10]
        history.event("start", self.request.id, exec=execution, token=self.lease.token)
        return {"size": len(data), "sha": hashlib.sha256(data.encode()).hexdigest()[:16],
                "token": self.lease.token, "exec": execution}

    @task_success.connect(weak=False)
    def on_success(sender: Any = None, result: Any = None, **kwargs: Any) -> None:
        # Fires only for an accepted outcome: a stale one is refused before the tracer gets here.
        if getattr(sender, "name", "").startswith("adv."):
            value = result if isinstance(result, dict) else {}
            history.event("accepted", sender.request.id, exec=value.get("exec"),
                          token=value.get("token"), name=sender.name)

    @task_received.connect(weak=False)
    def on_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if request is not None and str(request.name).startswith("adv."):
            data = request.request_dict
            history.event("received", str(request.id), token=data.get("lease_token"),
                          skip=data.get("lease_skip"))

    @celery_leases.stale_outcome_rejected.connect(weak=False)
    def on_refused(sender: Any = None, task_id: str = "?", token: Any = None, outcome: Any = None,
                   reason: Any = None, **kwargs: Any) -> None:
        history.event("refused", str(task_id), token=token, outcome=outcome, reason=str(reason))

    return app


app = create_app(os.environ)
