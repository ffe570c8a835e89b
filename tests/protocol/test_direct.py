"""Script calls on the process's own connection (celery_leases/protocol/transport/direct.py), on real Redis servers.

What must hold: the replies are the ones redis-py would give, a forked child
never touches its parent's socket, threads calling at once share writes and
each gets its own reply (a broken write fails each call it carried), a
connection that went stale is replaced, a timeout is never sent twice, and a
demoted (read-only) server counts as unavailable.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from celery_leases import Code, LeaseStore
from celery_leases.protocol.transport.direct import DirectCaller
from celery_leases.testing import wait_for
from celery_leases.exceptions import LeaseUnavailable
from celery_leases.testing.servers import RedisServer
from celery_leases.protocol.scripts import scripts
from tests.support.services import skip_or_fail


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


@pytest.fixture
def store(redis_server_url, key_prefix):
    return LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30)


def lifecycle(store: LeaseStore, task_id: str, owner: str = "w1") -> None:
    acq = store.acquire(task_id, owner)
    assert acq.code is Code.ACQUIRED
    store.finish(task_id, owner, acq.token, "succeeded")
    assert store.get(task_id).state == "succeeded"


def test_the_store_calls_its_scripts_on_one_held_connection(store, redis_client):
    # Given a store on one server: its script calls go through the direct caller
    assert isinstance(store.calls.direct, DirectCaller)
    lifecycle(store, "warm")  # the first calls load the scripts
    conn = store.calls.direct._conn
    before = script_calls(redis_client)
    # When a task's lease is acquired and finished three times over
    for i in range(3):
        lifecycle(store, f"t{i}")
    # Then each transition was one script call, all on the same connection
    assert script_calls(redis_client) - before == 6
    assert conn is not None and store.calls.direct._conn is conn
    # And the replies are redis-py's: a refused finish still names the current owner
    acq = store.acquire("taken", "w1")
    with pytest.raises(Exception) as refused:
        store.finish("taken", "w2", acq.token, "succeeded")
    assert "taken" in str(refused.value)


def _child(store: LeaseStore, queue) -> None:
    try:
        inherited = store.calls.direct._conn
        for i in range(50):
            lifecycle(store, f"child-{i}", owner="child")
        queue.put(("ok", store.calls.direct._conn is not inherited))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(exc)))


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_alone(store):
    # Given a parent whose direct connection is open
    lifecycle(store, "parent-0")
    parent_conn = store.calls.direct._conn
    # When a forked child makes its own calls
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(store, queue))
    child.start()
    status, detail = queue.get(timeout=30)
    child.join(10)
    # Then the child succeeded on a connection of its own
    assert (status, detail) == ("ok", True)
    # And the parent's connection still answers its own calls in order
    assert store.calls.direct._conn is parent_conn
    for i in range(1, 20):
        lifecycle(store, f"parent-{i}")


def test_threads_calling_at_once_share_writes_and_each_gets_its_own_answer(store):
    # Given eight threads that each run 40 task lifecycles (acquire, finish) at once
    direct = store.calls.direct
    calls0, writes0 = direct.calls, direct.writes
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            start.wait()
            for i in range(40):
                lifecycle(store, f"thread-{n}-{i}", owner=f"w{n}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Then every call got its own, correct answer (lifecycle checks each one)
    assert errors == []
    # And every call went over the direct connection, calls that came together in one write
    calls, writes = direct.calls - calls0, direct.writes - writes0
    assert calls >= 8 * 40 * 2 and writes < calls, (calls, writes)
    assert not direct._queue and not direct._writing


def test_a_broken_write_fails_every_call_it_carried_and_the_next_call_reconnects(store, monkeypatch):
    # Given a caller whose write is on the wire and two more queued behind it
    direct = store.calls.direct
    lifecycle(store, "warm")
    gate, entered = threading.Event(), threading.Event()
    real = direct._round_trip

    def stalled(commands, n, pid):
        if n > 1:  # the queued callers' shared write: the connection breaks under it
            direct._drop()
            raise ConnectionResetError("the server went away mid-write")
        entered.set()
        gate.wait(10)
        return real(commands, n, pid)

    monkeypatch.setattr(direct, "_round_trip", stalled)
    outcomes: dict = {}

    def call(name: str) -> None:
        try:
            outcomes[name] = store.acquire(f"{name}-task", f"owner-{name}")
        except BaseException as exc:  # noqa: BLE001
            outcomes[name] = exc

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert entered.wait(10)
    others = [threading.Thread(target=call, args=(name,)) for name in ("second", "third")]
    for t in others:
        t.start()
    wait_for(lambda: len(direct._queue) == 2, 10, what="two callers queued behind the write")
    gate.set()
    for t in [first, *others]:
        t.join(20)
    # Then the first call succeeds, and both calls of the broken write fail, named (none hangs)
    assert outcomes["first"].token >= 1
    for name in ("second", "third"):
        assert isinstance(outcomes[name], LeaseUnavailable), outcomes
    assert not direct._queue and not direct._writing
    # And the next call opens a new connection and succeeds
    monkeypatch.setattr(direct, "_round_trip", real)
    assert store.acquire("after-task", "owner-after").token >= 1


def test_a_connection_the_server_dropped_is_replaced_and_the_call_succeeds(store, redis_client):
    # Given a held direct connection
    lifecycle(store, "before")
    old = store.calls.direct._conn
    assert old is not None
    # When the server drops every client connection (as a restart would)
    redis_client.client_kill_filter(_type="normal", skipme=True)
    # Then the next call succeeds, on a new direct connection
    lifecycle(store, "after")
    assert store.calls.direct._conn is not None


def test_a_timeout_is_not_sent_twice_and_the_store_reports_it_unavailable(tmp_path, key_prefix):
    # Given a store with a short socket timeout on a server that stops answering
    server = RedisServer(dir=tmp_path).start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5)
        store = LeaseStore(client, prefix=key_prefix, ttl=30)
        lifecycle(store, "warm")
        admin = redis.Redis.from_url(server.url)
        before = script_calls(admin)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            # When an acquire times out
            started = time.monotonic()
            with pytest.raises(LeaseUnavailable) as exc_info:
                store.acquire("stalled", "w1")
            waited = time.monotonic() - started
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        # Then it is reported as unavailable after one timeout, naming the call
        assert "acquire" in str(exc_info.value)
        assert waited < 1.5
        # And the server ran the command once, not twice (the reply was lost with the connection)
        time.sleep(0.2)
        assert script_calls(admin) - before == 1
        # And the store works again once the server answers
        lifecycle(store, "resumed")
    finally:
        server.stop()
        server.cleanup()


def test_a_read_only_server_counts_as_unavailable(tmp_path, key_prefix):
    # Given a store pointed at a replica (a master demoted by a failover looks the same)
    primary = RedisServer(dir=tmp_path / "primary").start()
    replica = RedisServer(dir=tmp_path / "replica").start()
    try:
        replica.client().replicaof("127.0.0.1", primary.port)
        store = LeaseStore(redis.Redis.from_url(replica.url), prefix=key_prefix, ttl=30)
        # When a task tries to take its lease there, through redis-py (script not cached)
        # and then directly (cached)
        for cached in (False, True):
            if cached:
                replica.client().script_load(scripts.acquire.source)
            with pytest.raises(LeaseUnavailable) as exc_info:
                store.acquire("t", "w1")
            # Then it is unavailable (a failover under way), not a bad call, and says why
            assert "read only replica" in str(exc_info.value)
        # And the direct connection was dropped: the next call connects anew
        assert store.calls.direct._conn is None
        # And every other path that writes says the same (errors.py): a pipeline of
        # script calls over two shards, a plain write, a finish
        # (the leases are taken on the primary and have expired: claiming them must write)
        ids = [f"t{i}" for i in range(6)]
        on_primary = LeaseStore(redis.Redis.from_url(primary.url), prefix=key_prefix, shards=2)
        for task_id in ids:
            on_primary.acquire(task_id, "w0", ttl=0.05)
        sharded = LeaseStore(redis.Redis.from_url(replica.url), prefix=key_prefix, shards=2)
        deadline = time.monotonic() + 10
        while len(sharded.expired()) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.05)  # replicated and expired
        assert len(sharded.expired()) == len(ids)
        for name, call in {"pipeline": lambda: sharded.claim_expired(ids=ids),
                           "write": lambda: store.try_recovery_turn("w1", 1.0),
                           "finish": lambda: store.finish("t", "w1", 1, "succeeded")}.items():
            with pytest.raises(LeaseUnavailable) as exc_info:
                call()
            assert "read only replica" in str(exc_info.value), name
    finally:
        for server in (replica, primary):
            server.stop()
            server.cleanup()


def test_a_flushed_script_cache_is_reloaded(store, redis_client):
    # Given a server that lost its scripts
    lifecycle(store, "before")
    redis_client.script_flush()
    # Then the next call still works (redis-py sends the source) and the direct path resumes
    lifecycle(store, "after")
    lifecycle(store, "again")


class ChunkedSocket:
    """A socket whose reply arrives in 64 KiB reads, as a large reply does from a real one."""

    def __init__(self, data: bytes, chunk: int = 65536) -> None:
        self.data, self.chunk, self.pos = data, chunk, 0

    def recv(self, size: int) -> bytes:
        out = self.data[self.pos:self.pos + min(size, self.chunk)]
        self.pos += len(out)
        return out


def big_reply(megabytes: int) -> tuple[bytes, list]:
    """A claim-like reply: an array of 1 KiB bodies adding up to ``megabytes``."""
    items = [b"%06d" % i + b"x" * 1018 for i in range(megabytes * 1024)]
    return b"*%d\r\n" % len(items) + b"".join(b"$%d\r\n%s\r\n" % (len(i), i) for i in items), items


@pytest.mark.parametrize("use_hiredis", [False, True], ids=["scanner", "hiredis"])
def test_a_reply_read_in_many_pieces_is_parsed_once(use_hiredis, monkeypatch):
    from celery_leases.protocol.transport import direct, resp as wire
    from celery_leases.protocol.transport.direct import read_reply
    if use_hiredis and direct._HiredisReader is None:
        return run_with_hiredis("test_a_reply_read_in_many_pieces_is_parsed_once[hiredis]")
    # Given a 16 MB reply arriving 64 KiB at a time, and the reader's work counted, not
    # timed: each byte fed to hiredis, or each byte the scanner looks at per read
    data, items = big_reply(16)
    reads = -(-len(data) // 65536)
    fed, looked_at, parses = [], [], []
    if use_hiredis:
        real_reader = direct._HiredisReader

        class CountingReader:
            def __init__(self, **kwargs):
                self.reader = real_reader(**kwargs)

            def feed(self, chunk):
                fed.append(len(chunk))
                self.reader.feed(chunk)

            def gets(self):
                return self.reader.gets()

            def has_data(self):
                return self.reader.has_data()

        monkeypatch.setattr(direct, "_HiredisReader", CountingReader)
    else:
        class CountingScanner(wire.Scanner):
            def end(self, buf):
                looked_at.append(len(buf) - self.pos)  # what is left to look at from where it resumes
                return super().end(buf)

        real_parse = direct.parse
        monkeypatch.setattr(direct, "Scanner", CountingScanner)
        monkeypatch.setattr(direct, "parse", lambda buf, pos=0: parses.append(len(buf)) or real_parse(buf, pos))

    # When it is read
    sock = ChunkedSocket(data)
    reply = read_reply(sock, use_hiredis=use_hiredis)

    # Then it is the reply, read to its end, and the work is linear in its size (re-parsing
    # from byte 0 on every read looked at ~128 times the reply's bytes for 16 MB)
    assert reply == items and sock.pos == len(data)
    if use_hiredis:
        assert (len(fed), sum(fed)) == (reads, len(data))
    else:
        assert parses == [len(data)]
        assert len(looked_at) == reads
        assert sum(looked_at) <= 2 * len(data), (sum(looked_at), len(data))


HIREDIS_DIR = Path(__file__).resolve().parents[2] / ".hiredis"


def run_with_hiredis(test: str) -> None:
    """Run ``test`` of this module in a child pytest with hiredis importable (from .hiredis/,
    which make test fills: the suite's own venv keeps redis-py's Python parser)."""
    assert not os.environ.get("LEASES_TEST_HIREDIS_CHILD"), f"hiredis not importable from {HIREDIS_DIR}"
    if not (HIREDIS_DIR / "hiredis").is_dir():
        skip_or_fail(f"hiredis is not in {HIREDIS_DIR} (make test installs it there)")
    path = os.pathsep.join(filter(None, [str(HIREDIS_DIR), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "LEASES_TEST_HIREDIS_CHILD": "1", "PYTHONPATH": path}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            f"{__file__}::{test}"], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-3000:] + child.stderr[-2000:]


def test_a_cut_reply_waits_for_its_end_and_extra_bytes_are_refused():
    from celery_leases.protocol.transport.direct import read_reply
    from celery_leases.protocol.transport.resp import pack
    reply = b"*3\r\n$3\r\nabc\r\n*2\r\n:1\r\n$-1\r\n-NOSCRIPT No matching script\r\n"
    parsed = read_reply(ChunkedSocket(reply, chunk=1), use_hiredis=False)
    assert parsed[:2] == [b"abc", [1, None]] and isinstance(parsed[2], redis.exceptions.NoScriptError)
    with pytest.raises(redis.ConnectionError, match="unexpected bytes"):
        read_reply(ChunkedSocket(b":1\r\n:2\r\n"), use_hiredis=False)
    assert pack("SET", "k", 1.5, 2) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n1.5\r\n$1\r\n2\r\n"


@pytest.mark.parametrize("use_hiredis", [False, True], ids=["scanner", "hiredis"])
def test_the_replies_of_a_shared_write_are_read_in_order_however_they_are_cut(use_hiredis):
    from celery_leases.protocol.transport import direct
    from celery_leases.protocol.transport.direct import read_replies
    if use_hiredis and direct._HiredisReader is None:
        return run_with_hiredis(
            "test_the_replies_of_a_shared_write_are_read_in_order_however_they_are_cut[hiredis]")
    # Given the replies of three calls written together: an array, an error, an integer
    data = b"*2\r\n:1\r\n$3\r\nabc\r\n-NOSCRIPT No matching script\r\n:7\r\n"
    for chunk in (1, 5, len(data)):
        # When they arrive cut at every byte, every 5 bytes, or in one read
        first, error, last = read_replies(ChunkedSocket(data, chunk=chunk), 3, use_hiredis=use_hiredis)
        # Then each call gets its own reply, the error as redis-py's exception for it
        assert (first, last) == ([1, b"abc"], 7)
        assert isinstance(error, redis.exceptions.NoScriptError)
    # And a fourth reply's bytes after the three mean the connection is out of step
    with pytest.raises(redis.ConnectionError, match="unexpected bytes"):
        read_replies(ChunkedSocket(data + b":8\r\n"), 3, use_hiredis=use_hiredis)
