"""Execution histories: every process appends what it did to its own JSON-lines file.

Files, not Redis: the history must survive the faults it records (a Redis restart,
a paused Redis, a SIGKILL). Each process writes ``<dir>/<worker>-<pid>.jsonl`` with
one ``os.write`` per event on an ``O_APPEND`` descriptor, so an event is either
in the kernel (and survives the SIGKILL of its writer) or was never written.

Events (field ``ev``), all with ``t`` (wall clock, seconds; one host, one clock),
``task``, ``worker`` and ``pid``:

- ``received``  worker main process, at message receipt: ``token`` (leases: the
  lease acquired there, or none), ``skip`` (why the delivery will not run), ``gen``.
- ``start``     the body started: ``exec`` (a fresh id per execution), ``token``
  (0 in plain mode), ``seq``.
- ``write``     the sink write: ``t0``/``t1`` around it, ``accepted`` (the fence
  let it in; always True in plain mode), ``token``, ``exec``.
- ``end``       the body ended (returned or raised): ``exec``, ``error``.
- ``accepted``  the outcome left the task (Celery's task_success / task_failure):
  ``exec``, ``token``, ``state``.
- ``refused``   celery-leases refused the outcome (stale_outcome_rejected): ``token``,
  ``outcome``, ``reason``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["HistoryWriter", "read_history", "by_task"]


class HistoryWriter:
    """Appends events to ``<dir>/<worker>-<pid>.jsonl``; reopens after a fork."""

    def __init__(self, directory: str | os.PathLike[str] | None, worker: str) -> None:
        self.directory = Path(directory) if directory else None
        self.worker = worker
        self._fd: int | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def _descriptor(self) -> int | None:
        if self.directory is None:
            return None
        pid = os.getpid()
        if self._fd is None or self._pid != pid:
            # A prefork child inherits the parent's writer: give it its own file.
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"{self.worker}-{pid}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = pid
        return self._fd

    def event(self, ev: str, task: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.time(), "task": task, "worker": self.worker,
                           "pid": os.getpid(), **fields}, default=str, separators=(",", ":"))
        with self._lock:
            fd = self._descriptor()
            if fd is not None:
                os.write(fd, (line + "\n").encode())


def read_history(directory: str | os.PathLike[str]) -> list[dict]:
    """Every event of every process, ordered by time. A torn last line (SIGKILL mid-write) is skipped."""
    events: list[dict] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


def by_task(events: Iterable[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for event in events:
        out.setdefault(event.get("task", "?"), []).append(event)
    return out


def iter_lines(events: Iterable[dict], since: float = 0.0) -> Iterator[str]:
    """Human-readable lines of events, times relative to ``since``."""
    for e in events:
        rest = {k: v for k, v in e.items() if k not in ("ev", "t", "task", "worker", "pid")}
        where = f"{e.get('worker', '?')}/{e.get('pid', '?')}"
        yield f"  {e.get('t', 0.0) - since:9.3f}s  {e.get('ev', '?'):<9} {where:<22} " + \
            " ".join(f"{k}={v}" for k, v in sorted(rest.items()))
