"""Parking: what happens to a delivery that must not run and must not be re-queued.

A permanent error (a corrupt lease record, a malformed message) would come
back on every re-delivery, so the delivery is parked instead: kept in the
lease store for an operator (``celery leases parked`` / ``replay``), copied to
``leases_dead_letter_queue`` when one is set, and its waiters are released
with ``DeliveryParked``. The lease record is never touched here: a corrupt one
stays as it is, to be inspected (docs/recovery.md, "Parked deliveries").
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from kombu import Queue

from ..exceptions import DeliveryParked, LeaseError
from .messages import publish_raw, request_of
from ..signals import delivery_parked
from ..protocol.store import LeaseStore

__all__ = ["park_delivery"]

logger = logging.getLogger("celery_leases.parking")


def park_delivery(app: Any, store: LeaseStore, task_id: str, reason: str, *, dead_letter_queue: str | None,
                  name: str = "", body: bytes = b"", envelope: Mapping | None = None, key: str = "", field: str = "",
                  exc: BaseException | None = None) -> None:
    """Park one delivery of ``task_id``: store it in ``store``, dead-letter it, fail its waiters, tell.

    Each step goes on when another fails (each failure is logged naming the
    task): an unreachable lease store still leaves the dead-letter copy and the
    stored failure, so the delivery is never dropped without a word.
    ``dead_letter_queue`` is the app's ``leases_dead_letter_queue`` (None or '': none),
    handed down by the caller, which holds the app's settings.
    """
    key = key or getattr(exc, "key", "") or ""
    field = field or getattr(exc, "field", "") or ""
    envelope = dict(envelope or {})
    body = body or b""
    logger.error("task %s[%s] parked, not run: %s (key %s, field %s)%s", name or "?", task_id, reason,
                 key or "-", field or "-", f": {exc}" if exc is not None and str(exc) not in reason else "")
    try:
        store.park(task_id, reason, name=name, body=body, envelope=envelope, key=key, field=field)
    except LeaseError as error:
        logger.error("task %s: the parked delivery could not be stored in the lease store "
                     "(it is only in the dead-letter queue, if one is set): %s", task_id, error)
    queue = dead_letter_queue
    if queue and body and envelope:
        try:
            headers = dict(envelope.get("headers") or {})
            headers["lease_parked"] = reason
            publish_raw(app, body, envelope, headers, exchange="", routing_key=queue,
                        declare=[Queue(queue)])
        except Exception as error:  # noqa: BLE001 - the parked entry (if stored) still has it
            logger.error("task %s: publishing the parked delivery to %s failed: %r", task_id, queue, error)
    failure = DeliveryParked(task_id, reason, key, field)
    try:
        request = request_of(task_id, name, body, envelope)
        app.backend.mark_as_failure(task_id, failure, request=request)
    except Exception as error:  # noqa: BLE001 - logged; the entry stays listed
        logger.error("task %s: storing DeliveryParked in the result backend failed: %r", task_id, error)
    task = app.tasks.get(name) if name else None
    delivery_parked.send(sender=task if task is not None else app, task_id=task_id, reason=reason,
                         key=key, field=field)
