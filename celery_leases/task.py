"""LeasedTask: the task class whose every outcome is guarded by its lease token.

The lease itself is acquired in the worker's main process when the message is
received (see worker.py); the token reaches the execution as
``self.request.lease_token``. Here, in the process that runs the body, the
owner's outcome is recorded in the store *before* it leaves ``__call__``:
Celery sends link callbacks and chains before it writes the result, so a later
check would let a stale owner fire callbacks.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry

from .config import get_config
from .exceptions import LeaseError, LeaseLost, LeaseUnavailable
from .lease import DETACHED, Lease
from .results import fused_write, mark_stored
from .runtime import get_store, get_worker
from .signals import stale_outcome_rejected

logger = logging.getLogger("celery_leases.task")

# Keys the worker and this class add to the request; declared on Context so
# they stay out of request.headers and never travel into retry() re-publishes
# (Celery 5.7's push_request copies the request's __dict__ into a new Context,
# whose custom headers are every key Context does not declare).
for _name in ("lease_token", "lease_owner", "lease_generation", "lease_skip", "lease_unavailable",
              "_lease_handle"):
    if not hasattr(Context, _name):
        setattr(Context, _name, None)


class StaleOutcome(Ignore, LeaseError):
    """Raised in the worker to drop the outcome of an owner that lost its lease.

    An ``Ignore``: Celery's tracer then sends no callbacks, writes no result
    and acknowledges the message.
    """


class LeasedTask(Task):
    """Base class of leased tasks: ``@app.task(base=LeasedTask, bind=True)``.

    Per-task settings (``None`` means the app's ``leases_*`` setting):
    """

    Request = "celery_leases.request:LeasedRequest"

    #: Marks the task class as leased for the worker's hooks.
    leased = True
    #: Seconds the lease lives without a heartbeat.
    lease_ttl: float | None = None
    #: Seconds between heartbeats (must be below the ttl).
    lease_heartbeat_interval: float | None = None
    #: Recoveries before the task is declared dead.
    lease_max_recoveries: int | None = None
    #: Seconds the body may go without ``self.lease.heartbeat()``.
    lease_progress_timeout: float | None = None
    #: "flag" or "terminate" a running task whose lease was lost.
    lease_on_lost: str | None = None

    @property
    def lease(self) -> Lease:
        """The lease of the current execution (a detached one when there is none)."""
        request = self.request
        token = request.lease_token
        if token is None:
            return DETACHED  # type: ignore[return-value]
        handle = request.__dict__.get("_lease_handle")
        if handle is None or handle.token != token:
            config = get_config(self.app).for_task(self)
            worker = get_worker(self.app)
            handle = Lease(request.id, request.lease_owner, int(token),
                           int(request.lease_generation or 0), get_store(self.app),
                           check_every=min(1.0, config.heartbeat_interval),
                           beat_every=(config.progress_timeout / 10 if config.progress_timeout else 0.0),
                           local_lost=worker.is_lost if worker is not None else None)
            request._lease_handle = handle
        return handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.lease_skip:
            # The worker decided at receipt that this delivery must not run.
            raise Ignore(request.lease_skip)
        if request.lease_unavailable:
            # Neither the lease store nor a delayed re-queue worked: fail loudly
            # rather than run without a lease or drop the message.
            raise LeaseUnavailable(f"task {request.id}: {request.lease_unavailable}")
        if request.lease_token is None:
            return super().__call__(*args, **kwargs)
        lease = self.lease
        try:
            retval = super().__call__(*args, **kwargs)
        except Retry:
            if not lease.handed_over:
                self._finish(lease, "retry", next_attempt=(request.retries or 0) + 1)
            raise
        except Reject as exc:
            if exc.requeue:
                # The requeued copy must be able to take the lease at once.
                self._store_call(lambda: lease.store.release(lease.owner, {lease.task_id: lease.token},
                                                             unstarted=True), lease)
            else:
                self._finish(lease, "failed")
            raise
        except Ignore:
            if not lease.handed_over:  # replace() handed the lease to the replacement
                self._finish(lease, "succeeded")
            raise
        except Exception:
            self._finish(lease, "failed")
            raise
        write = fused_write(self, request, retval, lease.store)
        self._finish(lease, "succeeded", write=write)
        if write is not None:
            mark_stored(request)
        return retval

    def _finish(self, lease: Lease, outcome: str, next_attempt: int = 0,
                retry_grace: float | None = None, write: Any = None) -> None:
        """Record the outcome, or raise StaleOutcome so nothing of it leaves the worker."""
        try:
            self._store_call(lambda: lease.store.finish(lease.task_id, lease.owner, lease.token,
                                                        outcome, next_attempt=next_attempt,
                                                        retry_grace=retry_grace, write=write), lease)
        except LeaseLost as exc:
            lease._lost = True
            refuse(self, lease.task_id, lease.token, outcome, exc.reason)

    def _store_call(self, fn, lease: Lease) -> Any:
        """One retry on an unreachable store, then withhold the outcome (recovery re-runs it)."""
        try:
            return fn()
        except LeaseUnavailable:
            time.sleep(0.5)
            try:
                return fn()
            except LeaseUnavailable as exc:
                raise LeaseLost(lease.task_id, lease.token,
                                f"unconfirmed, store unreachable: {exc}") from exc

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None, **options: Any) -> Any:
        """Hand the lease to the next attempt *before* it is published.

        A stale owner is refused here and publishes nothing; the next attempt
        finds the lease waiting for it, and if the publish fails the stored
        message is recovered after the countdown plus ``leases_publish_grace``.
        """
        request = self.request
        lease = self.lease
        limit = self.max_retries if max_retries is None else max_retries
        will_retry = limit is None or (request.retries or 0) + 1 <= limit
        if will_retry and lease.held and not request.is_eager and not lease.handed_over:
            delay = countdown if countdown is not None else (
                0 if eta is not None else (self.default_retry_delay or 0))
            if eta is not None:
                from datetime import datetime, timezone
                delay = max(0.0, (eta - datetime.now(eta.tzinfo or timezone.utc)).total_seconds())
            config = get_config(self.app)
            self._finish(lease, "retry", next_attempt=(request.retries or 0) + 1,
                         retry_grace=float(delay) + config.publish_grace)
            lease.handed_over = True
        return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                             countdown=countdown, max_retries=max_retries, **options)

    def signature_from_request(self, request: Any = None, *args: Any, **kwargs: Any):
        """Retries carry the lease generation, so the next attempt is not taken for a stale copy."""
        sig = super().signature_from_request(request, *args, **kwargs)
        request = self.request if request is None else request
        generation = getattr(request, "lease_generation", None)
        if generation:
            headers = dict(sig.options.get("headers") or {})
            headers["lease_generation"] = int(generation)
            sig.set(headers=headers)
        return sig

    def on_replace(self, sig: Any) -> Any:
        """Hand the lease to the replacement, which Celery publishes under the same id.

        Here rather than in ``replace()``: Celery calls this once it has
        validated ``sig`` (an empty chain raises before), so a replacement
        that is refused leaves the lease, and the failure, to this execution.
        """
        lease = self.lease
        if lease.held and not lease.handed_over:
            generation = int(self.request.lease_generation or 0)
            if generation:
                headers = dict(sig.options.get("headers") or {})
                headers["lease_generation"] = generation
                sig.set(headers=headers)
            self._finish(lease, "retry", next_attempt=0)
            lease.handed_over = True
        return super().on_replace(sig)


def refuse(task: Any, task_id: str, token: int | None, outcome: str, reason: str) -> None:
    """Log and signal a refused outcome, then raise StaleOutcome."""
    logger.warning("task %s[%s]: outcome %r of token %s refused: lease %s",
                   getattr(task, "name", "?"), task_id, outcome, token, reason)
    stale_outcome_rejected.send(sender=task, task_id=task_id, token=token, outcome=outcome, reason=reason)
    raise StaleOutcome(f"stale outcome {outcome} of task {task_id} (token {token}) refused: {reason}")
