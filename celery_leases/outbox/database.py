"""The outbox's own connections, from ``leases_outbox_url``: the relay's, the CLI's.

URLs, in SQLAlchemy's spelling (a ``+driver`` part is allowed and ignored):

- ``postgresql://user:password@host:5432/dbname`` (psycopg 3, else psycopg2);
- ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``;
- ``mysql://user:password@host:3306/dbname`` (PyMySQL, else mysqlclient).

Each ``Executor`` wraps one DB-API connection: statements, fetches, commit and rollback,
and the errors that mean "the database is unreachable" (the relay backs off on those).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Sequence
from urllib.parse import unquote, urlsplit

from ..protocol.connection import redact
from .sql import Dialect, Table, dialect

__all__ = ["Database", "Executor", "scheme_of", "URL_SCHEMES"]

#: The schemes ``leases_outbox_url`` accepts (before any ``+driver``).
URL_SCHEMES = ("postgresql", "postgres", "sqlite", "mysql", "mariadb")


def scheme_of(url: str) -> str:
    return url.split(":", 1)[0].split("+", 1)[0].lower() if ":" in url else ""


class Executor:
    """Statements on one DB-API connection, in its transaction (committed by ``commit``)."""

    def __init__(self, conn: Any, db: Dialect) -> None:
        self.conn, self.dialect = conn, db

    def fetch(self, sql: str, params: Sequence[Any] = ()) -> list:
        cur = self.conn.cursor()
        try:
            cur.execute(sql, tuple(params))
            return list(cur.fetchall()) if cur.description else []
        finally:
            cur.close()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = self.conn.cursor()
        try:
            cur.execute(sql, tuple(params))
            return cur.rowcount
        finally:
            cur.close()

    def commit(self) -> None:
        self.conn.commit()

    def rollback(self) -> None:
        try:
            self.conn.rollback()
        except Exception:  # noqa: BLE001 - a broken connection: closed by the caller
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


class Database:
    """``leases_outbox_url``: which database, which driver, and connections to it."""

    def __init__(self, url: str, table: Table | str | None = None) -> None:
        if not isinstance(url, str) or scheme_of(url) not in URL_SCHEMES:
            raise ValueError(f"leases_outbox_url must be a postgresql://, sqlite:/// or mysql:// URL, "
                             f"got {redact(url)!r}")
        self.url = url
        self.table = table if isinstance(table, Table) else Table.parse(table)
        scheme = scheme_of(url)
        self.kind = {"postgres": "postgresql", "mariadb": "mysql"}.get(scheme, scheme)
        self.dialect = dialect(self.kind, "?" if self.kind == "sqlite" else "%s")
        self.driver = ""

    def __str__(self) -> str:
        return redact(self.url)

    # -- connections ----------------------------------------------------------------

    def connect(self, autocommit: bool = False) -> Any:
        """A new DB-API connection (in a transaction unless ``autocommit``)."""
        if self.kind == "sqlite":
            return sqlite3.connect(self.sqlite_path(), timeout=30.0, check_same_thread=False,
                                   isolation_level=None if autocommit else "DEFERRED")
        if self.kind == "postgresql":
            return self._postgresql(autocommit)
        return self._mysql(autocommit)

    def executor(self) -> Executor:
        return Executor(self.connect(), self.dialect)

    def sqlite_path(self) -> str:
        rest = self.url.split(":", 1)[1]
        if not rest.startswith("///"):
            raise ValueError(f"leases_outbox_url: a SQLite URL is sqlite:///relative/path.db or "
                             f"sqlite:////absolute/path.db, got {self.url!r}")
        return rest[3:].split("?", 1)[0] or ":memory:"

    def _dsn(self) -> str:
        scheme, rest = self.url.split(":", 1)
        return "postgresql:" + rest

    def _postgresql(self, autocommit: bool) -> Any:
        try:
            import psycopg
        except ImportError:
            psycopg = None  # type: ignore[assignment]
        if psycopg is not None:
            self.driver = "psycopg"
            return psycopg.connect(self._dsn(), autocommit=autocommit, connect_timeout=5)
        try:
            import psycopg2
        except ImportError:
            raise ImportError("leases_outbox_url names PostgreSQL: install psycopg (3) or psycopg2") from None
        self.driver = "psycopg2"
        conn = psycopg2.connect(self._dsn(), connect_timeout=5)
        conn.autocommit = autocommit
        return conn

    def _mysql(self, autocommit: bool) -> Any:
        parts = urlsplit(self.url)
        kwargs = {"host": parts.hostname or "127.0.0.1", "port": parts.port or 3306,
                  "user": unquote(parts.username or "root"), "password": unquote(parts.password or ""),
                  "database": parts.path.lstrip("/") or None, "connect_timeout": 5,
                  "autocommit": autocommit}
        try:
            import pymysql
            self.driver = "pymysql"
            return pymysql.connect(**kwargs)
        except ImportError:
            pass
        try:
            import MySQLdb
        except ImportError:
            raise ImportError("leases_outbox_url names MySQL: install PyMySQL or mysqlclient") from None
        self.driver = "MySQLdb"
        kwargs["passwd"], kwargs["db"] = kwargs.pop("password"), kwargs.pop("database")
        return MySQLdb.connect(**kwargs)

    # -- what the CLI runs ------------------------------------------------------------

    def create(self) -> list[str]:
        """Create the outbox table and its parked table (if absent): the statements run."""
        statements = self.dialect.create(self.table)
        ex = self.executor()
        try:
            for sql in statements:
                ex.run(sql)
            ex.commit()
        finally:
            ex.close()
        return statements
