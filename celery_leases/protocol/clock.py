"""The lease store server's clock as seen from this process.

Every deadline lives on the Redis server's clock (``TIME`` inside the
scripts). Two things in a worker need that clock on the Python side: the
not-after moment of a finish (settle.py) and the ETA of a re-queued copy
(worker.py). ``ServerClock`` reads it with one TIME call and then follows it
on the monotonic clock (one TIME per process per ``REFRESH`` seconds, not per
task), with error bounds: the call's round trip, a drift of ``DRIFT`` (1000
ppm, well above what NTP-disciplined clocks allow) and ``MARGIN`` (servers of
one store that disagree on the time). Neither a wrong wall clock nor an NTP
step on the worker changes it.

Knows nothing of Celery.
"""
from __future__ import annotations

import math
import time
import weakref
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

from ..exceptions import LeaseError, LeaseUnavailable

if TYPE_CHECKING:
    from .core import StoreCore

__all__ = ["ServerClock", "server_clock", "MARGIN", "REFRESH", "DRIFT"]

#: Seconds a TIME reading is used before it is read again (when the store answers).
REFRESH = 60.0
#: Relative rate error allowed between this host's monotonic clock and the server's clock.
DRIFT = 1e-3
#: Seconds added before giving up: the servers a finish may reach (a cluster's masters,
#: a Sentinel's new master after a failover) may disagree on the time by this much.
MARGIN = 0.25


class ServerClock:
    """Bounds on the store server's clock (ms), from one TIME reading and ``clock``."""

    def __init__(self, store: "StoreCore", clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.clock = store, clock
        #: (server ms, local time before the call, local time after it), or None.
        self.reading: tuple[int, float, float] | None = None

    def read(self) -> int:
        """One TIME call (the server's ms); raises LeaseUnavailable when the store does not answer."""
        t0 = self.clock()
        server = self.store.server_time_ms()
        self.reading = (server, t0, self.clock())
        return server

    def fresh(self) -> bool:
        """Read again if the reading is missing or old; False if there is still none."""
        if self.reading is None or self.clock() - self.reading[2] > REFRESH:
            try:
                self.read()
            except LeaseUnavailable:
                pass  # an older reading still bounds the clock, with more drift
        return self.reading is not None

    def upper_ms(self, t: float) -> int:
        """The latest the server's clock can read at local time ``t``."""
        server, t0, _ = self._reading()
        elapsed = max(0.0, t - t0)
        return server + 1 + math.ceil(1000 * elapsed * (1 + DRIFT))

    def past(self, server_ms: int) -> float:
        """The local time from which the server's clock surely reads more than ``server_ms``."""
        server, _, t1 = self._reading()
        return t1 + MARGIN + max(0, server_ms + 1 - server) / (1000 * (1 - DRIFT))

    def estimate_ms(self) -> int | None:
        """The server's clock now, from the last reading (None before the first)."""
        if self.reading is None:
            return None
        server, t0, t1 = self.reading
        return server + int((self.clock() - (t0 + t1) / 2) * 1000)

    def now(self, read: bool) -> tuple[datetime, str]:
        """The server's now as an aware UTC datetime, and where it came from.

        ``read``: the store is expected to answer, so read it; otherwise (or
        when the read fails) carry the last reading forward. A re-queued
        copy's ETA comes from here, never from the worker's wall clock (a
        worker an hour fast would delay its copies by an hour).
        """
        if read:
            try:
                return _utc(self.read()), "server clock"
            except LeaseError:
                pass
        estimate = self.estimate_ms()
        if estimate is not None:
            return _utc(estimate), "server clock (last reading + monotonic time)"
        # Never read (the store was unreachable since this process started): the
        # only clock left. Said in the log line so a skewed worker can be found.
        return datetime.now(timezone.utc), "worker wall clock (the store's clock was never read)"

    def _reading(self) -> tuple[int, float, float]:
        if self.reading is None:
            raise RuntimeError("ServerClock: no reading yet (call fresh() first)")
        return self.reading


_clocks: "weakref.WeakKeyDictionary[Any, ServerClock]" = weakref.WeakKeyDictionary()


def server_clock(store: "StoreCore") -> ServerClock:
    """This store's ServerClock (the store objects are per process already: runtime.py)."""
    found = _clocks.get(store)
    if found is None:
        found = _clocks[store] = ServerClock(store)
    return found


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, timezone.utc)
