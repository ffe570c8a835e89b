"""What receipt does with a delivery it does not run now (receipt.py decides which).

- refused: receipt settled it without running it; acknowledged at once (``refuse``);
- parked: a permanent error; kept for the operator, its waiters released, never re-queued
  (recovery/parking.py);
- re-queued for later: the lease store unreachable, or the delivery window full; a delayed
  copy (same id and headers) is published on the store's clock and this one acknowledged.
"""
from __future__ import annotations

import logging
from typing import Any

from ..config import LeaseConfig
from ..exceptions import LeaseError, LeaseUnavailable
from ..protocol.clock import ServerClock
from ..protocol.keys import usable_id
from ..protocol.store import LeaseStore
from ..recovery.messages import envelope_of, publish_raw
from ..recovery.parking import park_delivery
from .delivery import (DUE_HEADER, REQUEUES_HEADER, Throttled, describe, eta_after, lease_delivery,
                       requeue_delay)

logger = logging.getLogger("celery_leases.worker")


class Refusal:
    """Parks, re-queues or refuses the deliveries of one worker process that must not run now."""

    def __init__(self, app: Any, config: LeaseConfig, store: LeaseStore, clock: ServerClock) -> None:
        self.app, self.config, self.store, self.clock = app, config, store, clock

    def park(self, request: Any, exc: BaseException, due: bool) -> None:
        """A permanent error: the delivery is never run and never re-queued; it is parked
        (recovery/parking.py: kept for the operator, waiters released) and acknowledged."""
        reason = str(exc) or repr(exc)
        request.request_dict["lease_skip"] = f"delivery parked: {reason}"
        # An id that cannot be a key (None, a float, a lone surrogate) is parked under its repr.
        task_id = request.id if usable_id(request.id) else repr(request.id)
        try:
            try:
                envelope: dict | None = envelope_of(request.message)
            except Exception:  # noqa: BLE001 - a message too broken to describe is parked without it
                envelope = None
            park_delivery(self.app, self.store, task_id, reason,
                          dead_letter_queue=self.config.dead_letter_queue, name=request.task.name,
                          body=_bytes_or_empty(request.message.body), envelope=envelope,
                          key=getattr(exc, "key", "") or "", field=getattr(exc, "field", "") or "",
                          exc=exc if isinstance(exc, Exception) else None)
        except Exception as park_exc:  # noqa: BLE001 - not parked: kept, and tried again later
            logger.error("task %s: delivery must be parked (%s), but parking failed: %r",
                         describe(request), reason, park_exc)
            if due:
                self.requeue_later(request, LeaseUnavailable(f"parking failed: {park_exc!r}"))
            else:
                lease_delivery(request).pending = ParkLater(exc)
            return
        self.refuse(request)  # park_delivery logged it, naming the task, key and field

    @staticmethod
    def refuse(request: Any) -> None:
        """Receipt settled this delivery without running it: acknowledge it now (its
        prefetch slot is free at once); Celery's hand-over then completes it without
        its pool (LeasedRequest.execute_using_pool)."""
        lease_delivery(request).refused = True
        request.acknowledge()

    def requeue_later(self, request: Any, exc: LeaseError, delay: float | None = None) -> None:
        """Never run without a lease: publish a delayed copy (same id and headers) and
        acknowledge this one.

        The delay doubles with each re-queue of the delivery (``lease_requeues``
        header), from ``leases_unavailable_retry_delay`` up to
        ``leases_unavailable_retry_max_delay``; ``delay`` overrides it (a full
        delivery window). The ETA is on the lease store's clock (ServerClock),
        not this worker's wall clock; the receiving worker lays it on its own
        (``lease_due_ms``, ``Receipt._translate_due`` in receipt.py).
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
        loud = isinstance(exc, Throttled) or (first and not lease_delivery(request).warned)
        logger.log(logging.WARNING if loud else logging.DEBUG,
                   "task %s[%s]: %s (%s); message re-queued to run in %gs (ETA %s by the %s)%s",
                   request.task.name, request.id, what, exc, delay, headers["eta"], source,
                   "; its later re-queues are logged at DEBUG until it runs" if first else "")
        self.refuse(request)


class ParkLater:
    """A delivery that must be parked, but parking failed at receipt: tried again when due."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _bytes_or_empty(body: Any) -> bytes:
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return b""
