"""Publish tracking, the Celery side: record each leased task when it is published,
re-publish the ones no worker acquired within ``leases_delivery_timeout``.

Publishing: ``install(app)`` wraps ``app.send_task`` (every ``apply_async``,
``delay``, signature, canvas primitive, retry and ``replace`` goes through it)
only to note, for the publish under way, the app and the serializer and
compression the message is sent with. ``before_task_publish`` then has the
final routing (exchange, routing key), headers (with the ``lease_publish`` id)
and properties; the body is serialized here exactly as kombu will serialize it,
and recorded (queued.py, one script call) **before** the message is published,
so a publisher that dies in between leaves a record that recovery re-publishes.
A publish that raises (the caller is told the task was not sent) drops its
record again (forget.lua), so it does not run later behind the caller's back.
Only tasks this process knows to be leased are recorded (a task sent by name
that is not registered here is leased at receipt, as without tracking). When the
lease store cannot be reached the message is published all the same (logged once
per outage) and its record held in memory, written at the app's next publish the
store answers (PublishOutage, held_records.py): tracking never stops a publish.
A group's members are recorded as one batch (batches.py); the body is serialized
once for the record and the message (serialize.py).

Recovery: a step of every recovery pass (``LeaseStore.recovery_steps``, added by
``attach``) re-publishes overdue queued tasks or stores their expiry (undelivered.py).
"""
from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any

from celery.signals import before_task_publish

# (Importing publish_id first connects its publish id stamp before the record below.)
from .publish_id import RECORDED_HEADER, recorded_headers
from ..config import client_config
from ..exceptions import LeaseError
from . import one_call
from .batches import batch_groups, current_batch
from .held_records import HeldRecord, PublishOutage, confirm, untracked
from .one_call import BatchedOneCallRecord, OneCallRecord
from .serialize import delivery_mode_of, message_of, serialize_once
from .undelivered import Republisher
from ..protocol.queued import QueuedTask, QueuedTasks
from ..protocol.store import LeaseStore
from ..runtime import get_store, on_new_store
from ..outage import Outage

logger = logging.getLogger("celery_leases.tracking")

#: (app, serializer, compression) of the publish under way in this context, set by send_task.
_publishing: ContextVar[tuple | None] = ContextVar("celery_leases_publishing", default=None)


def install(app: Any) -> None:
    """Wrap ``app.send_task`` so the publish hook knows the app (install.py calls this)."""
    if getattr(app, "_celery_leases_tracking", False):
        return
    original = app.send_task
    outage = PublishOutage(Outage(logger, "celery-leases: publish tracking"))

    def send_task(name: str, *args: Any, **options: Any) -> Any:
        pending: list = []
        token = _publishing.set((app, options.get("serializer"), options.get("compression"),
                                 options.get("delivery_mode"), outage, pending))
        try:
            result = original(name, *args, **options)
        except BaseException:
            _publishing.reset(token)
            # Not sent, as far as the caller knows: the record must not make it run later.
            _forget(pending, outage)
            raise
        _publishing.reset(token)
        if pending and not getattr(pending[-1], "batched", False):
            # The record was sent before the message; its reply is read once the message is out
            # (a group member's, with the others', once the whole group is out).
            confirm(pending.pop(), outage)
        return result

    send_task.__wrapped__ = original  # type: ignore[attr-defined]
    app.send_task = send_task
    app._celery_leases_tracking = True
    on_new_store(attach)
    batch_groups()
    serialize_once()


def _one_call(app: Any) -> bool:
    """True when the lease store is the Redis broker's own server and database (the default
    with ``leases_redis_url`` unset): the publish record then rides with the LPUSH
    (one_call.py, installed then). Decided at the app's first recorded publish, once its
    settings are final."""
    wanted = app.__dict__.get("_celery_leases_one_call")
    if wanted is None:
        try:
            broker = app.conf.broker_url
            wanted = (isinstance(broker, str) and client_config(app).redis_url == broker
                      and app.connection_for_write().transport.driver_type == "redis")
        except Exception:  # noqa: BLE001 - a layout we cannot read keeps the two-call publish
            wanted = False
        if wanted:
            one_call.install()
        app._celery_leases_one_call = wanted
    return wanted


def queued_tasks(app: Any, store: LeaseStore | None = None) -> QueuedTasks | None:
    """The app's queued tasks, or None when publish tracking is off (leases_delivery_timeout)."""
    timeout = client_config(app).delivery_timeout
    if not timeout:
        return None
    if store is None:
        store = get_store(app)
    tracked = getattr(store, "_celery_leases_queued", None)
    if tracked is None or tracked.delivery_timeout != timeout:
        tracked = store._celery_leases_queued = QueuedTasks(store, timeout)  # type: ignore[attr-defined]
    return tracked


def attach(app: Any, store: LeaseStore) -> None:
    """Add the undelivered step to ``store``'s recovery passes (run for each store
    runtime.get_store builds, once install() ran)."""
    if not getattr(app, "_celery_leases_tracking", False):
        return  # an app install() never ran for: its publishes are not recorded here
    tracked = queued_tasks(app, store)
    if tracked is not None:
        republisher = Republisher(app)
        store.recovery_steps.append(
            lambda: tracked.recover(republisher.publish, republisher.on_expired))


@before_task_publish.connect(weak=False, dispatch_uid="celery_leases.tracking")
def record_publish(sender: Any = None, body: Any = None, exchange: Any = None, routing_key: Any = None,
                   headers: Any = None, properties: Any = None, **kwargs: Any) -> None:
    """Record a leased task as queued before its message goes out (cheap no-op otherwise)."""
    current = _publishing.get()
    if current is None or not isinstance(headers, dict) or "id" not in headers:
        return  # not an app with tracking installed, or task protocol 1
    app, serializer, compression, delivery_mode, outage, pending = current
    task = app.tasks.get(sender) if isinstance(sender, str) else None
    if not getattr(task, "leased", False):
        return
    message = tracked = None
    began = time.monotonic()
    try:
        tracked = queued_tasks(app)
        if tracked is None:
            return
        headers.pop(RECORDED_HEADER, None)
        message = message_of(app, sender, body, exchange, routing_key, headers, properties or {},
                             serializer, compression, delivery_mode_of(app, delivery_mode, kwargs.get("declare")))
        if not headers.get("retries"):
            # The worker's acquire may leave the message out (the store holds it) if it
            # receives the headers recorded here; a retry's record exists already and keeps
            # the first message, so a retry's message is always sent.
            stored = message.envelope["headers"]
            stored[RECORDED_HEADER] = headers[RECORDED_HEADER] = recorded_headers(stored)
        if outage.skipping():  # the store just failed to answer: hold it without waiting again
            outage.hold(message, tracked)
            pending.append(HeldRecord(message))
            return
        batch = current_batch.get()
        sent: Any
        if _one_call(app) and tracked.one_call_ok():
            # The store is the broker's server: the record rides with the message's LPUSH
            # (one_call.py), or is written after the publish if kombu pushes it elsewhere; a
            # group member's with the group's others, as one pipeline.
            sent = OneCallRecord(tracked, message) if batch is None else \
                BatchedOneCallRecord(tracked, message, batch, outage)
            one_call.pending.set(sent)
            pending.append(sent)
            return
        if batch is not None:
            sent = batch.send(tracked, message, outage) if tracked.can_send() else None
        else:
            sent = tracked.send(message)
        if sent is None:
            tracked.enqueue(message)
            sent = _Recorded(tracked, message)
        pending.append(sent)  # confirmed (the outage log) once the publish returned
    except LeaseError as exc:
        if outage.failed(exc, message, tracked, time.monotonic() - began) and message is not None:
            pending.append(HeldRecord(message))
    except Exception as exc:  # noqa: BLE001 - a message we cannot record is still published
        untracked(sender, headers.get("id"), exc)


class _Recorded:
    """A record already answered (written synchronously): nothing left to read."""

    def __init__(self, tracked: QueuedTasks, task: QueuedTask) -> None:
        self.tracked, self.task = tracked, task

    def result(self) -> None:
        return None


def _forget(pending: list, outage: PublishOutage) -> None:
    """After a publish that raised: read the record's reply if pending, then drop the record."""
    if not pending:
        return
    sent = pending.pop()
    if isinstance(sent, HeldRecord):
        outage.discard(sent.task.task_id)
        return
    if isinstance(sent, OneCallRecord) and not sent.sent:
        one_call.pending.set(None)  # nothing was recorded: nothing to drop (nor to write later)
        sent.sent = True
        return
    confirm(sent, outage)
    try:
        sent.tracked.forget(sent.task.task_id)
    except Exception as exc:  # noqa: BLE001 - the record stays: recovery runs it after the timeout
        logger.warning("task %s: its publish failed and its queued record could not be dropped "
                       "(%r); it runs after leases_delivery_timeout", sent.task.task_id, exc)
