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
- one writer at a time, and callers share its writes (group commit): a
  thread (threads pool, green threads) that calls while another's commands
  are on the wire queues its command; the next write carries every command
  queued by then, and their replies come back in one read. Each caller still
  gets its own reply before it returns; a worker whose eight threads finish
  together makes one round trip instead of eight, and none of them goes
  through redis-py;
- any error closes the connection; a connection error (not a timeout) on a
  connection held from an earlier call (the server restarted, a failover)
  sends the call (the whole write) once more on a new one, as redis-py's
  default retry does;
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

def read_reply(sock: Any, *, use_hiredis: bool | None = None) -> Any:
    """Read one reply from ``sock``; an error reply is returned as its exception."""
    return read_replies(sock, 1, use_hiredis=use_hiredis)[0]


def read_replies(sock: Any, n: int, *, use_hiredis: bool | None = None) -> list:
    """Read the next ``n`` replies from ``sock``; error replies are returned as their exceptions.

    The bytes are buffered linearly: with hiredis (when installed) its Reader
    is fed each read; else ``Scanner`` finds the replies' end as the reads come
    in and each reply is parsed once. Bytes after the last reply mean the
    connection is out of step.
    """
    if _HiredisReader is not None and use_hiredis is not False:
        reader = _HiredisReader(replyError=ResponseError)
        replies: list = []
        while True:
            data = sock.recv(65536)
            if not data:
                raise RedisConnectionError("the server closed the connection")
            reader.feed(data)
            while len(replies) < n:
                reply = reader.gets()
                if reply is False:
                    break
                replies.append(_error_class(reply))
            if len(replies) == n:
                if reader.has_data():
                    raise RedisConnectionError("unexpected bytes after a reply")
                return replies
    buffer, scanner = bytearray(), Scanner(n)
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
        parsed: list = []
        pos = 0
        for _ in range(n):
            reply, pos = parse(buffer, pos)
            parsed.append(reply)
        return parsed


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


_PENDING = object()


class _Call:
    """One caller's command, and its reply once read (or why there is none)."""

    __slots__ = ("command", "done", "reply", "error", "lead")

    def __init__(self, command: bytes) -> None:
        self.command = command
        self.done = threading.Event()
        self.reply: Any = _PENDING
        self.error: BaseException | None = None
        #: Woken to write the queue, not with a reply.
        self.lead = False

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.reply


class DirectCaller:
    """EVALSHA on this process's own connection; see the module docstring."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._conn: Any = None
        self._pid = 0
        self._reset(os.getpid())
        #: Calls sent here, and the writes (each one round trip) that carried them.
        self.calls = self.writes = 0

    def _reset(self, pid: int) -> None:
        """This process's own queue (a forked child starts with an empty one)."""
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._writing = False
        self._queue_pid = pid

    def call(self, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply; an error reply is raised as redis-py's exception for it."""
        (me,) = self._submit([pack("EVALSHA", sha, len(keys), *keys, *args)])
        return me.result()

    def call_many(self, sha: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list:
        """Each (keys, args) call's reply, all in one write; an error reply is returned as
        redis-py's exception for it (as a pipeline's ``raise_on_error=False``), and an error
        of the connection, which leaves the calls without replies, is raised."""
        return self.send([pack("EVALSHA", sha, len(keys), *keys, *args) for keys, args in calls])

    def send(self, commands: Sequence[bytes]) -> list:
        """Each packed command's reply, all in one write; an error reply is returned as
        redis-py's exception for it, and an error of the connection is raised."""
        out = []
        for call in self._submit(list(commands)):
            if call.error is not None and not isinstance(call.error, ResponseError):
                raise call.error
            out.append(call.error if call.error is not None else call.reply)
        return out

    def _submit(self, commands: list[bytes]) -> list[_Call]:
        """Queue ``commands`` together and see them written (by this thread or the writing
        one): all are in one write, since the writer takes the whole queue under the lock."""
        mine = [_Call(command) for command in commands]
        me = mine[0]
        pid = os.getpid()
        if self._queue_pid != pid:
            self._reset(pid)
        with self._lock:
            self.calls += len(mine)
            self._queue.extend(mine)
            lead = not self._writing
            self._writing = True
        if not lead:
            me.done.wait()
            if not me.lead:
                return mine
        try:
            with self._lock:
                batch, self._queue = self._queue, []
            self._write(batch, pid)
        finally:
            with self._lock:  # the next queued caller writes; else the writer is idle
                if self._queue:
                    self._queue[0].lead = True
                    self._queue[0].done.set()
                else:
                    self._writing = False
        return mine

    def _write(self, batch: list[_Call], pid: int) -> None:
        """Send ``batch`` in one write, give each its reply, wake the others."""
        try:
            self.writes += 1
            if self._pid != pid:
                self._conn = None  # the parent's socket: never read or write it here
            reused = self._conn is not None
            commands = b"".join(call.command for call in batch)
            try:
                replies = self._round_trip(commands, len(batch), pid)
            except (RedisConnectionError, ConnectionError):
                # Not a timeout: a script that may have run is not sent twice.
                if not reused:
                    raise
                replies = self._round_trip(commands, len(batch), pid)  # the held connection had gone stale
            for call, reply in zip(batch, replies):
                if isinstance(reply, Exception):
                    if isinstance(lease_error(reply, "EVALSHA"), LeaseUnavailable):
                        self._drop()  # a reconnect may reach the new master
                    call.error = reply
                else:
                    call.reply = reply
        except BaseException as exc:
            # Every caller of the write learns why it has no reply; none waits for ever. An
            # interruption aimed at the writing thread itself (a green timeout) stays its own.
            error = exc if isinstance(exc, Exception) else \
                RedisConnectionError(f"the write of {len(batch)} call(s) was interrupted: {exc!r}")
            for call in batch:
                if call.error is None and call.reply is _PENDING:
                    call.error = error
            if error is not exc:
                raise
        finally:
            for call in batch:
                call.lead = False
                call.done.set()

    def _round_trip(self, commands: bytes, n: int, pid: int) -> list:
        if self._conn is None:
            self._conn = open_connection(self.client)
            self._pid = pid
        sock = self._conn._sock
        try:
            sock.sendall(commands)
            return read_replies(sock, n)
        except BaseException:
            # A reply may still be on its way: the connection is unusable now.
            self._drop()
            raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_connection(self.client, conn)


__all__ = ["DirectCaller", "open_connection", "close_connection", "supported", "read_reply", "read_replies"]
