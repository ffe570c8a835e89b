"""The payments example: charge an order's card exactly once, even across a recovery.

Three protections, one per kind of side effect (docs/fencing.md):

- the card processor is called with an **idempotency key** derived from the
  task id and the step, so a re-run (or a paused worker's late request) gets
  the first charge back instead of a second one;
- the order row in our SQLite ledger is written with a **fenced update**, so a
  worker that lost its lease cannot overwrite what the newer owner wrote;
- each step is a **once-only step** (``self.lease.once``), so a re-run skips
  the steps an earlier owner completed;
- the receipt is a task of its own, sent through the **outbox** in the fenced
  write's transaction (``outbox.send`` on the ledger's connection): the order
  is paid and its receipt will be sent, or neither (docs/fencing.md, "The next
  task in the same transaction"). The workers relay the ledger's outbox.

Configured from the environment (``run.py`` sets it): PAYMENTS_REDIS_URL,
PAYMENTS_LEDGER (SQLite file), PAYMENTS_WORKER (a name for the audit trail),
PAYMENTS_PROCESSOR_LATENCY (seconds the card processor takes to answer).
"""
from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing

from celery import Celery

import celery_leases
from celery_leases import LeasedTask, StaleFence, fenced_update, idempotency_key, outbox
from celery_leases.outbox import Database

REDIS_URL = os.environ.get("PAYMENTS_REDIS_URL", "redis://127.0.0.1:6379/0")
LEDGER = os.environ.get("PAYMENTS_LEDGER", "ledger.db")
WORKER = os.environ.get("PAYMENTS_WORKER", f"pid-{os.getpid()}")
LATENCY = float(os.environ.get("PAYMENTS_PROCESSOR_LATENCY", "1.5"))

app = Celery("payments", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue="payments",
    leases_key_prefix="payments",
    leases_ttl=2.0,                  # short, so the demo's pause outlives it quickly
    # run.py runs the recovery pass itself, so the story is explicit; in
    # production leave worker recovery on (the default) and/or run beat.
    leases_worker_recovery=False,
    worker_prefetch_multiplier=1,
    leases_outbox_url=f"sqlite:///{LEDGER}",   # every worker relays the ledger's outbox
    leases_outbox_poll_interval=0.2,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
celery_leases.install(app)

SCHEMA = """
-- The card processor's books: one row per charge it actually made. It is an
-- external system; it lives in this file only to keep the example small.
CREATE TABLE IF NOT EXISTS card_charges (
    idempotency_key TEXT PRIMARY KEY,    -- the processor charges once per key
    charge_id       TEXT NOT NULL,
    order_id        TEXT NOT NULL,
    amount_cents    INTEGER NOT NULL,
    requested_by    TEXT NOT NULL        -- the worker whose request made the charge
);
-- Our own books: the order row is only ever written with a fenced update.
CREATE TABLE IF NOT EXISTS orders (
    id           TEXT PRIMARY KEY,
    amount_cents INTEGER NOT NULL,
    status       TEXT NOT NULL DEFAULT 'pending',
    charge_id    TEXT,
    paid_by      TEXT,
    fence        INTEGER NOT NULL DEFAULT 0    -- highest lease token accepted for this row
);
-- The receipt mailer's outbox (also keyed by idempotency key).
CREATE TABLE IF NOT EXISTS receipts (
    idempotency_key TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL,
    sent_by         TEXT NOT NULL
);
-- What happened, in order: for the printout.
CREATE TABLE IF NOT EXISTS audit (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    worker TEXT NOT NULL,
    token  INTEGER,
    event  TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
"""


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(LEDGER, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def init_ledger(orders: dict[str, int]) -> None:
    """Create the tables and the pending orders (order id -> amount in cents)."""
    Database(f"sqlite:///{LEDGER}").create()   # the outbox table: celery leases outbox init
    with closing(ledger()) as db, db:
        db.execute("PRAGMA journal_mode = WAL")   # readers (a paused worker's relay) never block writers
        db.executescript(SCHEMA)
        db.executemany("INSERT OR IGNORE INTO orders (id, amount_cents) VALUES (?, ?)", orders.items())


def audit(db: sqlite3.Connection, token: int | None, event: str, detail: str = "") -> None:
    db.execute("INSERT INTO audit (worker, token, event, detail) VALUES (?, ?, ?, ?)",
               (WORKER, token, event, detail))


def card_processor_charge(key: str, order_id: str, amount_cents: int, token: int) -> str:
    """The card processor's API, simulated: slow to answer, and idempotent per key.

    Like Stripe's ``Idempotency-Key``: a request with a key seen before makes
    no new charge and returns the first one.
    """
    with closing(ledger()) as db, db:
        audit(db, token, "charge requested", f"{order_id} {amount_cents} key {key[:8]}")
    time.sleep(LATENCY)  # the network and the processor; run.py pauses worker A in here
    with closing(ledger()) as db, db:
        created = db.execute(
            "INSERT OR IGNORE INTO card_charges VALUES (?, ?, ?, ?, ?)",
            (key, f"ch_{key[:12]}", order_id, amount_cents, WORKER)).rowcount
        (charge_id,) = db.execute("SELECT charge_id FROM card_charges WHERE idempotency_key = ?",
                                  (key,)).fetchone()
        audit(db, token, "card charged" if created else "processor replayed the charge",
              f"{charge_id}" + ("" if created else " (same idempotency key: no new charge)"))
    return charge_id


def charge_card_and_record(task_id: str, order_id: str, token: int) -> str:
    """Step "charge": charge through the processor, then mark the order paid, fenced."""
    with closing(ledger()) as db:
        (amount,) = db.execute("SELECT amount_cents FROM orders WHERE id = ?", (order_id,)).fetchone()
    charge_id = card_processor_charge(idempotency_key(task_id, "charge"), order_id, amount, token)
    with closing(ledger()) as db:
        try:
            with db:  # one transaction: the fenced row, the audit line and the receipt task
                fenced_update(db, "orders", order_id, token,
                              {"status": "paid", "charge_id": charge_id, "paid_by": WORKER})
                audit(db, token, "order marked paid", f"fenced write accepted, fence = {token}")
                receipt = outbox.send(db, send_receipt.s(order_id))
                audit(db, token, "receipt task sent", f"{receipt.id[:8]} (commits with the order)")
        except StaleFence as exc:
            with db:
                audit(db, token, "fenced write refused", str(exc))
            raise
    return charge_id


@app.task(base=LeasedTask, bind=True)
def send_receipt(self, order_id: str) -> None:
    """The mailer, simulated; idempotent per key. Sent through the outbox by the step that
    marked the order paid, so it exists only if that write committed."""
    key = idempotency_key(self.request.id, "send-receipt")
    with closing(ledger()) as db, db:
        db.execute("INSERT OR IGNORE INTO receipts VALUES (?, ?, ?)", (key, order_id, WORKER))
        audit(db, self.lease.token, "receipt sent", order_id)


@app.task(base=LeasedTask, bind=True)
def charge(self, order_id: str) -> dict:
    """Charge ``order_id`` once and send its receipt once, whoever ends up running it."""
    token = self.lease.token
    with closing(ledger()) as db, db:
        audit(db, token, "task started", f"{self.request.id} on {WORKER}")
    charge_id = self.lease.once("charge", charge_card_and_record, self.request.id, order_id, token)
    if charge_id is None:  # an earlier owner completed the step: read what it recorded
        with closing(ledger()) as db:
            (charge_id,) = db.execute("SELECT charge_id FROM orders WHERE id = ?", (order_id,)).fetchone()
    return {"order": order_id, "charge_id": charge_id, "worker": WORKER, "token": token}
