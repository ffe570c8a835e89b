"""The recovery task ``celery_leases.recover`` and its beat entry.

Beat sends the task every ``leases_recovery_interval``; a worker runs one recovery pass
(skipped when another recoverer ran one within the interval). The pass is the store's
(``LeaseStore.recover``); this module only says when, as ``fallback.py`` does for the
workers' own passes. ``install(app)`` calls ``register(app)``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from celery import Task
from celery.signals import beat_init

from ..config import LeaseConfig, client_config, get_config
from ..exceptions import ConfigurationError, LeaseError
from ..outage import Outage
from ..protocol.store import LeaseStore
from ..signals import recovery_pass

#: The logger these lines always had (operators filter on it), from when install() held this.
logger = logging.getLogger("celery_leases.install")

#: The recovery task's name: public (DESIGN.md), never changed.
RECOVER_TASK_NAME = "celery_leases.recover"


def register(app: Any, base: type[Task], get_store: Callable[[Any], LeaseStore]) -> None:
    """Register the recovery task on ``app`` (a ``base`` that is never a LeasedTask), add its
    beat entry once the app is configured, and report a broken setting in beat itself.
    ``get_store(app)`` gives the app's store in the process that runs the task (runtime.py,
    which imports this package: handed down, not imported back)."""
    outage = Outage(logging.getLogger("celery_leases.recovery"), "celery-leases: recovery task")

    @app.task(name=RECOVER_TASK_NAME, base=base, shared=False, ignore_result=True)
    def recover() -> dict:
        """One recovery pass (skipped when another recoverer ran one within the interval).

        An unreachable store is logged when the outage starts and when it ends
        (with counts), not with a traceback on every run.
        """
        return run_pass(app, get_store(app), outage)

    def add_beat_entry(*args: Any, **kwargs: Any) -> None:
        # Runs in every process once the app is configured: never fails on a
        # worker-only setting (beat_init below reports it in beat itself).
        config = client_config(app)
        if beat_entry_wanted(config) and not config.worker_errors:
            app.add_periodic_task(config.recovery_interval, app.signature(RECOVER_TASK_NAME),
                                  name=RECOVER_TASK_NAME)

    if app.configured:
        add_beat_entry()
    else:
        app.on_after_configure.connect(add_beat_entry, weak=False)

    def check_beat(sender: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        try:
            get_config(app)
        except ConfigurationError as exc:
            logger.error("celery-leases: %s; beat does not schedule %s (workers refuse to start "
                         "until this is fixed)", exc, RECOVER_TASK_NAME)

    beat_init.connect(check_beat, weak=False)


def run_pass(app: Any, store: LeaseStore, outage: Outage) -> dict:
    """The recovery task's body: a pass if this recoverer wins the interval's turn."""
    config = get_config(app)
    try:
        if not store.try_recovery_turn("beat", config.recovery_interval * 0.9):
            outage.succeeded()
            recovery_pass.send(sender=app, result="skipped", recoverer="beat")
            return {"skipped": True}
        report = store.recover().as_dict()
    except LeaseError as exc:
        outage.failed(exc)
        recovery_pass.send(sender=app, result="failed", recoverer="beat")
        return {"failed": str(exc)}
    outage.succeeded()
    recovery_pass.send(sender=app, result="ran", recoverer="beat")
    return report


def beat_entry_wanted(config: LeaseConfig) -> bool:
    """``leases_beat_schedule``: True or False as set; unset (None), only when the workers
    run no fallback recovery: two recoverers each interval would only log that one skipped."""
    if config.beat_schedule is None:
        return not config.worker_recovery
    return bool(config.beat_schedule)
