"""The heartbeat: one thread in the worker's main process renewing every held lease.

One ``renew_many`` call per tick covers all leases the worker holds, whatever
their number (one call per distinct ttl / progress-timeout class, in practice
one; with leases_shards above 1 it makes one script call per shard, pipelined).
A thread (not the event loop's timer) because the solo pool blocks the loop
while a task runs; a CPU-bound prefork child cannot starve it
either, since it lives in the main process. A failing tick is logged, counted
and retried on the next one: the thread never dies quietly.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .codes import Code
from .signals import leases_renewed
from .store import LeaseStore

logger = logging.getLogger("celery_leases.heartbeat")


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


class Heartbeat:
    def __init__(self, store: LeaseStore, owner: str, interval: float,
                 on_lost: Callable[[str, Held, Code], None], sender: Any = None,
                 on_missing: Callable[[str, Held], bool] | None = None) -> None:
        self.store, self.owner = store, owner
        #: Sender of the ``leases_renewed`` signal (the worker's app).
        self.sender = sender
        self.default_interval = interval
        self.on_lost = on_lost
        #: Asked first when a held lease's record is missing; True if it put the record back.
        self.on_missing = on_missing
        self.held: dict[str, Held] = {}
        self.lock = threading.Lock()
        self.ticks = self.failures = self.consecutive_failures = 0
        self.last_renewed_at: float | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: How long the thread's current wait lasts (the interval it computed before sleeping).
        self._sleeping_for = interval
        self._thread: threading.Thread | None = None

    # -- registry ---------------------------------------------------------

    def add(self, task_id: str, held: Held) -> None:
        with self.lock:
            self.held[task_id] = held
        # Wake the thread only if it sleeps longer than this lease allows (a
        # check in O(1): add runs for every task the worker receives).
        if held.interval < self._sleeping_for:
            self._wake.set()

    def forget(self, task_id: str, token: int | None = None) -> Held | None:
        """Stop renewing ``task_id``; with ``token``, only if the held lease is that one.

        Another delivery of the same task id (a refused duplicate) must not
        stop the renewal of the owner's lease.
        """
        with self.lock:
            held = self.held.get(task_id)
            if held is None or (token is not None and held.token != token):
                return None
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

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sleeping_for = self.interval
            self._wake.wait(self._sleeping_for)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug here must be seen, and the beat go on
                self.failures += 1
                logger.exception("lease heartbeat tick failed unexpectedly; retrying next tick")

    def tick(self) -> dict[str, Code]:
        """Renew every held lease in one call; hand the lost ones to ``on_lost``."""
        groups: dict[tuple, dict[str, int]] = {}
        with self.lock:
            for task_id, h in self.held.items():
                if not h.lost:
                    groups.setdefault((h.ttl, h.progress), {})[task_id] = h.token
        if not groups:
            return {}
        self.ticks += 1
        snapshot = {task_id: token for leases in groups.values() for task_id, token in leases.items()}
        try:
            not_renewed: dict[str, Code] = {}
            for (ttl, progress), leases in groups.items():
                not_renewed.update(self.store.renew_many(self.owner, leases, ttl=ttl,
                                                         check_progress=progress))
        except Exception as exc:  # noqa: BLE001 - counted, logged, retried next tick
            self.failures += 1
            self.consecutive_failures += 1
            logger.error("lease heartbeat could not renew %d lease(s) (%d failure(s) in a row): %s",
                         len(snapshot), self.consecutive_failures, exc)
            return {}
        if self.consecutive_failures:
            logger.warning("lease heartbeat recovered after %d failed tick(s)", self.consecutive_failures)
        self.consecutive_failures = 0
        self.last_renewed_at = time.monotonic()
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
