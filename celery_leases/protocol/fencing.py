"""Fenced writes and idempotency keys: protecting side effects outside the lease.

A lease cannot stop a paused worker from resuming and writing. These helpers
make the *receiving* system refuse it: every write carries the writer's
fencing token (``self.lease.token``) and is accepted only if no newer token was
accepted for the same resource. See docs/fencing.md for what each piece
guarantees and what it does not.

- ``fenced_set`` / ``fenced_get``: a fenced value or hash field in Redis (one
  Lua script, atomic).
- ``fenced_update``: ``UPDATE ... SET ..., fence = :token WHERE id = :id AND
  fence <= :token`` on any DB-API connection (sqlite3, psycopg, ...).
- ``idempotency_key``: a stable key for an external API, from task id + step.

Knows nothing of Celery.
"""
from __future__ import annotations

import json
import re
import sys
import uuid
from typing import Any, Mapping, Union

import redis

from .calls import call_script
from .codes import Code
from .connection import describe
from .errors import lease_error
from ..exceptions import CorruptRecord, StaleFence
from .keys import Keys
from .scripts import scripts

__all__ = ["fenced_set", "fenced_get", "fenced_update", "idempotency_key", "IDEMPOTENCY_NAMESPACE"]

#: Namespace of the UUIDv5 keys made by ``idempotency_key`` (fixed forever: changing
#: it would change every key, and a re-run would no longer match the first attempt).
IDEMPOTENCY_NAMESPACE = uuid.UUID("5c1f4c2e-6a0e-5d4b-9c59-2f0c8a4f1e07")

#: What an SQL identifier (table, column) may look like: no quoting needed, no injection possible.
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Hash field of a fence hash that holds the highest accepted token.
TOKEN_FIELD = "token"
#: Hash field of a plain (key-value) fenced write.
VALUE_FIELD = "value"


# -- Redis --------------------------------------------------------------------


def _keys(keys: Union[Keys, str]) -> Keys:
    return keys if isinstance(keys, Keys) else Keys(keys)


def _field(field: str | None) -> str:
    if field is None:
        return VALUE_FIELD
    if not isinstance(field, str) or not field:
        raise ValueError(f"fenced write: the hash field must be a non-empty string or None, got {field!r}")
    return f"field:{field}"


def _token(token: Any) -> int:
    """Fencing tokens are positive integers; None (a detached lease) is a mistake, named."""
    if isinstance(token, bool) or not isinstance(token, int) or token < 1:
        raise ValueError(
            f"a fencing token must be a positive int (self.lease.token), got {token!r}; "
            "an eager or direct call has no lease and no token")
    return token


def fenced_set(client: redis.Redis, keys: Union[Keys, str], resource: str, token: int,
               value: Union[bytes, str, int, float], *, field: str | None = None,
               raise_on_stale: bool = True) -> bool:
    """Write ``value`` to ``resource`` unless a newer token was already accepted for it.

    ``keys`` is the lease store's ``Keys`` (``celery_leases.store(app).keys``) or
    a key prefix: use the prefix the tokens come from, since only tokens of one
    prefix are comparable. With ``field`` the value goes to that field of the
    resource's hash (all fields share the resource's one fence). Returns True
    when accepted. A stale write raises StaleFence, or returns False with
    ``raise_on_stale=False``.
    """
    keys, token, name = _keys(keys), _token(token), _field(field)
    key = keys.fence(resource)
    reply = _call(client, key, lambda: call_script(client, scripts.fenced_write, (key,), (token, name, value)))
    if reply[0] == Code.CORRUPT:
        raise CorruptRecord(f"fence hash {key}: field {reply[2].decode()} {reply[3].decode()}; "
                            f"nothing was written", key, reply[2].decode())
    code, current = reply
    if Code(code) is Code.OK:
        return True
    if raise_on_stale:
        raise StaleFence(key, token, int(current))
    return False


def fenced_get(client: redis.Redis, keys: Union[Keys, str], resource: str, *,
               field: str | None = None) -> tuple[bytes | None, int]:
    """(value, fence) of ``resource``: the stored value (None if never written) and
    the highest token accepted for the resource (0 if none)."""
    key = _keys(keys).fence(resource)
    value, token = _call(client, key, lambda: client.hmget(key, _field(field), TOKEN_FIELD))
    try:
        return value, int(token or 0)
    except ValueError:
        raise CorruptRecord(f"fence hash {key}: field token is not a number: {token!r}") from None


def _call(client: redis.Redis, key: str, fn: Any) -> Any:
    """``fn()``, its Redis errors mapped as everywhere else (errors.py): READONLY after a
    failover is LeaseUnavailable, a key of another type CorruptRecord."""
    try:
        return fn()
    except Exception as exc:
        error = lease_error(exc, f"fenced write or read of {key}", describe(client))
        if error is exc:
            raise
        raise error from exc


# -- SQL ----------------------------------------------------------------------


def _identifier(name: Any, what: str, *, dotted: bool = False) -> str:
    parts = name.split(".") if dotted and isinstance(name, str) else [name]
    if not parts or len(parts) > 2 or not all(isinstance(p, str) and IDENTIFIER.match(p) for p in parts):
        raise ValueError(
            f"fenced_update: {what} {name!r} is not a plain SQL identifier "
            f"(letters, digits and _, not starting with a digit{'; schema.table allowed' if dotted else ''})")
    return name


def _paramstyle(conn: Any) -> str:
    """The DB-API paramstyle of the module a connection comes from (sqlite3: qmark, psycopg: pyformat)."""
    module = type(conn).__module__
    while module:
        style = getattr(sys.modules.get(module), "paramstyle", None)
        if style:
            return style
        module = module.rpartition(".")[0]
    raise ValueError(f"fenced_update: cannot tell the paramstyle of {type(conn).__qualname__} "
                     f"from module {type(conn).__module__}; pass paramstyle=")


def _placeholders(style: str):
    """A function (name, index) -> placeholder text, and whether params are a dict."""
    if style == "qmark":
        return (lambda name, i: "?"), False
    if style == "format":
        return (lambda name, i: "%s"), False
    if style == "numeric":
        return (lambda name, i: f":{i}"), False
    if style == "named":
        return (lambda name, i: f":{name}"), True
    if style == "pyformat":
        return (lambda name, i: f"%({name})s"), True
    raise ValueError(f"fenced_update: unsupported paramstyle {style!r}")


def fenced_update(conn: Any, table: str, id: Any, token: int, values: Mapping[str, Any], *,
                  id_column: str = "id", fence_column: str = "fence",
                  raise_on_stale: bool = True, paramstyle: str | None = None) -> bool:
    """``UPDATE table SET values..., fence = token WHERE id = :id AND fence <= :token``.

    Runs on the caller's DB-API connection, inside the caller's transaction:
    it never commits, so the fenced row and any other writes of the transaction
    commit (or roll back) together. Returns True when the row was updated. When
    the row's fence is newer than ``token`` it raises StaleFence, or returns
    False with ``raise_on_stale=False``; a missing row raises LookupError.
    A NULL fence counts as 0. ``id_column`` must be unique.

    Identifiers are checked against ``^[A-Za-z_][A-Za-z0-9_]*$`` (``table``
    may be ``schema.table``) and used unquoted; values are always bound
    parameters. The paramstyle comes from the connection's driver module
    (sqlite3: qmark, psycopg: pyformat) unless ``paramstyle`` is given.
    """
    token = _token(token)
    _identifier(table, "table", dotted=True)
    _identifier(id_column, "id_column")
    _identifier(fence_column, "fence_column")
    columns = list(values)
    for column in columns:
        _identifier(column, "column")
        if column in (id_column, fence_column):
            raise ValueError(f"fenced_update: values may not set {column!r}: it is the "
                             f"{'id' if column == id_column else 'fence'} column")
    mark, named = _placeholders(paramstyle or _paramstyle(conn))

    params: list[tuple[str, Any]] = []

    def bind(name: str, value: Any) -> str:
        params.append((name, value))
        return mark(name, len(params))

    assignments = [f"{c} = {bind(f'v{i}', values[c])}" for i, c in enumerate(columns)]
    assignments.append(f"{fence_column} = {bind('token', token)}")
    sql = (f"UPDATE {table} SET {', '.join(assignments)} "
           f"WHERE {id_column} = {bind('id', id)} "
           f"AND COALESCE({fence_column}, 0) <= {bind('token_guard', token)}")
    cursor = conn.cursor()
    try:
        cursor.execute(sql, dict(params) if named else [v for _, v in params])
        if cursor.rowcount > 0:
            return True
        # Nothing updated: tell a stale token from a missing row (same transaction).
        params.clear()
        cursor.execute(f"SELECT {fence_column} FROM {table} WHERE {id_column} = {bind('id', id)}",
                       dict(params) if named else [v for _, v in params])
        row = cursor.fetchone()
    finally:
        cursor.close()
    if row is None:
        raise LookupError(f"fenced_update: {table} has no row with {id_column} = {id!r}")
    if raise_on_stale:
        raise StaleFence(f"{table}.{id_column}={id!r}", token, None if row[0] is None else int(row[0]))
    return False


# -- idempotency keys ---------------------------------------------------------


def idempotency_key(task_id: str, step: str) -> str:
    """A stable idempotency key for one step of one task: the same on every run of the task id.

    A UUIDv5 of (task id, step), 36 characters of ``[0-9a-f-]``, so it fits
    the limits of payment and messaging APIs (Stripe's Idempotency-Key, ...).
    A re-run after a recovery or a retry keeps its task id, so it sends the
    same key and the API answers with the first attempt's result.
    """
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"idempotency_key: task_id must be a non-empty string, got {task_id!r}")
    if not isinstance(step, str) or not step:
        raise ValueError(f"idempotency_key: step must be a non-empty string, got {step!r}")
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, json.dumps([task_id, step])))
