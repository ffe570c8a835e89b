"""Acquire at receipt: each delivery of a leased task is leased before it may run, or refused.

The worker's main process acquires when Celery receives the message
(``task_received``), so prefetched and ETA-held messages are leased too, and
the main process knows the token it must fence its own writes with. What a
delivery must be (its fields, the delivery window, re-queue delays) is in
delivery.py; this module acts on it:

- an acquired lease: the request carries the token, the heartbeat renews it;
- any other answer (busy, finished, stale, dead): the delivery is not run;
- the store unreachable: tried again when the task is due, then re-queued
  with a growing delay, never run unleased;
- a permanent error: the delivery is parked, never re-queued.

What becomes of a delivery that does not run now (refused, parked, re-queued) is
refusal.py's.

With an event loop (prefork, threads) the acquire is sent without waiting,
together with those received meanwhile and the due start marks (acquirer.py).
Each acquire carries the *epoch* it was sent in: the consumer dropping its
requests (a broker reconnect, shutdown) starts a new epoch, and a lease granted
to an acquire of an older epoch is released at once.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from celery.exceptions import TaskRevokedError
from celery.worker.state import active_requests, reserved_requests
from celery.worker.state import revoked as revoked_tasks

from ..protocol.clock import ServerClock
from ..protocol.codes import Code
from ..config import LeaseConfig
from ..exceptions import LeaseError, LeaseUnavailable
from ..recovery.messages import envelope_of
from ..publishing.publish_id import PUBLISH_HEADER, RECORDED_HEADER, recorded_headers
from ..recovery.recoverer import Recoverer
from ..signals import delivery_refused, lease_acquired
from ..protocol.records import Acquisition
from ..protocol.store import AcquireRequest, LeaseStore
from .acquirer import Acquirer, Job
from .background import BackgroundFinishes
from .delivery import (DUE_HEADER, REQUEUES_HEADER, DeliveryWindow, Throttled, describe,
                       lease_delivery, local_eta, validate_message)
from .heartbeat import Heartbeat, Held
from .isolation import Isolation
from .refusal import ParkLater, Refusal

logger = logging.getLogger("celery_leases.worker")

__all__ = ["Receipt", "acquire_call"]

#: The acquire answers that refuse a delivery; any other non-owned answer is an error.
_REFUSALS = frozenset({Code.BUSY, Code.FINISHED, Code.STALE, Code.DEAD})


def acquire_call(request: Any, config: LeaseConfig, owner: str, shared: bool = False) -> dict:
    """The ``LeaseStore.acquire`` arguments for one delivery of a leased task, held by ``owner``
    (``shared``: whose pool runs several tasks in one process, isolation.py)."""
    message, request_dict = request.message, request.request_dict
    headers = message.headers or {}
    # Taken before the acquire is sent, so at most the server's deadline minus the ttl.
    lease_delivery(request).asked_at = time.monotonic()
    return dict(task_id=request.id, owner=owner, ttl=config.ttl,
                generation=int(headers.get("lease_generation") or 0),
                attempt=int(request_dict.get("retries") or 0),
                max_recoveries=config.max_recoveries,
                progress_timeout=config.progress_timeout or 0, name=request.task.name,
                body=message.body, envelope=envelope_of(message),
                publish=headers.get(PUBLISH_HEADER) or "",
                # Recorded at publish as received: the store holds the message (sent if not).
                recorded=RECORDED_HEADER in headers and headers[RECORDED_HEADER] == recorded_headers(headers),
                shared=shared)


class Receipt:
    """The acquire at receipt of one worker process, and what follows when it is refused.

    ``task_config(task)`` gives a task's settings; ``release(leases, unstarted)``
    gives leases back (the worker's held-lease bookkeeping, service.py).
    """

    def __init__(self, app: Any, config: LeaseConfig, store: LeaseStore, owner: str,
                 heartbeat: Heartbeat, clock: ServerClock, *,
                 task_config: Callable[[Any], LeaseConfig], release: Callable[..., int],
                 pool: Any = None, hub: Any = None, quick_release: Any = None,
                 prefork: bool = False, isolation: Isolation | None = None) -> None:
        self.app, self.config, self.store, self.owner = app, config, store, owner
        self.heartbeat, self.clock, self.pool = heartbeat, clock, pool
        self.task_config, self.release = task_config, release
        #: The gate of a shared-process pool (isolation.py): its deaths are not charged to
        #: one task, and a task the store asks to isolate runs alone.
        self.isolation = isolation
        #: Celery's semaphore release, for a deferred request found revoked (as _process_task does).
        self.quick_release = quick_release
        #: Bumped whenever the consumer drops its requests: acquires of an older epoch are released.
        self._epoch = 0
        #: With an event loop, acquires are sent without waiting for the reply (acquirer.py);
        #: while the pool has work they wait for company (prefork, and threads: their pool
        #: queues what it cannot start yet, which the reserved and active requests show).
        batch = prefork or type(pool).__module__ == "celery.concurrency.thread"
        self.acquirer = Acquirer(store, hub, busy=self._pool_busy if batch else None,
                                 marks=heartbeat) \
            if hub is not None and Acquirer.supported(store) else None
        if self.acquirer is not None:
            hub.on_tick.add(self.acquirer.tick)
        #: The solo pool's finishes nobody waits for, which ride with its acquires (``carry``).
        self.finishes: BackgroundFinishes | None = None
        #: Prefork: this process finishes its children's unread successes (``carry``;
        #: LeasedRequest marks the requests it will finish).
        self.finish_in_parent = False
        #: Deliveries admitted per task id per minute (in memory: holds when Redis is down).
        self.window = DeliveryWindow(config.deliveries_per_minute)
        #: What happens to a delivery that does not run now: parked, re-queued, refused.
        self.refusal = Refusal(app, config, store, clock)

    def carry(self, finishes: BackgroundFinishes) -> None:
        """The finishes nobody waits for ride with this process's acquires: in the acquirer's
        writes (prefork, whose successes this process then finishes: ``lease_parent_finish``),
        or in the write of the solo pool's waited acquire."""
        if finishes.carrier is not None and self.acquirer is not None:
            self.acquirer.finishes = finishes
            self.finish_in_parent = True
        else:
            self.finishes = finishes

    def drop_pending(self) -> None:
        """The consumer dropped its requests: acquires still under way must not hold leases.

        Leases already held are the caller's to release; the replies still
        outstanding are read now, and each lease they grant is released.
        """
        self._epoch += 1
        if self.acquirer is not None:
            self.acquirer.flush()

    def stop(self) -> None:
        self.drop_pending()
        if self.acquirer is not None:
            self.acquirer.stop()

    def _pool_busy(self) -> bool:
        """True while at least one task per pool process is ready to start: an acquire
        sent a little later then delays nothing. Ready: reserved by Celery, not
        started, not waiting for its own acquire (prefork: all in the loop thread;
        threads: the pool threads add to the active requests as they start, and a
        length read under the GIL needs no lock). Celery reserves a request just after
        ``task_received``, so the one being acquired may not be counted yet."""
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

    def acquire_pending(self, request: Any) -> None:
        """The task is due to run and its receipt left work to finish: the store was
        unreachable (acquire again), the delivery window was full (look again), or
        parking failed (park again)."""
        state = lease_delivery(request)
        pending, state.pending = state.pending, None
        if pending is None:
            return
        try:
            if isinstance(pending, ParkLater):
                self.refusal.park(request, pending.exc, due=True)
                return
            if isinstance(pending, Throttled):
                wait = self.window.room_in(request.id)
                if wait > 0:
                    self.refusal.requeue_later(request, pending, delay=max(wait, self.config.unavailable_retry_delay))
                    return
                self.window.admit(request.id)
            config = self.task_config(request.task)
            acq = self._acquire_now(acquire_call(request, config, self.owner, self.isolation is not None))
            self._settle(request, config, acq)
        except Exception as exc:  # noqa: BLE001 - fail closed: classified, never run unleased
            self._acquire_failed(request, exc, due=True)

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
            call = acquire_call(request, config, self.owner, self.isolation is not None)
            if self.acquirer is not None:
                # Sent now, read when the event loop sees the reply; the request
                # is handed to its pool once it is in (LeasedRequest defers it).
                lease_delivery(request).inflight = True
                self.acquirer.submit(Job(call, self._acquired, request,
                                         {"config": config, "epoch": self._epoch}))
                return
            acq = self._acquire_now(call)
            self._settle(request, config, acq)
        except Exception as exc:  # noqa: BLE001 - fail closed: classified, never run unleased
            lease_delivery(request).inflight = False
            self._acquire_failed(request, exc, due=False)

    def _acquire_now(self, call: dict) -> Acquisition:
        """The acquire, waited for here; on the solo pool the finishes queued since the last
        body ride in its write (background.py), so they land before this task can start."""
        finishes = self.finishes
        if finishes is None or not finishes.queued:
            return self.store.acquire(**call)
        req = AcquireRequest(**call)
        return finishes.ride(lambda reqs: self.store.acquire_with_finishes(req, reqs))

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
        state = lease_delivery(request)
        state.inflight = False
        if job.context["epoch"] != self._epoch:
            # The consumer dropped the request while its acquire was under way
            # (broker reconnect, shutdown): never run it; recovery takes the lease at once.
            state.deferred = None
            if isinstance(result, Acquisition) and result.owned:
                self.release({request.id: result.token})
            return
        try:
            if isinstance(result, Acquisition):
                self._settle(request, config, result)
            else:  # a LeaseError: the acquirer hands out nothing else
                self._acquire_failed(request, result, due=False)
        except Exception as exc:  # noqa: BLE001 - fail closed; the request is still handed over below
            self._acquire_failed(request, exc, due=False)
        deferred, state.deferred = state.deferred, None
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
                self.release({request.id: token})

    def _acquire_failed(self, request: Any, exc: BaseException, due: bool) -> None:
        """The one rule for errors at receipt: transient -> later, with backoff; anything else -> parked."""
        try:
            if not isinstance(exc, LeaseUnavailable):
                self.refusal.park(request, exc, due)
            elif due:
                self.refusal.requeue_later(request, exc)
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
        lease_delivery(request).pending = reason
        first = not (request.message.headers or {}).get(REQUEUES_HEADER)
        logger.log(logging.WARNING if first and isinstance(reason, LeaseUnavailable) else logging.DEBUG,
                   "task %s: %s at receipt; trying again when it is due to run",
                   describe(request), reason if isinstance(reason, Throttled)
                   else f"lease store unreachable ({reason})")
        if first and isinstance(reason, LeaseUnavailable):
            lease_delivery(request).warned = True

    def park_unleased(self, request: Any) -> None:
        """A leased request is due to run with no lease and no decision from receipt."""
        self.refusal.park(request, LeaseError(f"task {describe(request)}: no lease was acquired at receipt "
                                       f"(the task_received hook did not settle it)"), due=True)

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
            live_until = (lease_delivery(request).asked_at or time.monotonic()) + config.ttl
            request_dict["lease_expires_at"] = live_until
            if acq.isolate:
                # An earlier death's blame was uncertain: this run is marked started before
                # its body (LeasedTask) and, on a shared-process pool, runs alone.
                request_dict["lease_isolate"] = 1
                if self.isolation is not None:
                    self.isolation.isolate(request.id)
            self.heartbeat.add(request.id, Held(acq.token, request, config.heartbeat_interval,
                                                ttl=config.ttl, progress=bool(config.progress_timeout),
                                                live_until=live_until))
            lease_acquired.send(sender=task, task_id=request.id, token=acq.token, owner=self.owner,
                                taken_over=acq.code is Code.TAKEN_OVER)
            requeues = (message.headers or {}).get(REQUEUES_HEADER)
            if requeues or lease_delivery(request).warned:
                logger.info("task %s[%s]: lease acquired (token %s) after the lease store was "
                            "unreachable (%s re-queue(s))", task.name, request.id, acq.token, requeues or 0)
            return
        if acq.code not in _REFUSALS:
            raise LeaseError(f"task {task.name}[{request.id}]: acquire answered {acq.code!r}, which "
                             f"a delivery cannot act on")
        reason = f"{acq.code.words} ({self._refusal_facts(request, config, acq)})"
        logger.info("task %s[%s]: delivery not run: %s", task.name, request.id, reason)
        request.request_dict["lease_skip"] = reason
        if acq.code is Code.FINISHED and acq.state == "revoked":
            # Celery discards it as revoked when it is due (REVOKED stored, the message
            # acked), even on a worker that never heard of the revoke.
            revoked_tasks.add(request.id)
        delivery_refused.send(sender=task, task_id=request.id, reason=reason, code=acq.code,
                              token=acq.token)
        if acq.code is Code.DEAD:
            Recoverer(self.app, self.store, dead_letter_queue=config.dead_letter_queue).mark_dead(
                request.id, acq.recoveries, message.body, envelope_of(message))

    def _refusal_facts(self, request: Any, config: LeaseConfig, acq: Acquisition) -> str:
        """What a refused delivery's reason adds to its code's: whose lease, which state or copy."""
        if acq.code is Code.BUSY:  # a duplicate delivery to the holder is told so (#14.7)
            held = self.heartbeat.held.get(request.id)
            mine = held is not None and held.token == acq.token
            return f"token {acq.token}, by {'this worker' if mine else 'another worker'}"
        if acq.code is Code.FINISHED:
            return str(acq.state)
        if acq.code is Code.STALE:
            generation = int((request.message.headers or {}).get("lease_generation") or 0)
            return f"generation {generation}, current {acq.generation}"
        return f"leases_max_recoveries {config.max_recoveries}"
