"""The transactional outbox: a task exists if and only if the caller's transaction commits.

    from celery_leases import outbox

    with psycopg.connect(DSN) as conn:             # or sqlite3, psycopg2, a SQLAlchemy
        conn.execute("UPDATE orders ...")          # Connection or Session, django.db.connection
        result = outbox.send(conn, charge.s(order_id))
    # committed: the task will run, once; result.id is known already

``send`` writes the signature (frozen: every task id chosen now) as a row of the outbox
table, on the caller's connection, inside the caller's transaction, and returns its
``AsyncResult``. Nothing is published then. After COMMIT:

- a relay (every worker whose app sets ``leases_outbox_url``, or ``celery leases outbox
  relay``) publishes the row and deletes it; on PostgreSQL ``send`` also says ``NOTIFY``
  in the transaction, so the relays wake at COMMIT (and never for a rollback);
- a SQLAlchemy ``Session`` or a Django connection has a commit hook: the sending process
  publishes its own rows right after COMMIT, the way a relay does (claim, publish,
  delete), and the relay takes only what a dead or failing sender left.

Each row is published with the task id and the publish id chosen at ``send``; a row
published twice (a crash between publish and delete) is refused at receipt the second
time, so a committed leased task has one accepted run. The table comes from ``celery -A
proj leases outbox init`` (or the Django app's migration, ``celery_leases.contrib.django``).
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import current_app
from celery.result import AsyncResult
from kombu.utils.json import dumps

from ..config import client_config
from ..exceptions import LeaseError
from ..publishing.publish_id import new_publish_id
from .claims import claim, publish_batch
from .connections import Target, target_of
from .database import Database, Executor
from .relay import Relay, Status
from .sql import DEFAULT_TABLE, INIT_COMMAND, Table, missing_table

__all__ = ["send", "OutboxError", "Relay", "Status", "Database", "Table", "DEFAULT_TABLE",
           "INIT_COMMAND", "table_of"]

logger = logging.getLogger("celery_leases.outbox")

class OutboxError(LeaseError):
    """``send`` could not write its row (the table is missing, the connection is not one
    the outbox knows)."""


def table_of(app: Any) -> Table:
    """The outbox table ``app`` writes to (``leases_outbox_table``)."""
    return Table.parse(client_config(app).outbox_table)


def send(conn: Any, sig: Any, *, app: Any = None, publish_on_commit: bool = True) -> AsyncResult:
    """Write ``sig`` (a signature, chain, group or chord) into the outbox, in the transaction
    open on ``conn``; return its result (the task ids are chosen now).

    The task exists if and only if that transaction commits. ``conn``: a DB-API connection
    (psycopg 3, psycopg2, sqlite3, PyMySQL), a SQLAlchemy ``Connection`` or ``Session``, or
    a Django connection (``django.db.connection``; see ``celery_leases.contrib.django``).
    ``publish_on_commit=False``: leave the publish to the relay even where a commit hook
    exists. A relative ``countdown`` or ``expires`` counts from now, not from the publish.
    """
    app = app or getattr(sig, "app", None) or current_app._get_current_object()
    target = target_of(conn)
    table = table_of(app)
    sig = sig.clone()
    _absolute_times(sig)
    result = sig.freeze()
    payload = dumps(sig)
    publish_id = new_publish_id()
    db = target.dialect
    hook = publish_on_commit and target.kind in ("session", "django")
    params: tuple = (result.id, publish_id, str(sig.get("task") or "")[:255], payload)
    try:
        if db.notify(table) and not hook:  # PostgreSQL: the relays wake at COMMIT
            row_id = target.execute(db.insert_notify(table), (*params, table.channel))  # type: ignore[attr-defined]
        else:
            row_id = target.execute(db.insert(table), params)
    except Exception as exc:
        if missing_table(exc, table):
            raise OutboxError(f"celery_leases.outbox.send: the outbox table {table} does not exist in "
                              f"this database; create it with `{INIT_COMMAND}` (or the Django "
                              f"migration of celery_leases.contrib.django): {exc}") from exc
        raise
    if hook and row_id is not None:
        target.on_commit(lambda: _publish_now(app, target, table, int(row_id)))
    return result


def _absolute_times(sig: Any) -> None:
    """countdown and a relative expires count from the send, not from the publish."""
    options = sig.options
    now = datetime.now(timezone.utc)
    countdown = options.pop("countdown", None)
    if countdown is not None and options.get("eta") is None:
        options["eta"] = now + timedelta(seconds=float(countdown))
    expires = options.get("expires")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        options["expires"] = now + timedelta(seconds=float(expires))


# -- the commit hooks' publish -------------------------------------------------------


def _publish_now(app: Any, target: Target, table: Table, row_id: int) -> None:
    """Right after COMMIT, in the sending process: claim this row, publish, delete, as a relay
    does; a failure leaves it to the relay (logged)."""
    try:
        if target.kind == "session":
            with target.engine().connect() as sa_conn:  # type: ignore[attr-defined]
                _claim_and_publish(app, _SQLAlchemyExecutor(sa_conn, target.dialect), table, row_id)
        else:
            from django.db import transaction
            ex = _DjangoExecutor(target.conn, target.dialect)
            if target.dialect.skip_locked:
                with transaction.atomic(using=target.conn.alias):
                    _claim_and_publish(app, ex, table, row_id)
            else:
                _claim_and_publish(app, ex, table, row_id)
    except Exception as exc:  # noqa: BLE001 - committed: the relay publishes it
        logger.warning("celery-leases outbox: row %d could not be published after COMMIT (%r); "
                       "a relay publishes it", row_id, exc)


def _claim_and_publish(app: Any, ex: Executor, table: Table, row_id: int) -> None:
    rows = claim(ex, table, 1, [row_id])
    if not rows:
        ex.rollback()  # a relay took it, or it was rolled back (a savepoint)
        return
    batch = publish_batch(app, ex, table, rows)
    if batch.error is not None:
        raise batch.error


class _SQLAlchemyExecutor(Executor):
    def fetch(self, sql: str, params: Any = ()) -> list:
        result = self.conn.exec_driver_sql(sql, tuple(params))
        return [tuple(r) for r in result.fetchall()] if result.returns_rows else []

    def run(self, sql: str, params: Any = ()) -> int:
        return self.conn.exec_driver_sql(sql, tuple(params)).rowcount


class _DjangoExecutor(Executor):
    """A Django connection in autocommit (after COMMIT) or inside ``atomic`` (PostgreSQL,
    MySQL: the claim's locks last to the end of the block, which commits)."""

    def fetch(self, sql: str, params: Any = ()) -> list:
        with self.conn.cursor() as cur:
            cur.execute(sql, tuple(params))
            return list(cur.fetchall()) if cur.description else []

    def run(self, sql: str, params: Any = ()) -> int:
        with self.conn.cursor() as cur:
            cur.execute(sql, tuple(params))
            return cur.rowcount

    def commit(self) -> None:
        pass  # autocommit, or the atomic block commits

    def rollback(self) -> None:
        pass
