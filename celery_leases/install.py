"""install(app): the one call that wires celery-leases into an existing Celery app.

The composition root: it imports the layers and wires them together (the bootsteps,
publish tracking, the result hooks, the recovery task); nothing imports it back
except the public names and the tools above the wiring (cli/, testing/).
"""
from __future__ import annotations

from typing import Any

from celery import Task

from .config import client_config, forget_config, validate_pending
from .exceptions import ConfigurationError
from .protocol.store import LeaseStore
from .runtime import get_store, has_store, on_new_store
from .publishing import tracking
from .task import results
from .task.leased import LeasedTask
from .recovery import beat
# Importing it registers ``celery inspect leases`` (Celery's registry of remote-control commands is global).
from .worker import control  # noqa: F401
# Importing the steps also connects the task_received / worker_shutdown hooks.
from .worker.steps import HeartbeatStep, LeaseConsumerStep, LeaseStep, OutboxStep, RecoveryStep


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
    on_new_store(results.attach)
    app.steps["worker"].update((LeaseStep, HeartbeatStep, RecoveryStep, OutboxStep))
    app.steps["consumer"].add(LeaseConsumerStep)

    # Never a LeasedTask, whatever all_tasks says: a pass is safe to run twice and to
    # crash at any point, and a lease per beat tick would only add records.
    beat.register(app, task_base if not issubclass(task_base, LeasedTask) else Task, get_store)
    app._celery_leases_installed = True
    return app


def store(app: Any) -> LeaseStore:
    """The lease store of ``app`` in this process; ``.recover()`` re-publishes through the app."""
    return get_store(app)
