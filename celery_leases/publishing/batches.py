"""A group's publish (a chord header's, the outbox relay's rows) as one batch of records.

Each member's record is written on one connection as it is published, and the replies are
read once the last member is out, so a group costs about one lease-store round trip, not one
per member.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

from .. import patches
from ..protocol.queued import QueuedTask, QueuedTasks
from .held_records import PublishOutage, confirm

#: The batch of a group's (or chord header's) publish under way in this context (_Batch).
current_batch: ContextVar["_Batch | None"] = ContextVar("celery_leases_batch", default=None)


def batch_groups() -> None:
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
        if current_batch.get() is not None:  # a nested group: the outer batch takes its members
            yield from original(self, *args, **kwargs)
            return
        batch = _Batch()
        token = current_batch.set(batch)
        try:
            yield from original(self, *args, **kwargs)
        finally:
            current_batch.reset(token)
            batch.flush()

    _apply_tasks._celery_leases_batched = True  # type: ignore[attr-defined]
    patches.patch("celery.canvas.group._apply_tasks", canvas.group, "_apply_tasks", _apply_tasks)


@contextmanager
def batched() -> Iterator[None]:
    """The publishes of this block are one batch, as a group's members are (``batch_groups``):
    each record is written before its message goes out, the replies read once the block
    ends. The outbox relay publishes its rows this way (celery_leases/outbox/relay.py)."""
    if current_batch.get() is not None:  # inside a batch already: it takes these publishes too
        yield
        return
    batch = _Batch()
    token = current_batch.set(batch)
    try:
        yield
    finally:
        current_batch.reset(token)
        batch.flush()


class _Batch:
    """Records sent for one group's members, per store connection, read at the end."""

    def __init__(self) -> None:
        self.conns: dict[int, tuple[QueuedTasks, Any]] = {}
        self.entries: list[tuple[Any, "PublishOutage"]] = []

    def send(self, tracked: QueuedTasks, task: QueuedTask, outage: PublishOutage) -> "_Batched":
        sent = _Batched(self, self.write(tracked, task))
        self.entries.append((sent, outage))
        return sent

    def write(self, tracked: QueuedTasks, task: QueuedTask, push: tuple[str, str] | None = None) -> Any:
        """Write ``task``'s record (with its message's push, one_call.py) on the batch's
        connection to ``tracked``'s server; the PendingEnqueue, its reply read in order."""
        key = id(tracked)
        if key not in self.conns:
            self.conns[key] = (tracked, tracked.take())
        conn = self.conns[key][1]
        try:
            return tracked.send_on(conn, task, push=push)
        except Exception:
            self._drop(conn)  # disconnected: the replies due on it are lost, never misread
            raise

    def add(self, entry: Any, outage: PublishOutage) -> None:
        """A record confirmed with the batch, in order: ``entry.pending.result()`` at the flush
        (a one-call record of one_call.py, whose write happens when kombu pushes its message)."""
        self.entries.append((entry, outage))

    def _drop(self, conn: Any) -> None:
        lost = [(s, o) for s, o in self.entries if _conn_of(s) is conn]
        self.entries = [(s, o) for s, o in self.entries if _conn_of(s) is not conn]
        for sent, outage in lost:
            confirm(sent.pending, outage)  # fails: logged as untracked (leased at receipt)
        for key, (tracked, c) in list(self.conns.items()):
            if c is conn:
                tracked.give_back(conn)
                del self.conns[key]

    def read_up_to(self, entry: Any) -> None:
        """Confirm, in order, the entries before ``entry`` and take ``entry`` out (its caller
        reads its reply next); nothing when ``entry`` was taken out already."""
        if not any(sent is entry for sent, _ in self.entries):
            return
        while self.entries:
            sent, outage = self.entries.pop(0)
            if sent is entry:
                return
            confirm(sent.pending, outage)

    def flush(self) -> None:
        """Read every reply still due, in order, then give the connections back."""
        try:
            while self.entries:
                sent, outage = self.entries.pop(0)
                confirm(sent.pending, outage)
        finally:
            for tracked, conn in self.conns.values():
                tracked.give_back(conn)
            self.conns.clear()


def _conn_of(sent: Any) -> Any:
    """The connection an entry's record was written on (None: not written on the batch's)."""
    return getattr(sent.pending, "conn", None)


class _Batched:
    """A group member's record: confirmed with the batch (``result`` reads up to it now)."""

    batched = True

    def __init__(self, batch: _Batch, pending: Any) -> None:
        self.batch, self.pending = batch, pending
        self.tracked, self.task = pending.tracked, pending.task

    def result(self) -> Any:
        """Its publish raised: read the replies due up to this one (forget needs the record)."""
        if any(sent is self for sent, _ in self.batch.entries):
            self.batch.read_up_to(self)
            return self.pending.result()
        return None
