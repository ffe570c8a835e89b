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
from functools import cached_property
from typing import Any

from celery import bootsteps
from celery.exceptions import TaskRevokedError
from celery.signals import task_received, worker_process_init, worker_shutdown
from celery.worker.state import active_requests, reserved_requests
from celery.worker.state import revoked as revoked_tasks

from .acquirer import Acquirer, Job
from .checks import run_checks
from .codes import Code
from .config import LeaseConfig, get_config
from .exceptions import ConfigurationError, LeaseError, LeaseUnavailable
from .heartbeat import Heartbeat, Held
from .receipt import (DUE_HEADER, REQUEUES_HEADER, DeliveryWindow, Throttled, describe, eta_after,
                      local_eta, requeue_delay, usable_id, validate_message)
from .revokes import HeldRevokes, gate_backend, install_control_hook
from .outage import Outage
from .runtime import get_store, get_worker, set_worker
from .scripts import scripts
from .clock import server_clock
from .publish import PUBLISH_HEADER
from .signals import delivery_refused, lease_acquired, lease_lost
from .startup import EX_CONFIG, EX_UNAVAILABLE, refuse, refuse_if_misconfigured, wait_for_store
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
        #: Deliveries admitted per task id per minute (in memory: holds when Redis is down).
        self.window = DeliveryWindow(config.deliveries_per_minute)
        #: The store's clock, for the ETA of re-queued copies.
        self.clock = server_clock(self.store)
        self.heartbeat = Heartbeat(self.store, self.owner, config.heartbeat_interval, self._on_lost,
                                   sender=app, on_missing=self._on_missing)
        self._task_configs: dict[str, LeaseConfig] = {}
        self._stop = threading.Event()
        self._recovery_thread: threading.Thread | None = None
        self.recovery_passes = 0
        self.recovery_outage = Outage(logger, "celery-leases: fallback recovery pass")

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        # Wait for the lease store like Celery waits for its broker at start;
        # past the retries this raises LeaseUnavailable naming leases_redis_url.
        # The first reading of its clock, too (re-queue ETAs, a finish's not-after: clock.py).
        wait_for_store(self.app, self.clock.read)
        # Scripts are read once, here: the pool processes inherit them, and a
        # package upgraded on disk under a running worker cannot mix versions.
        scripts.load_all()
        run_checks(self.app, self.config, self.store)  # warnings only: Redis and broker settings
        self.gate_revokes()
        self.heartbeat.start()
        if self.config.worker_recovery:
            self._recovery_thread = threading.Thread(
                target=self._recovery_loop, name="celery-leases-recovery", daemon=True)
            self._recovery_thread.start()
        logger.info("celery-leases: worker %s renews leases every %.1fs (ttl %.1fs)",
                    self.owner, self.config.heartbeat_interval, self.config.ttl)

    def gate_revokes(self, backend: Any = None) -> None:
        """Every revoke path of Celery reaches the lease (revokes.py): the backends this
        process stores REVOKED with ask the store first, and so does the revoke command."""
        if backend is not None:
            gate_backend(backend, self.revoke_stored)
            return
        gate_backend(self.app.backend, self.revoke_stored)
        for task in list(self.app.tasks.values()):
            if getattr(task, "leased", False) and getattr(task, "_backend", None) is not None:
                gate_backend(task._backend, self.revoke_stored)
        install_control_hook()

    def stop(self, unstarted: bool) -> None:
        """Release what is still held and stop the threads."""
        self._stop.set()
        if "held_revokes" in self.__dict__:
            self.held_revokes.stop()
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
        """The task is due to run and its receipt left work to finish: the store was
        unreachable (acquire again), the delivery window was full (look again), or
        parking failed (park again)."""
        pending = request.__dict__.pop("_lease_pending", None)
        if pending is None:
            return
        try:
            if isinstance(pending, _ParkLater):
                self._park(request, pending.exc, due=True)
                return
            if isinstance(pending, Throttled):
                wait = self.window.room_in(request.id)
                if wait > 0:
                    self._requeue_later(request, pending, delay=max(wait, self.config.unavailable_retry_delay))
                    return
                self.window.admit(request.id)
            config = self.task_config(request.task)
            acq = self.store.acquire(**self._acquire_call(request, config))
            self._settle(request, config, acq)
        except Exception as exc:  # noqa: BLE001 - fail closed: classified, never run unleased
            self._acquire_failed(request, exc, due=True)

    def _acquire_call(self, request: Any, config: LeaseConfig) -> dict:
        message, request_dict = request.message, request.request_dict
        # Taken before the acquire is sent, so at most the server's deadline minus the ttl.
        request._lease_asked_at = time.monotonic()
        return dict(task_id=request.id, owner=self.owner, ttl=config.ttl,
                    generation=int((message.headers or {}).get("lease_generation") or 0),
                    attempt=int(request_dict.get("retries") or 0),
                    max_recoveries=config.max_recoveries,
                    progress_timeout=config.progress_timeout or 0, name=request.task.name,
                    body=message.body, envelope=envelope_of(message),
                    publish=(message.headers or {}).get(PUBLISH_HEADER) or "")

    def on_received(self, request: Any) -> None:
        """``task_received`` of a leased task: acquire, or decide now that it must not run.

        Whatever goes wrong here is classified (``_acquire_failed``), never
        left to the signal's error log: a receiver's exception would be
        swallowed and the task run without a lease.
        """
        try:
            validate_message(request)
            self._translate_due(request)
            config = self.task_config(request.task)
            wait = self.window.admit(request.id)
            if wait:
                self._postpone(request, Throttled(
                    f"task {describe(request)}: more than {self.config.deliveries_per_minute} deliveries "
                    f"in a minute (leases_deliveries_per_minute); postponed {wait:.1f}s"))
                return
            call = self._acquire_call(request, config)
            if self.acquirer is not None:
                # Sent now, read when the event loop sees the reply; the request
                # is handed to its pool once it is in (LeasedRequest defers it).
                request._lease_inflight = True
                self.acquirer.submit(Job(call, self._acquired, request,
                                         {"config": config, "epoch": self._epoch}))
                return
            acq = self.store.acquire(**call)
            self._settle(request, config, acq)
        except Exception as exc:  # noqa: BLE001 - fail closed: classified, never run unleased
            request.__dict__.pop("_lease_inflight", None)
            self._acquire_failed(request, exc, due=False)

    def _translate_due(self, request: Any) -> None:
        """A copy re-queued by a worker (``lease_due_ms``): its ETA on this worker's wall clock.

        Runs before Celery schedules the ETA (``task_received`` comes first in
        its strategy). Without a reading of the store's clock (never answered
        since start) the ``eta`` header stands as sent, on the store's clock.
        """
        due = (request.message.headers or {}).get(DUE_HEADER)
        if due is None:
            return
        server_now = self.clock.estimate_ms()
        if server_now is None:
            return
        eta = local_eta(due, server_now)
        request._request_dict["eta"] = eta.isoformat() if eta is not None else None
        request._eta = eta

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
        try:
            if isinstance(result, Acquisition):
                self._settle(request, config, result)
            else:  # a LeaseError: the acquirer hands out nothing else
                self._acquire_failed(request, result, due=False)
        except Exception as exc:  # noqa: BLE001 - fail closed; the request is still handed over below
            self._acquire_failed(request, exc, due=False)
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

    def _acquire_failed(self, request: Any, exc: BaseException, due: bool) -> None:
        """The one rule for errors at receipt: transient -> later, with backoff; anything else -> parked."""
        try:
            if not isinstance(exc, LeaseUnavailable):
                self._park(request, exc, due)
            elif due:
                self._requeue_later(request, exc)
            else:
                self._postpone(request, exc)
        except Exception as error:  # noqa: BLE001 - the last resort: refuse to run, loudly
            logger.critical("task %s: handling a failed acquire (%r) failed: %r; the delivery is not "
                            "run", describe(request), exc, error, exc_info=True)
            request.request_dict["lease_skip"] = f"lease acquire failed: {exc}"

    def _postpone(self, request: Any, reason: LeaseError) -> None:
        """Try again when the task is due to run (at once, or at its ETA).

        Re-queueing from here would loop: Celery receives an ETA copy at once
        and holds it, so each copy would be re-queued as soon as it arrived.
        """
        request._lease_pending = reason
        first = not (request.message.headers or {}).get(REQUEUES_HEADER)
        logger.log(logging.WARNING if first and isinstance(reason, LeaseUnavailable) else logging.DEBUG,
                   "task %s: %s at receipt; trying again when it is due to run",
                   describe(request), reason if isinstance(reason, Throttled)
                   else f"lease store unreachable ({reason})")
        if first and isinstance(reason, LeaseUnavailable):
            request._lease_warned = True

    def _park(self, request: Any, exc: BaseException, due: bool) -> None:
        """A permanent error: the delivery is never run and never re-queued; it is parked
        (parking.py: kept for the operator, waiters released) and acknowledged."""
        reason = str(exc) or repr(exc)
        request.request_dict["lease_skip"] = f"delivery parked: {reason}"
        # An id that cannot be a key (None, a float, a lone surrogate) is parked under its repr.
        task_id = request.id if usable_id(request.id) else repr(request.id)
        try:
            try:
                envelope: dict | None = envelope_of(request.message)
            except Exception:  # noqa: BLE001 - a message too broken to describe is parked without it
                envelope = None
            from .parking import park_delivery
            park_delivery(self.app, task_id, reason, name=request.task.name,
                          body=_bytes_or_empty(request.message.body), envelope=envelope,
                          key=getattr(exc, "key", "") or "", field=getattr(exc, "field", "") or "",
                          exc=exc if isinstance(exc, Exception) else None)
        except Exception as park_exc:  # noqa: BLE001 - not parked: kept, and tried again later
            logger.error("task %s: delivery must be parked (%s), but parking failed: %r",
                         describe(request), reason, park_exc)
            if due:
                self._requeue_later(request, LeaseUnavailable(f"parking failed: {park_exc!r}"))
            else:
                request._lease_pending = _ParkLater(exc)
            return
        self._refused(request)  # park_delivery logged it, naming the task, key and field

    def park_unleased(self, request: Any) -> None:
        """A leased request is due to run with no lease and no decision from receipt."""
        self._park(request, LeaseError(f"task {describe(request)}: no lease was acquired at receipt "
                                       f"(the task_received hook did not settle it)"), due=True)

    @staticmethod
    def _refused(request: Any) -> None:
        """Receipt settled this delivery without running it: acknowledge it now (its
        prefetch slot is free at once); Celery's hand-over then completes it without
        its pool (LeasedRequest.execute_using_pool)."""
        request._lease_refused = True
        request.acknowledge()

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
            requeues = (message.headers or {}).get(REQUEUES_HEADER)
            if requeues or request.__dict__.get("_lease_warned"):
                logger.info("task %s[%s]: lease acquired (token %s) after the lease store was "
                            "unreachable (%s re-queue(s))", task.name, request.id, acq.token, requeues or 0)
            return
        generation = int((message.headers or {}).get("lease_generation") or 0)
        held = self.heartbeat.held.get(request.id) if acq.code is Code.BUSY else None
        holder = "this worker already holds" if held is not None and held.token == acq.token \
            else "another worker holds"
        reason = {Code.BUSY: f"{holder} a live lease (token {acq.token})",
                  Code.FINISHED: f"the task already finished ({acq.state})",
                  Code.STALE: f"stale copy of the message (generation {generation}, "
                              f"current {acq.generation})",
                  Code.DEAD: f"the task used up its {config.max_recoveries} recoveries"}.get(acq.code)
        if reason is None:
            raise LeaseError(f"task {task.name}[{request.id}]: acquire answered {acq.code!r}, which "
                             f"a delivery cannot act on")
        logger.info("task %s[%s]: delivery not run: %s", task.name, request.id, reason)
        request.request_dict["lease_skip"] = reason
        if acq.code is Code.FINISHED and acq.state == "revoked":
            # Celery discards it as revoked when it is due (REVOKED stored, the message
            # acked), even on a worker that never heard of the revoke.
            revoked_tasks.add(request.id)
        delivery_refused.send(sender=task, task_id=request.id, reason=reason, code=acq.code,
                              token=acq.token)
        if acq.code is Code.DEAD:
            from .recovery import Recoverer
            Recoverer(self.app).mark_dead(request.id, acq.recoveries, message.body,
                                          envelope_of(message))

    def _requeue_later(self, request: Any, exc: LeaseError, delay: float | None = None) -> None:
        """Never run without a lease: publish a delayed copy (same id and headers) and
        acknowledge this one.

        The delay doubles with each re-queue of the delivery (``lease_requeues``
        header), from ``leases_unavailable_retry_delay`` up to
        ``leases_unavailable_retry_max_delay``; ``delay`` overrides it (a full
        delivery window). The ETA is on the lease store's clock (ServerClock),
        not this worker's wall clock; the receiving worker lays it on its own
        (``lease_due_ms``, ``_translate_due``).
        """
        message = request.message
        env = envelope_of(message)
        headers = dict(env["headers"])
        requeues = headers.get(REQUEUES_HEADER) or 0
        if type(requeues) is not int or requeues < 0:  # validated at receipt; a last resort here
            requeues = 0
        if delay is None:
            delay = requeue_delay(self.config.unavailable_retry_delay,
                                  self.config.unavailable_retry_max_delay, requeues)
            headers[REQUEUES_HEADER] = requeues + 1
        now, source = self.clock.now(read=not isinstance(exc, LeaseUnavailable))
        headers["eta"] = eta_after(now, delay)
        headers[DUE_HEADER] = int(now.timestamp() * 1000 + delay * 1000)
        what = "postponed" if isinstance(exc, Throttled) else "lease store unreachable"
        request.request_dict["lease_skip"] = f"{what}, re-queued to run in {delay:g}s"
        try:
            from .recovery import publish_raw
            publish_raw(self.app, message.body, env, headers)
        except Exception as publish_exc:  # noqa: BLE001 - the message must not be lost quietly
            request.request_dict["lease_skip"] = None
            request.request_dict["lease_unavailable"] = f"{exc}; re-queue failed: {publish_exc!r}"
            logger.error("task %s[%s]: %s and the delayed copy could not be published: %r",
                         request.task.name, request.id, what, publish_exc)
            return
        # One line per task when it goes unreachable (here, unless receipt already
        # said so), not one per copy; a postponement is rare and always said.
        first = not requeues and not isinstance(exc, Throttled)
        loud = isinstance(exc, Throttled) or (first and not request.__dict__.get("_lease_warned"))
        logger.log(logging.WARNING if loud else logging.DEBUG,
                   "task %s[%s]: %s (%s); message re-queued to run in %gs (ETA %s by the %s)%s",
                   request.task.name, request.id, what, exc, delay, headers["eta"], source,
                   "; its later re-queues are logged at DEBUG until it runs" if first else "")
        self._refused(request)

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

    # -- revokes (revokes.py: which Celery path calls which) -------------------

    @cached_property
    def held_revokes(self) -> HeldRevokes:
        """Revokes the store could not take yet (unreachable), retried until it answers."""
        return HeldRevokes(self.store.revoke, self.config.unavailable_retry_delay)

    def revoke(self, task_id: str, *, expired: bool = False, owner: str = "",
               token: int | None = None, name: str = "") -> bool:
        """Put a Celery revoke (or, ``expired``, an expiry) to the lease; True when Celery
        may store REVOKED.

        ``owner``/``token``: this worker's own lease of the delivery being
        discarded or terminated. False when the task finished (its stored
        result stays) or another owner runs it (its outcome stands). The store
        unreachable: True, as Celery revokes regardless, and the revoke is held
        and retried until the store answers.
        """
        if token is not None:
            self.heartbeat.forget(task_id, token)
        call: dict[str, Any] = dict(expired=expired, owner=owner if token is not None else "",
                    token=token or 0, name=name)
        try:
            code = self.store.revoke(task_id, **call)
        except LeaseUnavailable as exc:
            self.held_revokes.add(task_id, exc, **call)
            return True
        except LeaseError as exc:
            logger.error("task %s: revoke not applied to its lease: %s; Celery revokes it as usual",
                         task_id, exc)
            return True
        except Exception:  # noqa: BLE001 - called from inside Celery's revoke: never break it
            logger.exception("task %s: revoke not applied to its lease; Celery revokes it as usual",
                             task_id)
            return True
        if code is Code.OK:
            return True
        if code is Code.FINISHED:
            logger.info("task %s: revoke of a task that already finished: its stored result stays",
                        task_id)
        elif expired:
            logger.info("task %s: expired copy not run; another owner started the task in time "
                        "and its outcome stands", task_id)
        else:
            logger.info("task %s: revoked while another owner runs it: that run's outcome stands, "
                        "and the task will not run again", task_id)
        return False

    def revoke_stored(self, task_id: str) -> bool:
        """Celery's revoke command is about to store REVOKED for a task not running here
        (prefetched, ETA-held, or not held by this worker); True to let it."""
        with self.heartbeat.lock:
            held = self.heartbeat.held.get(task_id)
        request = held.request if held is not None else None
        if held is not None and not held.lost and request is not None \
                and request not in active_requests:
            return self.revoke(task_id, owner=self.owner, token=held.token, name=request.name)
        return self.revoke(task_id)

    def revoke_running(self, task_id: str) -> None:
        """A plain revoke of ``task_id`` (Celery's revoke command, before it runs): a leased
        request running here is not stopped, but the lease must remember the revoke."""
        request = next((r for r in list(active_requests) if r.id == task_id), None)
        if request is not None and getattr(request.task, "leased", False):
            self.revoke(task_id, name=request.name)

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


class _ParkLater:
    """A delivery that must be parked, but parking failed at receipt: tried again when due."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _bytes_or_empty(body: Any) -> bytes:
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return b""


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: builds the LeaseWorker and starts its heartbeat."""

    label = "Leases"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.lease_worker: LeaseWorker | None = None

    def create(self, w: Any) -> "LeaseStep":
        # Nothing here may raise: an exception in a bootstep's create escapes
        # WorkController.__init__ as a traceback. A broken setting is reported
        # once by the start-up check (startup.py), which stops the worker.
        try:
            self.lease_worker = self._build(w)
        except (ConfigurationError, LeaseUnavailable):
            self.lease_worker = None  # start() reports it, or waits for the store
        return self

    def _build(self, w: Any) -> LeaseWorker:
        config = get_config(w.app)
        # The acquire waits for Redis only where the event loop does not run
        # task bodies: prefork and threads. Elsewhere (solo, gevent, eventlet,
        # a transport without a loop) it stays a blocking call at receipt.
        hub = getattr(w, "hub", None) if getattr(w, "use_eventloop", False) else None
        if type(w.pool).__module__ not in ("celery.concurrency.prefork", "celery.concurrency.thread"):
            hub = None
        lease_worker = LeaseWorker(w.app, config, pool=w.pool, hostname=w.hostname, hub=hub,
                                   quick_release=getattr(w, "_quick_release", None),
                                   prefork=type(w.pool).__module__ == "celery.concurrency.prefork")
        set_worker(w.app, lease_worker)
        return lease_worker

    def start(self, w: Any) -> None:
        # Blocks the worker's start sequence: the consumer (started last) receives nothing
        # until the configuration passed and the lease store answered.
        refuse_if_misconfigured(w.app)
        try:
            if self.lease_worker is None:  # the store's client could not be built (a cluster down)
                wait_for_store(w.app, lambda: get_store(w.app).server_time_ms())
                self.lease_worker = self._build(w)
            self.lease_worker.start()
        except ConfigurationError as exc:  # what only building the client finds (a URL that does not parse)
            refuse(str(exc), EX_CONFIG)
        except LeaseUnavailable as exc:
            refuse(str(exc), EX_UNAVAILABLE)

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


@worker_process_init.connect
def _on_worker_process_init(sender: Any = None, **kwargs: Any) -> None:
    """A prefork child reads the store's clock before its first finish needs it (settle.py),
    so a store that stalls during that finish does not find it without a reading."""
    from celery import current_app
    app = current_app._get_current_object()
    if not getattr(app, "_celery_leases_installed", False):
        return
    try:
        server_clock(get_store(app)).fresh()  # a store away now: the first finish reads it
    except LeaseError as exc:
        logger.debug("celery-leases: pool process could not read the store's clock: %s", exc)


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    worker = get_worker(app) if app is not None else None
    if worker is not None:
        # The pool has finished: whatever is still held never started.
        worker.stop(unstarted=True)
        set_worker(app, None)


__all__ = ["LeaseStep", "LeaseConsumerStep", "LeaseWorker", "envelope_of"]
