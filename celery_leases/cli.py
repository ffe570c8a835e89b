"""``celery -A proj leases <command>``: inspect and maintain the leases of an app.

Registered through the ``celery.commands`` entry point (setup.py). Every
command reads the app's ``leases_*`` settings, talks to the lease store only,
prints a table (``--json``: JSON) and measures times on the Redis server's
clock, like the scripts do. Errors are one line on stderr and a non-zero exit
status: 1 (no such record, a failed publish, anything else), 69 (the lease
store is unreachable). Passwords of the app's URLs never appear in output.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import unquote, urlsplit

import click
import redis
from celery.bin.base import CeleryCommand

from .codes import ACTIVE, STATES, TERMINAL_STATES
from .config import client_config
from .exceptions import CorruptRecord, LeaseError, LeaseUnavailable
from .store import LeaseRecord, LeaseStore, Parked

logger = logging.getLogger("celery_leases.cli")

#: Exit status when the lease store cannot be reached (sysexits EX_UNAVAILABLE, as Celery uses).
EX_UNAVAILABLE = 69
#: ``ls --state`` choices: the six states, all finished ones, or every record.
STATE_CHOICES = (*STATES, "finished", "all")
#: Lifetime counters of ``LeaseStore.stats()`` (docs/design.md), shown as 0 until they first move.
COUNTERS = ("acquired", "taken_over", "busy_deliveries", "stale_deliveries", "recovered", "dead",
            "stalled", "refused", "retried", "succeeded", "failed", "revoked", "reasserted", "rerun")


class NotFound(LeaseError):
    """Raised when a command names a task that has no lease record."""


# -- plumbing -------------------------------------------------------------------


def _secrets(app: Any) -> list[str]:
    """Passwords in the app's URLs and transport options: scrubbed from everything the CLI prints.

    A second line of defence: messages are built with ``connection.redact`` and
    ``describe`` already, but an error text from redis-py or kombu is not ours.
    """
    found: list[str] = []
    for name in ("broker_url", "result_backend", "leases_redis_url"):
        urls = app.conf.get(name)
        for url in urls if isinstance(urls, (list, tuple)) else [urls]:
            if isinstance(url, str):
                for part in url.split(";"):
                    try:
                        password = urlsplit(part.strip()).password
                    except ValueError:
                        password = None
                    if password:
                        found += [password, unquote(password)]
    for name in ("leases_redis_transport_options", "broker_transport_options",
                 "result_backend_transport_options"):
        options = app.conf.get(name)
        if isinstance(options, dict):
            for holder in (options, options.get("sentinel_kwargs")):
                if isinstance(holder, dict) and isinstance(holder.get("password"), str):
                    found.append(holder["password"])
    # Longest first, so a password containing another is replaced whole.
    return sorted({s for s in found if s}, key=len, reverse=True)


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return " ".join(text.split())  # one line


def _command(fn: Callable) -> Callable:
    """Run a subcommand; expected failures become one line on stderr and an exit status."""
    @functools.wraps(fn)
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(ctx, *args, **kwargs)
        except NotFound as exc:
            status, message = 1, str(exc)
        except LeaseUnavailable as exc:
            status, message = EX_UNAVAILABLE, str(exc)
        except (LeaseError, redis.RedisError, OSError) as exc:
            status, message = 1, str(exc) or type(exc).__name__
        logger.debug("celery leases %s failed", ctx.info_name, exc_info=True)
        click.echo(f"celery leases {ctx.info_name}: error: {_scrub(message, _secrets(ctx.obj.app))}",
                   err=True)
        ctx.exit(status)
    return wrapper


def _store(ctx: click.Context) -> LeaseStore:
    from .install import store
    return store(ctx.obj.app)


def _prefix(ctx: click.Context) -> str:
    return client_config(ctx.obj.app).key_prefix


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


# -- formatting -------------------------------------------------------------------


def duration(ms: float) -> str:
    """A duration for people: 850ms -> 0.9s, 125s -> 2m05s, 2h03m, 3d04h."""
    s = max(0.0, ms / 1000.0)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000.0, timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def _ago(at_ms: int, now_ms: int) -> str:
    return f"{duration(now_ms - at_ms)} ago" if at_ms else "-"


def _deadline(record: LeaseRecord, now_ms: int) -> str:
    """Deadline relative to now, or "-" when the record is not in the deadline index."""
    if not record.deadline:
        return "-"
    if record.deadline > now_ms:
        return f"in {duration(record.deadline - now_ms)}"
    return f"due {duration(now_ms - record.deadline)} ago"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def record_json(record: LeaseRecord, now_ms: int) -> dict:
    """A record as JSON, with its times also relative to the server's now (seconds)."""
    return {
        "task_id": record.task_id, "name": record.name, "state": record.state,
        "token": record.token, "owner": record.owner, "generation": record.generation,
        "recoveries": record.recoveries, "attempt": record.attempt,
        "ttl_s": record.ttl / 1000.0,
        "deadline_ms": record.deadline or None,
        "deadline_in_s": (record.deadline - now_ms) / 1000.0 if record.deadline else None,
        "acquired_at_ms": record.acquired_at or None,
        "finished_at_ms": record.finished_at or None,
        "progress_timeout_s": record.progress_timeout / 1000.0 if record.progress_timeout else None,
        "progress_deadline_ms": record.progress_deadline or None,
        "has_message": record.has_message,
        "history": [{"token": t, "owner": o, "acquired_at_ms": at} for t, o, at in record.history],
    }


LS_HEADERS = ("TASK ID", "NAME", "STATE", "TOKEN", "OWNER", "GEN", "RECOV", "DEADLINE", "FINISHED")


def _ls_row(r: LeaseRecord, now_ms: int) -> tuple:
    return (r.task_id, r.name or "-", r.state, r.token, r.owner or "-", r.generation, r.recoveries,
            _deadline(r, now_ms), _ago(r.finished_at, now_ms))


# -- the command group --------------------------------------------------------------


@click.group(name="leases")
@click.pass_context
def leases(ctx: click.Context, **kwargs: Any) -> None:
    """Inspect and maintain the leases of the app (-A): ls, show, recover, stats, top, purge."""


def _indexed(store: LeaseStore, limit: int, state: str | None) -> list[LeaseRecord]:
    """Records in the deadline index, soonest deadline first, optionally of one state."""
    n = max(limit, 1)
    while True:
        rows = store.active(n)
        records = [r for r in store.records([t for t, _ in rows], skip_corrupt=True)
                   if state is None or r.state == state]
        if len(records) >= limit or len(rows) < n:
            return records[:limit]
        n *= 4


@leases.command(cls=CeleryCommand)
@click.option("--state", type=click.Choice(STATE_CHOICES), default=None,
              help="Without it, or with 'active': the leases in the deadline index (active ones, "
                   "and recoveries not yet confirmed), soonest deadline first; cheap. Any other "
                   "state, 'finished' (succeeded, failed, revoked, dead) or 'all': records found "
                   "by SCAN MATCH on the record prefix, in no order; its cost grows with the "
                   "number of keys in the database.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Show at most this many leases.")
@json_option
@click.pass_context
@_command
def ls(ctx: click.Context, state: str | None, limit: int, as_json: bool) -> None:
    """List leases: live ones from the deadline index, or records of a state."""
    store = _store(ctx)
    if state in (None, ACTIVE):
        source, records = "index", _indexed(store, limit, state)
    elif state == "finished":
        source, records = "scan", [r for r in store.scan() if r.state in TERMINAL_STATES][:limit]
    else:
        source, records = "scan", store.scan(state=None if state == "all" else state, limit=limit)
    now = store.server_time_ms()
    if as_json:
        _emit_json({"prefix": _prefix(ctx), "source": source, "now_ms": now,
                    "leases": [record_json(r, now) for r in records]})
        return
    if not records:
        click.echo(f"no leases{'' if state is None else f' in state {state}'} "
                   f"(prefix {_prefix(ctx)}, {store.description})")
        return
    click.echo(table(LS_HEADERS, (_ls_row(r, now) for r in records)))


@leases.command(cls=CeleryCommand)
@click.argument("task_id")
@json_option
@click.pass_context
@_command
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one task's lease: record, token history, recoveries, deadline."""
    store = _store(ctx)
    record = store.get(task_id)
    if record is None:
        raise NotFound(f"no lease record for task {task_id} (prefix {_prefix(ctx)}, "
                       f"{store.description}): never leased, or its record expired or was purged")
    steps = store.completed_steps(task_id)
    now = store.server_time_ms()
    if as_json:
        _emit_json({**record_json(record, now), "now_ms": now, "steps": steps})
        return
    progress = "off"
    if record.progress_timeout:
        progress = f"every {duration(record.progress_timeout)}"
        if record.progress_deadline and record.state == ACTIVE:
            progress += f", next report {_relative(record.progress_deadline, now)}"
    if record.deadline:
        deadline = f"{_deadline(record, now)} ({_iso(record.deadline)})"
    elif record.state in TERMINAL_STATES:
        deadline = "- (finished)"
    else:
        deadline = "- (waiting in the broker for a delivery)"
    fields = [
        ("task", record.task_id), ("name", record.name or "-"), ("state", record.state),
        ("owner", record.owner or "- (none)"), ("token", record.token),
        ("generation", record.generation), ("recoveries", record.recoveries),
        ("attempt", record.attempt), ("ttl", duration(record.ttl) if record.ttl else "-"),
        ("deadline", deadline),
        ("acquired", f"{_ago(record.acquired_at, now)} ({_iso(record.acquired_at)})"
         if record.acquired_at else "-"),
        ("finished", f"{_ago(record.finished_at, now)} ({_iso(record.finished_at)})"
         if record.finished_at else "-"),
        ("progress", progress),
        ("message", "stored (recovery can re-publish it)" if record.has_message else "-"),
    ]
    click.echo("\n".join(f"{k:<11} {v}" for k, v in fields))
    click.echo("\nowners, oldest first:")
    click.echo(_indent(table(("TOKEN", "OWNER", "ACQUIRED", "AT"),
                             ((t, o, _ago(at, now), _iso(at)) for t, o, at in record.history))))
    if steps:
        click.echo("\nonce-only steps done:")
        click.echo(_indent(table(("STEP", "TOKEN"), sorted(steps.items()))))


def _relative(at_ms: int, now_ms: int) -> str:
    return f"in {duration(at_ms - now_ms)}" if at_ms > now_ms else f"{duration(now_ms - at_ms)} ago"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


@leases.command(cls=CeleryCommand)
@click.option("--dry-run", is_flag=True,
              help="Only list the leases that are due (deadline passed); claim and publish nothing.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Claim at most this many leases (default: all that are due).")
@json_option
@click.pass_context
@_command
def recover(ctx: click.Context, dry_run: bool, limit: int | None, as_json: bool) -> None:
    """Run one recovery pass now: re-publish tasks whose lease expired."""
    store = _store(ctx)
    if dry_run:
        records = store.records(store.expired(limit or 1000), skip_corrupt=True)
        now = store.server_time_ms()
        if as_json:
            _emit_json({"dry_run": True, "now_ms": now, "due": [record_json(r, now) for r in records]})
            return
        if not records:
            click.echo("nothing is due for recovery")
            return
        max_recoveries = client_config(ctx.obj.app).max_recoveries
        click.echo(f"{len(records)} lease(s) due for recovery (dry run: nothing claimed; a task "
                   f"recovered {max_recoveries} time(s) already becomes dead instead):")
        click.echo(table(("TASK ID", "NAME", "STATE", "OWNER", "GEN", "RECOV", "DEADLINE"),
                         ((r.task_id, r.name or "-", r.state, r.owner or "-", r.generation,
                           r.recoveries, _deadline(r, now)) for r in records)))
        return
    report = store.recover(limit=limit)
    errors = [{"task_id": task_id, "error": _scrub(repr(exc), _secrets(ctx.obj.app))}
              for task_id, exc in report.errors]
    if as_json:
        _emit_json({**report.as_dict(), "errors": errors})
    else:
        click.echo(f"recovered {report.recovered}, dead {report.dead}, "
                   f"publish failed {report.publish_failed}, corrupt {report.corrupt}")
        for error in errors:
            click.echo(f"  {error['task_id']}: {error['error']} (claimed again after the publish grace)")
    if report.publish_failed:
        ctx.exit(1)


def _stats(store: LeaseStore, scan: bool) -> dict:
    now = store.server_time_ms()
    counters = {name: 0 for name in COUNTERS}
    counters.update(store.stats())
    indexed = counters.pop("indexed", 0)
    live = _indexed(store, indexed, None) if indexed else []
    records = store.scan() if scan else live
    states = {state: 0 for state in STATES}
    for record in records:
        states[record.state] = states.get(record.state, 0) + 1
    active = [r for r in live if r.state == ACTIVE and r.acquired_at]
    oldest = min(active, key=lambda r: r.acquired_at, default=None)
    return {
        "store": store.description, "now_ms": now,
        "states": states, "states_from": "scan" if scan else "index",
        "indexed": indexed, "due": sum(1 for r in live if r.deadline and r.deadline <= now),
        "oldest_active": None if oldest is None else {
            "task_id": oldest.task_id, "name": oldest.name, "age_s": (now - oldest.acquired_at) / 1000.0},
        "counters": counters,
    }


@leases.command(cls=CeleryCommand)
@click.option("--scan/--no-scan", default=True, show_default=True,
              help="Count records of every state with SCAN MATCH on the record prefix (its cost "
                   "grows with the keys in the database); --no-scan counts only the leases in the "
                   "deadline index (active, and recoveries not yet confirmed).")
@json_option
@click.pass_context
@_command
def stats(ctx: click.Context, scan: bool, as_json: bool) -> None:
    """Counts by state, lifetime counters and the oldest active lease."""
    data = {"prefix": _prefix(ctx), **_stats(_store(ctx), scan)}
    if as_json:
        _emit_json(data)
        return
    oldest = data["oldest_active"]
    click.echo(f"lease store {data['store']}, prefix {data['prefix']}")
    click.echo(f"\nrecords by state ({'all records, SCAN' if scan else 'deadline index only'}):")
    click.echo(_indent(table(("STATE", "COUNT"), data["states"].items())))
    click.echo(f"\ndeadline index: {data['indexed']} lease(s), {data['due']} due now")
    click.echo("oldest active lease: " + ("-" if oldest is None else
               f"{duration(oldest['age_s'] * 1000)} ({oldest['name'] or '-'}[{oldest['task_id']}])"))
    click.echo("\nlifetime counters:")
    click.echo(_indent(table(("COUNTER", "VALUE"), data["counters"].items())))


@leases.command(cls=CeleryCommand)
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--rows", type=click.IntRange(min=1), default=10, show_default=True,
              help="Leases with the soonest deadlines to show.")
@click.option("--iterations", type=click.IntRange(min=1), default=None,
              help="Stop after this many refreshes (default: until Ctrl-C).")
@json_option
@click.pass_context
@_command
def top(ctx: click.Context, interval: float, rows: int, iterations: int | None, as_json: bool) -> None:
    """Live view of the deadline index and the counters, refreshed until Ctrl-C.

    Reads only the index (its size, what is due, the soonest deadlines) and the
    counters: cheap enough to leave running. --json prints one object per line.
    """
    store, prefix = _store(ctx), _prefix(ctx)
    previous: dict | None = None
    n = 0
    try:
        while iterations is None or n < iterations:
            if n:
                time.sleep(interval)
            n += 1
            counters = store.stats()
            indexed = counters.pop("indexed", 0)
            due = len(store.expired(10_000))
            soonest = store.records([t for t, _ in store.active(rows)], skip_corrupt=True)
            now = store.server_time_ms()
            delta = {k: v - (previous or {}).get(k, v) for k, v in counters.items()}
            previous = counters
            if as_json:
                click.echo(json.dumps({"now_ms": now, "indexed": indexed, "due": due,
                                       "counters": counters, "delta": delta,
                                       "soonest": [record_json(r, now) for r in soonest]}))
                continue
            if sys.stdout.isatty():
                click.clear()
            elif n > 1:
                click.echo()
            click.echo(f"celery leases top - prefix {prefix}, {store.description} - {_iso(now)}")
            click.echo(f"indexed {indexed}   due now {due if due < 10_000 else '10000+'}   " + "   ".join(
                f"{k} {counters.get(k, 0)} (+{delta.get(k, 0)})"
                for k in ("acquired", "recovered", "dead", "refused", "stalled")))
            click.echo(table(("TASK ID", "NAME", "STATE", "OWNER", "TOKEN", "DEADLINE"),
                             ((r.task_id, r.name or "-", r.state, r.owner or "-", r.token,
                               _deadline(r, now)) for r in soonest)) if soonest else "no leases")
    except KeyboardInterrupt:
        pass


@leases.command(cls=CeleryCommand)
@click.option("--older-than", type=click.FloatRange(min=0), default=0.0, show_default=True,
              metavar="SECONDS", help="Only records that finished at least this long ago.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
@_command
def purge(ctx: click.Context, older_than: float, yes: bool, as_json: bool) -> None:
    """Delete finished records (succeeded, failed, revoked, dead); never active or recovering ones.

    Records are found by SCAN MATCH on the record prefix. A deleted record no
    longer refuses late duplicate deliveries of its task (such a copy would run
    again), which is what leases_retention is for: purge only to reclaim memory
    after an incident.
    """
    store = _store(ctx)
    if not yes:
        count = store.purge(older_than, dry_run=True)
        if not count:
            if as_json:
                _emit_json({"purged": 0})
            else:
                click.echo("nothing to purge")
            return
        click.confirm(f"Delete {count} finished lease record(s) finished {duration(older_than * 1000)} "
                      f"ago or more (prefix {_prefix(ctx)})? Late duplicates of those tasks "
                      f"would run again", abort=True, err=True)
    purged = store.purge(older_than)
    if as_json:
        _emit_json({"purged": purged})
    else:
        click.echo(f"purged {purged} finished lease record(s)")


# -- parked deliveries ---------------------------------------------------------------


def parked_json(entry: Parked, now_ms: int) -> dict:
    return {"task_id": entry.task_id, "name": entry.name, "reason": entry.reason, "key": entry.key,
            "field": entry.field, "parked_at_ms": entry.parked_at,
            "parked_age_s": max(0, now_ms - entry.parked_at) / 1000.0, "count": entry.count,
            "body_size": entry.body_size}


@leases.command(cls=CeleryCommand)
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              help="List at most this many, oldest first.")
@json_option
@click.pass_context
@_command
def parked(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List deliveries parked instead of run (a corrupt record, a malformed message), oldest first."""
    store = _store(ctx)
    entries = store.parked(limit)
    now = store.server_time_ms()
    if as_json:
        _emit_json({"now_ms": now, "parked": [parked_json(e, now) for e in entries]})
        return
    if not entries:
        click.echo("no parked deliveries")
        return
    click.echo(table(("TASK ID", "NAME", "PARKED", "TIMES", "KEY", "FIELD", "REASON"),
                     ((e.task_id, e.name or "-", _ago(e.parked_at, now), e.count, e.key or "-",
                       e.field or "-", e.reason) for e in entries)))
    click.echo("\nreplay one with: celery leases replay TASK_ID (see docs/operations.md)")


@leases.command(cls=CeleryCommand)
@click.argument("task_id")
@click.option("--reset-record", is_flag=True,
              help="Delete the task's lease record first (a corrupt one, or a finished one whose "
                   "task must run again); without it, replay refuses while the record is corrupt.")
@json_option
@click.pass_context
@_command
def replay(ctx: click.Context, task_id: str, reset_record: bool, as_json: bool) -> None:
    """Re-publish a parked delivery under the same task id, with its original routing."""
    from .recovery import publish_raw

    store, app = _store(ctx), ctx.obj.app
    if store.parked_entry(task_id) is None:
        raise NotFound(f"no parked delivery for task {task_id} (prefix {_prefix(ctx)}): "
                       f"see `celery leases parked`")
    reset = False
    if reset_record:
        reset = store.reset_record(task_id)
        record = None
    else:
        try:
            record = store.get(task_id)
        except CorruptRecord as exc:
            raise LeaseError(f"task {task_id}: its lease record {store.keys.record(task_id)} is still "
                             f"corrupt ({exc}); a replayed copy would be parked again. Fix the record, "
                             f"or replay with --reset-record to delete it first") from None
        if record is not None and record.state in TERMINAL_STATES:
            raise LeaseError(f"task {task_id}: its lease record is {record.state}, so a replayed copy "
                             f"would be refused as finished; replay with --reset-record to run it again")
    entry = store.unpark(task_id)
    if entry is None:
        raise NotFound(f"no parked delivery for task {task_id}: replayed or dropped meanwhile")
    if not entry.body or not entry.envelope:
        store.park(task_id, entry.reason, name=entry.name, body=entry.body, envelope=entry.envelope,
                   key=entry.key, field=entry.field)
        raise LeaseError(f"task {task_id}: the parked delivery holds no message to re-publish "
                         f"(reason: {entry.reason})")
    headers = dict(entry.envelope.get("headers") or {})
    if record is not None:
        # The record waits for a copy of its own generation (a recovering record refuses older ones).
        headers["lease_generation"] = record.generation
    try:
        # The parked delivery's DeliveryParked failure is forgotten: waiters wait for the replay.
        app.backend.forget(task_id)
        publish_raw(app, entry.body, entry.envelope, headers)
    except Exception:
        store.park(task_id, entry.reason, name=entry.name, body=entry.body, envelope=entry.envelope,
                   key=entry.key, field=entry.field)
        raise
    if as_json:
        _emit_json({"replayed": task_id, "name": entry.name, "record_reset": reset})
    else:
        click.echo(f"replayed {entry.name or '-'}[{task_id}] under the same id"
                   + (" (its lease record was deleted first)" if reset else ""))
