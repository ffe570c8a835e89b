"""Whether the worker's event loop still goes round, for the heartbeat's renewals.

The heartbeat is a thread of its own, so that neither a body running in the loop
(solo) nor a CPU-bound pool child can starve it. The other side of that: a main
thread that is wedged (a deadlock, a call that never returns) would leave the
heartbeat renewing, for ever, the leases of prefetched and ETA-held tasks that
only the loop can start. So a lease whose task only the loop can start is renewed
only while the loop went round within the lease's ttl (and at least
``LOOP_STALL_FLOOR`` seconds); past that it is left to expire, and recovery
gives the task to another worker (docs/recovery.md). A task
that may start without the loop (already started, given to a pool thread, or
written to a prefork child) keeps its renewals whatever the loop does: the loop
may not even have seen it start. Should the loop come back, such a request is
refused at its start by the check before start (task/leased.py), since its lease was not
renewed.
"""
from __future__ import annotations

from time import monotonic
from typing import Any

from celery.worker.state import active_requests

#: The shortest stall, in seconds, taken for a wedged loop whatever the ttl: a loaded
#: machine can hold a healthy loop up for a second or two, and a lease of a short ttl
#: must not be given away for that.
LOOP_STALL_FLOOR = 5.0

#: A stall this long is taken for a wedged loop whatever the worker holds, and logged: an
#: idle loop goes round at least every 10 s on any transport (kombu's hub polls for at most
#: that long), and a worker whose loop hangs (kombu's read of a broker connection that
#: never answers, a deadlock) would otherwise consume nothing without a word.
LOOP_WEDGED_AFTER = 15.0


class LoopWatch:
    """The time the event loop last went round (a ``hub.on_tick`` callback)."""

    def __init__(self, hub: Any, runs_bodies: bool = False) -> None:
        #: True where task bodies run in the loop's own thread (solo): the loop is then
        #: busy, not wedged, while a body runs.
        self.runs_bodies = runs_bodies
        self.hub = hub
        self.seen = monotonic()
        hub.on_tick.add(self.ticked)

    def ticked(self) -> None:
        self.seen = monotonic()

    def stalled_for(self) -> float:
        """Seconds since the loop last went round; 0 while a body runs in it (solo)."""
        if self.runs_bodies and active_requests:
            return 0.0
        return monotonic() - self.seen


def may_start_without_loop(request: Any) -> bool:
    """True if ``request``'s body may start without the event loop's help.

    Celery hands a request to its pool with ``pool.apply_async`` (keeping a weak
    reference to the result as ``_apply_result``). A pool thread or a solo pool then
    runs it on its own; prefork's pool writes the job to a child only from the loop,
    and marks it (``_scheduled_for``) when it does. Unknown cases count as True, so
    they keep their renewals.
    """
    if request is None:
        return True
    ref = getattr(request, "_apply_result", None)
    if ref is None:
        return False  # still in the consumer: reserved, ETA-held, or waiting for its acquire
    result = ref() if callable(ref) else ref
    if result is None:
        return True
    if hasattr(type(result), "_scheduled_for"):  # billiard's ApplyResult (prefork)
        return result._scheduled_for is not None or result._write_to is not None
    return True
