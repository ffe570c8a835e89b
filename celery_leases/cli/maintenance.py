"""The commands that change the store: ``recover``, ``purge``, ``parked`` and ``replay``."""
from __future__ import annotations

import click

from ..protocol.codes import TERMINAL_STATES
from ..config import client_config
from ..exceptions import CorruptRecord, LeaseError
from .base import (HelpArgument, LeasesCommand, NotFound, _command, _emit_json, _prefix, _scrub, _secrets, _store,
                   json_option, task_id_argument)
from .format import _ago, _deadline, duration, parked_json, record_json, table


@click.command(cls=LeasesCommand)
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
        if report.results_written:
            click.echo(f"results written {report.results_written} (kept results of tasks whose "
                       f"process died before Celery stored them)")
        for error in errors:
            click.echo(f"  {error['task_id']}: {error['error']} (claimed again after the publish grace)")
    if report.publish_failed:
        ctx.exit(1)


@click.command(cls=LeasesCommand)
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


@click.command(cls=LeasesCommand)
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


@click.command(cls=LeasesCommand)
@click.argument("task_id", cls=HelpArgument, callback=task_id_argument,
                help="The Celery task id (as in AsyncResult(TASK_ID)).")
@click.option("--reset-record", is_flag=True,
              help="Delete the task's lease record first (a corrupt one, or a finished one whose "
                   "task must run again); without it, replay refuses while the record is corrupt.")
@json_option
@click.pass_context
@_command
def replay(ctx: click.Context, task_id: str, reset_record: bool, as_json: bool) -> None:
    """Re-publish a parked delivery under the same task id, with its original routing."""
    from ..recovery.messages import publish_raw

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
