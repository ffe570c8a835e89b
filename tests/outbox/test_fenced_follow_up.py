"""docs/fencing.md, "The next task in the same transaction": a once-only SQL step and the
task that follows it commit together, fenced, once (SQLite, the relay in this process)."""
from __future__ import annotations

import json
import sqlite3

import pytest

from celery_leases import StaleFence, fenced_update, outbox
from celery_leases.outbox import Relay
from celery_leases.outbox.database import Database

NOTIFY = "tests.support.apps.leased_app.add"


def ship(conn: sqlite3.Connection, app, order_id: str, token: int, *, crash_before_commit: bool = False) -> str:
    """The recipe's body, as an owner holding ``token`` runs it."""
    conn.execute("BEGIN IMMEDIATE")  # SQLite: the read takes the write lock
    try:
        (status,) = conn.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
        if status == "shipped":
            conn.rollback()
            return "skipped"
        fenced_update(conn, "orders", order_id, token, {"status": "shipped"})
        outbox.send(conn, app.tasks[NOTIFY].s(token, 0))
        if crash_before_commit:
            raise KeyboardInterrupt("the owner dies before COMMIT")
        conn.commit()
        return "shipped"
    except BaseException:
        conn.rollback()
        raise


def test_the_step_and_its_follow_up_commit_together_fenced_and_once(sqlite_url, outbox_env, outbox_table,
                                                                     redis_client, key_prefix):
    from tests.support.apps.leased_app import create_app
    app = create_app(outbox_env)
    database = Database(sqlite_url, outbox_table)
    database.create()
    conn = sqlite3.connect(database.sqlite_path(), isolation_level=None)
    conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT, fence BIGINT NOT NULL DEFAULT 0)")
    conn.execute("INSERT INTO orders VALUES ('o1', 'new', 0)")
    relay = Relay(app, sqlite_url, outbox_table)

    def follow_ups() -> int:
        return conn.execute(f"SELECT count(*) FROM {outbox_table}").fetchone()[0]

    # An owner (token 2) that dies before COMMIT: neither the step nor its follow-up
    with pytest.raises(KeyboardInterrupt):
        ship(conn, app, "o1", 2, crash_before_commit=True)
    assert conn.execute("SELECT status, fence FROM orders").fetchone() == ("new", 0) and follow_ups() == 0
    # The next owner (token 3) commits both
    assert ship(conn, app, "o1", 3) == "shipped"
    assert conn.execute("SELECT status, fence FROM orders").fetchone() == ("shipped", 3) and follow_ups() == 1
    # A re-run after that owner died past COMMIT (token 4) skips the step: no second follow-up
    assert ship(conn, app, "o1", 4) == "skipped"
    assert follow_ups() == 1
    # A stale owner (token 1) on a fresh order whose fence is newer: refused, nothing committed
    conn.execute("INSERT INTO orders VALUES ('o2', 'new', 5)")
    with pytest.raises(StaleFence):
        ship(conn, app, "o2", 1)
    assert conn.execute("SELECT status FROM orders WHERE id = 'o2'").fetchone() == ("new",) and follow_ups() == 1
    # The one follow-up is published, carrying the token of the owner that committed it
    assert relay.run_once() == 1
    relay.close()
    (raw,) = redis_client.lrange(key_prefix, 0, -1)
    assert json.loads(raw)["headers"]["argsrepr"] == "[3, 0]"
    conn.close()
    app.close()
