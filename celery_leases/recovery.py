"""Recovery: re-publish claimed leases under the same task id; bury dead ones.

The store decides *which* tasks are recovered (claim_expired.lua); this module
only turns a claim back into a broker message and a dead task into a stored
LeaseExpired failure.
"""
from __future__ import annotations

import logging
from typing import Any

from celery.app.task import Context
from kombu import Queue
from kombu.serialization import loads

from .config import get_config
from .exceptions import LeaseError, LeaseExpired
from .signals import lease_dead, lease_recovered
from .store import Claim

logger = logging.getLogger("celery_leases.recovery")


def publish_raw(app: Any, body: bytes, envelope: dict, headers: dict, *,
                exchange: str | None = None, routing_key: str | None = None,
                declare: list | None = None) -> None:
    """Publish stored message bytes as they were: same id, routing, headers and properties."""
    props = envelope.get("properties") or {}
    exchange = envelope.get("exchange", "") if exchange is None else exchange
    routing_key = envelope.get("routing_key", "") if routing_key is None else routing_key
    if declare is None:
        declare = [q for q in app.amqp.queues.values()
                   if q.routing_key == routing_key and (q.exchange.name or "") == exchange]
    with app.producer_or_acquire() as producer:
        producer.publish(
            body, exchange=exchange, routing_key=routing_key, headers=headers,
            content_type=envelope.get("content_type"), content_encoding=envelope.get("content_encoding"),
            priority=envelope.get("priority") or 0, retry=True, declare=declare,
            correlation_id=props.get("correlation_id"), reply_to=props.get("reply_to"),
            delivery_mode=props.get("delivery_mode"),
        )


class Recoverer:
    """The Celery side of a recovery pass (``LeaseStore.recover``'s publish and on_dead)."""

    def __init__(self, app: Any) -> None:
        self.app = app

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
        if not lease_recovered.receivers:
            return None
        from .runtime import get_store
        try:
            return get_store(self.app).held_for(claim.task_id)
        except LeaseError as exc:
            logger.debug("task %s: recovered_after not available: %s", claim.task_id, exc)
            return None

    def on_corrupt(self, claim: Claim) -> None:
        """A claim whose lease record is corrupt: park the task (its record is left as it is)."""
        from .parking import park_delivery
        error = claim.error
        # A record of the wrong type has no readable name; the stored message's headers do.
        name = claim.name or str((claim.envelope.get("headers") or {}).get("task") or "")
        park_delivery(self.app, claim.task_id, f"corrupt lease record found by recovery: {error}",
                      name=name, body=claim.body, envelope=claim.envelope,
                      key=getattr(error, "key", ""), field=getattr(error, "field", ""), exc=error)

    def on_dead(self, claim: Claim) -> None:
        self.mark_dead(claim.task_id, claim.recoveries, claim.body, claim.envelope, claim.name)

    def mark_dead(self, task_id: str, recoveries: int, body: bytes, envelope: dict, name: str = "") -> None:
        """Store LeaseExpired as the task's result (waiters are released), signal, dead-letter."""
        exc = LeaseExpired(task_id, recoveries)
        request = self._request_of(task_id, name, body, envelope)
        logger.error("task %s[%s] is dead: abandoned %d time(s), leases_max_recoveries reached",
                     name or request.task, task_id, recoveries)
        self.app.backend.mark_as_failure(task_id, exc, request=request)
        lease_dead.send(sender=self.app, task_id=task_id, recoveries=recoveries)
        queue = get_config(self.app).dead_letter_queue
        if queue and body:
            headers = dict(envelope.get("headers") or {})
            headers["lease_dead"] = True
            publish_raw(self.app, body, envelope, headers, exchange="", routing_key=queue,
                        declare=[Queue(queue)])

    def _request_of(self, task_id: str, name: str, body: bytes, envelope: dict) -> Context:
        """A request context (chord, chain, errbacks, reply_to) rebuilt from the stored message."""
        headers = dict(envelope.get("headers") or {})
        props = envelope.get("properties") or {}
        fields: dict[str, Any] = {**headers, "id": task_id, "task": name or headers.get("task"),
                                  "reply_to": props.get("reply_to"),
                                  "correlation_id": props.get("correlation_id"),
                                  "delivery_info": {"exchange": envelope.get("exchange"),
                                                    "routing_key": envelope.get("routing_key")}}
        if body:
            try:
                args, kwargs, embed = loads(body, envelope.get("content_type"),
                                            envelope.get("content_encoding"), accept=None)
                fields.update(args=args, kwargs=kwargs, **(embed or {}))
            except Exception as exc:  # noqa: BLE001 - still store the failure, without canvas links
                logger.warning("task %s: stored message could not be decoded (%r); its chord, chain "
                               "and errbacks are not notified", task_id, exc)
        return Context(fields)
