"""Findings about a deployment, each with its one severity; the start-up checks that find most.

``FINDINGS`` is the one place a finding's severity is decided: the worker's
start-up checks log each finding at it (ERROR or WARNING on
``celery_leases.checks``), and ``celery leases doctor`` reports it at it
(doctor.py builds its lines from the same table). docs/operations.md lists
them ("Findings and their severities"; a test keeps the two in step).
``Finding`` is the one shape of a finding, for the start-up checks and the
doctor's lines alike.

``LeaseWorker.start()`` runs the start-up checks once the lease store
answers. A finding never stops the worker, whatever its severity: the store's
settings can be fixed while it runs (``CONFIG SET``), and a store meant to be
thrown away (a laptop, CI) is not an outage. A check that cannot run
(``CONFIG`` or ``INFO`` refused by an ACL, or renamed away on a managed Redis)
is logged at INFO as skipped. ``run_checks`` returns the findings, so they are
testable and a deployment script can use them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import RedisError, ResponseError

from ..config import LeaseConfig
from ..protocol.connection import scheme
from ..protocol.admin import other_layout
from ..protocol.store import LeaseStore

logger = logging.getLogger("celery_leases.checks")

#: Redis brokers whose unacknowledged messages come back after visibility_timeout.
_REDIS_BROKER_SCHEMES = ("redis", "rediss", "sentinel", "redis+socket")
#: kombu's Redis transport default visibility_timeout, in seconds.
_DEFAULT_VISIBILITY_TIMEOUT = 3600.0

#: Severities: ERROR, a guarantee is lost when the risk strikes (tasks lost or run twice);
#: WARNING, one is weakened or something needs a look. INFO and OK lines are no findings.
ERROR, WARNING, INFO, OK = "ERROR", "WARNING", "INFO", "OK"
#: The logging level of each severity (the worker logs a finding at it).
LEVELS = {ERROR: logging.ERROR, WARNING: logging.WARNING, INFO: logging.INFO, OK: logging.INFO}
#: The severities that are findings proper: the doctor exits 1 on them.
FINDING_LEVELS = (ERROR, WARNING)


@dataclass(frozen=True)
class Kind:
    """One kind of finding: the check that reports it and its severity."""

    #: The check's name: Finding.check, and the doctor's second column.
    check: str
    #: ERROR or WARNING.
    severity: str
    #: True when the worker's start-up checks report it too (else only the doctor does).
    at_worker_start: bool


#: Every finding, with its one severity, for the start-up checks and the doctor alike.
FINDINGS: dict[str, Kind] = {
    # the start-up checks (this module), which the doctor runs too
    "eviction": Kind("eviction", ERROR, True),
    "no_persistence": Kind("persistence", ERROR, True),
    "rdb_only": Kind("persistence", WARNING, True),
    "shards": Kind("shards", ERROR, True),
    "visibility_timeout": Kind("visibility_timeout", WARNING, True),
    "retention": Kind("retention", WARNING, True),
    "heartbeat": Kind("heartbeat", WARNING, True),
    # the doctor's own (doctor.py); a worker refuses to start on a settings problem (exit 78)
    # and waits for an unreachable store (exit 69 past its retries) instead
    "settings": Kind("settings", ERROR, False),
    "store_unreachable": Kind("store", ERROR, False),
    "clock_skew": Kind("clock", WARNING, False),
    "corrupt_record": Kind("records", ERROR, False),
    "stuck_lease": Kind("records", ERROR, False),
    "corrupt_stats": Kind("records", ERROR, False),
    "parked": Kind("parked", WARNING, False),
    "recovery_late": Kind("recovery", WARNING, False),
}


@dataclass(frozen=True)
class Finding:
    """One finding about a deployment: a start-up check's (``run_checks``) or the doctor's
    (ops/diagnosis.py, which adds its OK and INFO lines), so both report one shape."""

    #: Which check: "eviction", "persistence", "shards", "visibility_timeout", "retention",
    #: "heartbeat" (the start-up checks), or the doctor's: "settings", "store", "clock", "records", ...
    check: str
    #: ERROR or WARNING (the kind's in FINDINGS); INFO for a check that could not run or a
    #: cadence not observed; OK for a check that found nothing.
    severity: str
    #: What was found.
    message: str
    #: What to do about it (the doctor's advice; "" where nothing is needed).
    todo: str = ""
    #: The finding's key in FINDINGS, which gives its severity ("" for OK and INFO lines).
    kind: str = ""

    @property
    def level(self) -> int:
        """The logging level of the severity: what the worker logs the finding at."""
        return LEVELS[self.severity]

    @property
    def skipped(self) -> bool:
        """True for a check that could not run (INFO)."""
        return self.severity == INFO

    @property
    def counts(self) -> bool:
        """True for ERROR and WARNING: the findings proper (the doctor exits 1 on them)."""
        return self.severity in FINDING_LEVELS

    def as_dict(self) -> dict:
        """The doctor's ``--json`` entry: its keys are documented (docs/operations.md, doctor)."""
        return {"level": self.severity, "check": self.check, "what": self.message, "todo": self.todo,
                "kind": self.kind}


def found(kind: str, message: str, todo: str = "") -> Finding:
    """A finding of ``kind``, at the severity FINDINGS gives it."""
    entry = FINDINGS[kind]
    return Finding(entry.check, entry.severity, message, todo, kind)


class _Skip(Exception):
    """A check could not read what it needs."""


def run_checks(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """Run every check, log each finding, and return them. Never raises."""
    findings: list[Finding] = []
    for name, check in _CHECKS:
        try:
            findings += check(app, config, store)
        except _Skip as exc:
            findings.append(Finding(name, INFO, f"{name} check skipped: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a check must never stop the worker
            findings.append(Finding(name, INFO, f"{name} check skipped after an error: {exc!r}"))
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


def _each_master(store: LeaseStore, what: str, read: Callable[[Any], Any]) -> Any:
    """``read(target)`` on each master of a cluster (target: its node), or once on one server.

    Returns the first answer that ``_worst`` ranks as a problem, so a cluster
    is as good as its weakest master.
    """
    primaries = getattr(store.client, "get_primaries", None)
    if primaries is None:
        return [_server(store, what, lambda: read({}))]
    answers = []
    for node in primaries():
        target = {"target_nodes": node}
        answers.append(_server(store, f"{what} on {node.name}", lambda: _only(read(target))))
    return answers


def _only(answer: Any) -> Any:
    """A cluster's per-node answer ({node name: reply}) for a single node, unwrapped."""
    if isinstance(answer, dict) and len(answer) == 1:
        (value,) = answer.values()
        if isinstance(value, (dict, list)):
            return value
    return answer


def check_eviction(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """maxmemory-policy must be noeviction: an evicted record cannot be recovered."""
    infos = _each_master(store, "INFO memory", lambda t: store.client.info("memory", **t))
    info = next((i for i in infos if i.get("maxmemory_policy") != "noeviction"), infos[0])
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
    return [found("eviction",
                  f"lease store {store.description} has maxmemory-policy {policy} ({limit}); "
                  f"{risk}. Use maxmemory-policy noeviction for the lease store")]


def check_persistence(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """AOF: a restart without persistence loses every lease, RDB snapshots alone the last writes."""
    infos = _each_master(store, "INFO persistence", lambda t: store.client.info("persistence", **t))
    if all(int(info.get("aof_enabled") or 0) for info in infos):
        return []
    saves = _each_master(store, "CONFIG GET save", lambda t: store.client.config_get("save", **t))
    rdb = [save.get("save", "") for info, save in zip(infos, saves) if not int(info.get("aof_enabled") or 0)]
    if all(rdb):
        return [found("rdb_only",
                      f"lease store {store.description} persists by RDB snapshots only (save "
                      f"{rdb[0]!r}, appendonly no): a crash loses the lease writes since the last "
                      f"snapshot. Use appendonly yes")]
    return [found("no_persistence",
                  f"lease store {store.description} has no persistence (appendonly no, save ''): "
                  f"a restart loses every lease record, so tasks running at that moment are "
                  f"never recovered, and the fencing token counter starts again. "
                  f"Use appendonly yes")]


def check_shards(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """Live leases written under another leases_shards are stranded: nobody renews or recovers them."""
    other = other_layout(store)
    if other is None:
        return []
    count, indexed = other
    return [found("shards",
                  f"lease store {store.description} holds {indexed} live lease(s) of prefix "
                  f"{config.key_prefix} written with leases_shards={count}, but this worker uses "
                  f"leases_shards={config.shards}: they are not renewed, recovered or fenced by "
                  f"it. Run every worker with one value; change it only once those leases are "
                  f"finished (see docs/cluster.md)")]


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
    return [found("visibility_timeout",
                  f"broker_transport_options visibility_timeout ({timeout:g}s) is shorter than "
                  f"leases_ttl ({config.ttl:g}s): the Redis broker hands out a copy of every "
                  f"unacknowledged message (prefetched, ETA, acks_late){_kombu_held(config)} while "
                  f"its lease is still live; each copy is refused as busy, again every {timeout:g}s. "
                  f"Set visibility_timeout above the longest task or ETA, and above leases_ttl")]


def _kombu_held(config: LeaseConfig) -> str:
    """Which messages kombu's unacked copy still covers (worker/held.py)."""
    if config.held_deliveries and config.delivery_timeout:
        return (" kombu still holds (those without a publish record: leased tasks recorded at "
                "publish are held by their lease, leases_held_deliveries)")
    return ""


def check_retention(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """Finished records must outlive the longest time a duplicate can wait in the broker."""
    timeout = _visibility_timeout(app)
    if timeout is None or config.retention > timeout:
        return []
    return [found("retention",
                  f"leases_retention ({config.retention:g}s) is not longer than the Redis broker's "
                  f"visibility_timeout ({timeout:g}s): a duplicate restored by the broker after "
                  f"a finished task's record expired runs the task again"
                  f"{_HELD_NOTE if _kombu_held(config) else ''}")]


_HELD_NOTE = ("; only for messages without a publish record: leased tasks recorded at publish are "
              "held by their lease (leases_held_deliveries)")


def check_heartbeat(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    """One late heartbeat must not cost a lease: renew at most every ttl / 2."""
    if config.heartbeat_interval <= config.ttl / 2:
        return []
    return [found("heartbeat",
                  f"leases_heartbeat_interval ({config.heartbeat_interval:g}s) is more than half "
                  f"of leases_ttl ({config.ttl:g}s): a single slow or failed renewal lets leases "
                  f"of live tasks expire and be recovered; ttl / 3 is a safe choice")]


_CHECKS: tuple[tuple[str, Callable[[Any, LeaseConfig, LeaseStore], list[Finding]]], ...] = (
    ("eviction", check_eviction),
    ("persistence", check_persistence),
    ("shards", check_shards),
    ("visibility_timeout", check_visibility_timeout),
    ("retention", check_retention),
    ("heartbeat", check_heartbeat),
)

__all__ = ["Finding", "FINDINGS", "Kind", "found", "run_checks", "ERROR", "WARNING", "INFO", "OK"]
