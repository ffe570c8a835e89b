"""Worker start-up: refuse to start on a misconfiguration, wait for the lease store.

Two things must hold before a worker receives its first leased task:

- **Its configuration is sound**: ``install(app)`` was called if the app has
  LeasedTasks, every ``leases_*`` setting is valid (the worker-only ones too),
  and every task's ``lease_*`` options are. Otherwise the worker logs one
  CRITICAL line naming each problem and exits with ``os.EX_CONFIG`` (78).
  The check runs on Celery's ``celeryd_after_setup`` signal (in the worker
  blueprint's ``on_start``, after logging is set up, before any bootstep
  starts), connected when this module is imported, which importing
  ``LeasedTask`` does: it runs even when ``install(app)`` was forgotten.
  A signal receiver cannot veto with an exception (Celery logs and swallows
  it), but a ``SystemExit`` passes through, and ``WorkController.start``
  turns it into a clean stop with that exit code. ``LeaseStep.start`` runs
  the same check for workers that do not send the signal (Celery's in-process
  test worker).
- **The lease store answers**: ``wait_for_store`` retries like Celery's own
  broker connection at start (``broker_connection_retry_on_startup``,
  ``broker_connection_max_retries``, intervals of 2, 4, ... 30 s as kombu's
  ``ensure_connection``) from ``LeaseStep.start``, which blocks the worker's
  start sequence, so the consumer (started last) receives nothing meanwhile.
  Past the retries the worker logs one CRITICAL line naming
  ``leases_redis_url`` and exits with ``os.EX_UNAVAILABLE`` (69).
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable, Iterator, TypeVar

from celery.signals import celeryd_after_setup

from ..config import client_config, task_option_errors
from ..exceptions import ConfigurationError, LeaseUnavailable
from ..protocol.connection import redact

logger = logging.getLogger("celery_leases.worker")

T = TypeVar("T")

#: Exit status of a worker refused for its configuration, and of one whose lease store never answered.
EX_CONFIG = getattr(os, "EX_CONFIG", 78)
EX_UNAVAILABLE = getattr(os, "EX_UNAVAILABLE", 69)

#: Apps whose configuration passed the start-up check in this process.
_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()


def not_installed_message(names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"the app has LeasedTask tasks ({shown}) but celery_leases.install(app) was not "
            f"called: without it no lease is taken and the tasks would run unguarded; call "
            f"celery_leases.install(app) where the app is created")


def problems(app: Any) -> list[str]:
    """Everything that must stop a worker of ``app`` from starting, each naming what to fix."""
    tasks = list(app.tasks.values())
    if not getattr(app, "_celery_leases_installed", False):
        leased = sorted(t.name for t in tasks if getattr(t, "leased", False))
        return [not_installed_message(leased)] if leased else []
    found: list[str] = []
    config = None
    try:
        config = client_config(app)
    except ConfigurationError as exc:
        found += getattr(exc, "problems", (str(exc),))
    else:
        found += config.worker_errors
        config = None if config.worker_errors else config
    for task in sorted(tasks, key=lambda t: t.name or ""):
        found += task_option_errors(task, config)[0]
    return found


def refuse_if_misconfigured(app: Any) -> None:
    """Log every problem once, in one CRITICAL line, and exit (SystemExit(EX_CONFIG))."""
    if app in _checked:
        return
    found = problems(app)
    if found:
        refuse(found[0] if len(found) == 1 else f"{len(found)} problems:\n  - " + "\n  - ".join(found),
               EX_CONFIG)
    _checked.add(app)


@celeryd_after_setup.connect
def _check_at_worker_start(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    app = getattr(instance, "app", None)
    if app is not None:
        refuse_if_misconfigured(app)


# -- waiting for the lease store ---------------------------------------------------------------


def _intervals(start: float = 2.0, step: float = 2.0, maximum: float = 30.0) -> Iterator[float]:
    """kombu's ensure_connection intervals: 2, 4, 6, ... up to 30 s, then 30 s."""
    interval = start
    while True:
        yield interval
        interval = min(maximum, interval + step)


def _refused_credentials(exc: BaseException) -> bool:
    """An authentication error does not go away by waiting."""
    from redis.exceptions import AuthenticationError, AuthorizationError
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (AuthenticationError, AuthorizationError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _humanize(seconds: float) -> str:
    from celery.utils.time import humanize_seconds
    return humanize_seconds(seconds, "in", " ")


def wait_for_store(app: Any, probe: Callable[[], T], *, sleep: Callable[[float], None] = time.sleep,
                   check_shutdown: Callable[[], None] | None = None) -> T:
    """``probe()`` (a call to the lease store) until it answers, retrying like Celery's broker
    connection at start; LeaseUnavailable naming ``leases_redis_url`` once the retries are used up.

    ``check_shutdown`` (Celery's ``maybe_shutdown`` in a worker) runs between
    sleeps, so a SIGTERM while waiting stops the worker.
    """
    conf = app.conf
    retry = conf.get("broker_connection_retry_on_startup")
    if retry is None:
        retry = conf.get("broker_connection_retry", True)
    max_retries = conf.get("broker_connection_max_retries", 100)
    if check_shutdown is None:
        from celery.worker.state import maybe_shutdown
        check_shutdown = maybe_shutdown
    url = redact(client_config(app).redis_url)
    intervals = _intervals()
    attempt = 0
    while True:
        try:
            return probe()
        except LeaseUnavailable as exc:
            if not retry or _refused_credentials(exc):
                why = ("broker_connection_retry_on_startup is off" if not retry
                       else "credentials refused")
                raise LeaseUnavailable(f"lease store {url} (leases_redis_url) unreachable at "
                                       f"worker start ({why}): {exc}") from None
            if max_retries is not None and attempt >= max_retries:
                raise LeaseUnavailable(f"lease store {url} (leases_redis_url) still unreachable "
                                       f"after {attempt} retries (broker_connection_max_retries): "
                                       f"{exc}") from None
            attempt += 1
            interval = next(intervals)
            logger.error("celery-leases: Cannot connect to %s (leases_redis_url): %s.\n"
                         "Trying again %s... (%d/%s)", url, str(exc).rstrip("."), _humanize(interval),
                         attempt, max_retries)
            deadline = time.monotonic() + interval
            while True:
                check_shutdown()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sleep(min(0.2, left))


def refuse(message: str, code: int) -> None:
    """Stop a worker at start: one CRITICAL line, then SystemExit(code) (a clean stop)."""
    logger.critical("celery-leases: worker not started: %s", message)
    raise SystemExit(code)


__all__ = ["problems", "refuse", "refuse_if_misconfigured", "wait_for_store", "EX_CONFIG", "EX_UNAVAILABLE"]
