"""One log line when a repeated call starts failing, one when it works again.

The heartbeat, the workers' fallback recovery and the recovery task retry
on every tick or interval while the lease store is down; logging each failed
attempt (with a traceback) buried the one line an operator needs. An outage
is logged once when it starts and once when it ends, with the number of
failed attempts and how long it lasted; the attempts in between log at DEBUG.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from .exceptions import LeaseError


class Outage:
    """The failure state of one repeated call (not thread-safe: one caller each)."""

    def __init__(self, logger: logging.Logger, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.clock = logger, what, clock
        #: Failed attempts since the last success (0 while healthy).
        self.failures = 0
        self.since: float | None = None

    def failed(self, exc: BaseException, detail: str = "") -> None:
        """An attempt failed: logged at ERROR if it is the first of a run, else at DEBUG.

        An error that is not a LeaseError is a bug: its first occurrence keeps its traceback.
        """
        self.failures += 1
        suffix = f" ({detail})" if detail else ""
        if self.failures == 1:
            self.since = self.clock()
            self.logger.error("%s failed%s: %s; retrying, logged again when it works",
                              self.what, suffix, exc, exc_info=not isinstance(exc, LeaseError))
        else:
            self.logger.debug("%s failed again%s (%d in a row): %s", self.what, suffix, self.failures, exc)

    def succeeded(self, detail: str = "") -> None:
        """An attempt worked: ends a run of failures with one WARNING line, with counts."""
        if not self.failures:
            return
        lasted = self.clock() - (self.since if self.since is not None else self.clock())
        suffix = f" ({detail})" if detail else ""
        self.logger.warning("%s works again after %d failed attempt(s) over %.1fs%s",
                            self.what, self.failures, lasted, suffix)
        self.failures, self.since = 0, None

    def __repr__(self) -> str:
        return f"<Outage {self.what!r} failures={self.failures}>"


