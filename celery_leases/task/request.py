"""LeasedRequest: the worker main process's side of a leased task.

Celery writes some outcomes from the main process (a lost pool child, a hard
time limit, a revoke). Each is fenced here by the lease token the main process
got at receipt. Celery's strategy subclasses the task's Request class per
task (``create_request_cls``) and overrides ``on_success`` there, so the
override below is re-attached to each generated subclass.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import Terminated
from celery.exceptions import TaskRevokedError, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request
from celery.worker.state import revoked as revoked_tasks
from celery.worker.state import task_ready

from ..exceptions import LeaseLost, LeaseUnavailable
from ..worker.delivery import lease_delivery
from ..runtime import decided
from ..runtime import get_worker
from ..protocol.settle import settle_finish
from .results import finished_by_main_process
from ..signals import stale_outcome_rejected

logger = logging.getLogger("celery_leases.worker")

#: Seconds a main-process finish (a hard time limit's FAILURE, a REVOKED) is sent again
#: when its reply is lost: the event loop waits meanwhile.
MAIN_PROCESS_BOUND = 2.0


def _unwrap(exc: BaseException) -> BaseException:
    return exc.exc if isinstance(exc, ExceptionWithTraceback) else exc


class LeasedRequest(Request):
    """Request class of LeasedTask (``Task.Request``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        generated = cls.__dict__.get("on_success")
        if generated is not None:
            def on_success(self, failed__retval__runtime, _generated=generated, **kw):
                try:
                    self._lease_succeeded(failed__retval__runtime)
                    return _generated(self, failed__retval__runtime, **kw)
                finally:
                    self._lease_done()
            cls.on_success = on_success  # type: ignore[method-assign]
        generated_execute = cls.__dict__.get("execute_using_pool")
        if generated_execute is not None:
            def execute_using_pool(self, pool, _generated=generated_execute, **kw):
                if self._lease_defer(pool, kw):
                    return None
                self._lease_before_execute()
                return _generated(self, pool, **kw)
            cls.execute_using_pool = execute_using_pool  # type: ignore[method-assign]

    def _lease_defer(self, pool: Any, kwargs: dict) -> bool:
        """True when the acquire at receipt is still under way: the task is handed to
        the pool once its result is back (Receipt._acquired, worker/receipt.py)."""
        state = lease_delivery(self)
        if state.inflight:
            state.deferred = (pool, kwargs)
            return True
        return False

    def _lease_before_execute(self) -> None:
        """Finish what receipt left to do, now that the task is due to run; raise
        TaskRevokedError when it must not reach the pool.

        Receipt may have postponed the acquire (store unreachable, delivery
        window full): it is done now. A delivery settled without running
        (parked, or re-queued as a delayed copy) is completed here as Celery
        completes a revoked request: out of its reserved requests, acknowledged,
        and TaskRevokedError, on which Celery frees the pool slot it took.
        """
        worker = get_worker(self._app)
        state = lease_delivery(self)
        if state.pending is not None and worker is not None:
            worker.receipt.acquire_pending(self)
        if state.refused:
            task_ready(self)
            self.acknowledge()
            raise TaskRevokedError(f"task {self.id!r}: settled at receipt, not run "
                                   f"({self._request_dict.get('lease_skip')})")
        if (worker is not None and self.lease_token is None and getattr(self.task, "leased", False)
                and not self._request_dict.get("lease_skip")
                and not self._request_dict.get("lease_unavailable")):
            # Receipt never reached a decision for this request: never run it unleased.
            worker.receipt.park_unleased(self)
            task_ready(self)
            self.acknowledge()
            raise TaskRevokedError(f"task {self.id!r}: no lease was acquired at receipt")
        if worker is not None and worker.receipt.finish_in_parent and self.lease_token is not None \
                and finished_by_main_process(self.task, self._request_dict):
            # Prefork: its pool process leaves a success to this process (_lease_succeeded).
            self._request_dict["lease_parent_finish"] = 1

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
        if self._lease_defer(pool, kwargs):
            return None
        self._lease_before_execute()
        return super().execute_using_pool(pool, **kwargs)

    # -- helpers ---------------------------------------------------------------

    @property
    def lease_token(self) -> int | None:
        return self._request_dict.get("lease_token")

    def _lease_done(self) -> None:
        """The request ended: the heartbeat stops renewing its lease (if it held one)."""
        worker = get_worker(self._app)
        token = self.lease_token
        if worker is not None and token is not None:
            worker.forget(self.id, token)

    def _lease_succeeded(self, failed__retval__runtime: Any) -> None:
        """Prefork: a success the pool process left for this process to finish
        (``lease_parent_finish``, decided at receipt: worker/receipt.py) is queued for the
        acquirer's next write (worker/background.py); this process outlives the pool
        process, so the finish lands whatever that process's next task does."""
        if failed__retval__runtime[0] or not self._request_dict.get("lease_parent_finish"):
            return
        worker, token = get_worker(self._app), self.lease_token
        if worker is None or token is None:
            return
        owner, finishes = self._request_dict["lease_owner"], worker.finishes
        task, task_id = self.task, self.id

        def report(exc: Any) -> None:
            reason = getattr(exc, "reason", str(exc))
            logger.warning("task %s[%s]: succeeded outcome of token %s refused: lease %s",
                           task.name, task_id, token, reason)
            stale_outcome_rejected.send(sender=task, task_id=task_id, token=token,
                                        outcome="succeeded", reason=reason)

        if finishes is None or not finishes.add(task_id, owner, token, "succeeded",
                                                worker.task_config(task).ttl, report):
            self._lease_finish("succeeded", token)

    def _lease_finish(self, outcome: str, token: int | None) -> bool:
        """Record a main-process outcome; False when it must not be written.

        A lost reply is settled by sending the finish again (settle.py), as in
        the pool process, but for at most MAIN_PROCESS_BOUND seconds (or the
        heartbeat interval, if shorter): this runs in the worker's event loop,
        which then waits no longer than one call may take. Past that the
        outcome is withheld and no copy can apply any more; recovery re-runs
        the task.
        """
        worker = get_worker(self._app)
        if worker is None or token is None:
            return True
        store, owner = worker.store, self._request_dict["lease_owner"]

        def send(not_after: int) -> None:
            store.finish(self.id, owner, token, outcome, not_after=not_after)

        try:
            bound = min(MAIN_PROCESS_BOUND, worker.task_config(self.task).heartbeat_interval)
            settle_finish(store, send, bound=bound, task_id=self.id, token=token)
            return True
        except (LeaseLost, LeaseUnavailable) as exc:
            reason = getattr(exc, "reason", str(exc))
            logger.warning("task %s[%s]: %s outcome of token %s refused: lease %s",
                           self.name, self.id, outcome, token, reason)
            stale_outcome_rejected.send(sender=self.task, task_id=self.id, token=token,
                                        outcome=outcome, reason=reason)
            return False

    def _lease_settle_message(self, requeue: bool = False) -> None:
        if self.task.acks_late:
            if requeue:
                self.reject(requeue=True)
            else:
                self.acknowledge()

    # -- Celery callbacks (main process) ---------------------------------------

    def on_accepted(self, pid: Any, time_accepted: float) -> Any:
        """The pool started the task: queue its start mark, so that from now on the
        death of this worker counts a recovery against it (and not before: a task
        only prefetched is not charged for the death of its worker). Prefork calls
        this in the main process once the child took the job; threads and solo in
        the thread about to run the body."""
        if self.id in revoked_tasks and pid == os.getpid() and getattr(self.task, "leased", False):
            # An in-process pool (threads) starts queued work without asking whether it
            # was revoked meanwhile (Celery's own check ran when it was queued): no body,
            # and no start mark.
            self._request_dict["lease_skip"] = "revoked before it started"
            self._terminate_on_ack = None
            return super().on_accepted(pid, time_accepted)
        token = self.lease_token
        if token is not None:
            worker = get_worker(self._app)
            if worker is not None:
                worker.started(self.id, token)
        return super().on_accepted(pid, time_accepted)

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        try:
            self._lease_succeeded(failed__retval__runtime)
            return super().on_success(failed__retval__runtime, **kwargs)
        finally:
            self._lease_done()

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        token = self.lease_token
        worker = get_worker(self._app)
        if token is None or worker is None:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        worker.forget(self.id, token)
        exc = _unwrap(exc_info.exception)
        if self._already_revoked or (isinstance(exc, Terminated) and not self._already_cancelled):
            # A revoke (terminate) ended it: the lease was revoked when Celery announced
            # it, or Celery announces it now (revoked first, then REVOKED stored).
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        # Celery cancelled the running task (the end of a cold or soft shutdown, a broker
        # connection loss): its child ends Terminated, SystemExit or KeyboardInterrupt.
        cancelled = self._already_cancelled and isinstance(exc, (Terminated, SystemExit, KeyboardInterrupt))
        if isinstance(exc, (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)):
            # A recovery case, not a failure: waiters keep waiting for the re-run.
            # The pool process that ran it is gone or was stopped: it started, a death.
            released = worker.release({self.id: token}, started={self.id})
            logger.warning("task %s[%s]: %s (%r); lease %s for recovery, no FAILURE stored",
                           self.name, self.id, "cancelled by Celery" if cancelled else "pool process lost",
                           exc, "released" if released else "was no longer held")
            task_ready(self)
            if cancelled:
                # As in Celery, a cancelled acks_late message stays unacknowledged: the broker
                # gives it back (kombu restores it when the channel closes at shutdown), and
                # the released lease lets that copy acquire at once.
                return None
            self._lease_settle_message(requeue=self.task.reject_on_worker_lost)
            return None
        if (not return_ok or isinstance(exc, TimeLimitExceeded)) and not self._lease_finish("failed", token):
            task_ready(self)
            self._lease_settle_message()
            return None
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        token = self.lease_token
        worker = get_worker(self._app)
        if soft or token is None or worker is None:
            return super().on_timeout(soft, timeout)
        worker.forget(self.id, token)
        if not self._lease_finish("failed", token):
            task_ready(self)
            if self.task.acks_late:
                if self.task.acks_on_timeout:
                    self.acknowledge()
                else:
                    self.reject(requeue=True)
            return None
        return super().on_timeout(soft, timeout)

    # -- revokes (revokes.py lists every path) ----------------------------------

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> Any:
        """Celery discards (or terminated) this delivery as revoked or expired: the store
        decides first whether REVOKED may be stored."""
        worker = get_worker(self._app)
        if worker is None or not getattr(self.task, "leased", False):
            return super()._announce_revoked(reason, terminated, signum, expired)
        worker.revokes.gate(self.task.backend)
        token = self.lease_token
        if not worker.revokes.revoke(self.id, expired=expired, owner=self._request_dict.get("lease_owner") or "",
                                     token=token, name=self.name):
            # Finished (its result stays) or another owner runs it (its outcome stands).
            task_ready(self)
            self.acknowledge()
            self._already_revoked = True
            return None
        with decided(self.id):
            return super()._announce_revoked(reason, terminated, signum, expired)

    def terminate(self, pool: Any, signal: Any = None) -> Any:
        """Pools that cannot terminate (threads, solo) raise before Celery announces
        anything: the revoke still reaches the lease, as the plain revoke it then is."""
        try:
            return super().terminate(pool, signal)
        except (NotImplementedError, AttributeError):
            worker = get_worker(self._app)
            if worker is None or not getattr(self.task, "leased", False):
                raise
            if self.time_start:
                # Running and not stoppable: its outcome stands, it never runs again.
                worker.revokes.revoke(self.id, name=self.name)
                raise
            # Handed to an in-process pool, not started: the gate revoked its lease when
            # Celery stored REVOKED, and on_accepted keeps the body from running.
            logger.info("task %s[%s]: revoked before it started; the %s pool cannot terminate, "
                        "its body will not run", self.name, self.id, type(pool).__module__)
            return None

