"""The connections ``send`` accepts, as one interface: run a statement in the caller's
transaction, know the database, and (where the framework has one) a commit hook.

- DB-API connections: psycopg 3, psycopg2, sqlite3, PyMySQL / mysqlclient;
- SQLAlchemy 2: ``Connection`` and ``Session`` (a Session gets the commit hook);
- Django: a connection of ``django.db.connections`` (commit hook: ``transaction.on_commit``).

Nothing here imports a driver or a framework: a connection is recognised by the module
its class comes from, so a process that never uses SQLAlchemy or Django never loads them.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .sql import Dialect, dialect

__all__ = ["Target", "target_of"]

#: The DB-API modules known, by the top-level package of the connection's class.
_DBAPI = {"psycopg": ("postgresql", "%s"), "psycopg2": ("postgresql", "%s"),
          "sqlite3": ("sqlite", "?"), "_sqlite3": ("sqlite", "?"),
          "pymysql": ("mysql", "%s"), "MySQLdb": ("mysql", "%s")}


class Target:
    """Where one ``send`` writes: the caller's connection, in its open transaction."""

    #: "dbapi", "sqlalchemy", "session" or "django".
    kind = "dbapi"

    def __init__(self, conn: Any, db: Dialect) -> None:
        self.conn, self.dialect = conn, db

    def execute(self, sql: str, params: Sequence[Any]) -> Any:
        """Run ``sql``; the first column of its first row if it returns rows, else lastrowid."""
        cur = self.conn.cursor()
        try:
            cur.execute(sql, tuple(params))
            return _first(cur)
        finally:
            cur.close()

    def on_commit(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` once the caller's transaction committed; False: no hook here."""
        return False

    def key(self) -> Any:
        """What the rows sent in one transaction share (the pending rows' key)."""
        return id(self.conn)


def _first(cur: Any) -> Any:
    if cur.description:
        row = cur.fetchone()
        return row[0] if row else None
    return getattr(cur, "lastrowid", None)


class _SQLAlchemyConnection(Target):
    kind = "sqlalchemy"

    def execute(self, sql: str, params: Sequence[Any]) -> Any:
        result = self.conn.exec_driver_sql(sql, tuple(params))
        if result.returns_rows:
            row = result.fetchone()
            return row[0] if row else None
        return result.lastrowid


class _SQLAlchemySession(Target):
    """A Session: statements on its connection (joining its transaction); rows are
    published by the session's ``after_commit`` event (outbox/fast.py)."""

    kind = "session"

    def execute(self, sql: str, params: Sequence[Any]) -> Any:
        return _SQLAlchemyConnection(self.conn.connection(), self.dialect).execute(sql, params)

    def on_commit(self, callback: Callable[[], None]) -> bool:
        from sqlalchemy import event
        session = self.conn
        callbacks = session.info.get("celery_leases_outbox")
        if callbacks is None:
            callbacks = session.info["celery_leases_outbox"] = []

            def after_commit(s: Any) -> None:
                # Fired for the outermost transaction only: every row sent in it is committed.
                pending: list[Any] = list(callbacks)
                callbacks.clear()
                for fn in pending:
                    fn()

            def after_soft_rollback(s: Any, previous: Any) -> None:
                if getattr(previous, "parent", None) is None:
                    callbacks.clear()  # the whole transaction rolled back: nothing to publish
                # (a savepoint's rollback: its rows are gone, and the hook finds them gone)

            event.listen(session, "after_commit", after_commit)
            event.listen(session, "after_soft_rollback", after_soft_rollback)
        callbacks.append(callback)
        return True

    def key(self) -> Any:
        return id(self.conn)

    def engine(self) -> Any:
        return self.conn.get_bind()


class _Django(Target):
    kind = "django"

    def execute(self, sql: str, params: Sequence[Any]) -> Any:
        with self.conn.cursor() as cur:
            cur.execute(sql, tuple(params))
            return _first(cur)

    def on_commit(self, callback: Callable[[], None]) -> bool:
        from django.db import transaction
        transaction.on_commit(callback, using=self.conn.alias)
        return True


def _module(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def target_of(conn: Any) -> Target:
    """The Target for ``conn``; TypeError naming what is accepted for anything else."""
    module = _module(conn)
    if module == "sqlalchemy":
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session
        if isinstance(conn, Session):
            bind = conn.get_bind()
            return _SQLAlchemySession(conn, _sqlalchemy_dialect(bind.dialect))
        if isinstance(conn, Connection):
            return _SQLAlchemyConnection(conn, _sqlalchemy_dialect(conn.dialect))
    elif module == "django" or hasattr(conn, "vendor") and hasattr(conn, "alias"):
        vendor = getattr(conn, "vendor", "")
        return _Django(conn, dialect(vendor, "%s"))  # Django's cursors take %s everywhere
    elif module in _DBAPI:
        name, param = _DBAPI[module]
        return Target(conn, dialect(name, param))
    raise TypeError(
        f"celery_leases.outbox.send: cannot write to a {type(conn).__module__}.{type(conn).__name__}; "
        f"give a DB-API connection (psycopg 3, psycopg2, sqlite3, PyMySQL), a SQLAlchemy "
        f"Connection or Session, or django.db.connection")


def _sqlalchemy_dialect(sa_dialect: Any) -> Dialect:
    param = "?" if sa_dialect.paramstyle == "qmark" else "%s"
    return dialect(sa_dialect.name, param)
