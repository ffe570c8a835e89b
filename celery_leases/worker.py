"""Worker wiring: the bootstep, the acquire at receipt, and the shutdown hooks.

Protocol decisions live in the store and its scripts; this module only decides
*when* to call them:

- acquire when the worker receives the message (``task_received``, main
  process), so prefetched and ETA-held messages are covered too, and the main
  process knows the token it must fence its own writes with;
- renew from the heartbeat thread;
- release at once when a pool child dies or the worker shuts down warmly.
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import bootsteps
from celery.exceptions import TaskRevokedError
from celery.signals import task_received, worker_shutdown
from celery.worker.state import active_requests, reserved_requests

from .acquirer import Acquirer, Job
from .checks import run_checks
from .codes import Code
from .config import LeaseConfig, get_config
from .exceptions import LeaseError, LeaseUnavailable
from .heartbeat import Heartbeat, Held
from .outage import Outage
from .runtime import get_store, get_worker, set_worker
from .scripts import scripts
from .signals import delivery_refused, lease_acquired, lease_lost
from .store import Acquisition

logger = logging.getLogger("celery_leases.worker")


def envelope_of(message: Any) -> dict:
    """What recovery needs to re-publish a message exactly: routing, headers, properties."""
    info = message.delivery_info or {}
    props = dict(message.properties or {})
    props.pop("delivery_info", None)
    props.pop("body_encoding", None)
    props.pop("delivery_tag", None)
    return {
        "exchange": info.get("exchange") or "",
        "routing_key": info.get("routing_key") or "",
        "priority": info.get("priority", props.get("priority")),
        "headers": message.headers or {},
        "properties": props,
        "content_type": message.content_type,
        "content_encoding": message.content_encoding,
    }


class LeaseWorker:
    """The leases of one worker process: acquire, heartbeat, release, fallback recovery."""

    def __init__(self, app: Any, config: LeaseConfig, pool: Any = None, hostname: str | None = None,
                 hub: Any = None, quick_release: Any = None, prefork: bool = False) -> None:
        self.app, self.config, self.pool = app, config, pool
        #: Celery's semaphore release, for a deferred request found revoked (as _process_task does).
        self.quick_release = quick_release
        #: Bumped whenever the consumer drops its requests: acquires of an older epoch are released.
        self._epoch = 0
        self.owner = f"{hostname or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.store = get_store(app)
        #: With an event loop, acquires are sent without waiting for the reply (acquirer.py).
        self.acquirer = Acquirer(self.store, hub, busy=self._pool_busy if prefork else None) \
            if hub is not None and Acquirer.supported(self.store) else None
        if self.acquirer is not None:
            hub.on_tick.add(self.acquirer.tick)
        self.heartbeat = Heartbeat(self.store, self.owner, config.heartbeat_interval, self._on_lost,
                                   sender=app, on_missing=self._on_missing)
        self._task_configs: dict[str, LeaseConfig] = {}
        self._stop = threading.Event()
        self._recovery_thread: threading.Thread | None = None
        self.recovery_passes = 0
        self.recovery_outage = Outage(logger, "celery-leases: fallback recovery pass")

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        # Fail at worker start, naming the URL's setting, when Redis is not there.
        try:
            self.store.server_time_ms()
        except LeaseUnavailable as exc:
            raise LeaseUnavailable(f"leases_redis_url: {exc}") from exc
        # Scripts are read once, here: the pool processes inherit them, and a
        # package upgraded on disk under a running worker cannot mix versions.
        scripts.load_all()
        run_checks(self.app, self.config, self.store)  # warnings only: Redis and broker settings
        self.heartbeat.start()
        if self.config.worker_recovery:
            self._recovery_thread = threading.Thread(
                target=self._recovery_loop, name="celery-leases-recovery", daemon=True)
            self._recovery_thread.start()
        logger.info("celery-leases: worker %s renews leases every %.1fs (ttl %.1fs)",
                    self.owner, self.config.heartbeat_interval, self.config.ttl)

    def stop(self, unstarted: bool) -> None:
        """Release what is still held and stop the threads."""
        self._stop.set()
        self._drop_pending()
        if self.acquirer is not None:
            self.acquirer.stop()
        with self.heartbeat.lock:
            held = [(task_id, h) for task_id, h in self.heartbeat.held.items() if not h.lost]
        # Leases whose task never started are released unstarted whatever the caller
        # says: their next owner must not count a recovery for them.
        groups = {True: {t: h.token for t, h in held if unstarted or not h.started},
                  False: {t: h.token for t, h in held if not unstarted and h.started}}
        for flag, leases in groups.items():
            if not leases:
                continue
            try:
                n = self.store.release(self.owner, leases, unstarted=flag)
                logger.info("celery-leases: released %d lease(s) at shutdown", n)
            except LeaseError as exc:
                logger.error("celery-leases: could not release %d lease(s) at shutdown; they will "
                             "be recovered after their ttl: %s", len(leases), exc)
        self.heartbeat.stop()

    # -- acquire at receipt -------------------------------------------------

    def _pool_busy(self) -> bool:
        """True while at least one task per pool process is ready to start: an acquire
        sent a little later then delays nothing. Ready: reserved by Celery, not
        started, not waiting for its own acquire (prefork: all in the loop thread).
        Celery reserves a request just after ``task_received``, so the one being
        acquired may not be counted yet."""
        assert self.acquirer is not None
        slots = getattr(self.pool, "num_processes", 0) or 1
        waiting = len(reserved_requests) - len(active_requests)
        # Most calls are settled by the bounds alone (0 <= unleased <= pending).
        if waiting < slots:
            return False
        if waiting - self.acquirer.pending >= slots:
            return True
        unleased = sum(1 for request in self.acquirer.requests() if request in reserved_requests)
        return waiting - unleased >= slots

    def task_config(self, task: Any) -> LeaseConfig:
        config = self._task_configs.get(task.name)
        if config is None:
            config = self._task_configs[task.name] = self.config.for_task(task)
        return config

    def acquire_pending(self, request: Any) -> None:
        """Second try for a request whose acquire at receipt found the store unreachable."""
        request._lease_pending = None
        self.on_received(request, due=True)

    def _acquire_call(self, request: Any, config: LeaseConfig) -> dict:
        message, request_dict = request.message, request.request_dict
        # Taken before the acquire is sent, so at most the server's deadline minus the ttl.
        request._lease_asked_at = time.monotonic()
        return dict(task_id=request.id, owner=self.owner, ttl=config.ttl,
                    generation=int((message.headers or {}).get("lease_generation") or 0),
                    attempt=int(request_dict.get("retries") or 0),
                    max_recoveries=config.max_recoveries,
                    progress_timeout=config.progress_timeout or 0, name=request.task.name,
                    body=message.body, envelope=envelope_of(message))

    def on_received(self, request: Any, due: bool = False) -> None:
        config = self.task_config(request.task)
        if self.acquirer is not None and not due:
            # Sent now, read when the event loop sees the reply; the request
            # is handed to its pool once it is in (LeasedRequest defers it).
            request._lease_inflight = True
            self.acquirer.submit(Job(self._acquire_call(request, config), self._acquired, request,
                                     {"config": config, "epoch": self._epoch}))
            return
        try:
            acq = self.store.acquire(**self._acquire_call(request, config))
        except LeaseError as exc:
            self._acquire_failed(request, exc, due)
            return
        self._settle(request, config, acq)

    def _acquired(self, job: Job, result: Any) -> None:
        """An acquire sent by the acquirer is answered: settle it, then hand the task to its pool."""
        request, config = job.request, job.context["config"]
        request.__dict__.pop("_lease_inflight", None)
        if job.context["epoch"] != self._epoch:
            # The consumer dropped the request while its acquire was under way
            # (broker reconnect, shutdown): never run it; recovery takes the lease at once.
            request.__dict__.pop("_lease_deferred", None)
            if isinstance(result, Acquisition) and result.owned:
                self.release({request.id: result.token}, unstarted=True)
            return
        if isinstance(result, Acquisition):
            self._settle(request, config, result)
        else:  # a LeaseError: the acquirer hands out nothing else
            self._acquire_failed(request, result, due=False)
        deferred = request.__dict__.pop("_lease_deferred", None)
        if deferred is not None:
            self._execute(request, *deferred)

    def _execute(self, request: Any, pool: Any, kwargs: dict) -> None:
        """Hand a deferred request to its pool, as Celery's WorkController._process_task does."""
        try:
            request.execute_using_pool(pool, **kwargs)
        except TaskRevokedError:
            if self.quick_release is not None:
                self.quick_release()
        except Exception as exc:  # noqa: BLE001 - logged, and the lease goes to recovery
            logger.critical("task %s[%s]: handing the task to the pool failed: %r; its lease is "
                            "released for recovery", request.name, request.id, exc, exc_info=True)
            token = request.request_dict.get("lease_token")
            if token is not None:
                self.release({request.id: token}, unstarted=True)

    def _acquire_failed(self, request: Any, exc: LeaseError, due: bool) -> None:
        task = request.task
        if isinstance(exc, LeaseUnavailable):
            if due:
                self._requeue_later(request, exc)
            else:
                # Try again when the task is due to run (at once, or at its ETA):
                # re-queueing from here would loop, since Celery receives an ETA
                # copy immediately and holds it.
                request._lease_pending = exc
                logger.warning("task %s[%s]: lease store unreachable at receipt (%s); trying again "
                               "when it is due to run", task.name, request.id, exc)
            return
        logger.error("task %s[%s]: lease acquire failed, not run: %s", task.name, request.id, exc)
        request.request_dict["lease_skip"] = f"lease acquire failed: {exc}"
        self._requeue_later(request, exc)

    def _settle(self, request: Any, config: LeaseConfig, acq: Acquisition) -> None:
        """An acquired lease: the request carries its token and the heartbeat renews it.
        Any other answer marks the delivery as one that must not run."""
        task, message = request.task, request.message
        if acq.owned:
            request_dict = request.request_dict
            request_dict["lease_token"] = acq.token
            request_dict["lease_owner"] = self.owner
            request_dict["lease_generation"] = acq.generation
            # Until then the lease lives whatever happens to this worker; a body that
            # starts later checks it first (LeasedTask.__call__): the worker may have
            # been paused meanwhile, and its lease taken over.
            live_until = request.__dict__.get("_lease_asked_at", time.monotonic()) + config.ttl
            request_dict["lease_expires_at"] = live_until
            self.heartbeat.add(request.id, Held(acq.token, request, config.heartbeat_interval,
                                                ttl=config.ttl, progress=bool(config.progress_timeout),
                                                live_until=live_until))
            lease_acquired.send(sender=task, task_id=request.id, token=acq.token, owner=self.owner,
                                taken_over=acq.code is Code.TAKEN_OVER)
            return
        generation = int((message.headers or {}).get("lease_generation") or 0)
        reason = {Code.BUSY: f"another worker holds a live lease (token {acq.token})",
                  Code.FINISHED: f"the task already finished ({acq.state})",
                  Code.STALE: f"stale copy of the message (generation {generation}, "
                              f"current {acq.generation})",
                  Code.DEAD: f"the task used up its {config.max_recoveries} recoveries"}[acq.code]
        logger.info("task %s[%s]: delivery not run: %s", task.name, request.id, reason)
        request.request_dict["lease_skip"] = reason
        delivery_refused.send(sender=task, task_id=request.id, reason=reason, code=acq.code,
                              token=acq.token)
        if acq.code is Code.DEAD:
            from .recovery import Recoverer
            Recoverer(self.app).mark_dead(request.id, acq.recoveries, message.body,
                                          envelope_of(message))

    def _requeue_later(self, request: Any, exc: Exception) -> None:
        """The store is unreachable: never run without a lease; publish a delayed copy instead."""
        delay = self.config.unavailable_retry_delay
        request.request_dict["lease_skip"] = f"lease store unreachable, re-queued in {delay}s"
        message = request.message
        env = envelope_of(message)
        headers = dict(env["headers"])
        headers["eta"] = (datetime.now(timezone.utc) + timedelta(seconds=delay)).isoformat()
        try:
            from .recovery import publish_raw
            publish_raw(self.app, message.body, env, headers)
            logger.warning("task %s[%s]: lease store unreachable (%s); message re-queued to run in %ss",
                           request.task.name, request.id, exc, delay)
        except Exception as publish_exc:  # noqa: BLE001 - the message must not be lost quietly
            request.request_dict["lease_skip"] = None
            request.request_dict["lease_unavailable"] = f"{exc}; re-queue failed: {publish_exc!r}"
            logger.error("task %s[%s]: lease store unreachable and the delayed copy could not be "
                         "published: %r", request.task.name, request.id, publish_exc)

    # -- heartbeat hooks --------------------------------------------------

    def forget(self, task_id: str, token: int | None = None) -> None:
        self.heartbeat.forget(task_id, token)

    def is_lost(self, task_id: str, token: int) -> bool:
        return self.heartbeat.is_lost(task_id, token)

    def started(self, task_id: str, token: int) -> None:
        """The pool started the task: its lease now counts a recovery if this worker dies."""
        self.heartbeat.started(task_id, token)

    def live_until(self, task_id: str, token: int) -> float | None:
        """Monotonic time until which the lease is known to live (None: lost or not held)."""
        return self.heartbeat.live_until(task_id, token)

    def release_dropped(self) -> int:
        """Release the leases of requests the consumer dropped without running them.

        On a broker connection loss Celery's consumer discards its prefetched
        and ETA-held requests (their messages come back from the broker); they
        will never finish here, so their leases must not be renewed any more.
        """
        from celery.concurrency.base import BasePool
        from celery.worker.state import active_requests
        self._drop_pending()
        running = {id(request) for request in list(active_requests)}
        # Prefork's pool discards the jobs it had not started (Consumer.on_close
        # calls pool.flush()); the threads, solo and green pools keep theirs and
        # still run them, so those requests keep their leases.
        flush = getattr(getattr(self.pool, "flush", None), "__func__", None)
        flushes = flush is not None and flush is not BasePool.flush

        def dropped_by_consumer(request: Any) -> bool:
            if request is None or id(request) in running:
                return False
            handed_to_pool = getattr(request, "_apply_result", None) is not None
            return flushes or not handed_to_pool

        with self.heartbeat.lock:
            dropped = {task_id: held.token for task_id, held in self.heartbeat.held.items()
                       if dropped_by_consumer(held.request)}
        if not dropped:
            return 0
        released = self.release(dropped, unstarted=True)
        logger.info("celery-leases: released %d lease(s) of requests the consumer dropped "
                    "(broker reconnect or shutdown)", released)
        return released

    def _drop_pending(self) -> None:
        """The consumer dropped its requests: acquires still under way must not hold leases.

        Leases already held are the caller's to release; the replies still
        outstanding are read now, and each lease they grant is released.
        """
        self._epoch += 1
        if self.acquirer is not None:
            self.acquirer.flush()

    def release(self, leases: dict, unstarted: bool = False) -> int:
        for task_id, token in leases.items():
            self.heartbeat.forget(task_id, token)
        try:
            return self.store.release(self.owner, leases, unstarted=unstarted)
        except LeaseError as exc:
            logger.error("could not release lease(s) %s; recovery will take them after the ttl: %s",
                         ", ".join(leases), exc)
            return 0

    def revoke_unowned(self, task_id: str, expired: bool) -> bool:
        """A revoked or expired delivery this worker does not own; True to write REVOKED."""
        try:
            record = self.store.get(task_id)
            if record is None:
                return True
            if expired and record.state == "active":
                # Another owner started it before it expired: its outcome stands.
                return False
            self.store.finish(task_id, "", 0, "revoked")
            return True
        except LeaseError as exc:
            logger.info("task %s: revoke not applied to its lease: %s", task_id, exc)
            return record is None or record.state != "active"

    def _on_missing(self, task_id: str, held: Held) -> bool:
        """A held lease's record is gone: put it back under the same token if nobody else has one.

        Redis replicates asynchronously, so a failover can lose the write that
        created a lease. Without this the running task would be told it lost
        its lease, its outcome refused, and (with early acks) nothing left to
        re-run it. The store re-creates the record, with the message, only if
        no record exists (docs/redis-deployments.md).
        """
        request = held.request
        if request is None:
            return False
        call = self._acquire_call(request, self.task_config(request.task))
        # The generation the lease was acquired under (it may be above the message header's).
        call.update(ttl=held.ttl, generation=int(request.request_dict.get("lease_generation") or 0),
                    reassert=held.token)
        try:
            acq = self.store.acquire(**call)
        except LeaseError as exc:
            logger.error("task %s: lease record missing and could not be re-created: %s", task_id, exc)
            return False
        if acq.owned and acq.token == held.token:
            logger.warning("task %s: lease record was missing (a Redis failover lost the write that "
                           "created it?); re-created under token %s", task_id, held.token)
            return True
        return False

    def _on_lost(self, task_id: str, held: Held, code: Code) -> None:
        reason = {Code.STALLED: "no progress within the progress timeout",
                  Code.LOST: "taken over by another owner", Code.MISSING: "record missing"}.get(code, code.name)
        logger.warning("task %s: lease (token %s) lost: %s", task_id, held.token, reason)
        lease_lost.send(sender=self.app, task_id=task_id, token=held.token, reason=reason)
        request = held.request
        config = self.task_config(request.task) if request is not None else self.config
        if config.on_lost == "terminate" and request is not None:
            pid = getattr(request, "worker_pid", None)
            if pid and pid != os.getpid():
                logger.warning("task %s: terminating pool process %s (leases_on_lost='terminate')", task_id, pid)
                try:
                    os.kill(pid, _signal.SIGTERM)
                except OSError as exc:
                    logger.error("task %s: could not terminate pool process %s: %s", task_id, pid, exc)
            else:
                logger.warning("task %s: cannot terminate a task running in the worker's own process "
                               "(threads/solo pool); it is only flagged lost", task_id)

    # -- fallback recovery ------------------------------------------------

    def _recovery_loop(self) -> None:
        """Recovery without beat: each interval, the one worker that wins the guard runs a pass."""
        interval = self.config.recovery_interval
        while not self._stop.wait(interval):
            try:
                # The guard lives a little less than the interval: a guard that
                # outlived its interval by a millisecond would cost a whole turn.
                if self.store.try_recovery_turn(self.owner, interval * 0.9):
                    report = self.store.recover()
                    self.recovery_passes += 1
                    # Quiet when healthy: a pass that did nothing logs at DEBUG.
                    level = logging.INFO if report.recovered or report.dead else logging.DEBUG
                    logger.log(level, "celery-leases: recovery pass: %s", report.as_dict())
                else:
                    logger.debug("celery-leases: recovery pass skipped: another recoverer ran one")
                self.recovery_outage.succeeded()
            except Exception as exc:  # noqa: BLE001 - logged once per outage; the next interval tries again
                self.recovery_outage.failed(exc)


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: builds the LeaseWorker and starts its heartbeat."""

    label = "Leases"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.lease_worker: LeaseWorker | None = None

    def create(self, w: Any) -> "LeaseStep":
        config = get_config(w.app)
        # The acquire waits for Redis only where the event loop does not run
        # task bodies: prefork and threads. Elsewhere (solo, gevent, eventlet,
        # a transport without a loop) it stays a blocking call at receipt.
        hub = getattr(w, "hub", None) if getattr(w, "use_eventloop", False) else None
        if type(w.pool).__module__ not in ("celery.concurrency.prefork", "celery.concurrency.thread"):
            hub = None
        self.lease_worker = LeaseWorker(w.app, config, pool=w.pool, hostname=w.hostname, hub=hub,
                                        quick_release=getattr(w, "_quick_release", None),
                                        prefork=type(w.pool).__module__ == "celery.concurrency.prefork")
        set_worker(w.app, self.lease_worker)
        return self

    def start(self, w: Any) -> None:
        assert self.lease_worker is not None
        self.lease_worker.start()

    def stop(self, w: Any) -> None:
        # Warm shutdown: running tasks are still finishing in the pool, so the
        # heartbeat keeps going; worker_shutdown (after the pool) releases the rest.
        pass

    def terminate(self, w: Any) -> None:
        if self.lease_worker is not None:
            self.lease_worker.stop(unstarted=False)


class LeaseConsumerStep(bootsteps.StartStopStep):
    """Consumer bootstep: stopped whenever the consumer restarts (broker reconnect) or
    shuts down, right after Celery dropped the requests it had not started."""

    label = "Leases (consumer)"

    def stop(self, c: Any) -> None:
        worker = get_worker(c.app)
        if worker is not None:
            worker.release_dropped()

    shutdown = stop


@task_received.connect
def _on_task_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    task = getattr(request, "task", None)
    if task is None or not getattr(task, "leased", False):
        return
    worker = get_worker(task.app)
    if worker is not None:
        worker.on_received(request)


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    worker = get_worker(app) if app is not None else None
    if worker is not None:
        # The pool has finished: whatever is still held never started.
        worker.stop(unstarted=True)
        set_worker(app, None)


__all__ = ["LeaseStep", "LeaseConsumerStep", "LeaseWorker", "envelope_of"]
