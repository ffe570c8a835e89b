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
store answers (PublishOutage): tracking never stops a publish.

Recovery: a step of every recovery pass (``LeaseStore.recovery_steps``)
re-publishes overdue queued tasks with ``publish_raw`` (same id, routing,
headers, a new ``lease_generation``), and stores REVOKED (reason expired) for
those past their ``expires``, as Celery does for an expired message.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, Iterator

from celery import states
from celery.signals import before_task_publish
from kombu.compression import compress
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps

# (Importing publish first connects its publish id stamp before the record below.)
from .publish import PUBLISH_HEADER, RECORDED_HEADER, recorded_headers
from .config import client_config
from .exceptions import LeaseError, LeaseUnavailable
from .messages import publish_raw, request_of
from . import one_call, patches
from .one_call import OneCallRecord
from .protocol.queued import QueuedTask, QueuedTasks, Undelivered
from .protocol.store import LeaseStore
from .runtime import get_store, on_new_store
from .signals import undelivered_republished
from .worker.outage import Outage
from .worker.revokes import decided

logger = logging.getLogger("celery_leases.tracking")

#: (app, serializer, compression) of the publish under way in this context, set by send_task.
_publishing: ContextVar[tuple | None] = ContextVar("celery_leases_publishing", default=None)
#: The batch of a group's (or chord header's) publish under way in this context (_Batch).
_batch: ContextVar["_Batch | None"] = ContextVar("celery_leases_batch", default=None)
#: The body serialized for the record of the publish under way: (body, serializer, what
#: kombu's ``dumps`` returned), so that kombu's Producer does not serialize it a second time.
_serialized: ContextVar[tuple | None] = ContextVar("celery_leases_serialized", default=None)
#: The properties a re-publish needs (publish_raw reads these).
_PROPERTIES = ("correlation_id", "reply_to", "delivery_mode", "priority")


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
            _confirm(pending.pop(), outage)
        return result

    send_task.__wrapped__ = original  # type: ignore[attr-defined]
    app.send_task = send_task
    app._celery_leases_tracking = True
    on_new_store(attach)
    _batch_groups()
    _serialize_once()


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


def _batch_groups() -> None:
    """Make each group's publish (a chord header's too) one batch: its members' records are
    written on one connection as they are published, and their replies read once the last
    member is out, so a group costs about one lease-store round trip, not one per member.
    Celery publishes the members in a loop in ``group._apply_tasks`` (a generator the group
    consumes at once); the batch lasts as long as that loop."""
    from celery import canvas
    original = canvas.group._apply_tasks
    if getattr(original, "_celery_leases_batched", False):  # installed already
        return

    def _apply_tasks(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _batch.get() is not None:  # a nested group: the outer batch takes its members
            yield from original(self, *args, **kwargs)
            return
        batch = _Batch()
        token = _batch.set(batch)
        try:
            yield from original(self, *args, **kwargs)
        finally:
            _batch.reset(token)
            batch.flush()

    _apply_tasks._celery_leases_batched = True  # type: ignore[attr-defined]
    patches.patch("celery.canvas.group._apply_tasks", canvas.group, "_apply_tasks", _apply_tasks)


@contextmanager
def batched() -> Iterator[None]:
    """The publishes of this block are one batch, as a group's members are (``_batch_groups``):
    each record is written before its message goes out, the replies read once the block
    ends. The outbox relay publishes its rows this way (celery_leases/outbox/relay.py)."""
    if _batch.get() is not None:  # inside a batch already: it takes these publishes too
        yield
        return
    batch = _Batch()
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)
        batch.flush()


def _serialize_once() -> None:
    """Let kombu's Producer take the body the record serialized, instead of serializing it again.

    The record (``before_task_publish``) serializes the body with kombu's ``dumps`` just
    before Celery hands the same object to ``Producer.publish``, which serializes it with
    ``kombu.messaging.dumps``. That name is wrapped to return the record's result when it is
    asked for the very object (identity, held alive by the context variable) with the same
    serializer: the same function on the same input, so the same bytes, one serialization
    saved per publish. Anything else goes to kombu's own ``dumps``, as before."""
    import kombu.messaging as messaging
    original = messaging.dumps
    if getattr(original, "_celery_leases_once", False):
        return

    def dumps(data: Any, serializer: Any = None) -> Any:
        done = _serialized.get()
        if done is not None:
            _serialized.set(None)
            if done[0] is data and done[1] == serializer:
                return done[2]
        return original(data, serializer=serializer)

    dumps._celery_leases_once = True  # type: ignore[attr-defined]
    patches.patch("kombu.messaging.dumps", messaging, "dumps", dumps)


class _Batch:
    """Records sent for one group's members, per store connection, read at the end."""

    def __init__(self) -> None:
        self.conns: dict[int, tuple[QueuedTasks, Any]] = {}
        self.entries: list[tuple[Any, "PublishOutage"]] = []

    def send(self, tracked: QueuedTasks, task: QueuedTask, outage: PublishOutage) -> "_Batched":
        key = id(tracked)
        if key not in self.conns:
            self.conns[key] = (tracked, tracked.take())
        conn = self.conns[key][1]
        try:
            pending = tracked.send_on(conn, task)
        except Exception:
            self._drop(conn)  # disconnected: the replies due on it are lost, never misread
            raise
        sent = _Batched(self, pending)
        self.entries.append((sent, outage))
        return sent

    def _drop(self, conn: Any) -> None:
        lost = [(s, o) for s, o in self.entries if s.pending.conn is conn]
        self.entries = [(s, o) for s, o in self.entries if s.pending.conn is not conn]
        for sent, outage in lost:
            _confirm(sent.pending, outage)  # fails: logged as untracked (leased at receipt)
        for key, (tracked, c) in list(self.conns.items()):
            if c is conn:
                tracked.give_back(conn)
                del self.conns[key]

    def flush(self) -> None:
        """Read every reply still due, in order, then give the connections back."""
        try:
            while self.entries:
                sent, outage = self.entries.pop(0)
                _confirm(sent.pending, outage)
        finally:
            for tracked, conn in self.conns.values():
                tracked.give_back(conn)
            self.conns.clear()


class _Batched:
    """A group member's record: confirmed with the batch (``result`` reads up to it now)."""

    batched = True

    def __init__(self, batch: _Batch, pending: Any) -> None:
        self.batch, self.pending = batch, pending
        self.tracked, self.task = pending.tracked, pending.task

    def result(self) -> Any:
        """Its publish raised: read the replies due up to this one (forget needs the record)."""
        while self.batch.entries:
            sent, outage = self.batch.entries.pop(0)
            if sent is self:
                return self.pending.result()
            _confirm(sent.pending, outage)
        return None


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
                             serializer, compression, _delivery_mode(app, delivery_mode, kwargs.get("declare")))
        if not headers.get("retries"):
            # The worker's acquire may leave the message out (the store holds it) if it
            # receives the headers recorded here; a retry's record exists already and keeps
            # the first message, so a retry's message is always sent.
            stored = message.envelope["headers"]
            stored[RECORDED_HEADER] = headers[RECORDED_HEADER] = recorded_headers(stored)
        if outage.skipping():  # the store just failed to answer: hold it without waiting again
            outage.hold(message, tracked)
            pending.append(_Held(message))
            return
        batch = _batch.get()
        sent: Any
        if batch is None and _one_call(app) and tracked.one_call_ok():
            # The store is the broker's server: the record rides with the message's LPUSH
            # (one_call.py), or is written after the publish if kombu pushes it elsewhere.
            sent = OneCallRecord(tracked, message)
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
            pending.append(_Held(message))
    except Exception as exc:  # noqa: BLE001 - a message we cannot record is still published
        _untracked(sender, headers.get("id"), exc)


class _Recorded:
    """A record already answered (written synchronously): nothing left to read."""

    def __init__(self, tracked: QueuedTasks, task: QueuedTask) -> None:
        self.tracked, self.task = tracked, task

    def result(self) -> None:
        return None


class _Held:
    """A record the store could not take, held by the app's PublishOutage for later."""

    batched = False

    def __init__(self, task: QueuedTask) -> None:
        self.task = task


def _confirm(sent: Any, outage: "PublishOutage") -> None:
    if isinstance(sent, _Held):
        return  # already counted as failed, and held
    began = time.monotonic()
    try:
        sent.result()
    except LeaseError as exc:
        outage.failed(exc, sent.task, sent.tracked, time.monotonic() - began)
    except Exception as exc:  # noqa: BLE001 - the message is out; it is leased at receipt
        _untracked(sent.task.name, sent.task.task_id, exc)
    else:
        outage.succeeded()


class PublishOutage:
    """The lease store's outages as one app's publishes see them, and the records they owe.

    A record the store did not take because it could not be reached (``LeaseUnavailable``)
    is held here, and written at this app's next publish the store answers: a task published
    during a store restart is then tracked all the same, so a broker that loses it later does
    not lose it for good. Held at most ``MAX_HELD`` records (the oldest dropped first) and
    each for at most the delivery timeout (after that the task may have run and its record
    been purged: recording it then could run it again); what is dropped is logged by id.
    Held in memory: a process that publishes nothing more writes them as it exits (one try,
    at the interpreter's exit), and logs by id those the store still does not take; a
    process that is killed leaves them untracked (leased at receipt), as without tracking.

    A store that does not answer (stopped, partitioned) costs the publish that finds it so the
    client's socket timeout. For ``RETRY_DELAY`` seconds after such a failure (one that took
    ``SLOW_FAILURE`` seconds or more), doubling with each one up to ``RETRY_MAX_DELAY``, the
    publishes do not ask it again: their records are held at once (``skipping``), so an
    outage slows one publish per window, not every one. A failure that comes at once (the
    connection refused) costs little, and the next publish asks again.
    """

    MAX_HELD = 10_000
    RETRY_DELAY = 1.0
    RETRY_MAX_DELAY = 30.0
    SLOW_FAILURE = 0.5

    def __init__(self, outage: Outage) -> None:
        self.outage = outage
        self._held: dict[str, tuple[float, QueuedTask, QueuedTasks]] = {}
        self._lock = threading.Lock()
        #: Monotonic time before which publishes hold their records without asking the store.
        self._retry_at = 0.0
        self._delay = 0.0
        _outages.add(self)

    def skipping(self) -> bool:
        """True while the store failed too recently to be asked again (records are held)."""
        return self._retry_at > 0.0 and time.monotonic() < self._retry_at

    def failed(self, exc: BaseException, task: QueuedTask | None = None,
               tracked: QueuedTasks | None = None, waited: float = 0.0) -> bool:
        """A record failed after ``waited`` seconds; True if ``task``'s record is now held for later."""
        self.outage.failed(exc)
        if not isinstance(exc, LeaseUnavailable):
            return False
        if waited >= self.SLOW_FAILURE:
            self._delay = min(max(self.RETRY_DELAY, self._delay * 2), self.RETRY_MAX_DELAY)
            self._retry_at = time.monotonic() + self._delay
        if task is None or tracked is None:
            return False
        return self.hold(task, tracked)

    def hold(self, task: QueuedTask, tracked: QueuedTasks) -> bool:
        """Keep ``task``'s record for the next publish the store answers; True."""
        with self._lock:
            self._held.pop(task.task_id, None)
            self._held[task.task_id] = (time.monotonic(), task, tracked)
            dropped = [self._held.pop(next(iter(self._held)))[1].task_id
                       for _ in range(len(self._held) - self.MAX_HELD)]
        if dropped:
            logger.warning("publish tracking: more than %d records waiting for the lease store; "
                           "not tracked (leased at receipt): %s", self.MAX_HELD, ", ".join(dropped))
        return True

    def discard(self, task_id: str) -> None:
        """The publish of ``task_id`` raised: its held record must not make it run later."""
        with self._lock:
            self._held.pop(task_id, None)

    def succeeded(self) -> None:
        self.outage.succeeded()
        self._retry_at = self._delay = 0.0
        if self._held:
            self.flush()

    def flush(self) -> None:
        """Write the held records (one pipelined call per store); kept if the store fails again."""
        with self._lock:
            held, self._held = self._held, {}
        now = time.monotonic()
        late: dict[int, tuple[QueuedTasks, list]] = {}
        too_old = []
        for at, task, tracked in held.values():
            if now - at > tracked.delivery_timeout:
                too_old.append(task.task_id)
            else:
                late.setdefault(id(tracked), (tracked, []))[1].append((at, task))
        if too_old:
            logger.warning("publish tracking: the lease store was unreachable longer than "
                           "leases_delivery_timeout; not tracked (leased at receipt): %s", ", ".join(too_old))
        for tracked, entries in late.values():
            try:
                tracked.enqueue_many([task for _, task in entries])
            except LeaseError as exc:
                self.outage.failed(exc)
                with self._lock:
                    for at, task in entries:
                        self._held.setdefault(task.task_id, (at, task, tracked))
            else:
                logger.warning("publish tracking: %d task(s) published while the lease store was "
                               "unreachable are recorded now", len(entries))


    def at_exit(self) -> None:
        """The process exits: write what is held, one last try; log by id what is not."""
        if not self._held:
            return
        self.flush()
        with self._lock:
            left, self._held = list(self._held), {}
        if left:
            logger.warning("publish tracking: the process exits with %d record(s) the lease store "
                           "never took; not tracked (leased at receipt): %s", len(left), ", ".join(left))


#: Every app's PublishOutage, for the write of their held records at exit.
_outages: "weakref.WeakSet[PublishOutage]" = weakref.WeakSet()


@atexit.register
def _write_held_at_exit() -> None:
    # Registered after logging's own exit hook (imported first), so it runs before that one.
    for outage in list(_outages):
        try:
            outage.at_exit()
        except Exception:  # noqa: BLE001 - the interpreter is exiting: say so, do not raise
            logger.warning("publish tracking: held records could not be written at exit", exc_info=False)


def _forget(pending: list, outage: PublishOutage) -> None:
    """After a publish that raised: read the record's reply if pending, then drop the record."""
    if not pending:
        return
    sent = pending.pop()
    if isinstance(sent, _Held):
        outage.discard(sent.task.task_id)
        return
    if isinstance(sent, OneCallRecord) and not sent.sent:
        one_call.pending.set(None)  # nothing was recorded: nothing to drop
        return
    _confirm(sent, outage)
    try:
        sent.tracked.forget(sent.task.task_id)
    except Exception as exc:  # noqa: BLE001 - the record stays: recovery runs it after the timeout
        logger.warning("task %s: its publish failed and its queued record could not be dropped "
                       "(%r); it runs after leases_delivery_timeout", sent.task.task_id, exc)


def _untracked(name: Any, task_id: Any, exc: BaseException) -> None:
    logger.warning("task %s[%s]: not tracked from publish (%r); it is leased at receipt", name, task_id, exc)


def message_of(app: Any, name: str, body: Any, exchange: Any, routing_key: Any, headers: dict,
               properties: dict, serializer: str | None, compression: str | None,
               delivery_mode: int | None = None) -> QueuedTask:
    """The message as kombu will publish it: serialized body, routing, headers, properties."""
    if serializer is None or compression is None:
        default_serializer, default_compression, _ = _defaults(app)
        serializer = serializer or default_serializer
        compression = compression or default_compression
    serialized = content_type, content_encoding, data = dumps(body, serializer=serializer)
    _serialized.set((body, serializer, serialized))  # kombu's Producer takes it (_serialize_once)
    if isinstance(data, str):
        data = data.encode(content_encoding or "utf-8")
    stored_headers = dict(headers)
    if compression:
        data, stored_headers["compression"] = compress(data, compression)
    get = properties.get
    props = {k: v for k in _PROPERTIES if (v := get(k)) is not None}
    if delivery_mode is not None and "delivery_mode" not in props:
        props["delivery_mode"] = delivery_mode
    envelope = {"exchange": exchange or "", "routing_key": routing_key or "",
                "priority": get("priority"), "headers": stored_headers,
                "properties": props, "content_type": content_type,
                "content_encoding": content_encoding}
    eta, expires = headers.get("eta"), headers.get("expires")
    return QueuedTask(str(headers["id"]), name, data, envelope,
                      eta_ms=_epoch_ms(eta) if eta else 0, expires_ms=_epoch_ms(expires) if expires else 0,
                      publish=str(headers.get(PUBLISH_HEADER) or ""))


def _defaults(app: Any) -> tuple[str, str | None, Any]:
    """The app's task_serializer, task_compression and task_default_delivery_mode, read once
    per app as Celery's own task sender reads them (``app.amqp.send_task_message``): a conf
    lookup costs more than the whole record's serialization."""
    defaults = app.__dict__.get("_celery_leases_publish_defaults")
    if defaults is None:
        conf = app.conf
        defaults = app._celery_leases_publish_defaults = (
            conf.task_serializer, conf.task_compression, conf.task_default_delivery_mode)
    return defaults


def _delivery_mode(app: Any, option: Any, declare: Any) -> int | None:
    """The delivery mode the message goes out with, as Celery's task sender and kombu pick it
    (the option, else the queue's exchange's, else task_default_delivery_mode; Celery passes
    its queue to this signal as ``declare``), so a re-published copy is as persistent."""
    mode = option
    if mode is None:
        try:
            mode = declare[0].exchange.delivery_mode
        except (AttributeError, IndexError, TypeError):
            pass
        mode = mode or _defaults(app)[2]
    try:
        return maybe_delivery_mode(mode)
    except KeyError:
        return None  # a name kombu does not know: left to kombu, as before


def _epoch_ms(value: Any) -> int:
    """An ETA / expires header (ISO 8601, naive taken as UTC) in ms since the epoch; 0: none."""
    if not value:
        return 0
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)


class Republisher:
    """What a recovery pass does with an undelivered task: re-publish it, or store its expiry."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def publish(self, item: Undelivered) -> None:
        headers = dict(item.envelope.get("headers") or {})
        headers["lease_generation"] = item.generation
        publish_raw(self.app, item.body, item.envelope, headers)
        logger.warning("task %s[%s]: not acquired within leases_delivery_timeout; re-published "
                       "(generation %d)", item.name, item.task_id, item.generation)
        undelivered_republished.send(sender=self.app, task_id=item.task_id, generation=item.generation)

    def on_expired(self, item: Undelivered) -> None:
        """Past ``expires`` while undelivered: REVOKED (expired) for waiters, as Celery stores it."""
        task = self.app.tasks.get(item.name)
        store_result = task is None or task.store_errors_even_if_ignored or not task.ignore_result
        request = request_of(item.task_id, item.name, item.body, item.envelope)
        logger.info("task %s[%s]: expired before any worker received it; revoked", item.name, item.task_id)
        with decided(item.task_id):
            self.app.backend.mark_as_revoked(item.task_id, "expired", request=request,
                                             store_result=store_result, state=states.REVOKED)
