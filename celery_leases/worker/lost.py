"""Held leases that went wrong while their task runs: a missing record, a lost lease.

The heartbeat (heartbeat.py) finds both when it renews; this module decides
what the worker does about them:

- a record gone (a Redis failover lost the write that created it): put back
  under the same token, with the message, if nobody else has one;
- a lease lost (taken over, stalled, missing): told (``lease_lost``), and with
  ``leases_on_lost='terminate'`` the pool process running the task is stopped.
"""
from __future__ import annotations

import logging
import os
import signal as _signal
from typing import Any, Callable

from ..protocol.codes import Code
from ..config import LeaseConfig
from ..exceptions import LeaseError, LeaseUnavailable
from ..signals import lease_lost
from ..protocol.store import LeaseStore
from .heartbeat import Held
from .receipt import acquire_call

logger = logging.getLogger("celery_leases.worker")

__all__ = ["LostLeases"]


class LostLeases:
    """The heartbeat's ``on_missing`` and ``on_lost`` for one worker process."""

    def __init__(self, app: Any, config: LeaseConfig, store: LeaseStore, owner: str,
                 task_config: Callable[[Any], LeaseConfig]) -> None:
        self.app, self.config, self.store, self.owner = app, config, store, owner
        self.task_config = task_config

    def on_missing(self, task_id: str, held: Held) -> bool:
        """A held lease's record is gone: put it back under the same token if nobody else has one.

        True when the record is back, or when the store could not be reached
        (the heartbeat keeps the lease and asks again at its next renewal);
        False when the lease is lost.

        Redis replicates asynchronously, so a failover can lose the write that
        created a lease. Without this the running task would be told it lost
        its lease, its outcome refused, and (with early acks) nothing left to
        re-run it. The store re-creates the record, with the message, only if
        no record exists (docs/redis-deployments.md).
        """
        request = held.request
        if request is None:
            return False
        call = acquire_call(request, self.task_config(request.task), self.owner)
        # The generation the lease was acquired under (it may be above the message header's).
        call.update(ttl=held.ttl, generation=int(request.request_dict.get("lease_generation") or 0),
                    reassert=held.token)
        try:
            acq = self.store.acquire(**call)
        except LeaseUnavailable as exc:
            # The store did not answer: the lease is not lost for that. The
            # next tick renews again, finds the record still missing and
            # tries again (one call per tick while the task runs).
            logger.warning("task %s: lease record missing; re-creating it failed, will retry at the "
                           "next renewal: %s", task_id, exc)
            return True
        except LeaseError as exc:
            logger.error("task %s: lease record missing and could not be re-created: %s", task_id, exc)
            return False
        if acq.owned and acq.token == held.token:
            logger.warning("task %s: lease record was missing (a Redis failover lost the write that "
                           "created it?); re-created under token %s", task_id, held.token)
            return True
        return False

    def on_lost(self, task_id: str, held: Held, code: Code) -> None:
        """A held lease is lost (``code``: taken over, stalled, missing): tell, and terminate if asked."""
        reason = code.words
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
