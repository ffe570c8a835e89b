"""``celery leases doctor``: is this deployment healthy? One finding per problem, with what to do.

``diagnose(app)`` runs, in order: the settings (what would stop a worker from
starting, worker/startup.py), the lease store's reachability, the start-up
checks (checks.py: eviction policy, persistence, shards, visibility timeout,
retention, heartbeat), the server's clock against this host's, every record
(corrupt ones, and stuck ones: active long past their deadline, or recovering
past their publish grace), parked deliveries, and the recovery passes it sees
taking their turn.

Each finding is a ``checks.Finding``, the type the worker's start-up checks
return too, and its severity is the one ``checks.FINDINGS`` gives it, the
table the worker logs by: the doctor and a starting worker never disagree.
Severities: ERROR and WARNING are findings (exit 1); INFO (a check that could
not run, a cadence not observed) and OK are not.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

from ..worker.checks import ERROR, FINDING_LEVELS, INFO, OK, WARNING, Finding, found, run_checks
from ..config import LeaseConfig, client_config
from ..exceptions import ConfigurationError, CorruptRecord, LeaseUnavailable
from ..protocol.admin import scan_all
from ..protocol.codes import ACTIVE, RECOVERING
from ..protocol.store import LeaseStore
from ..runtime import get_store
from ..worker.startup import problems

#: Seconds of clock difference between the store's server and this host worth a warning.
CLOCK_SKEW_WARNING = 2.0
#: Corrupt or stuck records listed one per line; past this, one line says how many more.
MAX_LISTED = 20

#: What to do about each start-up check's finding (checks.py names the checks).
_TODO = {
    "eviction": "CONFIG SET maxmemory-policy noeviction on the lease store, and the same in its redis.conf",
    "persistence": "CONFIG SET appendonly yes on the lease store, and appendonly yes in its redis.conf",
    "shards": "run every worker with one leases_shards; change it only once the old leases finished",
    "visibility_timeout": "raise broker_transport_options['visibility_timeout'] above leases_ttl and "
                          "the longest task or ETA",
    "retention": "raise leases_retention above the broker's visibility_timeout",
    "heartbeat": "set leases_heartbeat_interval to leases_ttl / 3 or less (the default)",
}


class StoreUnreachable(Exception):
    """The lease store did not answer: ``findings`` holds what was found until then."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__(findings[-1].message)
        self.findings = findings


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Silence loggers whose lines the doctor reports as findings instead (checks, store)."""
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


def diagnose(app: Any, *, scan: bool = True, observe: float | None = None,
             stuck_after: float | None = None, sleep: Callable[[float], None] = time.sleep) -> list[Finding]:
    """Every finding about ``app``'s deployment, OK lines included.

    ``observe``: seconds to watch the recovery guard (None: until one turn is
    seen, at most ``leases_recovery_interval`` + 0.5 s; 0: one look).
    ``stuck_after``: seconds past its deadline after which a lease counts as
    stuck (default: 3 recovery intervals, at least 10 s). Raises
    StoreUnreachable (with the findings so far) when the store does not answer.
    """
    findings = [found("settings", p, "fix it where the app is configured; workers refuse "
                      "to start (exit 78) until then") for p in problems(app)]
    try:
        config = client_config(app)
    except ConfigurationError:
        return findings  # no store to examine without its settings
    if not findings:
        findings.append(Finding("settings", OK, "every leases_* setting and task option is valid"))
    store = get_store(app)
    try:
        with _quiet("celery_leases.checks", "celery_leases.store"):
            findings += _startup_checks(app, config, store)
            findings += _clock(store)
            findings += _records(store, config, scan, stuck_after)
            findings += _parked(store)
            findings += _recovery(store, config, observe, sleep)
    except LeaseUnavailable as exc:
        findings.append(found("store_unreachable", str(exc), "check leases_redis_url and that the "
                              "lease store's Redis is up and reachable from here"))
        raise StoreUnreachable(findings) from None
    return findings


def _startup_checks(app: Any, config: LeaseConfig, store: LeaseStore) -> list[Finding]:
    store.server_time_ms()  # reachable? (LeaseUnavailable otherwise: run_checks never raises)
    results = run_checks(app, config, store)
    out = []
    for f in results:
        if f.skipped:
            out.append(Finding(f.check, INFO, f.message, "check this setting by hand (docs/operations.md)"))
        else:
            out.append(found(f.kind, f.message, _TODO.get(f.check, "")))
    named = {f.check for f in results}
    if "eviction" not in named:
        out.append(Finding("eviction", OK, f"lease store {store.description} has maxmemory-policy noeviction"))
    if "persistence" not in named:
        out.append(Finding("persistence", OK, f"lease store {store.description} has appendonly yes"))
    return out


def _clock(store: LeaseStore) -> list[Finding]:
    t0 = time.time()
    server = store.server_time_ms()
    t1 = time.time()
    skew = server / 1000.0 - (t0 + t1) / 2
    bound = (t1 - t0) / 2
    text = (f"the lease store's clock is {abs(skew):.3f}s {'ahead of' if skew > 0 else 'behind'} "
            f"this host's (+/- {bound:.3f}s)")
    if abs(skew) - bound > CLOCK_SKEW_WARNING:
        return [found("clock_skew", text + ": deadlines follow the server's clock, so leases are "
                       "safe, but logs, ETAs and this host's view of deadlines disagree with it",
                       "run NTP (chrony, systemd-timesyncd) on the Redis host and on this one")]
    return [Finding("clock", OK, text)]


def _records(store: LeaseStore, config: LeaseConfig, scan: bool, stuck_after: float | None) -> list[Finding]:
    now = store.server_time_ms()
    out: list[Finding] = []
    if scan:
        records, corrupt = scan_all(store)
        for key, problem in corrupt[:MAX_LISTED]:
            out.append(found("corrupt_record", f"corrupt lease record {key}: {problem}",
                              f"read it with HGETALL {key}; repair the field or DEL the record "
                              f"(a parked delivery of it: celery leases replay TASK_ID --reset-record)"))
        if len(corrupt) > MAX_LISTED:
            out.append(found("corrupt_record", f"{len(corrupt) - MAX_LISTED} more corrupt lease records",
                              "as above"))
    else:
        records = store.records([t for t, _ in store.active(100_000)], skip_corrupt=True)
        out.append(Finding("records", INFO, "records not scanned (--no-scan): corrupt records not "
                           "looked for, stuck leases looked for in the deadline index only"))
    limit = stuck_after if stuck_after is not None else max(3 * config.recovery_interval, 10.0)
    stuck = [r for r in records if r.deadline and now - r.deadline > limit * 1000
             and r.state in (ACTIVE, RECOVERING)]
    for r in stuck[:MAX_LISTED]:
        late = (now - r.deadline) / 1000.0
        if r.state == ACTIVE:
            what = (f"stuck lease {r.name or '-'}[{r.task_id}]: active, due {late:.1f}s ago "
                    f"(owner {r.owner or '- (released)'}), and no recovery pass took it")
        else:
            what = (f"stuck lease {r.name or '-'}[{r.task_id}]: recovering, its re-publish unconfirmed "
                    f"{late:.1f}s past leases_publish_grace, and no recovery pass claimed it again")
        out.append(found("stuck_lease", what, "make sure recovery runs: beat with the "
                          "celery_leases.recover task, or leases_worker_recovery on the workers; "
                          "`celery leases recover` runs one pass now"))
    if len(stuck) > MAX_LISTED:
        out.append(found("stuck_lease", f"{len(stuck) - MAX_LISTED} more stuck leases", "as above"))
    if not any(f.counts for f in out):
        out.append(Finding("records", OK, f"{len(records)} record(s) read, none stuck"
                           + (", none corrupt" if scan else "")))
    try:
        store.stats()
    except CorruptRecord as exc:
        out.append(found("corrupt_stats", str(exc), f"repair or DEL {store.keys.stats} (lifetime "
                          f"counters only: nothing else reads it)"))
    return out


def _parked(store: LeaseStore) -> list[Finding]:
    entries = store.parked(1000)
    if not entries:
        return [Finding("parked", OK, "no parked deliveries")]
    now = store.server_time_ms()
    oldest = min(entries, key=lambda e: e.parked_at)
    return [found("parked", f"{len(entries)} delivery(ies) parked instead of run, the oldest "
                   f"{(now - oldest.parked_at) / 1000.0:.0f}s ago ({oldest.name or '-'}[{oldest.task_id}]: "
                   f"{oldest.reason})", "celery leases parked; fix the record or the producer, then "
                   "celery leases replay TASK_ID")]


def _recovery(store: LeaseStore, config: LeaseConfig, observe: float | None,
              sleep: Callable[[float], None]) -> list[Finding]:
    """Watch the recovery guard (the key each pass's recoverer sets for 0.9 interval) take turns."""
    key, guard_ms = store.keys.recovery_guard, config.recovery_interval * 900
    window = config.recovery_interval + 0.5 if observe is None else observe
    until = time.monotonic() + min(window, 60.0)
    turns: list[tuple[float, str]] = []  # (local time the turn was taken, owner)
    last_ttl: int | None = None

    def look() -> None:
        nonlocal last_ttl
        pipe = store.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        owner, ttl = store.calls.read(pipe.execute, f"reading {key}")
        ttl = int(ttl)
        if owner is None or ttl <= 0:
            last_ttl = None
            return
        if last_ttl is None or ttl > last_ttl + 50:  # set again since the last look: a new turn
            turns.append((time.time() - max(0.0, guard_ms - ttl) / 1000.0, owner.decode(errors="replace")))
        last_ttl = ttl

    look()
    while time.monotonic() < until and (observe is not None or not turns):
        sleep(0.2)
        look()
    counters = store.stats()
    lifetime = f"lifetime: {counters.get('recovered', 0)} recovered, {counters.get('dead', 0)} dead"
    if not turns:
        return [Finding("recovery", INFO, f"recovery cadence not observed: no recovery pass took its "
                        f"turn ({key}) within {window:g}s; {lifetime}",
                        "fine while no leases are due; otherwise see the stuck leases above")]
    age = time.time() - turns[-1][0]
    text = f"recovery passes run: the last by {turns[-1][1]} {age:.1f}s ago"
    if len(turns) >= 2:
        every = (turns[-1][0] - turns[0][0]) / (len(turns) - 1)
        text += f", every {every:.1f}s ({len(turns)} turns seen)"
        if every > 2 * config.recovery_interval:
            return [found("recovery_late", f"{text}; leases_recovery_interval is "
                           f"{config.recovery_interval:g}s; {lifetime}",
                           "check beat's schedule of celery_leases.recover and that beat runs once")]
    return [Finding("recovery", OK, f"{text}; {lifetime}")]


__all__ = ["Finding", "StoreUnreachable", "diagnose", "ERROR", "WARNING", "INFO", "OK", "FINDING_LEVELS"]
