"""A Celery app for integration tests, configured from the environment.

Workers import ``app`` (built from os.environ); tests build their own client
with ``create_app(env)`` using the same keys, so each test has its own key
prefix and queue:

LEASES_TEST_BROKER / LEASES_TEST_BACKEND / LEASES_TEST_LEASES_URL: URLs;
LEASES_TEST_LEASES_TRANSPORT: leases_redis_transport_options as JSON (Sentinel);
LEASES_TEST_HISTORY_URL: where tasks record their history (default: the lease store's URL);
LEASES_TEST_PREFIX: key prefix (also the queue name);
LEASES_TEST_DELIVERY_TIMEOUT: leases_delivery_timeout; unset, the product's default
(publish tracking on); "0" turns tracking off (a test that does says why);
LEASES_TEST_OUTBOX_URL / _POLL / _TABLE: leases_outbox_url (the workers relay that outbox),
leases_outbox_poll_interval and leases_outbox_table;
LEASES_TEST_TTL, LEASES_TEST_ACKS_LATE, LEASES_TEST_SHARDS, LEASES_TEST_HELD, ...: see create_app.
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Mapping

from celery import Celery
from celery.exceptions import Reject
from celery.worker.control import control_command

import celery_leases
from celery_leases import LeasedTask
from celery_leases.protocol.connection import connect


def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    prefix = get("LEASES_TEST_PREFIX", "leases-test")
    broker = get("LEASES_TEST_BROKER", "redis://127.0.0.1:6379/0")
    app = Celery("leased_app", broker=broker, backend=get("LEASES_TEST_BACKEND", broker))
    acks_late = get("LEASES_TEST_ACKS_LATE", "0") == "1"
    app.conf.update(
        task_default_queue=prefix,
        leases_redis_url=get("LEASES_TEST_LEASES_URL", broker),
        leases_redis_transport_options=json.loads(get("LEASES_TEST_LEASES_TRANSPORT", "null")),
        leases_key_prefix=prefix,
        leases_ttl=float(get("LEASES_TEST_TTL", "2")),
        leases_recovery_interval=float(get("LEASES_TEST_RECOVERY_INTERVAL", "1")),
        leases_max_recoveries=int(get("LEASES_TEST_MAX_RECOVERIES", "3")),
        leases_shards=int(get("LEASES_TEST_SHARDS", "1")),
        leases_worker_recovery=get("LEASES_TEST_WORKER_RECOVERY", "0") == "1",
        leases_on_lost=get("LEASES_TEST_ON_LOST", "flag"),
        leases_unavailable_retry_delay=float(get("LEASES_TEST_UNAVAILABLE_DELAY", "5")),
        leases_unavailable_retry_max_delay=float(get("LEASES_TEST_UNAVAILABLE_MAX_DELAY", "300")),
        leases_deliveries_per_minute=int(get("LEASES_TEST_DELIVERIES_PER_MINUTE", "20")),
        leases_dead_letter_queue=get("LEASES_TEST_DLQ") or None,
        leases_held_deliveries=get("LEASES_TEST_HELD", "1") == "1",
        leases_background_finishes=get("LEASES_TEST_BACKGROUND", "1") == "1",
        task_acks_late=acks_late,
        task_reject_on_worker_lost=acks_late,
        worker_prefetch_multiplier=int(get("LEASES_TEST_PREFETCH", "1")),
        broker_transport_options={"visibility_timeout": float(get("LEASES_TEST_VISIBILITY", "3600"))},
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if get("LEASES_TEST_OUTBOX_URL"):
        # The outbox the workers relay (tests/outbox/), and how often they look at it.
        app.conf.leases_outbox_url = get("LEASES_TEST_OUTBOX_URL")
        app.conf.leases_outbox_poll_interval = float(get("LEASES_TEST_OUTBOX_POLL", "0.2"))
    if get("LEASES_TEST_OUTBOX_TABLE"):
        app.conf.leases_outbox_table = get("LEASES_TEST_OUTBOX_TABLE")
    if get("LEASES_TEST_DELIVERY_TIMEOUT") is not None:
        # Unset: the product's default (publish tracking on), what users run.
        # "0": tracking off, for a test that says why.
        app.conf.leases_delivery_timeout = float(get("LEASES_TEST_DELIVERY_TIMEOUT"))
    celery_leases.install(app)
    if get("LEASES_TEST_NO_RECEIPT_HOOK") == "1":
        # A worker whose acquire at receipt never runs (a hook lost): bodies must still not run unleased.
        from celery.signals import task_received

        from celery_leases.worker.steps import _on_task_received
        task_received.disconnect(_on_task_received)
    # A Redis Cluster too (tests/deployments/test_cluster.py); a Sentinel store records through LEASES_TEST_HISTORY_URL.
    sink = connect(get("LEASES_TEST_HISTORY_URL") or app.conf.leases_redis_url)

    def record(event: str, task_id: str, **fields: object) -> None:
        """Append an execution event to the test's history list."""
        parts = [event, task_id, str(os.getpid())] + [f"{k}={v}" for k, v in sorted(fields.items())]
        sink.rpush(f"{prefix}:history", "|".join(parts))

    @app.task(base=LeasedTask, bind=True, shared=False)
    def sleep_then_echo(self, value, seconds=0.0):
        record("start", self.request.id, token=self.lease.token, value=value, at=f"{time.time():.3f}")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        record("end", self.request.id, token=self.lease.token, lost=self.lease.lost)
        return value


    @app.task(base=LeasedTask, bind=True, shared=False)
    def add(self, x, y):
        record("start", self.request.id, token=self.lease.token)
        return x + y


    @app.task(base=LeasedTask, bind=True, shared=False)
    def tsum(self, values):
        record("start", self.request.id, token=self.lease.token)
        return sum(values)


    class DiesOnceAfter(LeasedTask):
        """Kills its own process the first time it gets to ``die_after`` of a success: "finish"
        (accepted, before Celery's tracer stored the result, counted a chord part or this
        task sent its callbacks) or "return" (all of that done, not yet confirmed)."""

        die_after = "finish"

        def _die_once(self, task_id):
            if sink.set(f"{prefix}:died:{task_id}", 1, nx=True):
                record("died", task_id, after=self.die_after)
                os.kill(os.getpid(), signal.SIGKILL)

        def _finish(self, lease, outcome, *args, **kwargs):
            super()._finish(lease, outcome, *args, **kwargs)
            if outcome == "succeeded" and self.die_after == "finish":
                self._die_once(lease.task_id)

        def after_return(self, status, retval, task_id, *args, **kwargs):
            super().after_return(status, retval, task_id, *args, **kwargs)
            if status == "SUCCESS" and self.die_after == "return":
                self._die_once(task_id)

    @app.task(base=DiesOnceAfter, bind=True, shared=False)
    def add_then_die(self, x, y):
        record("start", self.request.id, token=self.lease.token)
        return x + y

    @app.task(base=DiesOnceAfter, bind=True, shared=False, die_after="return")
    def add_then_die_late(self, x, y):
        record("start", self.request.id, token=self.lease.token)
        return x + y

    @app.task(base=LeasedTask, bind=True, shared=False)
    def note_callback(self, value):
        record("callback", self.request.id, value=value)
        return value


    @app.task(base=LeasedTask, bind=True, max_retries=3, shared=False)
    def retry_or_replace_after(self, step, seconds):
        """Its first run waits ``seconds`` (a window for a fault), then retries itself or is
        replaced by ``add(1, 2)``; a later run (or the replacement) returns 3."""
        record("start", self.request.id, token=self.lease.token, retries=self.request.retries)
        if self.request.retries:
            return 3
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        if step == "retry":
            raise self.retry(countdown=0.2)
        raise self.replace(add.si(1, 2))

    @app.task(base=LeasedTask, bind=True, shared=False)
    def reject_requeue_after(self, seconds):
        """Its first run waits ``seconds`` (a window for a fault), then rejects its message
        with requeue; a later run returns "again"."""
        record("start", self.request.id, token=self.lease.token)
        if sink.incr(f"{prefix}:rejected:{self.request.id}") > 1:
            return "again"
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise Reject("requeued by the test", requeue=True)

    @app.task(base=LeasedTask, bind=True, max_retries=5, shared=False)
    def retry_twice(self):
        record("start", self.request.id, token=self.lease.token, retries=self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.2)
        return "done"


    @app.task(base=LeasedTask, bind=True, shared=False)
    def kill_own_worker(self):
        """A poison pill: kills the whole worker (main process included) every time it runs."""
        record("start", self.request.id, token=self.lease.token)
        time.sleep(0.2)
        os.killpg(os.getpgid(0), signal.SIGKILL)
        time.sleep(5)


    @app.task(base=LeasedTask, bind=True, shared=False)
    def kill_own_child(self, seconds=0.2):
        """Kills its own pool process (prefork) the first time it runs."""
        record("start", self.request.id, token=self.lease.token)
        if self.lease.token and sink.incr(f"{prefix}:killed:{self.request.id}") == 1:
            time.sleep(seconds)
            os.kill(os.getpid(), signal.SIGKILL)
        return "survived"


    @app.task(base=LeasedTask, bind=True, lease_progress_timeout=1.0, shared=False)
    def stuck(self, beats=0, stall=True):
        """Calls heartbeat() `beats` times (0.2 s apart), then stops reporting progress (or,
        with ``stall`` False, returns "steady": its progress came well within the timeout)."""
        record("start", self.request.id, token=self.lease.token)
        for _ in range(beats):
            self.lease.heartbeat()
            time.sleep(0.2)
        if not stall:
            return "steady"
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not self.lease.lost:
            time.sleep(0.1)
        record("end", self.request.id, token=self.lease.token, lost=self.lease.lost)
        return "finished"


    @app.task(bind=True, shared=False)
    def plain_sleep(self, value, seconds=0.0):
        record("start", self.request.id)
        time.sleep(seconds)
        return value


    @app.task(base=LeasedTask, bind=True, shared=False)
    def two_steps(self, pause=3.0):
        """Once-only steps "first" and "second"; the first execution to run "second"
        stays inside it for `pause` s (a window to pause the worker) before recording it."""
        record("start", self.request.id, token=self.lease.token)

        def step(name, hold=0.0):
            record("step", self.request.id, token=self.lease.token, step=name)
            deadline = time.monotonic() + hold
            while time.monotonic() < deadline:
                time.sleep(0.05)
            return f"{name}@{self.lease.token}"

        first = self.lease.once("first", step, "first")
        hold = pause if sink.incr(f"{prefix}:held:{self.request.id}") == 1 else 0.0
        try:
            second = self.lease.once("second", step, "second", hold=hold)
        except celery_leases.LeaseLost:
            record("refused", self.request.id, token=self.lease.token, step="second")
            raise
        record("end", self.request.id, token=self.lease.token, first=first, second=second)
        return [first, second]

    @app.task(bind=True, shared=False)
    def plain_kill_once(self):
        """A plain (unleased) poison pill: kills its own process the first time it runs."""
        record("start", self.request.id)
        if sink.incr(f"{prefix}:killed:{self.request.id}") == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return "survived"

    @app.task(base=LeasedTask, shared=False)
    def add_unbound(x, y):
        return x + y

    @app.task(base=LeasedTask, bind=True, ignore_result=True, shared=False)
    def add_ignored(self, x, y):
        record("start", self.request.id, token=self.lease.token)
        return x + y

    @app.task(base=DiesOnceAfter, bind=True, ignore_result=True, shared=False, die_after="return")
    def add_ignored_then_die(self, x, y):
        record("start", self.request.id, token=self.lease.token)
        return x + y

    @app.task(base=LeasedTask, bind=True, time_limit=1, shared=False)
    def hard_limited(self):
        record("start", self.request.id, token=self.lease.token)
        time.sleep(5)

    @app.task(base=LeasedTask, bind=True, soft_time_limit=0.5, shared=False)
    def soft_limited(self):
        from celery.exceptions import SoftTimeLimitExceeded
        record("start", self.request.id, token=self.lease.token)
        try:
            time.sleep(5)
        except SoftTimeLimitExceeded:
            return "soft limit handled"

    return app


app = create_app(os.environ)


@control_command(args=[("seconds", float)], signature="<seconds>")
def leases_test_wedge(state, seconds: float = 1.0) -> dict:
    """Block the worker's main thread, its event loop, for ``seconds`` (a wedged loop; the
    heartbeat thread and the pool run on)."""
    time.sleep(float(seconds))
    return {"ok": "woke"}
