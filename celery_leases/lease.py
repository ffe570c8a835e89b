"""``self.lease``: a running task's handle on its own lease."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .exceptions import LeaseLost, LeaseUnavailable

if TYPE_CHECKING:
    from .store import LeaseStore

logger = logging.getLogger("celery_leases.task")


class Lease:
    """The lease one execution of a task holds.

    ``token`` is the fencing token to hand to downstream writes. ``lost``
    becomes True once the worker or a check learns that another owner took
    over; ``check()`` asks the store now and raises LeaseLost.
    """

    __slots__ = ("task_id", "owner", "token", "generation", "store", "_lost", "_checked_at",
                 "_check_every", "_beat_at", "_beat_every", "_local_lost")

    def __init__(self, task_id: str, owner: str, token: int, generation: int,
                 store: "LeaseStore", *, check_every: float = 1.0, beat_every: float = 0.0,
                 local_lost=None) -> None:
        self.task_id, self.owner, self.token, self.generation = task_id, owner, token, generation
        self.store = store
        self._lost = False
        self._checked_at = time.monotonic()
        self._check_every = check_every
        self._beat_at = 0.0
        self._beat_every = beat_every
        #: In threads/solo pools the heartbeat lives in this process and flags losses here.
        self._local_lost = local_lost

    @property
    def held(self) -> bool:
        return True

    @property
    def lost(self) -> bool:
        """True once this execution is known to have lost its lease (cheap; cached)."""
        if self._lost:
            return True
        if self._local_lost is not None:
            if self._local_lost(self.task_id, self.token):
                self._lost = True
            return self._lost
        now = time.monotonic()
        if now - self._checked_at >= self._check_every:
            self._checked_at = now
            try:
                self.store.check(self.task_id, self.owner, self.token)
            except LeaseLost:
                self._lost = True
            except LeaseUnavailable as exc:
                logger.warning("task %s: cannot reach the lease store to check its lease: %s",
                               self.task_id, exc)
        return self._lost

    def check(self) -> None:
        """Raise LeaseLost unless this execution still owns the lease (asks the store)."""
        if self._lost:
            raise LeaseLost(self.task_id, self.token)
        try:
            self.store.check(self.task_id, self.owner, self.token)
        except LeaseLost:
            self._lost = True
            raise
        self._checked_at = time.monotonic()

    def heartbeat(self) -> None:
        """Report progress (needed when a progress timeout is set); raises LeaseLost when lost.

        Calls closer together than a tenth of the progress timeout are folded
        into one, so a tight loop may call this freely.
        """
        now = time.monotonic()
        if now - self._beat_at < self._beat_every:
            if self._lost:
                raise LeaseLost(self.task_id, self.token)
            return
        try:
            self.store.progress(self.task_id, self.owner, self.token)
        except LeaseLost:
            self._lost = True
            raise
        self._beat_at = now

    def __repr__(self) -> str:
        return f"<Lease {self.task_id} token={self.token} owner={self.owner}{' LOST' if self._lost else ''}>"


class DetachedLease:
    """``self.lease`` of an execution without a lease (eager mode, ``apply()``, direct calls).

    Nothing is fenced there: ``token`` is None, ``check()`` and ``heartbeat()`` do nothing.
    """

    task_id = owner = token = generation = None
    lost = False
    held = False

    def check(self) -> None:
        return None

    def heartbeat(self) -> None:
        return None

    def __repr__(self) -> str:
        return "<DetachedLease (no lease: eager or direct call)>"


DETACHED = DetachedLease()
