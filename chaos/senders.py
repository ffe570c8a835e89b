"""The ``kill_sender`` fault: a process sends tasks with a database transaction and is
SIGKILLed right after its COMMIT.

Leases mode sends them through the transactional outbox (``celery_leases.outbox.send``
on a SQLite file in the run directory, which the workers relay): the tasks exist from
the COMMIT on, so the process's death loses none. Plain mode does what Celery offers,
``transaction.on_commit(lambda: task.delay())``: the COMMIT, then the publishes, which
the death prevents, so those tasks are lost (reported, as everything plain mode does).

The fault's tasks join the run's workload (``Cluster.sender_tasks``, with their
COMMIT time as submission time), with sequence numbers from ``SEQ_BASE`` on, so the
checker holds them to the same invariants as the others.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos.faults import Task

__all__ = ["OUTBOX_DB", "SEQ_BASE", "TASKS_PER_SENDER", "prepare", "kill_sender", "outbox_url"]

#: The outbox's SQLite file in the run directory (chaos/app.py points the workers at it).
OUTBOX_DB = "outbox.db"
#: Sequence numbers of the senders' tasks start here (the workload's are below).
SEQ_BASE = 100_000
TASKS_PER_SENDER = 5
ROOT = Path(__file__).resolve().parent.parent


def outbox_url(run_dir: Path) -> str:
    return f"sqlite:///{Path(run_dir) / OUTBOX_DB}"


def prepare(cluster: Any) -> None:
    """Before the workers start: the outbox table (leases mode) and the fault's bookkeeping."""
    cluster.sender_tasks = []
    cluster.sender_submitted = {}
    if cluster.mode == "leases":
        from celery_leases.outbox.database import Database
        Database(outbox_url(cluster.run_dir)).create()
        with sqlite3.connect(Path(cluster.run_dir) / OUTBOX_DB) as conn:
            conn.execute("PRAGMA journal_mode=WAL")


def kill_sender(cluster: Any, pick: int) -> None:
    """Run one sender of TASKS_PER_SENDER tasks; it is SIGKILLed right after its COMMIT."""
    k = len(cluster.sender_tasks) // TASKS_PER_SENDER
    tasks = [Task(seq=SEQ_BASE + k * TASKS_PER_SENDER + j, id=f"sender{k}-{j}",
                  seconds=round(0.2 + 0.2 * ((pick + j) % 4), 3), submit_at=0.0)
             for j in range(TASKS_PER_SENDER)]
    spec = json.dumps([[t.seq, t.id, t.seconds] for t in tasks])
    out = Path(cluster.run_dir) / f"sender{k}.committed"
    env = {**os.environ, **cluster.client_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "chaos.senders", cluster.mode, outbox_url(cluster.run_dir),
                           str(out), spec], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    committed_at = float(out.read_text()) if out.exists() else None
    cluster._record("kill_sender", tasks=[t.id for t in tasks], rc=proc.returncode,
                    committed=committed_at is not None, error=proc.stderr[-300:] if proc.returncode != -9 else "")
    if committed_at is None:
        return  # died before its COMMIT: its tasks never existed
    with cluster.lock:
        cluster.sender_tasks.extend(tasks)
        for t in tasks:
            cluster.sender_submitted[t.id] = committed_at


def _sender(mode: str, url: str, out: str, spec: str) -> None:
    """The sender process: one transaction with the tasks, COMMIT, note its time, die."""
    from celery_leases.outbox.database import Database

    from chaos.app import TASK_NAME, create_app
    app = create_app(os.environ, results=False)
    tasks = json.loads(spec)
    if mode == "leases":
        import celery_leases
        from celery_leases import outbox
        conn = Database(url).connect()
        for seq, task_id, seconds in tasks:
            outbox.send(conn, app.signature(TASK_NAME, args=(seq, seconds)).set(task_id=task_id), app=app)
        conn.commit()
        assert celery_leases  # (installed by create_app)
    else:
        # transaction.on_commit(lambda: task.delay()): the publishes would follow the COMMIT.
        conn = sqlite3.connect(Database(url).sqlite_path())
        conn.execute("CREATE TABLE IF NOT EXISTS orders (n INTEGER)")
        conn.execute("INSERT INTO orders VALUES (1)")
        conn.commit()
    Path(out).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    _sender(*sys.argv[1:5])
