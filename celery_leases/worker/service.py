"""The leases of one worker process: its lifecycle and the leases it holds.

Protocol decisions live in the store and its scripts; the worker wiring only
decides *when* to call them. ``LeaseWorker`` is built by ``LeaseStep``
(steps.py) and puts together the services that do each job:

- receipt.py: acquire when the worker receives the message (main process);
- heartbeat.py: renew every held lease from one thread (started by ``HeartbeatStep``);
- background.py, finishing.py: the finishes nobody waits for, and which pool sends
  them how (a thread on threads, the next acquire on solo, the main process's
  acquires on prefork);
- lost.py: a held lease whose record went missing, or that was lost;
- revokes.py: every Celery revoke reaches the lease;
- recovery/fallback.py: recovery passes without beat (started by ``RecoveryStep``);
- isolation.py: on a shared-process pool, a task of uncertain blame runs alone;
- dropped.py: which requests a consumer restart dropped.

This module keeps what is left: start and stop, the per-task settings, and
the held leases: released at once when the consumer drops its requests, when
a pool child dies, or when the worker shuts down warmly.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Collection

from .checks import run_checks
from .dropped import DroppedRequests
from ..protocol.clock import server_clock
from ..config import LeaseConfig
from ..exceptions import LeaseError
from ..runtime import get_store
from ..protocol.scripts import scripts
from .finishing import before_each_body, for_pool
from .heartbeat import Heartbeat
from .isolation import Isolation
from .lost import LostLeases
from .receipt import Receipt
from .revokes import Revoker
from .startup import wait_for_store

if TYPE_CHECKING:
    from .loop import LoopWatch

logger = logging.getLogger("celery_leases.worker")

__all__ = ["LeaseWorker"]


class LeaseWorker:
    """The leases of one worker process: acquire, heartbeat, release, revoke."""

    def __init__(self, app: Any, config: LeaseConfig, pool: Any = None, hostname: str | None = None,
                 hub: Any = None, quick_release: Any = None, prefork: bool = False,
                 loop: LoopWatch | None = None, isolation: Isolation | None = None) -> None:
        self.app, self.config, self.pool = app, config, pool
        self.owner = f"{hostname or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.store = get_store(app)
        #: The store's clock, for the ETA of re-queued copies.
        self.clock = server_clock(self.store)
        self._task_configs: dict[str, LeaseConfig] = {}
        self.lost = LostLeases(app, config, self.store, self.owner, self.task_config)
        self.heartbeat = Heartbeat(self.store, self.owner, config.heartbeat_interval, self.lost.on_lost,
                                   sender=app, on_missing=self.lost.on_missing, loop=loop)
        self.receipt = Receipt(app, config, self.store, self.owner, self.heartbeat, self.clock,
                               task_config=self.task_config, release=self.release, pool=pool, hub=hub,
                               quick_release=quick_release, prefork=prefork, isolation=isolation)
        self.revokes = Revoker(app, config, self.store, self.owner, self.heartbeat)
        self.dropped = DroppedRequests(lambda: [h.request for _, h in self.heartbeat.held.snapshot()])
        #: Unread successes' finishes nobody waits for (background.py): sent by a thread where
        #: tasks share this process's threads; on the solo pool, riding with the next acquire.
        self.finishes = for_pool(self.store, pool, loop, self.receipt.acquirer) \
            if config.background_finishes else None
        if self.finishes is not None and self.finishes.hub is not None:
            self.receipt.carry(self.finishes)

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Wait for the store, load the scripts, run the checks, gate the revokes.

        The heartbeat and the fallback recovery have steps of their own (steps.py).
        """
        # Wait for the lease store like Celery waits for its broker at start;
        # past the retries this raises LeaseUnavailable naming leases_redis_url.
        # The first reading of its clock, too (re-queue ETAs, a finish's not-after: clock.py).
        wait_for_store(self.app, self.clock.read)
        # Scripts are read once, here: the pool processes inherit them, and a
        # package upgraded on disk under a running worker cannot mix versions.
        scripts.load_all()
        run_checks(self.app, self.config, self.store)  # logged at their severity; never stops the worker
        self.revokes.gate()
        if self.finishes is not None:
            self.finishes.start()
            if self.finishes.hub is not None and self.finishes.carrier is None:
                before_each_body(self.pool, self.finishes)
        logger.info("celery-leases: worker %s renews leases every %.1fs (ttl %.1fs)",
                    self.owner, self.config.heartbeat_interval, self.config.ttl)

    def stop(self) -> None:
        """Release what is still held and stop the heartbeat.

        The start marks of the tasks the pool started ride with the release, and
        each record decides whether its release costs a recovery (release.lua):
        prefetched tasks cost none, tasks a cold shutdown cut short cost one.
        """
        self.revokes.stop()
        self.receipt.stop()
        if self.finishes is not None:  # the pool is gone: its last finishes go out first
            self.finishes.stop()
        held = [(task_id, h) for task_id, h in self.heartbeat.held.snapshot() if not h.lost]
        if held:
            leases = {task_id: h.token for task_id, h in held}
            try:
                n = self.store.release(self.owner, leases, started={t for t, h in held if h.started})
                logger.info("celery-leases: released %d lease(s) at shutdown", n)
            except LeaseError as exc:
                logger.error("celery-leases: could not release %d lease(s) at shutdown; they will "
                             "be recovered after their ttl: %s", len(leases), exc)
        self.heartbeat.stop()

    def task_config(self, task: Any) -> LeaseConfig:
        """``task``'s settings (task attribute > app.conf > default), built once per task name."""
        config = self._task_configs.get(task.name)
        if config is None:
            config = self._task_configs[task.name] = self.config.for_task(task)
        return config

    # -- held leases ------------------------------------------------------

    def forget(self, task_id: str, token: int | None = None) -> None:
        self.heartbeat.forget(task_id, token)

    def is_lost(self, task_id: str, token: int) -> bool:
        return self.heartbeat.is_lost(task_id, token)

    def started(self, task_id: str, token: int) -> None:
        """The pool started the task: its lease now counts a recovery if this worker dies."""
        self.heartbeat.started(task_id, token)

    def live_until(self, task_id: str, token: int) -> float | None:
        """Monotonic time until which the lease is known to live (None: lost or not held)."""
        return self.heartbeat.live_until(task_id, token)

    def release_dropped(self) -> int:
        """Release the leases of requests the consumer dropped without running them
        (dropped.py): they will never finish here, and their messages come back."""
        self.receipt.drop_pending()
        try:
            rule = self.dropped.rule()
            dropped = self.heartbeat.held.select(lambda held: rule(held.request))
        finally:
            self.dropped.settled()
        if not dropped:
            return 0
        released = self.release(dropped)
        logger.info("celery-leases: released %d lease(s) of requests the consumer dropped "
                    "(broker reconnect or shutdown)", released)
        return released

    def release(self, leases: dict, started: Collection[str] = ()) -> int:
        """Give ``leases`` (task id -> token) back now: no longer renewed, free for the next owner.

        Whether that costs a recovery is the record's to say (release.lua); the start
        marks still waiting in the heartbeat ride along, and ``started`` adds the tasks
        the caller knows started (a pool process died running it).
        """
        marks = set(started)
        for task_id, token in leases.items():
            held = self.heartbeat.forget(task_id, token)
            if held is not None and held.started:
                marks.add(task_id)
        try:
            return self.store.release(self.owner, leases, started=marks)
        except LeaseError as exc:
            logger.error("could not release lease(s) %s; recovery will take them after the ttl: %s",
                         ", ".join(leases), exc)
            return 0
