"""``celery leases ls --workers``: the leases each running worker holds, by Celery's remote control.

The same broadcast as ``celery -A proj inspect leases`` (worker/control.py):
each worker answers from its own memory, so this works while the store is
down, and shows what every worker believes it holds (a ``LOST`` lease is one
its heartbeat found taken over or expired). Both print the table of
``format.held_row``; this one puts every worker's leases in one table, filters
them, and shows deadlines relative to the store's clock. ``--json`` is the
reply as ``celery inspect leases --json`` prints it.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import click

from ..exceptions import LeaseError
from ..worker.control import COMMAND
from .base import _emit_json, _store
from .format import HELD_HEADERS, held_row, table

#: The table's columns: the worker, then every field of the inspect reply (docs/operations.md).
HEADERS = ("WORKER", *HELD_HEADERS)


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
    rows = [(hostname, *held_row(entry, now)) for hostname, leases in replies.items() for entry in leases]
    empty = [hostname for hostname, leases in replies.items() if not leases]
    if rows:
        click.echo(table(HEADERS, rows))
    if empty:
        click.echo(("\n" if rows else "") + "holding no leases: " + ", ".join(empty))
