"""Lease-held deliveries: on a Redis broker, the lease replaces kombu's unacked copy.

kombu's Redis transport emulates acks: every delivered message is written into
its ``unacked`` hash and index at delivery (a waited-for ZADD + HSET, the
message serialized again) and removed at the ack (a waited-for ZREM + HDEL),
so that ``restore_visible`` can put it back after ``visibility_timeout`` if the
worker dies. A task its publisher recorded in the lease store (publish
tracking: the ``lease_recorded`` header) is held by the store from publish to
finish already: its queued record brings it back if the worker dies before
the acquire, and its lease after. For those messages the second copy only
ever produced a duplicate that the acquire refused, for two round trips per
message in the worker's event loop.

``LeaseHeldQoS`` keeps such deliveries in memory only (kombu's in-memory
bookkeeping, which prefetch counting and fair distribution use, stays as it
is), and does from memory what kombu did from its hash:

- ``reject(requeue=True)`` (``Reject(requeue=True)``, ``task_reject_on_worker_lost``)
  puts the message back at the head of its queue at once;
- ``restore_unacked`` (warm and soft shutdown, a channel closed) puts every
  held message back at once.

Every other message (no publish record: a publisher without the plugin,
tracking off, a plain task) keeps kombu's bookkeeping unchanged. A consumer
restart after a broker connection loss cannot put anything back while the
broker is away: the worker releases the leases of the requests the consumer
dropped (service.py), and recovery re-publishes them within a recovery
interval of the store answering; a message dropped before its acquire comes
back through its queued record (``leases_delivery_timeout``).

Installed by the worker (``LeaseStep``) as kombu's Redis channel's ``QoS``
class, in the worker's process only, when the broker is Redis, publish tracking
is on and ``leases_held_deliveries`` is true; ``uninstall()`` restores kombu's.
"""
from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from .. import patches
from ..publishing.publish_id import RECORDED_HEADER, recorded_headers

logger = logging.getLogger("celery_leases.worker")

__all__ = ["LeaseHeldQoS", "install", "uninstall", "installed", "is_lease_held"]


def is_lease_held(payload: Any) -> bool:
    """True for a message (kombu's raw payload) whose publisher recorded it in the lease store."""
    try:
        headers = payload["headers"]
        mark = headers[RECORDED_HEADER]
    except (KeyError, TypeError):
        return False
    return mark == recorded_headers(headers)


class LeaseHeldQoS(kombu_redis.QoS):
    """kombu's Redis QoS, with lease-held deliveries kept in memory only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: delivery tag -> (payload, exchange, routing key) of each lease-held delivery not acked.
        self._held: dict[Any, tuple[Any, str, str]] = {}

    def append(self, message: Any, delivery_tag: Any) -> None:
        payload = message._raw
        if not is_lease_held(payload):
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        self._held[delivery_tag] = (payload, delivery["exchange"], delivery["routing_key"])
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        if self._held.pop(delivery_tag, None) is None:
            return super().ack(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        held = self._held.pop(delivery_tag, None)
        if held is None:
            return super().reject(delivery_tag, requeue=requeue)
        if requeue:
            self._put_back([held], leftmost=True)
        virtual.QoS.ack(self, delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        held, self._held = self._held, {}
        if held:
            self._put_back(list(held.values()), client=client)
        delivered: Any = self._delivered  # (kombu declares it None on the class, sets it per instance)
        with self.channel.conn_or_acquire(client) as conn:
            for tag in delivered:
                if tag not in held:
                    self.restore_by_tag(tag, client=conn)
        delivered.clear()

    def _put_back(self, items: list, leftmost: bool = False, client: Any = None) -> None:
        """Push held messages back onto their queues (flagged redelivered, as kombu does)."""
        with self.channel.conn_or_acquire(client) as conn:
            pipe = conn.pipeline()
            for payload, exchange, routing_key in items:
                self.channel._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
            pipe.execute()
        logger.debug("celery-leases: %d lease-held message(s) put back on their queue(s)", len(items))


_NAME = "kombu.transport.redis.Channel.QoS"


def install() -> bool:
    """Make kombu's Redis channels of this process use LeaseHeldQoS (once, patches.py); True if it did."""
    return patches.patch(_NAME, kombu_redis.Channel, "QoS", LeaseHeldQoS)


def uninstall() -> None:
    """Give kombu's Redis channels their own QoS back (channels made meanwhile keep theirs)."""
    patches.undo(_NAME)


def installed() -> bool:
    return kombu_redis.Channel.QoS is LeaseHeldQoS
