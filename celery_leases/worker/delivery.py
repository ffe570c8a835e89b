"""The rules a delivery meets at receipt, before it may reach the lease store.

Receipt (receipt.py) decides *when*; this module holds *what*: which
messages are malformed (and in which field), how many deliveries of one task
id a worker admits per minute, and how long a re-queued copy waits (its ETA
comes from the store's clock: clock.py). Errors at receipt fall in two
classes (docs/celery.md, "Errors at receipt"):

- transient (``LeaseUnavailable``: unreachable, READONLY, timeouts): the
  delivery is tried again when due, then re-queued with a growing delay;
- permanent (anything else: a malformed message, a corrupt record, a script
  error): the delivery is parked, never re-queued.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from datetime import datetime, timedelta, timezone
from time import monotonic
from typing import Any, Callable

from ..exceptions import LeaseError
from ..publishing.publish_id import MAX_PUBLISH_ID, PUBLISH_HEADER
from ..protocol.keys import usable_id

__all__ = ["LeaseDelivery", "lease_delivery", "MalformedMessage", "Throttled", "validate_message",
           "DeliveryWindow",
           "requeue_delay", "REQUEUES_HEADER", "DUE_HEADER", "local_eta", "describe", "eta_after"]

#: Header of a copy re-queued because the lease store was unreachable: how many
#: times this delivery was re-queued so far (the backoff exponent).
REQUEUES_HEADER = "lease_requeues"
#: Header of such a copy: when it is due, in ms on the lease store's clock. Its
#: ``eta`` header is on that clock too, but Celery compares an ETA with the
#: receiving worker's wall clock: a leased worker translates this one instead
#: (``local_eta``), so neither the sender's nor the receiver's clock matters.
DUE_HEADER = "lease_due_ms"

#: Largest integer a header may carry: Lua numbers are doubles, exact below 2^53.
_MAX_INT = 2 ** 53


class LeaseDelivery:
    """What one delivery of a leased task is to the lease, from receipt to its hand-over to
    the pool: one object of ours on Celery's Request (``lease_delivery``), not attributes of
    Celery's class. Read and written in the worker's main thread only."""

    __slots__ = ("asked_at", "inflight", "deferred", "pending", "refused", "warned")

    def __init__(self) -> None:
        #: Monotonic time the acquire was sent: the lease lives at least until this + ttl.
        self.asked_at: float | None = None
        #: The acquire is under way (sent by the acquirer, its reply not read yet).
        self.inflight = False
        #: (pool, kwargs) of the hand-over to the pool that waits for the acquire's reply.
        self.deferred: tuple | None = None
        #: Work receipt left for when the task is due: a LeaseError to acquire again after, a
        #: Throttled delivery window, or a parking to try again.
        self.pending: Any = None
        #: Receipt settled the delivery without running it (parked, refused, re-queued).
        self.refused = False
        #: Receipt already said once that the store was unreachable for this delivery.
        self.warned = False


def lease_delivery(request: Any) -> LeaseDelivery:
    """``request``'s LeaseDelivery, made on first use."""
    state = request.__dict__.get("_lease")
    if state is None:
        state = request.__dict__["_lease"] = LeaseDelivery()
    return state


class MalformedMessage(LeaseError):
    """Raised when a delivery of a leased task cannot be leased as it is (bad id, header, body).

    ``field`` names the part of the message at fault (``id``, ``headers``,
    ``lease_generation``, ``retries``, ``lease_publish``, ``body``, ``envelope``).
    """

    def __init__(self, message: str, field: str = "") -> None:
        self.field = field
        super().__init__(message)

    def __reduce__(self):
        return (self.__class__, (str(self), self.field))


class Throttled(LeaseError):
    """Raised when a task id had more deliveries this minute than a worker admits."""


def describe(request: Any) -> str:
    """``name[id]`` of a delivery for messages: the id as repr when it is not a plain string."""
    task_id = getattr(request, "id", None)
    shown = task_id if usable_id(task_id) else repr(task_id)
    return f"{getattr(request, 'name', None) or getattr(request.task, 'name', '?')}[{shown}]"


def _integer_header(request: Any, headers: Any, name: str) -> None:
    value = headers.get(name)
    if value is None or (type(value) is int and 0 <= value < _MAX_INT):
        return
    raise MalformedMessage(f"task {describe(request)}: header {name} must be a non-negative integer, "
                           f"got {value!r}", field=name)


def validate_message(request: Any) -> None:
    """Raise MalformedMessage naming the delivery and the field unless it can be leased.

    Cheap (type checks and one encode, about a microsecond), since every
    delivery of a leased task passes here: the id must be a non-empty UTF-8
    string and the one in the headers (recovery re-publishes those headers,
    so they must carry it), the lease headers integers, the body bytes.
    """
    task_id = request.id
    if not usable_id(task_id):
        kind = "missing" if task_id is None else (
            "empty" if task_id == "" else "not a string" if not isinstance(task_id, str)
            else "not valid UTF-8 (a lone surrogate)")
        raise MalformedMessage(f"task {describe(request)}: the task id is {kind}: {task_id!r}", field="id")
    message = request.message
    headers = message.headers
    if not isinstance(headers, dict):
        raise MalformedMessage(f"task {describe(request)}: the message has no headers (got {headers!r}); "
                               f"a leased task needs Celery's message protocol 2", field="headers")
    if headers.get("id") != task_id:
        raise MalformedMessage(f"task {describe(request)}: header id is missing or differs from the "
                               f"task id: {headers.get('id')!r}", field="id")
    _integer_header(request, headers, "lease_generation")
    _integer_header(request, headers, REQUEUES_HEADER)
    _integer_header(request, headers, DUE_HEADER)
    _integer_header(request, request.request_dict, "retries")
    publish = headers.get(PUBLISH_HEADER)
    if publish is not None and not (isinstance(publish, str) and 0 < len(publish) <= MAX_PUBLISH_ID
                                    and publish.isascii() and publish.isalnum()):
        raise MalformedMessage(f"task {describe(request)}: header {PUBLISH_HEADER} must be 1 to "
                               f"{MAX_PUBLISH_ID} ASCII letters or digits, got {publish!r}",
                               field=PUBLISH_HEADER)
    if not isinstance(message.body, (bytes, bytearray, str)):
        raise MalformedMessage(f"task {describe(request)}: the message body is not bytes: "
                               f"{type(message.body).__name__}", field="body")


class DeliveryWindow:
    """At most ``limit`` admitted deliveries per task id in any ``window`` seconds, in this process.

    In memory, so it holds when Redis is down. A sliding log per id (at most
    ``limit`` monotonic timestamps); ids idle for a whole window are dropped
    as new deliveries come in, so the table holds only ids seen in the last
    window. Deliveries it refuses are not counted: a postponed copy comes
    back once the window has room.
    """

    def __init__(self, limit: int, window: float = 60.0, clock: Callable[[], float] = monotonic) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        #: id -> the time of its one delivery (most ids), or a log of up to ``limit`` times.
        self._seen: OrderedDict[str, float | deque] = OrderedDict()

    def admit(self, task_id: str) -> float:
        """0.0 when the delivery is admitted (and counted), else seconds until the window has room."""
        now = self.clock()
        seen = self._seen
        # Forget ids whose last delivery left the window (least recently touched first).
        while seen:
            oldest = next(iter(seen.values()))
            last = oldest[-1] if isinstance(oldest, deque) else oldest
            if now - last < self.window:
                break
            seen.popitem(last=False)
        times = seen.get(task_id)
        if times is None:
            seen[task_id] = now  # a float until a second delivery: most ids see one
            return 0.0
        seen.move_to_end(task_id)
        if not isinstance(times, deque):
            if self.limit > 1 or now - times >= self.window:
                seen[task_id] = deque((times, now), maxlen=max(self.limit, 1))
                return 0.0
            return self.window - (now - times)
        if len(times) >= self.limit:
            wait = self.window - (now - times[0])
            if wait > 0:
                return wait
        times.append(now)
        return 0.0

    def room_in(self, task_id: str) -> float:
        """Seconds until ``task_id`` may be admitted again (0.0: now); counts nothing."""
        times = self._seen.get(task_id)
        if times is None:
            return 0.0
        if not isinstance(times, deque):
            times = deque((times,))
        if len(times) < self.limit:
            return 0.0
        return max(0.0, self.window - (self.clock() - times[0]))


def requeue_delay(base: float, cap: float, requeues: int) -> float:
    """``base`` * 2^requeues, at most ``cap`` (and never below ``base``)."""
    return min(base * 2.0 ** min(requeues, 64), max(cap, base))


def eta_after(now: datetime, seconds: float) -> str:
    """The ``eta`` header value (ISO 8601, UTC) ``seconds`` after ``now``."""
    return (now + timedelta(seconds=seconds)).isoformat()


def local_eta(due_ms: int, server_now_ms: int, now: Callable[[], datetime] | None = None) -> datetime | None:
    """This worker's wall-clock moment for ``due_ms`` on the store's clock; None once it passed.

    The store's clock now is ``server_now_ms`` (clock.py's estimate): the
    time left is measured on that clock, then laid on this worker's own, so a
    worker whose wall clock is off by an hour still waits only the delay.
    """
    left = (int(due_ms) - int(server_now_ms)) / 1000.0
    if left <= 0:
        return None
    return (now or _wall_now)() + timedelta(seconds=left)


def _wall_now() -> datetime:
    return datetime.now(timezone.utc)
