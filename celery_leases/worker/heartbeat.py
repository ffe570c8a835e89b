"""The heartbeat: one thread in the worker's main process renewing every held lease.

One ``renew_many`` call per tick covers all leases the worker holds, whatever
their number (one call per distinct ttl / progress-timeout class, in practice
one; with leases_shards above 1 it makes one script call per shard, pipelined).
A thread (not the event loop's timer) because the solo pool blocks the loop
while a task runs; a CPU-bound prefork child cannot starve it
either, since it lives in the main process. A failing tick is counted and
retried on the next one (an outage is logged when it starts and when it ends):
the thread never dies quietly.

The same thread sends the start marks (``LeaseStore.mark_started``): when the
pool starts a task, the mark is queued here and sent within
``START_MARK_DELAY``, several in one call; a task that finishes first needs
no mark at all, so a short task costs no extra call. Where the worker's
acquirer runs (acquirer.py), a mark that has waited its delay rides along
with the next acquire the acquirer sends (``take_due_starts``) instead, and
the thread sends only what no acquire took within ``START_MARK_FALLBACK``.
A tick never sends marks: it is one renewal call whatever else is queued.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..protocol.codes import Code
from ..protocol.store import LeaseStore
from ..signals import heartbeat_ticked, leases_renewed
from .loop import LOOP_STALL_FLOOR, LOOP_WEDGED_AFTER, LoopWatch, may_start_without_loop
from ..outage import Outage

logger = logging.getLogger("celery_leases.heartbeat")

#: Seconds a start mark waits to share its call with others, and for the task to
#: end first (it then needs none): at 5 ms the overhead benchmark's no-op tasks
#: still sent ~0.15 mark calls per task, at 25 ms ~0.04. Not longer, since a body
#: that kills its worker before its mark is in Redis costs its task only an
#: unstarted recovery (bounded apart, docs/recovery.md).
START_MARK_DELAY = 0.025
#: Where acquires carry the marks (``carry_marks``), seconds a mark waits before the
#: thread sends it in a call of its own: an idle worker's marks still go out promptly.
START_MARK_FALLBACK = 2 * START_MARK_DELAY


@dataclass
class Held:
    """A lease this worker holds."""

    token: int
    request: Any = None
    interval: float = 10.0
    ttl: float = 30.0
    #: True when the task has a progress timeout the renewal must enforce.
    progress: bool = False
    lost: bool = False
    #: True once the pool started the task (its start mark is then queued or sent).
    started: bool = False
    #: Monotonic time until which the lease is known to live (its last renewal or
    #: acquisition, sent at or after that time minus the ttl); 0 when unknown.
    live_until: float = 0.0


class HeldLeases(dict):
    """The leases this worker holds (task id -> Held), with the lock that guards them.

    The heartbeat's thread, the event loop and the pool's threads all read and change
    them: every reader outside heartbeat.py takes a ``snapshot`` (or ``select``), which
    holds the lock, instead of the lock itself. A plain ``get`` of one entry needs none.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def snapshot(self) -> list[tuple[str, Held]]:
        """Every (task id, Held), as they are now."""
        with self.lock:
            return list(self.items())

    def select(self, keep: Callable[[Held], bool]) -> dict[str, int]:
        """Task id -> token of the held leases ``keep`` says yes to."""
        with self.lock:
            return {task_id: held.token for task_id, held in self.items() if keep(held)}


class Heartbeat:
    def __init__(self, store: LeaseStore, owner: str, interval: float,
                 on_lost: Callable[[str, Held, Code], None], sender: Any = None,
                 on_missing: Callable[[str, Held], bool] | None = None,
                 loop: LoopWatch | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.owner = store, owner
        #: Monotonic seconds (``time.monotonic``; a test drives its own): mark delays, tick
        #: timing, and how long a lease is known to live (compared with time.monotonic()).
        self.clock = clock
        #: Sender of the ``leases_renewed`` signal (the worker's app).
        self.sender = sender
        self.default_interval = interval
        self.on_lost = on_lost
        #: Asked first when a held lease's record is missing; True if it put the record back.
        self.on_missing = on_missing
        #: The leases held, and their lock (which also guards the start marks below).
        self.held = HeldLeases()
        self.lock = self.held.lock
        self.ticks = self.failures = self.consecutive_failures = 0
        self.last_renewed_at: float | None = None
        self.outage = Outage(logger, "lease heartbeat")
        #: Start marks waiting to be sent: task id -> (token, monotonic time it was queued).
        self._starts: dict[str, tuple[int, float]] = {}
        #: Seconds a mark waits for the thread to send it (START_MARK_FALLBACK once
        #: acquires carry the marks).
        self.mark_wait = START_MARK_DELAY
        #: Marks sent with an acquire (take_due_starts) rather than by the thread.
        self.starts_carried = 0
        #: True from the wake-up for a start mark until the thread takes the marks: later
        #: starts then need no wake-up of their own (an Event.set per task is not free).
        self._starts_due = False
        self.start_calls = 0
        self._start_outage = Outage(logger, "lease start marks")
        #: The event loop's watch (loop.py), or None where there is no loop to watch: leases
        #: whose task only the loop can start are renewed only while it goes round.
        self.loop = loop
        #: Leases left unrenewed at the last tick because the loop stalled (logged once per stall).
        self.unrenewed_for_loop = 0
        #: The longest stall seen while the loop counts as wedged (LOOP_WEDGED_AFTER), else 0.
        self.loop_wedged_for = 0.0
        #: Set by add() when a new lease needs a renewal sooner than the current wait.
        self._retick = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: How long the thread's current wait lasts (the interval it computed before sleeping).
        self._sleeping_for = interval
        #: When the thread's current tick is due (monotonic): mark sends wait no longer.
        self._tick_due = 0.0
        self._thread: threading.Thread | None = None

    # -- registry ---------------------------------------------------------

    def add(self, task_id: str, held: Held) -> None:
        with self.lock:
            self.held[task_id] = held
        # Wake the thread only if it sleeps longer than this lease allows (a
        # check in O(1): add runs for every task the worker receives).
        if held.interval < self._sleeping_for:
            self._retick = True
            self._wake.set()

    def started(self, task_id: str, token: int) -> None:
        """The pool started this lease's task: queue its start mark (sent by the thread)."""
        with self.lock:
            held = self.held.get(task_id)
            if held is None or held.token != token or held.started:
                return
            held.started = True
            self._starts[task_id] = (token, self.clock())
            if self._starts_due:  # the thread is already on its way for the others
                return
            self._starts_due = True
        self._wake.set()

    def carry_marks(self) -> None:
        """Acquires carry the marks from now on: the thread sends only those left behind."""
        self.mark_wait = START_MARK_FALLBACK

    def take_due_starts(self) -> dict[str, int]:
        """The marks that have waited ``START_MARK_DELAY``, taken to ride along with an
        acquire (acquire_many): task id -> token. A task that ends within the delay
        still needs no mark."""
        if not self._starts:  # the common case, without the lock
            return {}
        now = self.clock()
        with self.lock:
            due = {task_id: token for task_id, (token, at) in self._starts.items()
                   if now - at >= START_MARK_DELAY}
            for task_id in due:
                del self._starts[task_id]
        self.starts_carried += len(due)
        return due

    def give_back_starts(self, starts: dict[str, int]) -> None:
        """Marks an acquire took but could not deliver: queued again, due at once, for
        the leases still held (the thread sends them)."""
        with self.lock:
            for task_id, token in starts.items():
                held = self.held.get(task_id)
                if held is not None and held.token == token:
                    self._starts.setdefault(task_id, (token, 0.0))
            self._starts_due = True
        self._wake.set()

    def live_until(self, task_id: str, token: int) -> float | None:
        """Monotonic time until which this lease is known to live; None if it is lost or not held."""
        held = self.held.get(task_id)
        if held is None or held.token != token or held.lost:
            return None
        return held.live_until

    def forget(self, task_id: str, token: int | None = None) -> Held | None:
        """Stop renewing ``task_id``; with ``token``, only if the held lease is that one.

        Another delivery of the same task id (a refused duplicate) must not
        stop the renewal of the owner's lease.
        """
        with self.lock:
            held = self.held.get(task_id)
            if held is None or (token is not None and held.token != token):
                return None
            # A task that ended before its start mark went out needs none.
            self._starts.pop(task_id, None)
            return self.held.pop(task_id)

    def is_lost(self, task_id: str, token: int) -> bool:
        held = self.held.get(task_id)
        return held is None or held.token != token or held.lost

    @property
    def interval(self) -> float:
        """The shortest heartbeat interval any held lease asks for."""
        with self.lock:
            intervals = [h.interval for h in self.held.values()]
        return min([self.default_interval, *intervals])

    # -- thread -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-leases-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool | None:
        """None before ``start()``; then whether the renewal thread still runs (health.py)."""
        if self._thread is None:
            return None
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sleeping_for = self.interval
            due = self.clock() + self._sleeping_for
            # Wake-ups for start marks send them and go back to sleep until the tick is due.
            self._tick_due = due
            while True:
                # Marks first: those a tick left queued are sent after it, not by it, so
                # that a tick is one call at any load.
                if self._starts or self._starts_due:
                    self._guarded(self._send_starts_when_due)
                if self._retick or self.clock() >= due:
                    self._retick = False
                    break
                self._wake.wait(max(0.0, due - self.clock()))
                self._wake.clear()
                if self._stop.is_set():
                    return
            self._guarded(self.tick)

    def _guarded(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a bug here must be seen, and the beat go on
            self.failures += 1
            logger.exception("lease heartbeat: %s failed unexpectedly; retrying", fn.__name__)

    def _send_starts_when_due(self) -> None:
        """Send every queued mark once the oldest has waited ``mark_wait`` (those an
        acquire carried meanwhile are gone from the queue); back in time for the tick,
        which sends what is still queued."""
        tick_due = self._tick_due
        while not self._stop.is_set() and not self._retick:
            with self.lock:
                if not self._starts:
                    self._starts_due = False
                    return
                oldest = min(at for _, at in self._starts.values())
            now = self.clock()
            if now >= oldest + self.mark_wait:
                self.send_starts()
                return
            if now >= tick_due:
                return
            self._stop.wait(min(oldest + self.mark_wait, tick_due) - now)

    def send_starts(self) -> int:
        """Send the queued start marks in one call; on failure they wait for the next try."""
        with self.lock:
            starts, self._starts = self._starts, {}
            self._starts_due = False
        if not starts:
            return 0
        try:
            marked = self.store.mark_started(self.owner, {t: token for t, (token, _) in starts.items()})
        except Exception as exc:  # noqa: BLE001 - counted, logged once per outage, sent again
            with self.lock:
                for task_id, queued in starts.items():
                    held = self.held.get(task_id)
                    if held is not None and held.token == queued[0]:
                        self._starts.setdefault(task_id, queued)
            self._start_outage.failed(exc, f"{len(starts)} lease(s)")
            return 0
        self.start_calls += 1
        self._start_outage.succeeded()
        return marked

    def _loop_stall(self, stalled: float, waiting: int) -> None:
        if stalled > LOOP_WEDGED_AFTER:
            if not self.loop_wedged_for:
                logger.warning("celery-leases: the worker's event loop has not run for %.1fs: this worker "
                               "receives, starts and acknowledges no message until it does (a broker "
                               "connection that hangs, or a wedged main thread; SIGUSR1 logs every "
                               "thread's stack)", stalled)
            self.loop_wedged_for = max(self.loop_wedged_for, stalled)
        elif self.loop_wedged_for:
            logger.warning("celery-leases: the worker's event loop runs again after a stall of at "
                           "least %.1fs", self.loop_wedged_for)
            self.loop_wedged_for = 0.0
        if waiting and not self.unrenewed_for_loop:
            logger.warning("celery-leases: the worker's event loop has not run for %.1fs: %d lease(s) of "
                           "tasks it has not started are no longer renewed, so that other workers take "
                           "them over once they expire", stalled, waiting)
        elif not waiting and self.unrenewed_for_loop:
            logger.warning("celery-leases: the worker's event loop runs again; leases of tasks it has "
                           "not started are renewed again (those taken over meanwhile will not start here)")
        self.unrenewed_for_loop = waiting

    def tick(self) -> dict[str, Code]:
        """Renew every held lease in one call; hand the lost ones to ``on_lost``."""
        groups: dict[tuple, dict[str, int]] = {}
        stalled = self.loop.stalled_for() if self.loop is not None else 0.0
        waiting = 0
        with self.lock:
            for task_id, h in self.held.items():
                if h.lost:
                    continue
                if stalled > max(h.ttl, LOOP_STALL_FLOOR) and not h.started \
                        and not may_start_without_loop(h.request):
                    waiting += 1  # only the stalled loop could start it: left to expire (loop.py)
                    continue
                groups.setdefault((h.ttl, h.progress), {})[task_id] = h.token
        self._loop_stall(stalled, waiting)
        if not groups:
            heartbeat_ticked.send(sender=self.sender, owner=self.owner, held=0, seconds=None, failed=False)
            return {}
        self.ticks += 1
        snapshot = {task_id: token for leases in groups.values() for task_id, token in leases.items()}
        sent_at = self.clock()
        try:
            not_renewed: dict[str, Code] = {}
            for (ttl, progress), leases in groups.items():
                not_renewed.update(self.store.renew_many(self.owner, leases, ttl=ttl,
                                                         check_progress=progress))
        except Exception as exc:  # noqa: BLE001 - counted, logged once per outage, retried next tick
            self.failures += 1
            self.consecutive_failures += 1
            self.outage.failed(exc, f"{len(snapshot)} lease(s) not renewed")
            heartbeat_ticked.send(sender=self.sender, owner=self.owner, held=len(snapshot),
                                  seconds=self.clock() - sent_at, failed=True)
            return {}
        heartbeat_ticked.send(sender=self.sender, owner=self.owner, held=len(snapshot),
                              seconds=self.clock() - sent_at, failed=False)
        self.outage.succeeded(f"{len(snapshot)} lease(s) renewed")
        self.consecutive_failures = 0
        self.last_renewed_at = self.clock()
        with self.lock:
            for task_id, token in snapshot.items():
                held = self.held.get(task_id)
                if held is not None and held.token == token and task_id not in not_renewed:
                    held.live_until = sent_at + held.ttl
        leases_renewed.send(sender=self.sender, owner=self.owner,
                            renewed=len(snapshot) - len(not_renewed), not_renewed=len(not_renewed))
        for task_id, code in not_renewed.items():
            if code is Code.FINISHED:
                self.forget(task_id)
                continue
            if code is Code.MISSING and self.on_missing is not None:
                with self.lock:
                    held = self.held.get(task_id)
                if held is not None and held.token == snapshot[task_id] and self.on_missing(task_id, held):
                    continue
            with self.lock:
                held = self.held.get(task_id)
                if held is None or held.token != snapshot[task_id]:
                    continue
                held.lost = True
            self.on_lost(task_id, held, code)
        return not_renewed
