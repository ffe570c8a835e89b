"""Settling a finish whose reply was lost: ask again until the store answers, never assume.

A finish that times out may still run: a stalled server (SIGSTOP, a long
fork, a saturated host) executes the buffered EVALSHA when it resumes. The
caller therefore never treats "no reply" as "not applied". It sends the same
finish again, with backoff, until the store answers; finish.lua answers OK to
the same finish of the same owner and token once any copy of it was applied,
so the answer settles what happened.

The wait is bounded. Every copy carries one *not-after* moment on the server's
clock: a copy that reaches the server later is refused (LATE) and changes
nothing. The caller gives up only once the server's clock is surely past that
moment, so after it has given up (and withheld the outcome: no result, no
callbacks) no copy can apply the outcome behind its back; the lease, no
longer renewed, expires and recovery re-runs the task. docs/celery.md
("Outcomes when the store stalls") explains the choice.

The not-after moment needs the server's clock in this process (clock.py). A
server whose clock is stepped backwards by more than its error bounds while a
finish is pending defeats the bound (the deadlines of every lease rest on the
same clock).

Knows nothing of Celery.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from .clock import ServerClock, server_clock
from ..exceptions import LeaseLost, LeaseUnavailable

if TYPE_CHECKING:
    from .core import StoreCore

__all__ = ["settle_finish"]

T = TypeVar("T")

logger = logging.getLogger("celery_leases.task")

#: First pause between copies of a finish, doubled after each, up to MAX_DELAY.
FIRST_DELAY, MAX_DELAY = 0.25, 2.0


def settle_finish(store: "StoreCore", send: Callable[[int], T], *, bound: float, task_id: str,
                  token: int, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep,
                  server: ServerClock | None = None) -> T:
    """``send(not_after)`` until the store answers; its result, or LeaseLost.

    ``send`` is one finish call with the given not-after (server ms); it
    raises LeaseUnavailable when the reply does not come, LeaseLost when
    refused. Copies go out with backoff for ``bound`` seconds; then one more
    once the server's clock is surely past the not-after moment (its answer,
    OK or LATE, settles the outcome for good). If that one gets no answer
    either, LeaseLost says the outcome is withheld and can no longer apply.
    """
    server = server or server_clock(store)
    start = clock()
    delay = FIRST_DELAY
    while not server.fresh():
        # No reading of the server's clock yet (this process's first finish, the store
        # away): nothing has been sent, so withholding the outcome is safe.
        waited = clock() - start
        if waited >= bound:
            raise LeaseLost(task_id, token, f"unconfirmed, store unreachable for {waited:.1f}s "
                                            f"(no finish was sent)")
        sleep(min(delay, bound - waited))
        delay = min(delay * 2, MAX_DELAY)
    sent_at = clock()
    not_after = server.upper_ms(sent_at) + math.ceil(bound * 1000)
    final = server.past(not_after)
    delay = FIRST_DELAY
    copies = 0
    while True:
        copies += 1
        try:
            answer = send(not_after)
        except LeaseUnavailable as exc:
            last = exc
        except LeaseLost as exc:
            if copies > 1:
                logger.warning("task %s: finish of token %s settled by copy %d after %.1fs: "
                               "refused (%s)", task_id, token, copies, clock() - sent_at, exc.reason)
            raise
        else:
            if copies > 1:
                logger.warning("task %s: finish of token %s settled by copy %d after %.1fs: accepted",
                               task_id, token, copies, clock() - sent_at)
            return answer
        now = clock()
        if copies == 1:
            logger.warning("task %s: no answer to the finish of token %s (%s); asking the store "
                           "again for up to %.1fs", task_id, token, last, final - now)
        if now >= final:
            raise LeaseLost(task_id, token, (
                f"unconfirmed, store unreachable for {now - sent_at:.1f}s; withheld, and no "
                f"copy of the finish can apply after server time {not_after} ms: {last}")) from last
        sleep(min(delay, final - now))
        delay = min(delay * 2, MAX_DELAY)
