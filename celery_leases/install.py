"""install(app): the one call that wires celery-leases into an existing Celery app."""
from __future__ import annotations

import logging
import sys
from typing import Any

from celery import Task
from celery.signals import beat_init

from .config import LeaseConfig, client_config, forget_config, get_config, validate_pending
from .exceptions import ConfigurationError, LeaseError
from .protocol.store import LeaseStore
from .runtime import get_store, has_store, on_new_store
from .signals import recovery_pass
from . import results, tracking
from .task import LeasedTask
from .worker.outage import Outage
# Importing it registers ``celery inspect leases`` (Celery's registry of remote-control commands is global).
from .worker import control  # noqa: F401
# Importing the steps also connects the task_received / worker_shutdown hooks.
from .worker.steps import HeartbeatStep, LeaseConsumerStep, LeaseStep, OutboxStep, RecoveryStep

logger = logging.getLogger("celery_leases.install")

RECOVER_TASK_NAME = "celery_leases.recover"


def install(app: Any, *, all_tasks: bool = False, **settings: Any) -> Any:
    """Add the worker bootstep, the signal hooks, the recovery task and its beat entry.

    ``settings`` are ``leases_*`` settings without the prefix (``ttl=10``),
    written into ``app.conf``. ``all_tasks=True`` makes every task whose class
    Celery builds after this call a LeasedTask: the tasks defined later, and
    those defined earlier that the app has not finalized yet (Celery builds a
    task's class when the app is finalized). The recovery task never is one.

    A second call installs nothing twice; its settings and ``all_tasks`` are
    applied as a first call's would be, so a call that asks for them is never
    ignored.
    """
    installed = getattr(app, "_celery_leases_installed", False)
    if installed and not (settings or all_tasks):
        return app
    if settings:
        if installed and has_store(app):
            raise ConfigurationError(
                f"install(app) was called again with {', '.join(f'leases_{k}' for k in settings)} "
                f"after this process built the lease store from the earlier settings; give every "
                f"setting to the first install(app, ...) or set it in app.conf before the app is used")
        app.conf.update({f"leases_{key}": value for key, value in settings.items()})
        forget_config(app)
    # A broken setting a publisher uses fails here, named; worker-only settings
    # (and the rest) are checked when a worker starts (startup.py), so a web
    # tier's ``import proj`` never fails on them.
    if app.configured:
        client_config(app)
    else:
        validate_pending(app)
    task_base = app.Task
    if all_tasks and not issubclass(task_base, LeasedTask):
        app.Task = type("LeasedAppTask", (LeasedTask, task_base), {"__module__": __name__})
    if installed:
        return app
    tracking.install(app)
    if "celery.bin.base" in sys.modules:
        # Celery's command line, which loads it before -A proj: `celery inspect leases` prints
        # tables. Other processes never print replies and skip importing it (and pygments).
        from .cli import inspect_leases
        inspect_leases.install()
    on_new_store(results.attach)
    app.steps["worker"].update((LeaseStep, HeartbeatStep, RecoveryStep, OutboxStep))
    app.steps["consumer"].add(LeaseConsumerStep)

    outage = Outage(logging.getLogger("celery_leases.recovery"), "celery-leases: recovery task")

    # Never a LeasedTask, whatever all_tasks says: a pass is safe to run twice and to
    # crash at any point, and a lease per beat tick would only add records.
    base = task_base if not issubclass(task_base, LeasedTask) else Task

    @app.task(name=RECOVER_TASK_NAME, base=base, shared=False, ignore_result=True)
    def recover() -> dict:
        """One recovery pass (skipped when another recoverer ran one within the interval).

        An unreachable store is logged when the outage starts and when it ends
        (with counts), not with a traceback on every run.
        """
        config = get_config(app)
        store_ = store(app)
        try:
            if not store_.try_recovery_turn("beat", config.recovery_interval * 0.9):
                outage.succeeded()
                recovery_pass.send(sender=app, result="skipped", recoverer="beat")
                return {"skipped": True}
            report = store_.recover().as_dict()
        except LeaseError as exc:
            outage.failed(exc)
            recovery_pass.send(sender=app, result="failed", recoverer="beat")
            return {"failed": str(exc)}
        outage.succeeded()
        recovery_pass.send(sender=app, result="ran", recoverer="beat")
        return report

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
    app._celery_leases_installed = True
    return app


def beat_entry_wanted(config: LeaseConfig) -> bool:
    """``leases_beat_schedule``: True or False as set; unset (None), only when the workers
    run no fallback recovery: two recoverers each interval would only log that one skipped."""
    if config.beat_schedule is None:
        return not config.worker_recovery
    return bool(config.beat_schedule)


def store(app: Any) -> LeaseStore:
    """The lease store of ``app`` in this process; ``.recover()`` re-publishes through the app."""
    return get_store(app)
