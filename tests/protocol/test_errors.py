"""One error map (celery_leases/protocol/errors.py), the same on every path that talks to Redis.

Each error a server can answer with is fed to each path: the store's scripts
on the direct connection and through redis-py, its pipelines, its reads, the
fenced writes, the worker's acquirer. Errors come from a real socket: a small
server that answers every command with the error under test (LOADING,
MASTERDOWN, CLUSTERDOWN and TRYAGAIN cannot be provoked on demand on one
server), one that never answers (a timeout), a closed port; READONLY and
WRONGTYPE also from real redis-servers (tests/protocol/test_direct.py, test_fencing.py).
"""
from __future__ import annotations

import socket
import threading

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import (BusyLoadingError, ClusterDownError, DataError, MasterDownError,
                              ReadOnlyError, ResponseError, TryAgainError)
from redis.retry import Retry

from celery_leases import LeaseStore
from celery_leases.protocol.errors import lease_error
from celery_leases.worker.acquirer import Acquirer, Job
from celery_leases.exceptions import CorruptRecord, LeaseError, LeaseUnavailable
from celery_leases.protocol.fencing import fenced_get, fenced_set
from celery_leases.testing.servers import free_port
from celery_leases.protocol.transport.resp import Incomplete, parse

UNAVAILABLE, CORRUPT, OTHER = LeaseUnavailable, CorruptRecord, LeaseError

#: Error replies and what every path must make of them.
REPLIES = [
    ("LOADING Redis is loading the dataset in memory", UNAVAILABLE),
    ("READONLY You can't write against a read only replica.", UNAVAILABLE),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", UNAVAILABLE),
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", UNAVAILABLE),
    ("BUSYKEY Target key name already exists.", OTHER),
    ("CLUSTERDOWN The cluster is down", UNAVAILABLE),
    ("TRYAGAIN Multiple keys request during rehashing of slot", UNAVAILABLE),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", CORRUPT),
    ("CORRUPT {p}:lease:t field token is not a number: x", CORRUPT),
    ("ERR Error running script (call to f_0123): @user_script:1: boom", OTHER),
]


def test_the_map_itself():
    cases = [
        (redis.ConnectionError("refused"), UNAVAILABLE), (redis.TimeoutError("slow"), UNAVAILABLE),
        (socket.timeout("timed out"), UNAVAILABLE), (ConnectionRefusedError(111, "refused"), UNAVAILABLE),
        (BusyLoadingError("LOADING ..."), UNAVAILABLE), (ReadOnlyError("READONLY ..."), UNAVAILABLE),
        (MasterDownError("MASTERDOWN ..."), UNAVAILABLE), (ClusterDownError("CLUSTERDOWN ..."), UNAVAILABLE),
        (TryAgainError("TRYAGAIN ..."), UNAVAILABLE),
        *((ResponseError(text), kind) for text, kind in REPLIES),
    ]
    for exc, kind in cases:
        mapped = lease_error(exc, "finish (task t, key k)", "redis://h:1/0")
        assert type(mapped) is kind, (exc, mapped)
        assert "finish (task t, key k)" in str(mapped)
    # A LeaseError passes through; anything else is not the map's business
    already = LeaseUnavailable("x")
    assert lease_error(already, "w") is already
    for exc in (ValueError("bug"), DataError("bad argument"), KeyError("k")):
        assert lease_error(exc, "w") is exc


class ErrorServer:
    """Answers every command with one error line (``mode="error"``), never answers
    (``"silent"``), or closes each connection at once (``"close"``). Handshake commands
    (HELLO, CLIENT, SELECT, AUTH, PING) are answered so redis-py reaches the command under
    test; ``commands`` counts the others, so a test can tell the command was sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.mode, self.error = "error", "ERR unset"
        self.conns: list[socket.socket] = []
        self.commands = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while True:
                if self.mode == "close":
                    conn.close()
                    return
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
                while True:
                    try:
                        command, end = parse(buffer)
                    except Incomplete:
                        break
                    buffer = buffer[end:]
                    if self.mode == "silent":
                        continue
                    name = command[0].upper() if isinstance(command, list) else b""
                    if name == b"HELLO":  # redis-py 8 speaks RESP3
                        conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                    elif name in (b"CLIENT", b"SELECT", b"AUTH", b"PING"):
                        conn.sendall(b"+OK\r\n")
                    else:
                        self.commands += 1
                        conn.sendall(b"-" + self.error.encode() + b"\r\n")
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass


@pytest.fixture
def server():
    srv = ErrorServer()
    yield srv
    srv.close()


def client_for(url: str) -> redis.Redis:
    # No redis-py retries: each path's own behaviour is under test, once.
    return redis.Redis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3,
                                retry=Retry(NoBackoff(), 0))


class Hub:
    """The little of kombu's event loop the acquirer uses (the test reads replies with flush)."""

    def __init__(self) -> None:
        self.readers: dict = {}

    def add_reader(self, fd, callback) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd) -> None:
        self.readers.pop(fd, None)


class Acquire:
    """The worker's acquirer, as the event loop drives it: sent, then its reply read."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store

    def __call__(self) -> None:
        results = []
        acquirer = Acquirer(self.store, Hub())
        acquirer.submit(Job({"task_id": "t", "owner": "w"}, lambda job, result: results.append(result)))
        acquirer.flush(timeout=1.0)
        acquirer._close()
        (result,) = results
        if isinstance(result, Exception):
            raise result


def paths(url: str) -> dict:
    """Every path to Redis, each a call that must raise the mapped error."""
    def store(shards: int = 1, direct: bool = True) -> LeaseStore:
        s = LeaseStore(client_for(url), prefix="p", shards=shards)
        if not direct:
            s.calls.direct = None
        return s

    return {
        "script, direct": lambda: store().acquire("t", "w"),
        "script, redis-py": lambda: store(direct=False).acquire("t", "w"),
        "pipeline": lambda: store(shards=2).renew_many("w", {f"t{i}": 1 for i in range(8)}),
        "read": lambda: store().get("t"),
        "fenced write": lambda: fenced_set(client_for(url), "p", "r", 1, "v"),
        "fenced read": lambda: fenced_get(client_for(url), "p", "r"),
        "acquirer": Acquire(store()),
    }


@pytest.mark.parametrize("text,kind", REPLIES, ids=[t.split()[0] for t, _ in REPLIES])
def test_each_error_reply_maps_the_same_on_every_path(server, text, kind):
    # Given a server that answers every command with this error
    server.error = text
    for name, call in paths(server.url).items():
        # When each path meets it, Then each raises the same kind of LeaseError, saying why
        before = server.commands
        with pytest.raises(LeaseError) as raised:
            call()
        assert server.commands > before, f"{name}: the command under test was never sent"
        assert type(raised.value) is kind, (name, raised.value)
        assert text.split(" ", 1)[1] in str(raised.value), (name, raised.value)


@pytest.mark.parametrize("mode", ["silent", "close", "refused"])
def test_timeouts_and_connection_errors_are_unavailable_on_every_path(server, mode):
    if mode == "refused":
        url = f"redis://127.0.0.1:{free_port()}/0"
    else:
        server.mode, url = mode, server.url
    for name, call in paths(url).items():
        with pytest.raises(LeaseError) as raised:
            call()
        assert type(raised.value) is LeaseUnavailable, (name, raised.value)
