"""The Celery app chaos workers run, and the harness submits to, configured from the environment.

One workload task, ``chaos.work(seq, seconds)``: it sleeps ``seconds``, writes its
result and its token to a Redis "sink" (a fenced write in leases mode, a plain SET
in plain mode) and returns the same value. Every step goes to the execution
history (``chaos.history``).

Environment (``chaos.cluster`` sets it for each worker):

CHAOS_MODE               ``leases`` (LeasedTask, early ack) or ``plain`` (Celery's own
                         ``acks_late`` + ``task_reject_on_worker_lost`` + a short
                         ``visibility_timeout``)
CHAOS_REDIS_URL          ``redis://127.0.0.1:PORT``: broker db 0, results db 1,
                         leases db 2, sink db 3
CHAOS_LEASES_URL         the lease store (default: CHAOS_REDIS_URL db 2)
CHAOS_BROKER_URL         the broker (default: CHAOS_REDIS_URL db 0); the fault runs give it a
                         redis-server of its own without persistence (the ``broker_loss`` fault)
CHAOS_DELIVERY_TIMEOUT   leases_delivery_timeout (publish tracking), 10 s by default
CHAOS_HISTORY_DIR        where each process appends its history
CHAOS_WORKER             this worker's name in the history
CHAOS_TTL                leases_ttl (heartbeat ttl/3, recovery every ttl/3)
CHAOS_VISIBILITY_TIMEOUT the Redis transport's visibility_timeout (plain mode)
CHAOS_PREFETCH           worker_prefetch_multiplier
CHAOS_MAX_RECOVERIES     leases_max_recoveries
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import redis
from celery import Celery
from celery.app.task import Context
from celery.signals import task_failure, task_received, task_success

from chaos.history import HistoryWriter
from chaos.senders import OUTBOX_DB

MODES = ("leases", "plain")
TASK_NAME = "chaos.work"
QUEUE = "chaos"
#: Databases of the one chaos Redis.
BROKER_DB, BACKEND_DB, LEASES_DB, SINK_DB = 0, 1, 2, 3
#: Key prefix of the leases (and so of the sink's fences).
LEASES_PREFIX = "chaos"
#: Seconds a sink write keeps retrying while Redis is down or paused.
SINK_RETRY_FOR = 60.0

# The id the worker's main process gives each delivery at receipt reaches the
# execution as self.request.chaos_delivery (declared here so it stays out of headers).
if not hasattr(Context, "chaos_delivery"):
    Context.chaos_delivery = None


def sink_resource(task_id: str) -> str:
    """The fenced resource (leases mode) or key (plain mode) a task writes its result to."""
    return f"task:{task_id}"


def expected_result(seq: int) -> str:
    """What task number ``seq`` computes; the checker knows it too."""
    return f"r{seq * 7919 % 10007}"


def settings(env: Mapping[str, str]) -> dict:
    mode = env.get("CHAOS_MODE", "leases")
    if mode not in MODES:
        raise ValueError(f"CHAOS_MODE must be one of {MODES}, got {mode!r}")
    base = env.get("CHAOS_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
    ttl = float(env.get("CHAOS_TTL", "3"))
    plain = mode == "plain"
    transport: dict[str, Any] = {
        # Socket timeouts bound how long a paused or restarting Redis blocks a worker.
        "socket_timeout": 5, "socket_connect_timeout": 3, "retry_on_timeout": True,
        "health_check_interval": 5,
    }
    if plain:
        # Celery's own answer to a lost worker: redelivery after the visibility
        # timeout. Restore checks every second, so plain Celery gets its best case.
        transport.update(visibility_timeout=float(env.get("CHAOS_VISIBILITY_TIMEOUT", "5")),
                         unacked_restore_interval=1, unacked_restore_throttle=1)
    return dict(
        broker_url=env.get("CHAOS_BROKER_URL") or f"{base}/{BROKER_DB}",
        result_backend=f"{base}/{BACKEND_DB}",
        task_default_queue=QUEUE,
        task_acks_late=plain,
        task_reject_on_worker_lost=plain,
        worker_prefetch_multiplier=int(env.get("CHAOS_PREFETCH", "2")),
        broker_transport_options=transport,
        # The broker connection must survive Redis restarts: retry forever.
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # So must result writes.
        result_backend_always_retry=True,
        result_backend_max_retries=1000,
        result_backend_base_sleep_between_retries_ms=50,
        result_backend_max_sleep_between_retries_ms=1000,
        redis_socket_timeout=5,
        redis_socket_connect_timeout=3,
        redis_retry_on_timeout=True,
        redis_backend_health_check_interval=5,
        result_expires=None,
        task_default_retry_delay=1,
        worker_hijack_root_logger=False,
        # celery-leases (ignored in plain mode: not installed there).
        leases_redis_url=env.get("CHAOS_LEASES_URL") or f"{base}/{LEASES_DB}",
        leases_key_prefix=LEASES_PREFIX,
        leases_ttl=ttl,
        leases_heartbeat_interval=ttl / 3,
        leases_recovery_interval=ttl / 3,
        leases_max_recoveries=int(env.get("CHAOS_MAX_RECOVERIES", "10")),
        leases_publish_grace=5.0,
        leases_unavailable_retry_delay=1.0,
        leases_worker_recovery=True,
        leases_beat_schedule=False,
        # Short, so tasks a broker_loss took are re-published within the run; a task only late
        # behind the backlog gets a copy that acquire refuses as stale.
        leases_delivery_timeout=float(env.get("CHAOS_DELIVERY_TIMEOUT", "10")),
        # The kill_sender fault's outbox (chaos/senders.py): a SQLite file in the run directory,
        # beside the workers' history; the workers relay it (leases mode).
        leases_outbox_url=_outbox_url(env) if mode == "leases" else None,
        leases_outbox_poll_interval=0.2,
    )


def _outbox_url(env: Mapping[str, str]) -> str | None:
    history = env.get("CHAOS_HISTORY_DIR")
    if not history:
        return None  # the harness: it sends, it does not relay
    return f"sqlite:///{Path(history).parent / OUTBOX_DB}"


def create_app(env: Mapping[str, str], *, results: bool = True) -> Celery:
    """The chaos app for one mode; workers build it from os.environ, the harness from its env.

    ``results=False`` gives the harness an app to submit with: the Redis result
    backend would subscribe to every submitted task's result (pub/sub), and that
    subscription retries for a long while once the run stops its Redis.
    """
    conf = settings(env)
    if not results:
        conf["result_backend"] = None
    mode = env.get("CHAOS_MODE", "leases")
    leased = mode == "leases"
    app = Celery("chaos", broker=conf["broker_url"], backend=conf["result_backend"])
    app.conf.update(conf)
    app.chaos_mode = mode
    history = HistoryWriter(env.get("CHAOS_HISTORY_DIR"), env.get("CHAOS_WORKER", "harness"))
    app.chaos_history = history
    sink_url = f"{env.get('CHAOS_REDIS_URL', 'redis://127.0.0.1:6379').rstrip('/')}/{SINK_DB}"
    sinks: dict[int, redis.Redis] = {}
    current = threading.local()

    def sink() -> redis.Redis:
        pid = os.getpid()
        if pid not in sinks:
            sinks[pid] = redis.Redis.from_url(sink_url, socket_timeout=2, socket_connect_timeout=2)
        return sinks[pid]

    options: dict[str, Any] = {"name": TASK_NAME, "bind": True}
    if leased:
        import celery_leases
        celery_leases.install(app)
        options["base"] = celery_leases.LeasedTask

    def write_sink(task_id: str, token: int, value: str) -> bool:
        """The task's side effect; retried while Redis is unreachable. True when the write landed."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
        deadline = time.monotonic() + SINK_RETRY_FOR
        while True:
            try:
                if leased:
                    import celery_leases
                    keys = celery_leases.store(app).keys
                    return celery_leases.fenced_set(sink(), keys, sink_resource(task_id), token, value,
                                                    raise_on_stale=False)
                sink().set(sink_resource(task_id), value)
                return True
            except Exception as exc:  # noqa: BLE001 - only unavailability is retried
                import celery_leases
                unavailable = isinstance(exc, (celery_leases.LeaseUnavailable, RedisConnectionError,
                                               RedisTimeoutError, OSError))
                if not unavailable or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    @app.task(**options)
    def work(self, seq: int, seconds: float) -> dict:
        task_id = self.request.id
        token = int(self.lease.token or 0) if leased else 0
        execution = uuid.uuid4().hex[:10]
        current.execution, current.token = execution, token
        history.event("start", task_id, exec=execution, token=token, seq=seq,
                      delivery=self.request.chaos_delivery,
                      redelivered=bool((self.request.delivery_info or {}).get("redelivered")))
        error = None
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            value = {"seq": seq, "result": expected_result(seq), "token": token, "exec": execution,
                     "worker": history.worker, "pid": os.getpid()}
            t0 = time.time()
            accepted = write_sink(task_id, token, json.dumps(value, sort_keys=True))
            history.event("write", task_id, exec=execution, token=token, t0=t0, t1=time.time(),
                          accepted=accepted)
            if not accepted:
                # A newer owner already wrote: this execution is stale. Raising lets
                # the store refuse the outcome (leases mode).
                raise RuntimeError(f"sink write of token {token} refused: a newer token wrote")
            return value
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            history.event("end", task_id, exec=execution, token=token, error=error)

    # Signals are connected without a sender filter: ``work`` may still be a lazy proxy here.
    @task_success.connect(weak=False)
    def on_success(sender: Any = None, result: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "name", None) != TASK_NAME:
            return
        result = result if isinstance(result, dict) else {}
        history.event("accepted", sender.request.id, exec=result.get("exec"),
                      token=result.get("token"), state="SUCCESS")

    @task_failure.connect(weak=False)
    def on_failure(sender: Any = None, task_id: str = "?", exception: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "name", None) != TASK_NAME:
            return
        history.event("accepted", task_id, exec=getattr(current, "execution", None),
                      token=getattr(current, "token", None), state="FAILURE", error=repr(exception))

    @task_received.connect(weak=False)
    def on_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        if request is None or request.name != TASK_NAME:
            return
        data = request.request_dict
        headers = request.message.headers or {}
        data["chaos_delivery"] = delivery = uuid.uuid4().hex[:10]
        history.event("received", request.id, delivery=delivery, token=data.get("lease_token"),
                      skip=data.get("lease_skip"), gen=headers.get("lease_generation"),
                      redelivered=bool((request.delivery_info or {}).get("redelivered")))

    if leased:
        from celery_leases import delivery_refused, lease_acquired, stale_outcome_rejected

        # The acquire's answer comes after task_received (the worker sends it
        # without waiting): the delivery's token, or why it is not run.
        @lease_acquired.connect(weak=False)
        def on_acquired(sender: Any = None, task_id: str = "?", token: Any = None, **kwargs: Any) -> None:
            if getattr(sender, "name", None) == TASK_NAME:
                history.event("acquire", task_id, token=token)

        @delivery_refused.connect(weak=False)
        def on_refused_delivery(sender: Any = None, task_id: str = "?", reason: Any = None,
                                **kwargs: Any) -> None:
            if getattr(sender, "name", None) == TASK_NAME:
                history.event("acquire", task_id, skip=reason)

        @stale_outcome_rejected.connect(weak=False)
        def on_refused(sender: Any = None, task_id: str = "?", token: Any = None, outcome: Any = None,
                       reason: Any = None, **kwargs: Any) -> None:
            history.event("refused", task_id, token=token, outcome=outcome, reason=reason,
                          exec=getattr(current, "execution", None))

    app.chaos_work = work
    return app


app = create_app(os.environ)
