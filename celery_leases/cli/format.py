"""How ``celery leases`` prints: durations, times relative to the server's now, tables, JSON."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable, Sequence

from ..protocol.codes import ACTIVE
from ..protocol.records import LeaseRecord, Parked


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
    running = running_for_ms(record, now_ms)
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
        "running_for_s": None if running is None else running / 1000.0,
        "started": record.started,
        "has_message": record.has_message,
        "history": [{"token": t, "owner": o, "acquired_at_ms": at} for t, o, at in record.history],
    }


def running_for_ms(record: LeaseRecord, now_ms: int) -> int | None:
    """How long the current owner has held an active lease whose body started (None otherwise)."""
    if record.state != ACTIVE or not record.acquired_at or not record.started:
        return None
    return max(0, now_ms - record.acquired_at)


def _running(record: LeaseRecord, now_ms: int) -> str:
    """The RUNNING column: the time since the owner acquired the lease, or why there is none."""
    if record.state == ACTIVE and record.acquired_at and not record.started:
        return "not started"
    running = running_for_ms(record, now_ms)
    return "-" if running is None else duration(running)


LS_HEADERS = ("TASK ID", "NAME", "STATE", "TOKEN", "OWNER", "GEN", "RECOV", "RUNNING", "DEADLINE",
              "FINISHED")


def _ls_row(r: LeaseRecord, now_ms: int) -> tuple:
    return (r.task_id, r.name or "-", r.state, r.token, r.owner or "-", r.generation, r.recoveries,
            _running(r, now_ms), _deadline(r, now_ms), _ago(r.finished_at, now_ms))


#: The columns of the leases one worker holds (``celery inspect leases``); ``leases ls --workers``
#: puts WORKER before them. Every field of the inspect reply (worker/control.py), for people.
HELD_HEADERS = ("TASK ID", "NAME", "TOKEN", "HELD", "RUNNING", "DEADLINE", "LOST")


def held_row(entry: dict, now_ms: int | None) -> tuple:
    """A row of HELD_HEADERS from one lease of a worker's inspect reply.

    DEADLINE is relative to ``now_ms`` (the store's clock); without it, the
    reply's ISO time: the worker's deadline is on the store's clock, which this
    host's clock may not match.
    """
    running, held = entry.get("running_for"), entry.get("held_for")
    return (entry["task_id"], entry.get("name") or "-", entry.get("token"),
            "-" if held is None else duration(held * 1000),
            "not started" if running is None else duration(running * 1000),
            _held_deadline(entry, now_ms), "lost" if entry.get("lost") else "-")


def _held_deadline(entry: dict, now_ms: int | None) -> str:
    deadline = entry.get("deadline_ms")
    if deadline is None:
        return "-"
    if now_ms is None:
        return entry.get("deadline") or "-"
    return f"in {duration(deadline - now_ms)}" if deadline > now_ms else f"due {duration(now_ms - deadline)} ago"


def _relative(at_ms: int, now_ms: int) -> str:
    return f"in {duration(at_ms - now_ms)}" if at_ms > now_ms else f"{duration(now_ms - at_ms)} ago"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def parked_json(entry: Parked, now_ms: int) -> dict:
    return {"task_id": entry.task_id, "name": entry.name, "reason": entry.reason, "key": entry.key,
            "field": entry.field, "parked_at_ms": entry.parked_at,
            "parked_age_s": max(0, now_ms - entry.parked_at) / 1000.0, "count": entry.count,
            "body_size": entry.body_size}
