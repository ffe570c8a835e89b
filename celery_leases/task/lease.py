"""``self.lease``: a running task's handle on its own lease."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..exceptions import CorruptRecord, LeaseLost, LeaseUnavailable

if TYPE_CHECKING:
    from ..protocol.store import LeaseStore

logger = logging.getLogger("celery_leases.task")

T = TypeVar("T")


class Lease:
    """The lease one execution of a task holds.

    ``token`` is the fencing token to hand to downstream writes. ``lost``
    becomes True once the worker or a check learns that another owner took
    over; ``check()`` asks the store now and raises LeaseLost.
    """

    __slots__ = ("task_id", "owner", "token", "generation", "store", "handed_over", "_lost",
                 "_checked_at", "_check_every", "_beat_at", "_beat_every", "_local_lost")

    def __init__(self, task_id: str, owner: str, token: int, generation: int,
                 store: "LeaseStore", *, check_every: float = 1.0, beat_every: float = 0.0,
                 local_lost=None) -> None:
        self.task_id, self.owner, self.token, self.generation = task_id, owner, token, generation
        self.store = store
        #: True once this execution handed the lease on (retry, replace): the
        #: next attempt owns it, and this execution's own outcome writes nothing.
        #: Kept here, not on the request: Celery copies the request per call.
        self.handed_over = False
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
            except CorruptRecord as exc:
                # Ownership cannot be confirmed from a corrupt record: fail closed (check() raises it).
                logger.error("task %s: its lease record is corrupt, the lease counts as lost: %s",
                             self.task_id, exc)
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

    def once(self, step: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T | None:
        """Run ``fn(*args, **kwargs)`` unless ``step`` is already done for this task id.

        Returns fn's result, or None when an earlier execution of this task id
        (this owner or one before a recovery) already completed the step. After
        fn returns, the step is recorded atomically, and only while this
        execution still owns the lease: raises LeaseLost (and fn's effect is
        not recorded) when the lease was lost, before fn runs or while it ran.
        If fn raises, nothing is recorded and the exception propagates.

        A crash between fn returning and the record being written makes the
        step run again on the next owner, so fn should pass an idempotency
        key (``celery_leases.idempotency_key(task_id, step)``) to whatever it
        calls. See docs/fencing.md.
        """
        _check_step_name(step)
        self.check()  # a known-stale owner starts no side effect
        done = self.store.completed_steps(self.task_id)
        if step in done:
            logger.info("task %s: step %r already done (token %s), skipped", self.task_id, step, done[step])
            return None
        result = fn(*args, **kwargs)
        try:
            recorded = self.store.complete_step(self.task_id, self.owner, self.token, step)
        except LeaseLost:
            self._lost = True
            logger.warning("task %s: step %r ran under token %s but the lease was lost; "
                           "not recorded", self.task_id, step, self.token)
            raise
        if not recorded:
            logger.warning("task %s: step %r was recorded by another call meanwhile", self.task_id, step)
        return result

    def __repr__(self) -> str:
        return f"<Lease {self.task_id} token={self.token} owner={self.owner}{' LOST' if self._lost else ''}>"


class DetachedLease:
    """``self.lease`` of an execution without a lease (eager mode, ``apply()``, direct calls).

    Nothing is fenced there: ``token`` is None, ``check()`` and ``heartbeat()`` do nothing.
    """

    task_id = owner = token = generation = None
    lost = False
    held = False
    handed_over = False

    def check(self) -> None:
        return None

    def heartbeat(self) -> None:
        return None

    def once(self, step: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T | None:
        """Run ``fn(*args, **kwargs)`` and return its result: without a lease nothing is recorded."""
        _check_step_name(step)
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return "<DetachedLease (no lease: eager or direct call)>"


DETACHED = DetachedLease()


def _check_step_name(step: Any) -> None:
    if not isinstance(step, str) or not step:
        raise ValueError(f"once(): the step name must be a non-empty string, got {step!r}")
