"""The read-only commands: ``ls``, ``show``, ``stats`` and ``top``."""
from __future__ import annotations

import json
import sys
import time
from fnmatch import fnmatchcase
from typing import Callable

import click

from ..protocol.codes import ACTIVE, RECOVERING, STATES, TERMINAL_STATES
from ..protocol.records import LeaseRecord
from ..protocol.store import LeaseStore
from . import workers
from .counters import StatsHelp
from .counters import explain as explain_counter
from .base import (COUNTERS, STATE_CHOICES, HelpArgument, LeasesCommand, NotFound, _command, _emit_json, _prefix,
                   _store, json_option, task_id_argument)
from .format import (LS_HEADERS, _ago, _deadline, _indent, _iso, _ls_row, _relative, _running, duration,
                     record_json, table)


Match = Callable[[LeaseRecord], bool]
#: The states of the records in the deadline index: what ``stats --no-scan`` counts.
INDEXED_STATES = (ACTIVE, RECOVERING)


def matcher(name: str | None, worker: str | None) -> Match:
    """A test of ``--name`` and ``--worker``: shell-style patterns (an exact value matches itself).

    ``--worker`` matches the owner's worker hostname (``celery@web-1``), or the
    whole owner id (``celery@web-1:4123:9f2c1a``).
    """
    def match(record: LeaseRecord) -> bool:
        if name is not None and not fnmatchcase(record.name or "", name):
            return False
        if worker is not None:
            owner = record.owner or ""
            return fnmatchcase(owner, worker) or fnmatchcase(owner.rsplit(":", 2)[0], worker)
        return True
    return match


def _indexed(store: LeaseStore, limit: int, state: str | None, match: Match | None = None) -> list[LeaseRecord]:
    """Records in the deadline index, soonest deadline first, optionally of one state and matching."""
    n = max(limit, 1)
    while True:
        rows = store.active(n)
        records = [r for r in store.records([t for t, _ in rows], skip_corrupt=True)
                   if (state is None or r.state == state) and (match is None or match(r))]
        if len(records) >= limit or len(rows) < n:
            return records[:limit]
        n *= 4


def filter_options(fn: Callable) -> Callable:
    """``--name`` and ``--worker``, shared by ``ls`` and ``top``."""
    fn = click.option("--worker", metavar="PATTERN", default=None,
                      help="Only leases owned by this worker: its hostname (celery@web-1) or "
                           "owner id, shell-style pattern allowed (celery@web-*).")(fn)
    return click.option("--name", metavar="PATTERN", default=None,
                        help="Only tasks of this name, shell-style pattern allowed "
                             "(proj.tasks.*).")(fn)


@click.command(cls=LeasesCommand)
@click.option("--state", type=click.Choice(STATE_CHOICES), default=None,
              help="Without it, or with 'active': the leases in the deadline index (active ones, "
                   "and recoveries not yet confirmed), soonest deadline first; cheap. Any other "
                   "state, 'finished' (succeeded, failed, revoked, dead) or 'all': records found "
                   "by SCAN MATCH on the record prefix, in no order; its cost grows with the "
                   "number of keys in the database.")
@filter_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Show at most this many leases.")
@click.option("--workers", "from_workers", is_flag=True,
              help="Ask the running workers instead of the store (Celery's remote control, as "
                   "`celery inspect leases`): the leases each worker holds, by worker.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="With --workers: seconds to wait for the workers' replies.")
@json_option
@click.pass_context
@_command
def ls(ctx: click.Context, state: str | None, name: str | None, worker: str | None, limit: int,
       from_workers: bool, timeout: float, as_json: bool) -> None:
    """List leases: live ones from the deadline index, or records of a state."""
    if from_workers:
        if state not in (None, ACTIVE):
            raise click.UsageError("--workers lists the leases workers hold: --state does not apply")
        workers.ls_workers(ctx, name, worker, limit, timeout, as_json)
        return
    store, match = _store(ctx), matcher(name, worker)
    if state in (None, ACTIVE):
        source, records = "index", _indexed(store, limit, state, match)
    elif state == "finished":
        source, records = "scan", [r for r in store.scan() if r.state in TERMINAL_STATES and match(r)][:limit]
    elif name is None and worker is None:
        source, records = "scan", store.scan(state=None if state == "all" else state, limit=limit)
    else:
        source, records = "scan", [r for r in store.scan(state=None if state == "all" else state)
                                   if match(r)][:limit]
    now = store.server_time_ms()
    if as_json:
        _emit_json({"prefix": _prefix(ctx), "source": source, "now_ms": now,
                    "leases": [record_json(r, now) for r in records]})
        return
    if not records:
        click.echo(f"no leases{'' if state is None else f' in state {state}'}"
                   f"{' matching the filters' if name or worker else ''} "
                   f"(prefix {_prefix(ctx)}, {store.description})")
        return
    click.echo(table(LS_HEADERS, (_ls_row(r, now) for r in records)))


@click.command(cls=LeasesCommand)
@click.argument("task_id", cls=HelpArgument, callback=task_id_argument,
                help="The Celery task id (as in AsyncResult(TASK_ID)).")
@json_option
@click.pass_context
@_command
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show the lease of the task TASK_ID: record, token history, recoveries, deadline."""
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


def _stats(store: LeaseStore, scan: bool) -> dict:
    now = store.server_time_ms()
    counters = {name: 0 for name in COUNTERS}
    counters.update(store.stats())
    indexed = counters.pop("indexed", 0)
    live = _indexed(store, indexed, None) if indexed else []
    records = store.scan() if scan else live
    # Without the scan only the index's states are counted; the others are None ("not counted").
    states: dict[str, int | None] = {state: 0 if scan or state in INDEXED_STATES else None
                                     for state in STATES}
    for record in records:
        states[record.state] = (states.get(record.state) or 0) + 1
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


class StatsCommand(StatsHelp, LeasesCommand):
    """``stats``: its --help ends with each lifetime counter and what it counts."""


@click.command(cls=StatsCommand)
@click.option("--scan/--no-scan", default=True, show_default=True,
              help="Count records of every state with SCAN MATCH on the record prefix (its cost "
                   "grows with the keys in the database); --no-scan counts only the leases in the "
                   "deadline index (active, and recoveries not yet confirmed) and says \"not "
                   "counted\" (JSON: null) for the other states.")
@click.option("--explain", is_flag=True,
              help="Add a column saying what each lifetime counter counts (listed below too).")
@json_option
@click.pass_context
@_command
def stats(ctx: click.Context, scan: bool, explain: bool, as_json: bool) -> None:
    """Counts by state, lifetime counters and the oldest active lease.

    The lifetime counters are cluster-wide totals of this key prefix, kept in
    the lease store since it was first used (they never reset).
    """
    data = {"prefix": _prefix(ctx), **_stats(_store(ctx), scan)}
    if as_json:
        _emit_json(data)
        return
    oldest = data["oldest_active"]
    click.echo(f"lease store {data['store']}, prefix {data['prefix']}")
    click.echo(f"\nrecords by state ({'all records, SCAN' if scan else 'deadline index only'}):")
    click.echo(_indent(table(("STATE", "COUNT"), ((state, "not counted" if count is None else count)
                                                   for state, count in data["states"].items()))))
    click.echo(f"\ndeadline index: {data['indexed']} lease(s), {data['due']} due now")
    click.echo("oldest active lease: " + ("-" if oldest is None else
               f"{duration(oldest['age_s'] * 1000)} ({oldest['name'] or '-'}[{oldest['task_id']}])"))
    click.echo("\nlifetime counters" + ("" if explain else " (what each counts: --explain, or --help)") + ":")
    if explain:
        click.echo(_indent(table(("COUNTER", "VALUE", "COUNTS"),
                                 ((k, v, explain_counter(k) or "-") for k, v in data["counters"].items()))))
    else:
        click.echo(_indent(table(("COUNTER", "VALUE"), data["counters"].items())))


@click.command(cls=LeasesCommand)
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--rows", type=click.IntRange(min=1), default=10, show_default=True,
              help="Leases with the soonest deadlines to show.")
@click.option("--iterations", type=click.IntRange(min=1), default=None,
              help="Stop after this many refreshes (default: until Ctrl-C).")
@filter_options
@json_option
@click.pass_context
@_command
def top(ctx: click.Context, interval: float, rows: int, iterations: int | None, name: str | None,
        worker: str | None, as_json: bool) -> None:
    """Live view of the deadline index and the counters, refreshed until Ctrl-C.

    Reads only the index (its size, what is due, the soonest deadlines) and the
    counters: cheap enough to leave running. --json prints one object per line.
    """
    store, prefix = _store(ctx), _prefix(ctx)
    match = None if name is None and worker is None else matcher(name, worker)
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
            soonest = _indexed(store, rows, None, match)
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
            click.echo(table(("TASK ID", "NAME", "STATE", "OWNER", "TOKEN", "RUNNING", "DEADLINE"),
                             ((r.task_id, r.name or "-", r.state, r.owner or "-", r.token,
                               _running(r, now), _deadline(r, now)) for r in soonest))
                       if soonest else "no leases")
    except KeyboardInterrupt:
        pass
