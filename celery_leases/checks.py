"""Start-up checks: settings of Redis and Celery that quietly weaken the lease guarantees.

``LeaseWorker.start()`` runs them once the lease store answers. Each problem
is logged at WARNING on ``celery_leases.checks`` and never stops the worker;
a check that cannot run (``CONFIG`` or ``INFO`` refused by an ACL, or renamed
away on a managed Redis) is logged at INFO as skipped. ``run_checks`` returns
the findings, so they are testable and a deployment script can use them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import RedisError, ResponseError

from .config import LeaseConfig
from .connection import scheme
from .store import LeaseStore

logger = logging.getLogger("celery_leases.checks")

#: Redis brokers whose unacknowledged messages come back after visibility_timeout.
_REDIS_BROKER_SCHEMES = ("redis", "rediss", "sentinel", "redis+socket")
#: kombu's Redis transport default visibility_timeout, in seconds.
_DEFAULT_VISIBILITY_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Finding:
    """One result of a start-up check."""

    #: Which check: "eviction", "persistence", "visibility_timeout", "retention", "heartbeat".
    check: str
    #: logging.WARNING for a problem, logging.INFO for a skipped check.
    level: int
    message: str

    @property
    def skipped(self) -> bool:
        return self.level < logging.WARNING


class _Skip(Exception):
    """A check could not read what it needs."""


def run_checks(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """Run every check, log each finding, and return them. Never raises."""
    findings: list[Finding] = []
    for name, check in _CHECKS:
        try:
            findings += check(app, config, store)
        except _Skip as exc:
            findings.append(Finding(name, logging.INFO, f"{name} check skipped: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a check must never stop the worker
            findings.append(Finding(name, logging.INFO, f"{name} check skipped after an error: {exc!r}"))
    for finding in findings:
        logger.log(finding.level, "celery-leases: %s", finding.message)
    return findings


# -- Redis ---------------------------------------------------------------------


def _server(store: LeaseStore, what: str, read: Callable[[], Any]) -> Any:
    """Read server settings; a refused or renamed command means the check is skipped."""
    try:
        return read()
    except ResponseError as exc:  # NOPERM (ACL), unknown command (renamed away)
        raise _Skip(f"{what} refused by {store.description} ({exc}); "
                    f"check the setting by hand (docs/operations.md)") from None
    except RedisError as exc:
        raise _Skip(f"{what} failed on {store.description}: {exc}") from None


def check_eviction(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """maxmemory-policy must be noeviction: an evicted record cannot be recovered."""
    info = _server(store, "INFO memory", lambda: store.client.info("memory"))
    policy = info.get("maxmemory_policy")
    if policy is None:
        raise _Skip(f"INFO memory of {store.description} has no maxmemory_policy")
    if policy == "noeviction":
        return []
    maxmemory = int(info.get("maxmemory") or 0)
    limit = (f"maxmemory is {maxmemory} bytes" if maxmemory else
             "maxmemory is 0 (no limit) now, so nothing is evicted until a limit is set")
    if str(policy).startswith("volatile-"):
        risk = ("volatile-* evicts only keys with an expiry. Records of running tasks have none, "
                "but finished records (kept for leases_retention so late duplicate deliveries "
                "are refused) and records of tasks waiting in the broker after a recovery or a "
                "retry do: evicting them lets a late duplicate run the task again")
    else:
        risk = ("it can evict any key: the record or the deadline index entry of a running "
                "task, which is then never recovered and loses its fencing guard")
    return [Finding("eviction", logging.WARNING,
                    f"lease store {store.description} has maxmemory-policy {policy} ({limit}); "
                    f"{risk}. Use maxmemory-policy noeviction for the lease store")]


def check_persistence(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """AOF (or at least RDB snapshots): a restart without persistence loses every lease."""
    info = _server(store, "INFO persistence", lambda: store.client.info("persistence"))
    if int(info.get("aof_enabled") or 0):
        return []
    save = _server(store, "CONFIG GET save", lambda: store.client.config_get("save")).get("save", "")
    if save:
        return []
    return [Finding("persistence", logging.WARNING,
                    f"lease store {store.description} has no persistence (appendonly no, save ''): "
                    f"a restart loses every lease record, so tasks running at that moment are "
                    f"never recovered, and the fencing token counter starts again. "
                    f"Use appendonly yes")]


# -- Celery settings -------------------------------------------------------------


def _visibility_timeout(app: Any) -> float | None:
    """The Redis broker's visibility_timeout in seconds, or None when the broker is not Redis."""
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):  # failover URLs
        url = url[0] if url else ""
    if scheme(str(url)) not in _REDIS_BROKER_SCHEMES:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout") or _DEFAULT_VISIBILITY_TIMEOUT)


def check_visibility_timeout(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """A Redis broker must not redeliver a message before its lease can expire."""
    timeout = _visibility_timeout(app)
    if timeout is None or timeout >= config.ttl:
        return []
    return [Finding("visibility_timeout", logging.WARNING,
                    f"broker_transport_options visibility_timeout ({timeout:g}s) is shorter than "
                    f"leases_ttl ({config.ttl:g}s): the Redis broker hands out a copy of every "
                    f"unacknowledged message (prefetched, ETA, acks_late) while its lease is still "
                    f"live; each copy is refused as busy, again every {timeout:g}s. Set "
                    f"visibility_timeout above the longest task or ETA, and above leases_ttl")]


def check_retention(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """Finished records must outlive the longest time a duplicate can wait in the broker."""
    timeout = _visibility_timeout(app)
    if timeout is None or config.retention > timeout:
        return []
    return [Finding("retention", logging.WARNING,
                    f"leases_retention ({config.retention:g}s) is not longer than the Redis broker's "
                    f"visibility_timeout ({timeout:g}s): a duplicate restored by the broker after "
                    f"a finished task's record expired runs the task again")]


def check_heartbeat(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """One late heartbeat must not cost a lease: renew at most every ttl / 2."""
    if config.heartbeat_interval <= config.ttl / 2:
        return []
    return [Finding("heartbeat", logging.WARNING,
                    f"leases_heartbeat_interval ({config.heartbeat_interval:g}s) is more than half "
                    f"of leases_ttl ({config.ttl:g}s): a single slow or failed renewal lets leases "
                    f"of live tasks expire and be recovered; ttl / 3 is a safe choice")]


_CHECKS: tuple[tuple[str, Callable[[Any, LeaseConfig, LeaseStore], list[Finding]]], ...] = (
    ("eviction", check_eviction),
    ("persistence", check_persistence),
    ("visibility_timeout", check_visibility_timeout),
    ("retention", check_retention),
    ("heartbeat", check_heartbeat),
)

__all__ = ["Finding", "run_checks"]
