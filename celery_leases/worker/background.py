"""Finishes nobody waits for, sent by a thread of their own, several in one write.

On the threads pool a task's finish is a round trip made from the worker's
own process, and the task waits for its answer before it returns.
For a task whose outcome nobody reads (its result not stored, and no
callback, errback, chain, chord or group waiting on it: ``LeasedTask``
decides) the answer changes nothing the worker does next: accepted or
refused, nothing of the outcome leaves the worker. Such a finish is queued
here and the task returns at once; this thread sends what is queued after
``GATHER`` seconds, in one write (``LeaseStore.finish_many``: one finish_many.lua call).

Unchanged: each finish carries its owner and token and is refused as a waited
one is (logged, ``stale_outcome_rejected``); one that gets no answer is sent
again with backoff until a copy has gone out after its not-after moment
(settle.py's rule: the store then answers for good), and is otherwise withheld,
so recovery runs the task again once its lease expires. A worker that dies
before its finishes land leaves their leases to expire and their tasks to run
again, as a death just after any body does. What differs: the record reads
``active`` until the write lands (``GATHER`` and a round trip after the body
ended), and a death in that window counts for the task as a death while it ran:
on a pool whose tasks share their process every death is an uncertain one
(isolation.py), so a task there is charged nothing it would not be charged
while running. An isolated run starts only once nothing is queued here
(``flush``), so its death stays its own alone.

Only there: on a pool of one task per process (prefork, solo, a threads pool of
one) a death is charged to the task that ran, and a finish still on its way
when the next task killed the process would charge that death to the task
before it. Those pools, and the green pools, keep waited finishes.
``leases_background_finishes = False`` turns this off.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable

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

#: The pools whose finishes may go out in the background (with more than one task at a
#: time in the process: isolation.shares_process).
POOLS = frozenset({"celery.concurrency.thread"})


class Pending:
    """One queued finish: the request (with its not-after), when a copy settles it for good
    (monotonic), and what reports a refusal (logged and signalled as a waited one's)."""

    __slots__ = ("req", "final", "report", "retry_at", "delay")

    def __init__(self, req: FinishRequest, final: float, report: Callable[[LeaseError], None]) -> None:
        self.req, self.final, self.report = req, final, report
        #: Monotonic time before which it is not sent again (after a write that got no answer).
        self.retry_at = 0.0
        self.delay = FIRST_DELAY


class BackgroundFinishes:
    """The queue of finishes nobody waits for, and the thread that sends them."""

    def __init__(self, store: LeaseStore, *, gather: float = GATHER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.gather, self.clock = store, gather, clock
        self.server = server_clock(store)
        self.pid = os.getpid()
        self._queue: list[Pending] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Finishes sent and accepted, refused, withheld; writes made.
        self.accepted = self.refusals = self.withheld = self.writes = 0
        self.outage = Outage(logger, "background finishes")

    # -- the tasks' side ------------------------------------------------------

    def add(self, task_id: str, owner: str, token: int, outcome: str, bound: float,
            report: Callable[[LeaseError], None]) -> bool:
        """Queue the finish of ``task_id`` (a terminal ``outcome``); False when its caller
        must finish and wait itself: another process (a prefork child), the thread not
        running, or no reading of the server's clock to bound its copies with. ``bound``:
        seconds its copies may apply (the lease's ttl, as a waited finish's); ``report``:
        called with the reason if it is refused or withheld."""
        if self._thread is None or self._stop.is_set() or os.getpid() != self.pid \
                or not self.server.fresh():
            return False
        not_after = self.server.upper_ms(self.clock()) + math.ceil(bound * 1000)
        pending = Pending(FinishRequest(task_id, owner, token, outcome, not_after=not_after),
                          self.server.past(not_after), report)
        with self._lock:
            self._queue.append(pending)
            first = len(self._queue) == 1
        if first:
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

    # -- the thread -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-leases-finishes", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool | None:
        """None before ``start()``; then whether the thread still runs (health.py)."""
        return None if self._thread is None else self._thread.is_alive()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """No more queueing; the thread sends what is queued, for up to ``timeout`` seconds,
        then stops; what is still unsent is withheld (logged), and recovery runs those
        tasks again once their leases expire."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            left, self._queue = self._queue, []
        if left:
            self._withhold(left, "the worker stopped before the store answered it")

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

    def _send_due(self, stopping: bool) -> None:
        """Send every queued finish whose copy is due, in one write. At a stop, everything
        queued goes once more, due or not."""
        now = self.clock()
        with self._lock:
            batch = [p for p in self._queue if stopping or p.retry_at <= now]
            if not batch:
                return
            self._queue = [p for p in self._queue if not (stopping or p.retry_at <= now)]
        self.writes += 1
        sent_at = self.clock()
        try:
            answers = self.store.finish_many([p.req for p in batch])
        except LeaseUnavailable as exc:
            self.outage.failed(exc, f"{len(batch)} finish(es) not answered")
            self._again(batch, sent_at, exc)
            return
        except LeaseError as exc:
            # One finish the server refuses to run (an error reply) fails the whole
            # pipelined batch: each goes alone, so that one fails by itself.
            if len(batch) > 1:
                for p in batch:
                    self._send_alone(p)
            else:
                self._answered(batch[0], exc)
            return
        except Exception as exc:
            # A bug: these finishes are not left unreported (their leases expire and
            # recovery runs the tasks again); the traceback is logged by _guarded.
            self._withhold(batch, f"not sent: unexpected error {exc!r}")
            raise
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
        if over:
            self._withhold(over, f"unconfirmed, store unreachable; no copy can apply any more: {exc}")

    def _withhold(self, batch: list[Pending], why: str) -> None:
        """No copy of these can apply any more: reported as refused (the lease, no longer
        renewed, expires and recovery runs the task again)."""
        self.withheld += len(batch)
        for p in batch:
            p.report(LeaseLost(p.req.task_id, p.req.token, f"withheld, {why}"))
