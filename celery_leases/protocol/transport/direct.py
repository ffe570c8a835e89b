"""Script calls on one connection kept per process, without redis-py's per-call work.

A leased task makes its calls from the process that runs it (the finish from
a pool process, the blocking acquire with the solo pool). Through redis-py a
call costs about 20 µs of CPU more than the round trip itself: a connection
taken from the pool and checked with a system call, the command packed, the
reply parsed and passed through the response callbacks. Here the command is
packed and the reply parsed with resp.py on a connection held for the
process, which the store's own client opened (so TLS, AUTH, SELECT and
Sentinel's current master are redis-py's business, as on any of its connections).

Rules that keep it as safe as redis-py:

- one connection per process: a forked child never touches the socket it
  inherited, it opens its own;
- one caller at a time: a second thread (threads pool) goes through redis-py
  instead of waiting for the connection;
- any error closes the connection; a connection error (not a timeout) on a
  connection held from an earlier call (the server restarted, a failover)
  sends the call once more on a new one, as redis-py's default retry does;
- an error reply that says the server cannot serve us now (``READONLY``
  from a master demoted under us, ``LOADING``, ``MASTERDOWN``: errors.py)
  closes the connection, as redis-py's Sentinel connections do, and is
  raised (the store maps it to LeaseUnavailable);
- ``NOSCRIPT`` (the server lost its script cache) is left to the caller,
  which sends the script through redis-py with its source.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ...exceptions import LeaseUnavailable
from ..errors import lease_error
from .resp import ERRORS, Scanner, pack, parse

try:  # redis-py's C parser, when installed (the "hiredis" extra): it buffers and parses in C
    from hiredis import Reader as _HiredisReader
except ImportError:  # pragma: no cover - depends on the environment
    _HiredisReader = None

#: Returned by ``call`` when another thread holds the connection: use redis-py.
BUSY = object()


def read_reply(sock: Any, *, use_hiredis: bool | None = None) -> Any:
    """Read one reply from ``sock``; an error reply is returned as its exception.

    The bytes are buffered linearly: with hiredis (when installed) its Reader
    is fed each read; else ``Scanner`` finds the reply's end as the reads come
    in and the reply is parsed once. Bytes after the reply mean the connection
    is out of step.
    """
    if _HiredisReader is not None and use_hiredis is not False:
        reader = _HiredisReader(replyError=ResponseError)
        while True:
            data = sock.recv(65536)
            if not data:
                raise RedisConnectionError("the server closed the connection")
            reader.feed(data)
            reply = reader.gets()
            if reply is not False:
                if reader.has_data():
                    raise RedisConnectionError("unexpected bytes after a reply")
                return _error_class(reply)
    buffer, scanner = bytearray(), Scanner()
    while True:
        data = sock.recv(65536)
        if not data:
            raise RedisConnectionError("the server closed the connection")
        buffer += data
        end = scanner.end(buffer)
        if end is None:
            continue
        if end != len(buffer):
            raise RedisConnectionError(f"{len(buffer) - end} unexpected bytes after a reply")
        return parse(buffer)[0]


def _error_class(reply: Any) -> Any:
    """hiredis gives every error reply as ResponseError: the class parse() would give it."""
    if isinstance(reply, ResponseError) and type(reply) is ResponseError:
        text = str(reply)
        return ERRORS.get(text.split(" ", 1)[0].encode(), ResponseError)(text)
    return reply


def open_connection(client: Any) -> Any:
    """A connected redis-py connection from ``client``'s pool, kept out of the pool until released."""
    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name
        conn = pool.get_connection("EVALSHA")
    try:
        conn.connect()
    except Exception:
        pool.release(conn)
        raise
    return conn


def close_connection(client: Any, conn: Any) -> None:
    """Close ``conn`` and give it back to the pool (which reconnects it when next used)."""
    try:
        conn.disconnect()
    finally:
        client.connection_pool.release(conn)


def supported(client: Any) -> bool:
    """One server behind a connection pool (not a cluster), replies as bytes."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or hasattr(client, "get_node_from_key"):
        return False
    return not getattr(pool, "connection_kwargs", {}).get("decode_responses")


class DirectCaller:
    """EVALSHA on this process's own connection; see the module docstring."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        #: Calls sent here (each one round trip), for benchmarks and tests.
        self.calls = 0

    def call(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply; an error reply is raised as redis-py's exception for it."""
        if not self._lock.acquire(blocking=False):
            return BUSY
        try:
            command = pack("EVALSHA", sha, len(keys), *keys, *args)
            self.calls += 1
            pid = os.getpid()
            if self._pid != pid:
                self._conn = None  # the parent's socket: never read or write it here
            reused = self._conn is not None
            try:
                reply = self._round_trip(command, pid)
            except (RedisConnectionError, ConnectionError):
                # Not a timeout: a script that may have run is not sent twice.
                if not reused:
                    raise
                reply = self._round_trip(command, pid)  # the held connection had gone stale
            if isinstance(reply, Exception):
                if isinstance(lease_error(reply, "EVALSHA"), LeaseUnavailable):
                    self._drop()  # a reconnect may reach the new master
                raise reply
            return reply
        finally:
            self._lock.release()

    def _round_trip(self, command: bytes, pid: int) -> Any:
        if self._conn is None:
            self._conn = open_connection(self.client)
            self._pid = pid
        sock = self._conn._sock
        try:
            sock.sendall(command)
            return read_reply(sock)
        except BaseException:
            # A reply may still be on its way: the connection is unusable now.
            self._drop()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_connection(self.client, conn)


__all__ = ["DirectCaller", "BUSY", "open_connection", "close_connection", "supported", "read_reply"]
