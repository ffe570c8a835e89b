"""Recovery: re-publish claimed leases under the same task id; bury dead ones.

The store decides *which* tasks are recovered (claim_expired.lua); this module
only turns a claim back into a broker message and a dead task into a stored
LeaseExpired failure.
"""
from __future__ import annotations

import logging
from typing import Any

from kombu import Queue

from ..exceptions import LeaseError, LeaseExpired
from .messages import publish_raw, request_of
from .parking import park_delivery
from ..signals import lease_dead, lease_recovered
from ..protocol.records import Claim
from ..protocol.store import LeaseStore

logger = logging.getLogger("celery_leases.recovery")


class Recoverer:
    """The Celery side of a recovery pass (``LeaseStore.recover``'s publish and on_dead).

    The store is built with this recoverer's callbacks and then handed to it
    (runtime.py): it reads ``held_for`` and parks through that store.
    """

    def __init__(self, app: Any, store: LeaseStore | None = None, *, dead_letter_queue: str | None) -> None:
        # (The settings are handed down by whoever builds it, runtime.py or the receipt.)
        self.app, self.store, self.dead_letter_queue = app, store, dead_letter_queue

    def publish(self, claim: Claim) -> None:
        if not claim.body or not claim.envelope:
            raise ValueError(f"task {claim.task_id}: the lease record holds no message to re-publish")
        headers = dict(claim.envelope.get("headers") or {})
        headers["lease_generation"] = claim.generation
        publish_raw(self.app, claim.body, claim.envelope, headers)
        logger.info("recovered task %s[%s]: re-published (generation %d, recovery %d)",
                    claim.name, claim.task_id, claim.generation, claim.recoveries)
        lease_recovered.send(sender=self.app, task_id=claim.task_id, generation=claim.generation,
                             recoveries=claim.recoveries, recovered_after=self._recovered_after(claim))

    def _recovered_after(self, claim: Claim) -> float | None:
        """Seconds from the last owner's acquisition to now; read only when someone listens."""
        if not lease_recovered.receivers or self.store is None:
            return None
        try:
            return self.store.held_for(claim.task_id)
        except LeaseError as exc:
            logger.debug("task %s: recovered_after not available: %s", claim.task_id, exc)
            return None

    def on_corrupt(self, claim: Claim) -> None:
        """A claim whose lease record is corrupt: park the task (its record is left as it is)."""
        error = claim.error
        # A record of the wrong type has no readable name; the stored message's headers do.
        name = claim.name or str((claim.envelope.get("headers") or {}).get("task") or "")
        if self.store is None:
            raise LeaseError(f"task {claim.task_id}: the recoverer has no store to park it in")
        park_delivery(self.app, self.store, claim.task_id,
                      f"corrupt lease record found by recovery: {error}",
                      dead_letter_queue=self.dead_letter_queue, name=name,
                      body=claim.body, envelope=claim.envelope,
                      key=getattr(error, "key", ""), field=getattr(error, "field", ""), exc=error)

    def on_dead(self, claim: Claim) -> None:
        self.mark_dead(claim.task_id, claim.recoveries, claim.body, claim.envelope, claim.name)

    def mark_dead(self, task_id: str, recoveries: int, body: bytes, envelope: dict, name: str = "") -> None:
        """Store LeaseExpired as the task's result (waiters are released), signal, keep the message
        for ``replay`` (parked), dead-letter."""
        exc = LeaseExpired(task_id, recoveries)
        request = request_of(task_id, name, body, envelope)
        logger.error("task %s[%s] is dead: abandoned %d time(s), leases_max_recoveries reached",
                     name or request.task, task_id, recoveries)
        self.app.backend.mark_as_failure(task_id, exc, request=request)
        lease_dead.send(sender=self.app, task_id=task_id, recoveries=recoveries)
        if self.store is not None and body:
            # Kept for an operator, as a parked delivery is: `celery leases replay TASK_ID
            # --reset-record` runs it again once its cause is fixed (the finish drops the message).
            try:
                self.store.park(task_id, f"dead: abandoned {recoveries} time(s), leases_max_recoveries "
                                         f"reached", name=name or request.task, body=body, envelope=envelope)
            except LeaseError as error:
                logger.error("task %s: the dead task's message could not be kept for replay: %s",
                             task_id, error)
        queue = self.dead_letter_queue
        if queue and body:
            headers = dict(envelope.get("headers") or {})
            headers["lease_dead"] = True
            publish_raw(self.app, body, envelope, headers, exchange="", routing_key=queue,
                        declare=[Queue(queue)])
