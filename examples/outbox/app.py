"""A shop that sends its welcome e-mail through the outbox (SQLite, no setup).

    REDIS_URL=redis://127.0.0.1:6379/0 OUTBOX_EXAMPLE_DB=shop.db celery -A app worker -l info

``leases_outbox_url`` names the shop's own database: every worker of this app relays
its outbox (publishes the committed rows, then deletes them). The shop writes a user
and the task that welcomes them in one transaction (``signup``): both, or neither.

Environment: REDIS_URL (broker, result backend and lease store); OUTBOX_EXAMPLE_DB
(the SQLite file); OUTBOX_EXAMPLE_PREFIX (lease key prefix and queue name).
"""
from __future__ import annotations

import os
import sqlite3

import redis
from celery import Celery

import celery_leases
from celery_leases import LeasedTask, outbox

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DB = os.environ.get("OUTBOX_EXAMPLE_DB", "shop.db")
PREFIX = os.environ.get("OUTBOX_EXAMPLE_PREFIX", "outbox-example")

app = Celery("outbox_example", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=PREFIX,
    leases_key_prefix=PREFIX,
    leases_outbox_url=f"sqlite:///{DB}",    # the workers relay this database's outbox
    leases_outbox_poll_interval=0.2,        # SQLite has no NOTIFY: the relay looks this often
)
celery_leases.install(app)
runs = redis.Redis.from_url(REDIS_URL)


@app.task(base=LeasedTask, bind=True)
def welcome(self, user_id: int, email: str) -> str:
    runs.rpush(f"{PREFIX}:runs", f"{self.request.id} {user_id} {self.lease.token}")
    return f"welcome mail to {email} (user {user_id})"


def connect() -> sqlite3.Connection:
    conn = sqlite3.connect(DB, timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, email TEXT UNIQUE)")
    return conn


def signup(conn: sqlite3.Connection, email: str):
    """Write the user and the task that welcomes them, in the caller's transaction."""
    cur = conn.execute("INSERT INTO users (email) VALUES (?)", (email,))
    return outbox.send(conn, welcome.s(cur.lastrowid, email))
