"""Records the lease store could not take, held for the app's next publish it answers.

A publish is never stopped by the lease store: when the store cannot be reached the message
goes out all the same and its record waits here (``PublishOutage``), logged once per outage.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

from ..exceptions import LeaseError, LeaseUnavailable
from ..outage import Outage
from ..protocol.queued import QueuedTask, QueuedTasks

#: The logger of publish tracking (operators filter on it; the name stays).
logger = logging.getLogger("celery_leases.tracking")


class HeldRecord:
    """A record the store could not take, held by the app's PublishOutage for later."""

    batched = False

    def __init__(self, task: QueuedTask) -> None:
        self.task = task


def confirm(sent: Any, outage: "PublishOutage") -> None:
    if isinstance(sent, HeldRecord):
        return  # already counted as failed, and held
    began = time.monotonic()
    try:
        sent.result()
    except LeaseError as exc:
        outage.failed(exc, sent.task, sent.tracked, time.monotonic() - began)
    except Exception as exc:  # noqa: BLE001 - the message is out; it is leased at receipt
        untracked(sent.task.name, sent.task.task_id, exc)
    else:
        outage.succeeded()


class PublishOutage:
    """The lease store's outages as one app's publishes see them, and the records they owe.

    A record the store did not take because it could not be reached (``LeaseUnavailable``)
    is held here, and written at this app's next publish the store answers: a task published
    during a store restart is then tracked all the same, so a broker that loses it later does
    not lose it for good, however long the outage was. Held at most ``MAX_HELD`` records
    (the oldest dropped first) and each for at most the store's retention: a record written
    late finds the task's own record if a worker took it meanwhile (acquired at receipt; a
    finished one is kept that long) and changes nothing, but after the retention the task
    may have run and its record expired, and recording it then could run it again. What is
    dropped is logged by id.
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
            if now - at > tracked.store.settings.retention:
                too_old.append(task.task_id)
            else:
                late.setdefault(id(tracked), (tracked, []))[1].append((at, task))
        if too_old:
            logger.warning("publish tracking: the lease store was unreachable longer than "
                           "leases_retention; not tracked (leased at receipt): %s", ", ".join(too_old))
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


def untracked(name: Any, task_id: Any, exc: BaseException) -> None:
    logger.warning("task %s[%s]: not tracked from publish (%r); it is leased at receipt", name, task_id, exc)
