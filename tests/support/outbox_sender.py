"""A process that sends tasks through the outbox and dies: ``python -m tests.support.outbox_sender``.

    python -m tests.support.outbox_sender MODE URL COUNT IDS_FILE

The app is tests/support/apps/leased_app.py, configured from the environment (the test's
broker, prefix and outbox table). It sends COUNT ``add(i, i)`` tasks in one transaction,
writes their task ids to IDS_FILE (one a line), then, by MODE:

- ``after``: commits, and SIGKILLs itself at once (a raw DB-API connection: the relay
  publishes them);
- ``session-after``: a SQLAlchemy Session; SIGKILLs itself inside the commit, after COMMIT
  and before the session's commit hook could publish (a listener registered first);
- ``before``: SIGKILLs itself before COMMIT (the transaction never commits);
- ``relay-crash``: no sending: runs a relay over the outbox that SIGKILLs itself once it
  published its first batch, before the delete (URL and the app as above).
"""
from __future__ import annotations

import os
import signal
import sys


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str, url: str, count: int, ids_file: str) -> None:
    from tests.support.apps.leased_app import app
    from celery_leases import outbox
    add = app.tasks["tests.support.apps.leased_app.add"]
    if mode == "relay-crash":
        from celery_leases.outbox import claims
        original = claims._settle

        def settle(ex, table, rows, batch):
            with open(ids_file, "w") as f:
                f.write("\n".join(row.task_id for row in batch.published))
            die()  # published, not deleted
            original(ex, table, rows, batch)

        claims._settle = settle
        outbox.Relay(app, url, app.conf.leases_outbox_table).run_once()
        return
    if mode == "session-after":
        from sqlalchemy import create_engine, event
        from sqlalchemy.orm import Session
        session = Session(create_engine(url.replace("postgresql://", "postgresql+psycopg://")))
        event.listen(session, "after_commit", lambda s: die())  # before the outbox's own hook
        conn, commit = session, session.commit
    else:
        from celery_leases.outbox.database import Database
        conn = Database(url).connect()
        commit = conn.commit
    results = [outbox.send(conn, add.s(i, i)) for i in range(count)]
    with open(ids_file, "w") as f:
        f.write("\n".join(r.id for r in results))
    if mode == "before":
        die()
    commit()
    die()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
