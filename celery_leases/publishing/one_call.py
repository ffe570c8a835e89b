"""One-call publish: the publish record and the broker's LPUSH in one script call.

When the lease store and a Redis broker share a server and database (the default
when ``leases_redis_url`` is unset), a leased task's record at publish
(tracking.py, enqueue.lua) and kombu's LPUSH of its message go out as one
EVALSHA: atomic (no window between record and publish), one command instead of
two for the server, and no redis-py LPUSH in the publishing process.

The record is prepared at ``before_task_publish`` (tracking.py) and left here
(``OneCallRecord``); kombu's Redis channel ``_put`` (wrapped by ``install``)
sends it with the message it is about to push, for the direct exchanges Celery
routes tasks through, with kombu's priority lists (``_q_for_pri``) and ETA
messages as they are. Anything else goes kombu's own way and the record is
written after the publish (``OneCallRecord.result``), as with another layout:
a fanout exchange, a queue with ``x-expires``, kombu's ``global_keyprefix``, a
broker that is not the store's server. A call whose reply is lost may have
pushed the message: kombu's LPUSH then sends it again, and the acquire refuses
the second copy of that publish. A group's members (batches.py) go out the same
way, as one pipeline (``BatchedOneCallRecord``).
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps as kombu_dumps

from .. import patches
from ..exceptions import LeaseError, LeaseUnavailable
from ..protocol.queued import QueuedTask, QueuedTasks

logger = logging.getLogger("celery_leases.tracking")

__all__ = ["OneCallRecord", "BatchedOneCallRecord", "pending", "install", "same_server"]

#: The record waiting for its message in this context (set at before_task_publish).
pending: ContextVar["OneCallRecord | None"] = ContextVar("celery_leases_one_call", default=None)


class OneCallRecord:
    """A publish record that rides with its message's LPUSH, or is written after the publish."""

    batched = False

    def __init__(self, tracked: QueuedTasks, task: QueuedTask) -> None:
        self.tracked, self.task = tracked, task
        #: The record's answer once sent with the message; the error if that call failed.
        self.reply: Any = None
        self.error: BaseException | None = None
        self.sent = False

    def push(self, channel: Any, list_key: str, payload: str, fallback: Any = None) -> bool:
        """Send the record with the message's LPUSH; False when the message must still be pushed
        by kombu (the call failed before the server could have taken it, or it is unknown).
        (``fallback``, kombu's own push of the message, is for a batched record's late answer.)"""
        self.sent = True
        try:
            self.reply = self.tracked.enqueue_and_push(self.task, list_key, payload)
            return True
        except LeaseUnavailable as exc:  # no answer: unknown whether it was pushed, kombu pushes it
            self.error = exc
            return False
        except LeaseError as exc:  # an answer (the record failed): the server pushed the message
            self.error = exc
            return True
        except Exception as exc:  # noqa: BLE001 - nothing was sent: kombu pushes it
            self.error = exc
            return False

    def result(self) -> Any:
        """The record's answer (tracking's ``_confirm``): written now if no message took it."""
        if not self.sent:
            if pending.get() is self:
                pending.set(None)
            self.sent = True
            return self.tracked.enqueue(self.task)
        if self.error is not None:
            raise self.error
        return self.reply


class BatchedOneCallRecord(OneCallRecord):
    """A group member's one-call record (a chord header's, the outbox relay's rows too): its
    record and its message's push are written on the batch's connection without waiting for
    the answer, after the members before it (batches.py), and the answers are read once the
    group is out, so a whole group goes out as one pipeline: one round trip, not one per member.

    An answer that never comes (the connection broke) leaves it unknown whether the script
    pushed the message: kombu pushes it then (a copy of the same publish, which the acquire
    refuses if both arrive), and the record is held as any record the store did not take.
    """

    batched = True

    def __init__(self, tracked: QueuedTasks, task: QueuedTask, batch: Any, outage: Any) -> None:
        super().__init__(tracked, task)
        self.batch = batch
        #: The call written on the batch's connection (a PendingEnqueue), once kombu pushed.
        self.written: Any = None
        self.fallback: Any = None
        self.done = False
        self.pending = self  # the batch confirms ``entry.pending`` of each entry, in order
        batch.add(self, outage)

    @property
    def conn(self) -> Any:
        return getattr(self.written, "conn", None)

    def push(self, channel: Any, list_key: str, payload: str, fallback: Any = None) -> bool:
        if not self.tracked.can_send():  # this process's first record: sent and answered now
            return super().push(channel, list_key, payload)
        self.sent = True
        try:
            self.written = self.batch.write(self.tracked, self.task, push=(list_key, payload))
        except Exception as exc:  # noqa: BLE001 - not written (or unknown): kombu pushes it
            self.error = exc
            return False
        self.fallback = fallback
        return True

    def result(self) -> Any:
        """The record's answer, read once (the replies before it first, in order)."""
        if not self.done:
            self.batch.read_up_to(self)
        if self.done:
            if self.error is not None:
                raise self.error
            return self.reply
        self.done = True
        try:
            self.reply = super().result() if self.written is None else self.written.result()
        except LeaseUnavailable as exc:
            self.error = exc
            if self.written is not None:
                self._push_again()
            raise
        except Exception as exc:
            self.error = exc
            raise
        return self.reply

    def _push_again(self) -> None:
        try:
            self.fallback()
        except Exception as exc:  # noqa: BLE001 - logged by id; the held record brings it back
            logger.error("task %s: the answer to its record and publish was lost, and kombu's own "
                         "push of its message failed too (%r): its record is held and, once "
                         "written, recovery re-publishes it after leases_delivery_timeout",
                         self.task.task_id, exc)


def same_server(channel: Any, tracked: QueuedTasks) -> bool:
    """True when ``channel``'s Redis is the lease store's server and database (cached)."""
    known = channel.__dict__.get("_celery_leases_same_server")
    if known is not None:
        return known
    try:
        mine = channel.client.connection_pool.connection_kwargs
        store = tracked.store.client.connection_pool.connection_kwargs
        fields = ("host", "port", "path", "db", "username")
        same = (not getattr(channel, "global_keyprefix", "")
                and type(channel.client.connection_pool) is type(tracked.store.client.connection_pool)
                and all(mine.get(f) == store.get(f) for f in fields))
    except Exception:  # noqa: BLE001 - a channel we cannot compare is not the store's
        same = False
    channel.__dict__["_celery_leases_same_server"] = same
    return same


def install() -> None:
    """Wrap kombu's Redis ``Channel._put`` (once per process, patches.py)."""
    channel_cls = kombu_redis.Channel
    original = channel_cls._put
    if getattr(original, "_celery_leases_one_call", False):
        return

    def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> Any:
        record = pending.get()
        if (record is not None and not record.sent and not kwargs.get("_publish_batch")
                and queue not in (getattr(self, "_expires", None) or ())  # (queue expiry: kombu 5.7)
                and _headers_id(message) == record.task.task_id and same_server(self, record.tracked)):
            pending.set(None)
            key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
            if record.push(self, key, kombu_dumps(message),
                           lambda: original(self, queue, message, **kwargs)):
                return None
        return original(self, queue, message, **kwargs)

    _put._celery_leases_one_call = True  # type: ignore[attr-defined]
    patches.patch("kombu.transport.redis.Channel._put", channel_cls, "_put", _put)


def _headers_id(message: Any) -> Any:
    try:
        return message["headers"]["id"]
    except (KeyError, TypeError):
        return None
