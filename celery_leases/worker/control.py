"""``celery -A proj inspect leases``: the leases a worker holds, from Celery's remote control.

Registered in Celery's global command registry (``Panel``) when this module is
imported, which ``install(app)`` does; the ``celery inspect`` program checks a
command name against that registry in its own process, so the app module
(``-A proj``) must import celery_leases.install, as it does by calling it.

The answer comes from the worker's memory (its heartbeat's held leases), not
from the store: it is what the worker believes it holds, and it answers even
while the store is unreachable. ``deadline`` is the latest moment the worker
knows its lease to live (its last renewal or acquisition plus the ttl) on the
store's clock as last read by the worker; the store's own deadline is a few
milliseconds later.

The reply keeps Celery's shape (a list of plain dicts, as ``inspect active``
answers), so ``celery inspect leases --json`` and
``app.control.broadcast("leases", reply=True)`` give the data as it is. For
people, ``celery inspect leases`` prints it as a table per worker
(cli/inspect_leases.py) and ``celery leases ls --workers`` (cli/workers.py) as
one table of all workers, both from ``cli.format.held_row``.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from celery.worker.control import inspect_command

from ..runtime import get_worker

__all__ = ["COMMAND", "held_leases", "leases"]

#: The inspect command's name: ``celery inspect leases``, ``broadcast("leases")``.
COMMAND = "leases"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000.0, timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def held_leases(worker: Any) -> list[dict]:
    """The leases ``worker`` (a LeaseWorker) holds, soonest deadline first, as plain values.

    Per lease: task_id, name, token, deadline (ISO 8601, UTC) and deadline_ms
    (server-clock ms; None before the store's clock was read), running_for
    (seconds since the pool started the task; None while it waits, prefetched
    or with an ETA), held_for (seconds since the lease was asked for), started
    and lost.
    """
    heartbeat = worker.heartbeat
    held = heartbeat.held.snapshot()
    server_now = worker.clock.estimate_ms()
    mono, wall = time.monotonic(), time.time()
    out = []
    for task_id, lease in held:
        request = lease.request
        deadline_ms = None
        if server_now is not None and lease.live_until:
            deadline_ms = server_now + int((lease.live_until - mono) * 1000)
        time_start = getattr(request, "time_start", None)
        state = getattr(request, "__dict__", {}).get("_lease")
        asked_at = state.asked_at if state is not None else None
        out.append({
            "task_id": task_id,
            "name": getattr(request, "name", None) or "",
            "token": lease.token,
            "deadline": _iso(deadline_ms) if deadline_ms is not None else None,
            "deadline_ms": deadline_ms,
            "running_for": round(max(0.0, wall - time_start), 3) if time_start else None,
            "held_for": round(max(0.0, mono - asked_at), 3) if asked_at else None,
            "started": lease.started,
            "lost": lease.lost,
        })
    out.sort(key=lambda entry: (entry["deadline_ms"] is None, entry["deadline_ms"] or 0))
    return out


@inspect_command(name=COMMAND)
def leases(state: Any, **kwargs: Any) -> list[dict]:
    """List the celery-leases leases this worker holds (a table; --json: the data)."""
    worker = get_worker(state.app)
    return [] if worker is None else held_leases(worker)
