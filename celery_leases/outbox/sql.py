"""The outbox table and every statement on it, per database: PostgreSQL, SQLite, MySQL 8.

One table (``leases_outbox_table``, ``schema.name`` or ``name``) holds a row per task
sent and not published yet; ``<name>_parked`` holds the rows the relay could not decode.
Columns:

- ``id``: the row's order and key (publish and delete by id);
- ``task_id``, ``publish_id``: the ids the task is published under, chosen at ``send``;
  every publish of the row carries both, so a second publish is refused at receipt;
- ``name``: the task's name (logs, ``outbox status``); ``payload``: the frozen signature, JSON;
- ``created_at``: the database's clock at the insert, seconds since the epoch (the age of
  the oldest row is read on the same clock);
- SQLite only, ``claimed_at``: a relay's claim (SQLite has no row locks: a relay claims
  rows in a short write transaction and publishes outside it, so the application's writes
  never wait for a publish).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Table", "Dialect", "DIALECTS", "dialect", "table_error", "missing_table", "DEFAULT_TABLE",
           "CLAIM_SECONDS", "INIT_COMMAND"]

#: The default table name (``leases_outbox_table``).
DEFAULT_TABLE = "celery_leases_outbox"
#: The command that creates the outbox table, as errors name it.
INIT_COMMAND = "celery -A proj leases outbox init"
#: SQLite: seconds a relay's claim on a row lasts; a relay that dies after its claim leaves
#: the row to the next relay after this long (published again: refused at receipt).
CLAIM_SECONDS = 60.0

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,55}\Z")


def table_error(value: object) -> str | None:
    """Why ``value`` cannot name the outbox table, or None."""
    if not isinstance(value, str):
        return "must be a table name: 'name' or 'schema.name'"
    parts = value.split(".")
    if len(parts) > 2 or not all(_IDENTIFIER.match(p) for p in parts):
        return ("must be a table name, 'name' or 'schema.name', each a letter or underscore "
                "then letters, digits or underscores (at most 56 characters)")
    return None


@dataclass(frozen=True)
class Table:
    """The outbox table's name, and its parked rows' table beside it."""

    name: str = DEFAULT_TABLE
    schema: str | None = None

    @classmethod
    def parse(cls, value: str | None) -> "Table":
        value = value or DEFAULT_TABLE
        error = table_error(value)
        if error:
            raise ValueError(f"leases_outbox_table {error}, got {value!r}")
        schema, _, name = value.rpartition(".")
        return cls(name, schema or None)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name

    @property
    def channel(self) -> str:
        """PostgreSQL: the LISTEN/NOTIFY channel that wakes the relays of this table."""
        return str(self)


class Dialect:
    """The statements of one database; ``param`` is the driver's placeholder."""

    name = ""
    quote = '"'
    #: SQL for "now, in seconds since the epoch" on the database's clock.
    now = ""
    #: Whether claims lock rows (SELECT ... FOR UPDATE SKIP LOCKED), or use ``claimed_at``.
    skip_locked = True
    #: Whether an INSERT can say RETURNING id (else the cursor's lastrowid).
    returning = True

    def __init__(self, param: str = "%s") -> None:
        self.param = param

    def ident(self, table: Table, suffix: str = "") -> str:
        q = self.quote
        name = f"{q}{table.name}{suffix}{q}"
        return f"{q}{table.schema}{q}.{name}" if table.schema else name

    def params(self, n: int) -> str:
        return ", ".join([self.param] * n)

    # -- schema -------------------------------------------------------------------

    def create(self, table: Table) -> list[str]:
        raise NotImplementedError

    def exists(self, table: Table) -> str:
        """A statement that fails when the table does not exist."""
        return f"SELECT 1 FROM {self.ident(table)} WHERE 1 = 0"

    # -- send ---------------------------------------------------------------------

    def insert(self, table: Table) -> str:
        sql = (f"INSERT INTO {self.ident(table)} (task_id, publish_id, name, payload) "
               f"VALUES ({self.params(4)})")
        return sql + " RETURNING id" if self.returning else sql

    def notify(self, table: Table) -> str | None:
        """A statement that wakes the relays when the transaction commits (None: they poll)."""
        return None

    # -- relay --------------------------------------------------------------------

    def claim(self, table: Table, limit: int, ids: int = 0) -> str:
        """Lock up to ``limit`` rows, oldest first (or the rows of ``ids`` ids), skipping
        rows another relay holds: id, task_id, publish_id, name, payload."""
        where = f" WHERE id IN ({self.params(ids)})" if ids else ""
        return (f"SELECT id, task_id, publish_id, name, payload FROM {self.ident(table)}{where} "
                f"ORDER BY id LIMIT {int(limit)} FOR UPDATE SKIP LOCKED")

    def delete(self, table: Table, n: int) -> str:
        return f"DELETE FROM {self.ident(table)} WHERE id IN ({self.params(n)})"

    def park(self, table: Table) -> str:
        """Move one row to the parked table, with the error (params: error, id)."""
        return (f"INSERT INTO {self.ident(table, '_parked')} "
                f"(id, task_id, publish_id, name, payload, created_at, parked_at, error) "
                f"SELECT id, task_id, publish_id, name, payload, created_at, {self.now}, {self.param} "
                f"FROM {self.ident(table)} WHERE id = {self.param}")

    def status(self, table: Table) -> str:
        """Rows waiting, and the oldest one's age in seconds (None when empty)."""
        return f"SELECT count(*), {self.now} - min(created_at) FROM {self.ident(table)}"

    def parked_count(self, table: Table) -> str:
        return f"SELECT count(*) FROM {self.ident(table, '_parked')}"

    def parked_rows(self, table: Table, limit: int) -> str:
        return (f"SELECT id, task_id, name, {self.now} - parked_at, error "
                f"FROM {self.ident(table, '_parked')} ORDER BY id LIMIT {int(limit)}")


class PostgreSQL(Dialect):
    name = "postgresql"
    now = "extract(epoch from clock_timestamp())::double precision"

    def create(self, table: Table) -> list[str]:
        columns = ("task_id varchar(255) NOT NULL, publish_id varchar(64) NOT NULL, "
                   "name varchar(255) NOT NULL, payload text NOT NULL, "
                   f"created_at double precision NOT NULL DEFAULT ({self.now})")
        out = [f'CREATE SCHEMA IF NOT EXISTS "{table.schema}"'] if table.schema else []
        return out + [
            f"CREATE TABLE IF NOT EXISTS {self.ident(table)} (id bigserial PRIMARY KEY, {columns})",
            f"CREATE TABLE IF NOT EXISTS {self.ident(table, '_parked')} (id bigint PRIMARY KEY, "
            f"{columns}, parked_at double precision NOT NULL, error text NOT NULL)",
        ]

    def notify(self, table: Table) -> str:
        return f"SELECT pg_notify({self.param}, '')"

    def insert_notify(self, table: Table) -> str:
        """``insert`` and ``notify`` in one statement (one round trip): params of both."""
        return (f"WITH sent AS ({self.insert(table)}) "
                f"SELECT sent.id FROM sent, (SELECT pg_notify({self.param}, '')) AS woken")

    def listen(self, table: Table) -> str:
        return f'LISTEN "{table.channel}"'


class SQLite(Dialect):
    name = "sqlite"
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    skip_locked = False

    def __init__(self, param: str = "?") -> None:
        super().__init__(param)

    def create(self, table: Table) -> list[str]:
        columns = ("task_id TEXT NOT NULL, publish_id TEXT NOT NULL, name TEXT NOT NULL, "
                   f"payload TEXT NOT NULL, created_at REAL NOT NULL DEFAULT ({self.now})")
        return [
            f"CREATE TABLE IF NOT EXISTS {self.ident(table)} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            f"{columns}, claimed_at REAL)",
            f"CREATE TABLE IF NOT EXISTS {self.ident(table, '_parked')} (id INTEGER PRIMARY KEY, "
            f"{columns}, parked_at REAL NOT NULL, error TEXT NOT NULL)",
        ]

    def claim(self, table: Table, limit: int, ids: int = 0) -> str:
        """Rows free to claim (no claim, or one older than CLAIM_SECONDS), oldest first; the
        caller holds SQLite's write lock (BEGIN IMMEDIATE) and marks them (``mark``)."""
        free = f"(claimed_at IS NULL OR claimed_at < {self.now} - {CLAIM_SECONDS})"
        where = f"id IN ({self.params(ids)}) AND {free}" if ids else free
        return (f"SELECT id, task_id, publish_id, name, payload FROM {self.ident(table)} "
                f"WHERE {where} ORDER BY id LIMIT {int(limit)}")

    def mark(self, table: Table, n: int) -> str:
        return f"UPDATE {self.ident(table)} SET claimed_at = {self.now} WHERE id IN ({self.params(n)})"

    def unmark(self, table: Table, n: int) -> str:
        return f"UPDATE {self.ident(table)} SET claimed_at = NULL WHERE id IN ({self.params(n)})"


class MySQL(Dialect):
    name = "mysql"
    quote = "`"
    now = "UNIX_TIMESTAMP(NOW(6))"
    returning = False

    def create(self, table: Table) -> list[str]:
        columns = ("task_id VARCHAR(255) NOT NULL, publish_id VARCHAR(64) NOT NULL, "
                   "name VARCHAR(255) NOT NULL, payload LONGTEXT NOT NULL, "
                   f"created_at DOUBLE NOT NULL DEFAULT ({self.now})")
        return [
            f"CREATE TABLE IF NOT EXISTS {self.ident(table)} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
            f"{columns}) ENGINE=InnoDB",
            f"CREATE TABLE IF NOT EXISTS {self.ident(table, '_parked')} (id BIGINT PRIMARY KEY, "
            f"{columns}, parked_at DOUBLE NOT NULL, error TEXT NOT NULL) ENGINE=InnoDB",
        ]


DIALECTS: dict[str, type[Dialect]] = {"postgresql": PostgreSQL, "sqlite": SQLite, "mysql": MySQL}


def dialect(name: str, param: str | None = None) -> Dialect:
    """The dialect called ``name`` (postgresql, sqlite, mysql; mariadb is mysql)."""
    name = {"postgres": "postgresql", "mariadb": "mysql"}.get(name, name)
    cls = DIALECTS.get(name)
    if cls is None:
        raise ValueError(f"the outbox supports PostgreSQL, SQLite and MySQL 8, not {name!r}")
    return cls() if param is None else cls(param)


def missing_table(exc: BaseException, table: Table) -> bool:
    """True when the driver's ``exc`` says the outbox table (or its schema) does not exist."""
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if code in ("42P01", "3F000"):  # PostgreSQL: undefined table, undefined schema
        return True
    args = getattr(exc, "args", ())
    if args and args[0] == 1146:  # MySQL: table doesn't exist
        return True
    text = str(exc).lower()
    return table.name.lower() in text and any(
        words in text for words in ("no such table", "does not exist", "doesn't exist"))

