"""Isolation: a task whose blame is uncertain runs alone in a pool whose tasks share a process.

On threads, gevent and eventlet, a task that kills its process takes every task
running beside it down too, so the store cannot tell from such a death which
task caused it (``charge_death`` in the scripts' shared helpers): each of them is
charged an *uncertain* recovery, not a recovery, and its next runs are
isolated. An isolated run waits until nothing else runs in the worker, then
runs with nothing beside it: if it dies, the death is its own and counts; if
it ends, it is cleared. Isolation holds back the worker's other work while the
isolated task waits for the pool to drain and while it runs (docs/recovery.md).

This gate sits in front of the pool's ``apply_async``: every job of the worker,
leased or not, passes through it, so plain tasks are held back too. A job
held here counts as handed to the pool (it will run here), and Celery's
terminate of a held job drops it before it starts.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("celery_leases.worker")

__all__ = ["Isolation", "SHARED_PROCESS_POOLS", "shares_process"]

#: Pool modules whose tasks run in one process (a death there is shared by all of them).
SHARED_PROCESS_POOLS = ("celery.concurrency.thread", "celery.concurrency.gevent",
                        "celery.concurrency.eventlet")


def shares_process(pool: Any) -> bool:
    """True for a pool that runs more than one task at a time in one process."""
    return type(pool).__module__ in SHARED_PROCESS_POOLS and (getattr(pool, "limit", 1) or 1) > 1


@dataclass
class HeldJob:
    """A job the gate holds back: what ``apply_async`` was asked, until it is dispatched.

    Celery keeps a weak reference to what ``apply_async`` returned and calls its
    ``terminate`` on a revoke with terminate: a held job is then dropped.
    """

    task_id: str | None
    target: Callable[..., Any]
    args: Any
    kwargs: Any
    options: dict = field(default_factory=dict)
    dropped: bool = False

    def terminate(self, signal: Any = None) -> None:
        self.dropped = True


class Isolation:
    """The gate in front of one worker's shared-process pool.

    ``isolate(task_id)`` names a task to run alone (the store answered its acquire
    with ``isolate``); ``apply_async`` replaces the pool's own. Called from the
    consumer's thread (jobs in) and from the pool's threads or greenlets (jobs
    ending), so its state has one lock and nothing is dispatched while holding it.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._apply = pool.apply_async
        self._lock = threading.Lock()
        #: Task ids the store asked to run alone, until their job ends.
        self._suspects: set[str] = set()
        #: Jobs dispatched to the pool and not yet ended.
        self._running = 0
        #: The task id running alone now (nothing else is dispatched until it ends).
        self._alone: str | None = None
        #: Jobs held back, in the order they came.
        self._waiting: deque[HeldJob] = deque()
        #: Isolated runs so far (a counter for logs and tests).
        self.isolated = 0
        self._spawn = _spawner(pool)

    def install(self) -> None:
        """Put the gate in front of the pool. Before the consumer starts: Celery's
        per-task request classes take ``pool.apply_async`` when they are made."""
        self.pool.apply_async = self.apply_async

    def isolate(self, task_id: str) -> None:
        with self._lock:
            self._suspects.add(task_id)

    def holds(self, request: Any) -> bool:
        """True while ``request``'s job waits here (it will run in this worker)."""
        task_id = getattr(request, "id", None)
        with self._lock:
            return any(job.task_id == task_id and not job.dropped for job in self._waiting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def apply_async(self, target: Callable[..., Any], args: Any = None, kwargs: Any = None,
                    **options: Any) -> Any:
        """The pool's ``apply_async``: run now, or hold the job while a task runs alone
        or waits to (the job's own result, or its HeldJob)."""
        task_id = options.get("correlation_id")
        job = HeldJob(task_id, target, args, kwargs, options)
        with self._lock:
            now = not self._waiting and self._alone is None and (
                task_id not in self._suspects or self._running == 0)
            if now:
                self._start(job)
            else:
                self._waiting.append(job)
        if now:
            return self._dispatch(job)
        if task_id in self._suspects:
            logger.info("task %s: held until nothing else runs in this worker: an earlier death "
                        "of its worker is not known to be its own", task_id)
        return job

    def _start(self, job: HeldJob) -> None:
        """Count ``job`` as running (under the lock); it runs alone if it is a suspect."""
        self._running += 1
        if job.task_id is not None and job.task_id in self._suspects:
            self._alone = job.task_id
            self.isolated += 1

    def _dispatch(self, job: HeldJob) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return job.target(*args, **kwargs)
            finally:
                self._ended(job)
        try:
            return self._apply(run, job.args, job.kwargs, **job.options)
        except BaseException:
            self._ended(job)  # never started: the lease goes back at shutdown or by recovery
            raise

    def _ended(self, job: HeldJob) -> None:
        with self._lock:
            self._running -= 1
            if job.task_id is not None:
                self._suspects.discard(job.task_id)
                if self._alone == job.task_id:
                    self._alone = None
            ready = self._take_ready()
        if ready:
            self._spawn(self._dispatch_all, ready)

    def _take_ready(self) -> list[HeldJob]:
        """The held jobs that may start now, in order (under the lock)."""
        ready: list[HeldJob] = []
        while self._waiting and self._alone is None:
            job = self._waiting[0]
            if job.dropped:
                self._waiting.popleft()
                continue
            if job.task_id in self._suspects and self._running > 0:
                break  # it waits for the pool to drain; everything after it waits too
            self._waiting.popleft()
            self._start(job)
            ready.append(job)
        return ready

    def _dispatch_all(self, jobs: list[HeldJob]) -> None:
        for job in jobs:
            if job.dropped:
                self._ended(job)
                continue
            try:
                self._dispatch(job)
            except Exception as exc:  # noqa: BLE001 - the pool is closing: its lease goes back
                logger.error("task %s: held back for an isolated task, then not handed to the pool: "
                             "%r; its lease is released at shutdown or recovered after its ttl",
                             job.task_id, exc)


def _spawner(pool: Any) -> Callable[..., None]:
    """How held jobs are dispatched when a job ends. Threads: in the ending thread (the
    executor's submit never blocks). Green pools: in a greenlet of its own, since their
    spawn blocks while the pool is full, and the ending greenlet still holds its slot."""
    module = type(pool).__module__
    if module == "celery.concurrency.gevent":
        import gevent
        return lambda fn, *args: gevent.spawn(fn, *args) and None
    if module == "celery.concurrency.eventlet":
        import eventlet
        return lambda fn, *args: eventlet.spawn_n(fn, *args)
    return lambda fn, *args: fn(*args)
