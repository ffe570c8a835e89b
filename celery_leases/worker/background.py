"""Finishes nobody waits for: queued by the task, which returns at once, and sent
several in one write.

For a task whose outcome nobody reads (its result not stored, and no callback,
errback, chain, chord or group waiting on it: ``LeasedTask`` decides) the
finish's answer changes nothing the worker does next: accepted or refused,
nothing of the outcome leaves the worker. Such a finish is queued here, and:

- on prefork, the pool process makes no finish: the worker's main process
  queues it when the pool reports the success (task/request.py, for the
  requests it marked ``lease_parent_finish`` before handing them over), and
  its acquirer's next write carries it (worker/acquirer.py: the finishes'
  call first, then the acquires), or, with no acquire to ride with, a write
  of their own after ``GATHER`` seconds;
- on a threads pool of more than one thread, a thread of its own sends what
  is queued after ``GATHER`` seconds, in one write (``LeaseStore.finish_many``:
  one finish_many.lua call);
- on the solo pool, the finishes ride in the write of the next acquire
  (``ride``, ``LeaseStore.acquire_with_finishes``), which the worker waits for
  before that task may run; what no acquire takes within ``GATHER`` seconds
  goes out from the event loop, and before any other body starts
  (``before_each_body``: a plain task, an ETA that came due) what is queued
  goes first.

Unchanged: each finish carries its owner and token and is refused as a waited
one is (logged, ``stale_outcome_rejected``); one that gets no answer is sent
again with backoff until a copy has gone out after its not-after moment
(settle.py's rule: the store then answers for good), and is otherwise withheld,
so recovery runs the task again once its lease expires. A worker that dies
before its finishes land leaves their leases to expire and their tasks to run
again, as a death just after any body does. What differs: the record reads
``active`` until the write lands (up to ``GATHER`` and a round trip after the
body ended), and a death in that window counts for the task as a death while it
ran (on prefork: a pool process that dies after the body, before it reported
the success). On a pool whose tasks share their process every death is an
uncertain one (isolation.py), so a task there is charged nothing it would not
be charged while running; an isolated run starts only once nothing is queued
here (``flush``), so its death stays its own alone. On prefork and solo a
death is charged to the task that ran: prefork's finishes are sent by the main
process, which the next task's death in a pool process does not stop, and on
solo no body starts while a finish queued before it is on its way, so the next
task's death is never charged to the one before.

A threads pool of one and the green pools keep waited finishes.
``leases_background_finishes = False`` turns this off.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable

from ..exceptions import LeaseError, LeaseLost, LeaseUnavailable
from ..outage import Outage
from ..protocol.clock import server_clock
from ..protocol.settle import FIRST_DELAY, MAX_DELAY
from ..protocol.store import FinishRequest, LeaseStore

logger = logging.getLogger("celery_leases.worker")

#: Seconds a queued finish waits for others to share its write. A no-op task takes about
#: a millisecond on the threads pool: a few finishes per write in a drain, and an idle
#: worker's single finish still lands within a few milliseconds.
GATHER = 0.002
#: Seconds ``stop`` waits for the last write at shutdown before it gives the rest up.
STOP_TIMEOUT = 5.0

class Pending:
    """One queued finish: the request (with its not-after), when a copy settles it for good
    (monotonic), and what reports a refusal (logged and signalled as a waited one's)."""

    __slots__ = ("req", "final", "report", "retry_at", "delay", "since")

    def __init__(self, req: FinishRequest, final: float, report: Callable[[LeaseError], None],
                 since: float = 0.0) -> None:
        self.req, self.final, self.report = req, final, report
        #: Monotonic time it was queued.
        self.since = since
        #: Monotonic time before which it is not sent again (after a write that got no answer).
        self.retry_at = 0.0
        self.delay = FIRST_DELAY


class BackgroundFinishes:
    """The queue of finishes nobody waits for, and the thread that sends them."""

    def __init__(self, store: LeaseStore, *, gather: float = GATHER,
                 clock: Callable[[], float] = time.monotonic, hub: Any = None) -> None:
        self.store, self.gather, self.clock = store, gather, clock
        #: The solo pool's event loop: no thread; the finishes ride with the next acquire
        #: (``ride``), or go out from the loop ``gather`` seconds after the first was queued.
        self.hub = hub
        #: Prefork's acquirer (worker/acquirer.py), whose writes carry the finishes: the
        #: timer then asks it to write (``tick``) instead of sending them here.
        self.carrier: Any = None
        self._started = False
        self._armed = False
        self.server = server_clock(store)
        self.pid = os.getpid()
        self._queue: list[Pending] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Finishes sent and accepted, refused, withheld; writes made; finishes an acquire carried.
        self.accepted = self.refusals = self.withheld = self.writes = self.carried = 0
        self.outage = Outage(logger, "background finishes")

    # -- the tasks' side ------------------------------------------------------

    def add(self, task_id: str, owner: str, token: int, outcome: str, bound: float,
            report: Callable[[LeaseError], None]) -> bool:
        """Queue the finish of ``task_id`` (a terminal ``outcome``); False when its caller
        must finish and wait itself: another process (a prefork child), the thread not
        running, or no reading of the server's clock to bound its copies with. ``bound``:
        seconds its copies may apply (the lease's ttl, as a waited finish's); ``report``:
        called with the reason if it is refused or withheld."""
        if not self._started or self._stop.is_set() or os.getpid() != self.pid \
                or not self.server.fresh():
            return False
        not_after = self.server.upper_ms(self.clock()) + math.ceil(bound * 1000)
        pending = Pending(FinishRequest(task_id, owner, token, outcome, not_after=not_after),
                          self.server.past(not_after), report, self.clock())
        with self._lock:
            self._queue.append(pending)
            first = len(self._queue) == 1
        if first:
            if self.hub is not None:
                self._arm(self.gather)
            else:
                self._wake.set()
        return True

    @property
    def queued(self) -> int:
        return len(self._queue)

    def flush(self) -> None:
        """Send what is queued now from the caller's thread, and return once it is answered
        (or handed back to the thread's retries): an isolated run starts with none of its
        neighbours' outcomes still on their way."""
        if self._queue and os.getpid() == self.pid:
            self._send_due(True)

    def ride(self, send: Callable[[list[FinishRequest]], tuple[Any, Any]]) -> Any:
        """The solo pool's acquire, with the queued finishes due now in its write:
        ``send(finishes)`` makes the call and gives the acquire's answer and the
        finishes' (each a value, ``LeaseStore.acquire_with_finishes``). Returns the
        Acquisition or raises the acquire's LeaseError; the finishes are settled as
        a write of their own would settle them. They land before the acquired task's
        body can start, so its death is never charged to a task before it."""
        batch = self._take(False)
        if batch:
            self.writes += 1
            self.carried += len(batch)
        sent_at = self.clock()
        try:
            acquired, answers = send([p.req for p in batch])
        except Exception as exc:
            if batch:  # a bug: these finishes are not left unreported
                self._withhold(batch, f"not sent: unexpected error {exc!r}")
            raise
        if batch:
            self._settle(batch, answers, sent_at)
        if isinstance(acquired, BaseException):
            raise acquired
        return acquired

    # -- the thread, or the solo pool's loop ---------------------------------------

    def start(self) -> None:
        self._started = True
        if self.hub is None:
            self._thread = threading.Thread(target=self._run, name="celery-leases-finishes", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool | None:
        """None before ``start()`` or without a thread; else whether the thread still runs
        (health.py)."""
        return None if self._thread is None else self._thread.is_alive()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """No more queueing; the thread (or, on the solo pool, the caller) sends what is
        queued, for up to ``timeout`` seconds, then stops; what is still unsent is
        withheld (logged), and recovery runs those tasks again once their leases expire."""
        self._stop.set()
        self._wake.set()
        if self.hub is not None and self._started and os.getpid() == self.pid:
            self._guarded(self._send_due, True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            left, self._queue = self._queue, []
        if left:
            self._withhold(left, "the worker stopped before the store answered it")
        if self._started:
            logger.info("background finishes: %d accepted, %d refused, %d withheld, in %d write(s); "
                        "%d rode with an acquire", self.accepted, self.refusals, self.withheld,
                        self.writes, self.carried)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._next_wait())
            if self._stop.is_set():
                break
            # Company for the first finish: its neighbours queued meanwhile share the write.
            self._stop.wait(self.gather)
            self._wake.clear()
            self._guarded(self._send_due, False)
        self._guarded(self._send_due, True)

    def _arm(self, delay: float) -> None:
        """On the solo pool's loop: send what is due after ``delay`` seconds (what the next
        acquire has not taken by then), once."""
        if not self._armed:
            self._armed = True
            self.hub.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._armed = False
        if self._stop.is_set():
            return
        if self.carrier is not None:
            self._guarded(lambda _: self.carrier.tick(), False)
        else:
            self._guarded(self._send_due, False)
        wait = self._next_wait()
        if wait is not None:
            self._arm(max(wait, self.gather))

    def _next_wait(self) -> float | None:
        """Seconds until the first finish waiting for its next copy is due; None: none queued
        (an ``add`` wakes the thread)."""
        with self._lock:
            if not self._queue:
                return None
            due = min(p.retry_at for p in self._queue)
        return max(0.0, due - self.clock())

    def _guarded(self, fn: Callable[[bool], None], stopping: bool) -> None:
        try:
            fn(stopping)
        except Exception:  # noqa: BLE001 - a bug here must be seen, and the thread go on
            logger.exception("background finishes: %s failed unexpectedly; retrying", fn.__name__)
            self._stop.wait(FIRST_DELAY)

    # -- the carrier's side (prefork: the acquirer's writes) -----------------------

    def due_alone(self) -> bool:
        """A finish waits for a write of its own: queued ``gather`` seconds ago (no
        acquire took it meanwhile), or due again after a write that got no answer."""
        now = self.clock()
        return any((p.retry_at or p.since + self.gather) <= now for p in self._queue)

    def take(self, riding: bool) -> list[Pending]:
        """The finishes due now, for the carrier's next write (``riding``: with acquires)."""
        batch = self._take(False)
        if batch:
            self.writes += 1
            if riding:
                self.carried += len(batch)
        return batch

    def settle(self, batch: list[Pending], answers: Any, sent_at: float) -> None:
        """The carrier's write of ``batch`` answered: each finish's answer, or the error of all."""
        self._settle(batch, answers, sent_at)

    def _take(self, stopping: bool) -> list[Pending]:
        """The queued finishes whose copy is due (at a stop: all of them), out of the queue."""
        now = self.clock()
        with self._lock:
            batch = [p for p in self._queue if stopping or p.retry_at <= now]
            if batch:
                self._queue = [p for p in self._queue if not (stopping or p.retry_at <= now)]
        return batch

    def _send_due(self, stopping: bool) -> None:
        """Send every queued finish whose copy is due, in one write. At a stop, everything
        queued goes once more, due or not."""
        batch = self._take(stopping)
        if not batch:
            return
        self.writes += 1
        sent_at = self.clock()
        try:
            answers: Any = self.store.finish_many([p.req for p in batch])
        except LeaseError as exc:
            answers = exc
        except Exception as exc:
            # A bug: these finishes are not left unreported (their leases expire and
            # recovery runs the tasks again); the traceback is logged by _guarded.
            self._withhold(batch, f"not sent: unexpected error {exc!r}")
            raise
        self._settle(batch, answers, sent_at)

    def _settle(self, batch: list[Pending], answers: Any, sent_at: float) -> None:
        """What a write of ``batch`` answered: each finish's answer, or the LeaseError of all."""
        if isinstance(answers, LeaseUnavailable):
            self.outage.failed(answers, f"{len(batch)} finish(es) not answered")
            self._again(batch, sent_at, answers)
            return
        if isinstance(answers, LeaseError):
            # One finish the server refuses to run (an error reply) fails the whole
            # pipelined batch: each goes alone, so that one fails by itself.
            if len(batch) > 1:
                for p in batch:
                    self._send_alone(p)
            else:
                self._answered(batch[0], answers)
            return
        self.outage.succeeded(f"{len(batch)} finish(es) answered")
        for p, answer in zip(batch, answers):
            self._answered(p, answer)

    def _send_alone(self, p: Pending) -> None:
        sent_at = self.clock()
        try:
            (answer,) = self.store.finish_many([p.req])
        except LeaseUnavailable as exc:
            self._again([p], sent_at, exc)
        except LeaseError as exc:
            self._answered(p, exc)
        except Exception as exc:  # a bug: reported, and logged by _guarded
            self._withhold([p], f"not sent: unexpected error {exc!r}")
            raise
        else:
            self._answered(p, answer)

    def _answered(self, p: Pending, answer: LeaseError | None) -> None:
        if answer is None:
            self.accepted += 1
            return
        self.refusals += 1
        p.report(answer)

    def _again(self, batch: list[Pending], sent_at: float, exc: BaseException) -> None:
        """No answer: each goes again after its backoff, unless a copy sent at or after its
        final moment went unanswered too (then no copy can apply any more: withheld)."""
        if self._stop.is_set():
            self._withhold(batch, f"no answer at shutdown: {exc}")
            return
        over = [p for p in batch if sent_at >= p.final]
        for p in batch:
            if sent_at < p.final:
                p.retry_at = min(sent_at + p.delay, p.final)
                p.delay = min(p.delay * 2, MAX_DELAY)
        with self._lock:
            self._queue.extend(p for p in batch if sent_at < p.final)
        if self.hub is not None and len(over) < len(batch):
            self._arm(max(self._next_wait() or 0.0, self.gather))
        if over:
            self._withhold(over, f"unconfirmed, store unreachable; no copy can apply any more: {exc}")

    def _withhold(self, batch: list[Pending], why: str) -> None:
        """No copy of these can apply any more: reported as refused (the lease, no longer
        renewed, expires and recovery runs the task again)."""
        self.withheld += len(batch)
        for p in batch:
            p.report(LeaseLost(p.req.task_id, p.req.token, f"withheld, {why}"))
