"""Fallback recovery: recovery passes run by the workers themselves, for apps without beat.

Every worker runs this thread (``leases_worker_recovery``); each interval the
one that wins the store's recovery guard runs a pass, the others skip. The
pass itself is the store's (``LeaseStore.recover``); this only says when.
Started and stopped by ``RecoveryStep`` (steps.py).
"""
from __future__ import annotations

import logging
import threading

from ..protocol.store import LeaseStore
from ..signals import recovery_pass
from ..outage import Outage

logger = logging.getLogger("celery_leases.worker")


class FallbackRecovery:
    """One thread: every ``interval`` seconds, a recovery pass if this worker wins the turn."""

    def __init__(self, store: LeaseStore, owner: str, interval: float, sender: object = None) -> None:
        self.store, self.owner, self.interval = store, owner, interval
        #: Sender of the ``recovery_pass`` signal (the worker's app).
        self.sender = sender
        #: Passes this worker ran (won the turn and finished).
        self.passes = 0
        self.outage = Outage(logger, "celery-leases: fallback recovery pass")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-leases-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the pass under way, if any (the thread is a daemon: never waited for)."""
        self._stop.set()

    def _run(self) -> None:
        interval = self.interval
        while not self._stop.wait(interval):
            try:
                # The guard lives a little less than the interval: a guard that
                # outlived its interval by a millisecond would cost a whole turn.
                if self.store.try_recovery_turn(self.owner, interval * 0.9):
                    report = self.store.recover()
                    self.passes += 1
                    # Quiet when healthy: a pass that did nothing logs at DEBUG.
                    level = logging.INFO if report.recovered or report.dead else logging.DEBUG
                    logger.log(level, "celery-leases: recovery pass: %s", report.as_dict())
                    result = "ran"
                else:
                    logger.debug("celery-leases: recovery pass skipped: another recoverer ran one")
                    result = "skipped"
                self.outage.succeeded()
            except Exception as exc:  # noqa: BLE001 - logged once per outage; the next interval tries again
                self.outage.failed(exc)
                result = "failed"
            recovery_pass.send(sender=self.sender, result=result, recoverer=self.owner)
