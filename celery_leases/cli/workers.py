"""``celery leases ls --workers``: the leases each running worker holds, by Celery's remote control.

The same broadcast as ``celery -A proj inspect leases`` (worker/control.py):
each worker answers from its own memory, so this works while the store is
down, and shows what every worker believes it holds (a ``LOST`` lease is one
its heartbeat found taken over or expired). This is the table for people:
``celery inspect`` prints every reply itself, a dict per lease as for
``inspect active``, and its ``--json`` is the same data as ``ls --workers
--json``.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import click

from ..exceptions import LeaseError
from .base import _emit_json, _store
from .format import duration, table

#: The remote-control command (worker/control.py).
COMMAND = "leases"
#: The table's columns: every field of the inspect reply, for people (docs/operations.md).
HEADERS = ("WORKER", "TASK ID", "NAME", "TOKEN", "HELD", "RUNNING", "DEADLINE", "LOST")


def ask_workers(app: Any, timeout: float) -> dict[str, list[dict]]:
    """{worker hostname: [held lease, ...]} from every worker that answered within ``timeout``."""
    replies = app.control.broadcast(COMMAND, reply=True, timeout=timeout) or []
    out: dict[str, list[dict]] = {}
    for reply in replies:
        for hostname, leases in reply.items():
            # A worker of an app without celery-leases answers {"error": "No such command"}.
            out[hostname] = leases if isinstance(leases, list) else []
    return dict(sorted(out.items()))


def _filter(replies: dict[str, list[dict]], name: str | None, worker: str | None,
            limit: int) -> dict[str, list[dict]]:
    out = {}
    for hostname, leases in replies.items():
        if worker is not None and not fnmatchcase(hostname, worker):
            continue
        out[hostname] = [entry for entry in leases
                         if name is None or fnmatchcase(entry.get("name") or "", name)][:limit]
    return out


def _deadline(entry: dict, now_ms: int | None) -> str:
    deadline = entry.get("deadline_ms")
    if deadline is None:
        return "-"
    if now_ms is None:
        return entry.get("deadline") or "-"
    return f"in {duration(deadline - now_ms)}" if deadline > now_ms else f"due {duration(now_ms - deadline)} ago"


def ls_workers(ctx: click.Context, name: str | None, worker: str | None, limit: int, timeout: float,
               as_json: bool) -> None:
    """Print the workers' held leases: a table by worker, or Celery's reply shape as JSON."""
    app = ctx.obj.app
    now: int | None = None
    if not as_json:
        # Read before asking: the broadcast waits out its timeout, the workers answered at its start.
        try:
            now = _store(ctx).server_time_ms()
        except LeaseError:
            pass  # the workers answer from memory; deadlines are then shown as ISO times
    replies = _filter(ask_workers(app, timeout), name, worker, limit)
    if as_json:
        _emit_json(replies)
        return
    if not replies:
        click.echo(f"no worker answered within {timeout:g}s"
                   + (" (or none matched --worker)" if worker else ""))
        return
    rows = []
    for hostname, leases in replies.items():
        for entry in leases:
            running, held = entry.get("running_for"), entry.get("held_for")
            rows.append((hostname, entry["task_id"], entry.get("name") or "-", entry.get("token"),
                         "-" if held is None else duration(held * 1000),
                         "not started" if running is None else duration(running * 1000),
                         _deadline(entry, now), "lost" if entry.get("lost") else "-"))
    empty = [hostname for hostname, leases in replies.items() if not leases]
    if rows:
        click.echo(table(HEADERS, rows))
    if empty:
        click.echo(("\n" if rows else "") + "holding no leases: " + ", ".join(empty))
