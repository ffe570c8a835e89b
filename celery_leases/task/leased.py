"""LeasedTask: the task class whose every outcome is guarded by its lease token.

The lease itself is acquired in the worker's main process when the message is
received (see worker/receipt.py); the token reaches the execution as
``self.request.lease_token``. Here, in the process that runs the body, the
owner's outcome is recorded in the store *before* it leaves ``__call__``:
Celery sends link callbacks and chains before it writes the result, so a later
check would let a stale owner fire callbacks.
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any, NoReturn

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry

from ..publishing import publish_id  # noqa: F401 - stamps each publish with its own id (publish_id.py)
from ..ops import tracing
from ..worker import startup  # noqa: F401 - connects the worker start-up check (install(app) forgotten)
from .callbacks import send_callbacks
from ..protocol.codes import Code
from ..config import client_config, get_config, task_option_errors
from ..exceptions import ConfigurationError, LeaseError, LeaseLost, LeaseUnavailable
from .lease import DETACHED, Lease
from .results import confirmations, fused_write, keep_failure, keep_success, mark_stored, outcome_unread
from ..runtime import get_store, get_worker
from ..protocol.settle import settle_finish
from ..signals import delivery_refused
from .refusals import StaleOutcome, refusal_reason, refuse, report_refusal

logger = logging.getLogger("celery_leases.task")

# Keys the worker and this class add to the request; declared on Context so
# they stay out of request.headers and never travel into retry() re-publishes
# (Celery 5.7's push_request copies the request's __dict__ into a new Context,
# whose custom headers are every key Context does not declare).
for _name in ("lease_token", "lease_owner", "lease_generation", "lease_skip", "lease_unavailable",
              "_lease_handle", "lease_expires_at", "lease_publish", "lease_recorded", "lease_isolate",
              "lease_parent_finish"):
    if not hasattr(Context, _name):
        setattr(Context, _name, None)


#: Set once this process has warned that a LeasedTask ran unleased (eager, apply(), a direct call).
_warned_unleased = False


class LeasedTask(Task):
    """Base class of leased tasks: ``@app.task(base=LeasedTask, bind=True)``.

    Per-task settings (``None`` means the app's ``leases_*`` setting):
    """

    Request = "celery_leases.task.request:LeasedRequest"

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

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """``@app.task(...)`` time: refuse invalid ``lease_*`` options, naming task, option, value.

        How the options combine with the app's ttl is checked only when the
        app's worker settings are valid; the worker checks everything again at start.
        """
        super().on_bound(app)
        if cls.__dict__.get("abstract") or not getattr(cls, "name", None):
            return
        if getattr(app.loader, "worker_initialized", False):
            # A worker finalizing its app: a raise here would escape as a traceback
            # from WorkController.__init__; the start-up check refuses it in one line.
            return
        config = None
        try:
            config = client_config(app)
            config = None if config.worker_errors else config
        except ConfigurationError:
            config = None  # install() or the worker reports the settings
        errors = task_option_errors(cls, config)[0]
        if errors:
            raise ConfigurationError(errors[0] if len(errors) == 1 else "; ".join(errors))

    @property
    def lease(self) -> Lease:
        """The lease of the current execution (a detached one when there is none)."""
        request = self.request
        token = request.lease_token
        if token is None:
            return DETACHED  # type: ignore[return-value]
        handle = request.__dict__.get("_lease_handle")
        if handle is None or handle.token != token:
            config = self._lease_config()
            worker = get_worker(self.app)
            handle = Lease(request.id, request.lease_owner, int(token),
                           int(request.lease_generation or 0), get_store(self.app),
                           check_every=min(1.0, config.heartbeat_interval),
                           beat_every=(config.progress_timeout / 10 if config.progress_timeout else 0.0),
                           local_lost=worker.is_lost if worker is not None else None)
            request._lease_handle = handle
        return handle

    def _lease_config(self) -> Any:
        """This task's settings, built once per app config (validating the ``lease_*``
        options reads every attribute of the class: too slow to do for every execution)."""
        app_config = get_config(self.app)
        cached = self.__dict__.get("_lease_config_cache")
        if cached is None or cached[0] is not app_config:
            cached = self._lease_config_cache = (app_config, app_config.for_task(self))
        return cached[1]

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
            if request.is_eager or request.called_directly:
                _warn_unleased(self)
                return super().__call__(*args, **kwargs)
            # Run by a worker, yet no lease was taken at receipt: fail, never run unguarded.
            raise self._unleased_error(request)
        lease = self.lease
        self._check_before_start(lease)
        if request.lease_isolate:
            worker = get_worker(self.app)
            if worker is not None and worker.finishes is not None:
                worker.finishes.flush()  # its neighbours' outcomes land before it runs alone
            self._mark_alone(lease)
        tracing.run_started(self, lease)   # returns at once unless tracing.enable() was called
        try:
            retval = super().__call__(*args, **kwargs)
        except StaleOutcome:
            # Refused or withheld already (a retry's or replace's hand-over, in the body): that
            # outcome is settled; finishing again as "succeeded" would finish a task that never
            # returned, and a withheld hand-over must leave the lease for recovery.
            raise
        except Retry:
            if not lease.handed_over:
                self._finish(lease, "retry", next_attempt=(request.retries or 0) + 1)
            raise
        except Reject as exc:
            if exc.requeue:
                # The requeued copy must be able to take the lease at once. Unconfirmed, the
                # Reject still stands: the copy is refused while the lease lives, and the
                # lease, no longer renewed, expires for recovery to re-run the task.
                try:
                    self._store_call(lambda: lease.store.release(
                        lease.owner, {lease.task_id: lease.token}, hand_back=True), lease)
                except LeaseError as error:
                    logger.warning("task %s[%s]: lease (token %s) not released for its requeued copy "
                                   "(%s); recovery re-runs the task once the lease expires",
                                   self.name, lease.task_id, lease.token, error)
            else:
                self._finish(lease, "failed")
            raise
        except Ignore:
            if not lease.handed_over:  # replace() handed the lease to the replacement
                self._finish(lease, "succeeded")
            raise
        except Exception as exc:
            self._finish(lease, "failed", kept=keep_failure(self, request, exc, traceback.format_exc()))
            raise
        write = fused_write(self, request, retval, lease.store)
        self._finish(lease, "succeeded", write=write,
                     kept=keep_success(self, request, retval, written=write is not None))
        if write is not None:
            mark_stored(request)
        if request.callbacks or request.chain:
            send_callbacks(self, request, retval)
        return retval

    def _unleased_error(self, request: Any) -> ConfigurationError:
        """Why a worker's delivery has no lease: install(app) missing, a bad option, or see the log.
        (Celery's tracer logs the failure with this message.)"""
        if not getattr(self.app, "_celery_leases_installed", False):
            why = startup.not_installed_message([self.name])
        else:
            try:
                get_config(self.app).for_task(self)
                why = ("no lease was taken when the worker received it (see the worker's log "
                       "for the error at receipt)")
            except ConfigurationError as exc:
                why = str(exc)
        return ConfigurationError(f"task {self.name}[{request.id}] not run: {why}")

    def _check_before_start(self, lease: Lease) -> None:
        """Never start a body on a lease known lost, or one that may have expired unrenewed.

        A request can wait long between its acquire at receipt and its start
        (prefetched behind long tasks, or in a worker paused meanwhile); its
        lease may have been recovered and its task finished elsewhere. Cheap:
        the heartbeat's knowledge in this process (threads, solo), else the
        monotonic deadline the acquire gave; the store is asked only when that
        deadline passed (one round trip for a request held past its ttl).
        """
        request = self.request
        now = time.monotonic()
        worker = get_worker(self.app)
        if worker is not None:
            until = worker.live_until(lease.task_id, lease.token)
            if until is None:
                self._not_started(lease, "the heartbeat found it lost")
            if until > now:
                return
        else:
            expires = request.lease_expires_at
            if expires is None or expires > now:
                return
        try:
            lease.store.check(lease.task_id, lease.owner, lease.token)
        except LeaseLost as exc:
            self._not_started(lease, f"lost while the task waited to start ({exc.reason})")
        except LeaseError as exc:
            # Unverifiable (store unreachable, record unreadable), and possibly expired:
            # fail closed. The lease is no longer renewed, so recovery re-runs the
            # task once its deadline passes.
            if worker is not None:
                worker.forget(lease.task_id, lease.token)
            self._not_started(lease, f"not verifiable after its deadline passed ({exc})")

    def _mark_alone(self, lease: Lease) -> None:
        """An isolated run (an earlier death's blame was uncertain): its start is marked,
        alone, before the body, so that if this body kills its worker the death is
        charged to it exactly (docs/recovery.md, "Shared-process pools").

        No isolated body runs without its mark: the store charges an isolated task
        nothing for a death before its mark (it waited for its turn while something
        else killed the worker), which holds only if an unmarked isolated body never
        ran. A store that cannot take the mark leaves the task to recovery after its ttl.
        """
        try:
            marked = self._store_call(lambda: lease.store.mark_started(
                lease.owner, {lease.task_id: lease.token}, alone=True), lease)
        except LeaseError as exc:
            self._not_started(lease, f"not marked started for its isolated run ({exc}); "
                                     f"recovery runs it after its ttl")
        if not marked:
            self._not_started(lease, "no longer held when its isolated run was to start")

    def _not_started(self, lease: Lease, reason: str) -> NoReturn:
        lease._lost = True
        logger.warning("task %s[%s]: body not started: lease (token %s) %s",
                       self.name, lease.task_id, lease.token, reason)
        delivery_refused.send(sender=self, task_id=lease.task_id, reason=reason, code=Code.LOST,
                              token=lease.token)
        raise StaleOutcome(f"task {lease.task_id} (token {lease.token}) not started: lease {reason}")

    def _finish(self, lease: Lease, outcome: str, next_attempt: int = 0,
                retry_grace: float | None = None, write: Any = None, kept: bytes | None = None) -> None:
        """Record the outcome, or raise StaleOutcome so nothing of it leaves the worker.

        A finish whose reply is lost is sent again until the store answers
        (settle.py), for up to the lease's ttl: the answer says whether it was
        applied, never an assumption. Past that no copy can apply any more, and
        the outcome is withheld for recovery to re-run the task.

        ``kept``: the result Celery writes after this finish, kept in the store
        until ``after_return`` says it was written (results.py); the written
        ones of earlier tasks ride along.
        """
        store = lease.store
        ttl = self.lease_ttl or get_config(self.app).ttl
        if outcome == "succeeded" and write is None and kept is None and (
                self.request.lease_parent_finish or self._in_background(lease, ttl)):
            # Prefork's main process finishes it once the pool reports the success
            # (task/request.py); elsewhere it is queued (worker/background.py).
            return
        confirmed = confirmations()
        written = confirmed.take(store, lease.task_id) if outcome != "retry" else []

        def send(not_after: int) -> None:
            store.finish(lease.task_id, lease.owner, lease.token, outcome, next_attempt=next_attempt,
                         retry_grace=retry_grace, write=write, not_after=not_after,
                         kept=kept, kept_due=ttl, written=written)

        try:
            settle_finish(store, send, bound=ttl, task_id=lease.task_id, token=lease.token)
        except LeaseError as exc:
            # Refused, or not verifiable (a corrupt record): nothing of the outcome may leave
            # the worker. The lease is forgotten when the request ends; recovery then re-runs
            # the task, or meets the corrupt record and parks it.
            lease._lost = True
            refuse(self, lease.task_id, lease.token, outcome, refusal_reason(exc))
        if kept is not None:
            confirmed.kept_for(store, lease.task_id)

    def _in_background(self, lease: Lease, bound: float) -> bool:
        """A success nobody reads, where the worker sends such finishes in the background
        (worker/background.py): queued there, and the task returns without waiting."""
        worker = get_worker(self.app)
        finishes = worker.finishes if worker is not None else None
        if finishes is None or self.request.lease_isolate or not outcome_unread(self, self.request):
            return False
        task_id, token = lease.task_id, lease.token
        return finishes.add(task_id, lease.owner, token, "succeeded", bound,
                            lambda exc: report_refusal(self, task_id, token, "succeeded", refusal_reason(exc)))

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any,
                     einfo: Any) -> None:
        """Celery's tracer stored this task's result: a result the finish kept is confirmed
        by this process's next finish. (A subclass overriding this without ``super()`` only
        leaves its confirmations to recovery, which finds the results written.)"""
        confirmations().stored(task_id)

    def _store_call(self, fn, lease: Lease) -> Any:
        """One retry on an unreachable store, then give up (a release: recovery takes the lease
        after its ttl instead; finishes are settled by _finish)."""
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


def _warn_unleased(task: Any) -> None:
    global _warned_unleased
    if not _warned_unleased:
        _warned_unleased = True
        logger.warning("celery-leases: LeasedTask %s ran without a lease (eager mode, apply() or a "
                       "direct call): self.lease is detached, its token None and check() passes. "
                       "Only a worker takes leases. Warned once per process.", task.name)
