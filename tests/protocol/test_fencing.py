"""Fenced writes (Redis and SQL) and idempotency keys, against a real redis-server,
SQLite and PostgreSQL.

The invariant every fenced write keeps: once a write with token T was accepted
for a resource, no write with a token older than T is accepted for it again.
"""
from __future__ import annotations

import queue
import random
import sqlite3
import threading
import time
import uuid
from collections import defaultdict

import pytest
import redis

from celery_leases import (CorruptRecord, LeaseError, StaleFence, fenced_get, fenced_set,
                           fenced_update, idempotency_key)
from celery_leases.protocol.codes import Code
from celery_leases.protocol.keys import Keys
from celery_leases.protocol.calls import call_script
from celery_leases.protocol.scripts import scripts
from tests.support.services import skip_or_fail

RESOURCES = 1000      #: resources written concurrently
WRITERS = 3           #: owners (tokens) per resource: the newest is current, the others stale
WRITES_EACH = 2       #: writes per owner
THREADS = 16

PG_DSN = "host=127.0.0.1 port=5432 dbname=test connect_timeout=3"


# -- Redis --------------------------------------------------------------------


def test_redis_write_accepted_then_older_token_refused(redis_client, key_prefix):
    # Given a resource written under token 7
    assert fenced_set(redis_client, key_prefix, "order:1", 7, "paid by 7") is True
    # When a writer with the older token 5 writes, Then StaleFence names both tokens
    with pytest.raises(StaleFence) as info:
        fenced_set(redis_client, key_prefix, "order:1", 5, "paid by 5")
    assert (info.value.token, info.value.current) == (5, 7)
    assert isinstance(info.value, LeaseError)
    # And asked for a boolean, the same write returns False
    assert fenced_set(redis_client, key_prefix, "order:1", 5, "paid by 5", raise_on_stale=False) is False
    # And the value and fence are still the newer writer's
    assert fenced_get(redis_client, key_prefix, "order:1") == (b"paid by 7", 7)


def test_redis_equal_and_newer_tokens_are_accepted(redis_client, key_prefix):
    keys = Keys(key_prefix)
    assert fenced_set(redis_client, keys, "r", 3, "a")
    assert fenced_set(redis_client, keys, "r", 3, "b")        # the same owner writes again
    assert fenced_set(redis_client, keys, "r", 9, "c")
    assert fenced_get(redis_client, keys, "r") == (b"c", 9)
    assert fenced_get(redis_client, keys, "never-written") == (None, 0)


def test_redis_hash_fields_share_the_resource_fence(redis_client, key_prefix):
    # Given field "status" written under token 8
    fenced_set(redis_client, key_prefix, "order:2", 8, "paid", field="status")
    # When token 6 writes another field of the same resource, Then it is refused
    assert not fenced_set(redis_client, key_prefix, "order:2", 6, "x", field="note", raise_on_stale=False)
    # And token 8 may write it; fields are independent values under one fence
    fenced_set(redis_client, key_prefix, "order:2", 8, "card", field="note")
    assert fenced_get(redis_client, key_prefix, "order:2", field="status") == (b"paid", 8)
    assert fenced_get(redis_client, key_prefix, "order:2", field="note") == (b"card", 8)
    # And a field named "token" cannot clobber the fence
    fenced_set(redis_client, key_prefix, "order:2", 8, "999", field="token")
    assert fenced_get(redis_client, key_prefix, "order:2")[1] == 8


def test_redis_script_answers_with_contract_codes(redis_client, key_prefix):
    key = Keys(key_prefix).fence("r")
    assert call_script(redis_client, scripts.fenced_write, (key,), (5, "value", "v")) == [Code.OK, 5]
    assert call_script(redis_client, scripts.fenced_write, (key,), (4, "value", "v")) == [Code.STALE_FENCE, 5]


@pytest.mark.parametrize("token", [None, 0, -1, True, "5", 1.5])
def test_redis_bad_tokens_are_named(redis_client, key_prefix, token):
    with pytest.raises(ValueError, match="fencing token"):
        fenced_set(redis_client, key_prefix, "r", token, "v")


def test_redis_a_key_of_another_type_is_reported(redis_client, key_prefix):
    key = Keys(key_prefix).fence("r")
    redis_client.set(key, "not a hash")
    with pytest.raises(CorruptRecord, match="fence"):
        fenced_set(redis_client, key_prefix, "r", 1, "v")


def test_redis_a_read_only_replica_is_unavailable_not_a_raw_error(tmp_path, key_prefix):
    """A failover demotes the master the fence writes go to: READONLY means "try again
    later" here as on every other path (errors.py), never a raw ResponseError."""
    from celery_leases import LeaseUnavailable
    from celery_leases.testing.servers import RedisServer
    primary = RedisServer(dir=tmp_path / "primary").start()
    replica = RedisServer(dir=tmp_path / "replica").start()
    try:
        primary_client = primary.client()
        assert fenced_set(primary_client, key_prefix, "r", 3, "v")
        replica.client().replicaof("127.0.0.1", primary.port)
        replica_client = replica.client()
        deadline = time.monotonic() + 10
        while replica_client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)
        # When a fenced write reaches the replica (script cached there, and not)
        for cached in (False, True):
            if cached:
                replica_client.script_load(scripts.fenced_write.source)
            with pytest.raises(LeaseUnavailable) as raised:
                fenced_set(replica_client, key_prefix, "r", 4, "w")
            assert "read only replica" in str(raised.value) and key_prefix in str(raised.value)
        # And reads still work there; nothing was written
        assert fenced_get(replica_client, key_prefix, "r") == (b"v", 3)
    finally:
        for server in (replica, primary):
            server.stop()
            server.cleanup()


def test_redis_a_corrupt_fence_is_reported_by_the_script_and_the_read(redis_client, key_prefix):
    # A fence hash whose token field is not a number: the script's CORRUPT answer names the key
    key = Keys(key_prefix).fence("r")
    redis_client.hset(key, mapping={"token": "x", "value": "v"})
    for call in (lambda: fenced_set(redis_client, key_prefix, "r", 1, "v"),
                 lambda: fenced_get(redis_client, key_prefix, "r")):
        with pytest.raises(CorruptRecord) as raised:
            call()
        assert key in str(raised.value)


# -- the concurrent stale/current writers check ---------------------------------


def concurrent_writers(write, resources=RESOURCES):
    """Run WRITERS owners x WRITES_EACH writes per resource from THREADS threads.

    Tokens are drawn from one increasing counter, as leases draw them, and each
    resource's writes come in random order. For half of the resources the
    writes are adjacent in the queue, so threads run them at the same time;
    for the other half they are spread over the whole run, so stale writes
    also arrive well after the newer owner's was accepted.
    ``write(resource, token) -> bool``.
    Returns {resource: [(token, accepted, started_ns, ended_ns), ...]}.
    """
    rng = random.Random(4242)
    next_token = iter(range(1, 10**9))
    adjacent, spread = [], []
    for r in range(resources):
        owners = [next(next_token) for _ in range(WRITERS)]
        writes = [(r, t) for t in owners for _ in range(WRITES_EACH)]
        rng.shuffle(writes)
        (adjacent if r % 2 else spread).append(writes)
    spread_jobs = [job for writes in spread for job in writes]
    rng.shuffle(spread_jobs)
    jobs = []
    for i, writes in enumerate(adjacent):
        jobs.extend(writes)
        jobs.extend(spread_jobs[i * len(writes):(i + 1) * len(writes)])
    jobs.extend(spread_jobs[len(adjacent) * WRITERS * WRITES_EACH:])
    work: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        work.put(job)
    log = defaultdict(list)
    lock = threading.Lock()
    errors = []

    def run():
        mine = []
        try:
            while True:
                try:
                    r, t = work.get_nowait()
                except queue.Empty:
                    break
                started = time.monotonic_ns()
                accepted = write(r, t)
                mine.append((r, (t, accepted, started, time.monotonic_ns())))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        with lock:
            for r, entry in mine:
                log[r].append(entry)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert sum(len(v) for v in log.values()) == len(jobs)
    return log


def assert_never_older_after_newer(log, final):
    """No write was accepted after a newer token's write had been accepted; the newest wins.

    ``final(resource) -> (value token, fence)`` reads the end state.
    """
    after_newer = overlapping = 0
    for r, writes in log.items():
        for token, accepted, started, ended in writes:
            newer_done = [t for t, ok, _, end in writes if ok and t > token and end < started]
            assert not (accepted and newer_done), (
                f"resource {r}: token {token} accepted after token {max(newer_done)} was")
            after_newer += bool(newer_done)
            overlapping += any(t != token and s < ended and started < e for t, _, s, e in writes)
        newest = max(t for t, *_ in writes)
        assert all(ok for t, ok, *_ in writes if t == newest), f"resource {r}: the newest owner was refused"
        assert final(r) == (newest, newest), f"resource {r} ends as {final(r)}, newest token {newest}"
    # The run really had stale writes after a newer one was accepted, and racing writes
    # (SQLite serializes writers on its database lock, so fewer of those overlap)
    assert after_newer > len(log) // 4, after_newer
    assert overlapping > len(log) // 50, overlapping


def test_redis_concurrent_stale_and_current_writers(redis_server_url, key_prefix):
    # Given 1,000 resources, each written by three owners (two stale, one current), twice each
    pool = redis.ConnectionPool.from_url(redis_server_url, max_connections=THREADS + 2)
    client = redis.Redis(connection_pool=pool)
    keys = Keys(key_prefix)
    try:
        # When all writes race from 16 threads
        log = concurrent_writers(lambda r, t: fenced_set(client, keys, f"res:{r}", t, str(t),
                                                         raise_on_stale=False))

        # Then no resource took an older token's write after a newer one, and each ends newest
        def final(r):
            value, fence = fenced_get(client, keys, f"res:{r}")
            return int(value), fence

        assert_never_older_after_newer(log, final)
    finally:
        pool.disconnect()


# -- SQL: SQLite and PostgreSQL ----------------------------------------------------


class SQLite:
    name = "sqlite"
    paramstyles = ("qmark", "numeric", "named")

    def __init__(self, tmp_path):
        self.path = str(tmp_path / "fence.db")
        with sqlite3.connect(self.path) as conn:
            conn.execute("PRAGMA journal_mode=WAL")

    def connect(self):
        conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        conn.execute("PRAGMA synchronous=OFF")
        return conn

    bigint = "INTEGER"


class Postgres:
    name = "postgres"
    paramstyles = ("pyformat", "format")
    bigint = "BIGINT"

    def __init__(self):
        try:
            import psycopg
        except ImportError:
            skip_or_fail("psycopg is not installed (pip install 'psycopg[binary]')")
        self.psycopg = psycopg
        errors = []
        for user in ("postgres", "root"):
            try:
                psycopg.connect(f"{PG_DSN} user={user}").close()
            except psycopg.Error as exc:
                errors.append(f"{user}: {' '.join(str(exc).split())}")
                continue
            self.user = user
            return
        skip_or_fail("PostgreSQL not reachable on 127.0.0.1:5432 (database test, user postgres "
                     "or root): " + "; ".join(errors))

    def connect(self):
        return self.psycopg.connect(f"{PG_DSN} user={self.user}")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path):
    """A database with a fresh, uniquely named table ``db.table`` (dropped afterwards)."""
    backend = SQLite(tmp_path) if request.param == "sqlite" else Postgres()
    backend.table = f"fence_{uuid.uuid4().hex[:12]}"
    conn = backend.connect()
    cur = conn.cursor()
    cur.execute(f"CREATE TABLE {backend.table} (id {backend.bigint} PRIMARY KEY, "
                f"status TEXT, amount {backend.bigint}, fence {backend.bigint} DEFAULT 0)")
    conn.commit()
    backend.conn = conn
    try:
        yield backend
    finally:
        conn.rollback()
        cur = conn.cursor()
        cur.execute(f"DROP TABLE IF EXISTS {backend.table}")
        conn.commit()
        conn.close()


def insert(db, *ids, fence=0):
    cur = db.conn.cursor()
    for i in ids:
        cur.execute(f"INSERT INTO {db.table} (id, status, amount, fence) VALUES ({i}, 'new', 0, "
                    f"{'NULL' if fence is None else int(fence)})")
    db.conn.commit()


def row(db, i):
    cur = db.conn.cursor()
    cur.execute(f"SELECT status, amount, fence FROM {db.table} WHERE id = {int(i)}")
    out = cur.fetchone()
    db.conn.commit()
    return tuple(out) if out else None


def test_sql_write_accepted_then_older_token_refused(db):
    # Given an order row written under token 7
    insert(db, 1)
    assert fenced_update(db.conn, db.table, 1, 7, {"status": "paid", "amount": 700}) is True
    db.conn.commit()
    # When a writer with token 5 updates it, Then StaleFence with both tokens
    with pytest.raises(StaleFence) as info:
        fenced_update(db.conn, db.table, 1, 5, {"status": "refunded"})
    assert (info.value.token, info.value.current) == (5, 7)
    # And asked for a boolean it returns False
    assert fenced_update(db.conn, db.table, 1, 5, {"status": "refunded"}, raise_on_stale=False) is False
    db.conn.rollback()
    # And the row is still the newer writer's
    assert row(db, 1) == ("paid", 700, 7)


def test_sql_equal_token_accepted_null_fence_is_zero(db):
    insert(db, 1)
    insert(db, 2, fence=None)
    assert fenced_update(db.conn, db.table, 1, 4, {"status": "a"})
    assert fenced_update(db.conn, db.table, 1, 4, {"status": "b"})     # same owner again
    assert fenced_update(db.conn, db.table, 2, 1, {"status": "c"})     # NULL fence counts as 0
    db.conn.commit()
    assert row(db, 1) == ("b", 0, 4) and row(db, 2) == ("c", 0, 1)


def test_sql_update_joins_the_callers_transaction(db):
    # Given a fenced update that the caller rolls back
    insert(db, 1)
    fenced_update(db.conn, db.table, 1, 3, {"status": "paid"})
    db.conn.rollback()
    # Then neither the value nor the fence was written
    assert row(db, 1) == ("new", 0, 0)


def test_sql_missing_row_is_not_a_stale_fence(db):
    with pytest.raises(LookupError, match="no row with id = 42"):
        fenced_update(db.conn, db.table, 42, 3, {"status": "paid"})
    with pytest.raises(LookupError):
        fenced_update(db.conn, db.table, 42, 3, {"status": "paid"}, raise_on_stale=False)


def test_sql_every_paramstyle_of_the_driver(db):
    insert(db, 1)
    for token, style in enumerate(db.paramstyles, start=2):
        assert fenced_update(db.conn, db.table, 1, token, {"status": style, "amount": token},
                             paramstyle=style)
        assert not fenced_update(db.conn, db.table, 1, token - 1, {"status": "stale"},
                                 paramstyle=style, raise_on_stale=False)
    db.conn.commit()
    last = len(db.paramstyles) + 1
    assert row(db, 1) == (db.paramstyles[-1], last, last)


@pytest.mark.parametrize("kwargs, bad", [
    ({"table": "orders; DROP TABLE x"}, "orders; DROP TABLE x"),
    ({"table": "a.b.c"}, "a.b.c"),
    ({"id_column": "id = 1 OR 1"}, "id = 1 OR 1"),
    ({"fence_column": '"fence"'}, '"fence"'),
    ({"values": {"status = 'x', amount": 1}}, "status = 'x', amount"),
    ({"values": {"1st": 1}}, "1st"),
])
def test_sql_bad_identifiers_are_named(kwargs, bad):
    args = {"table": "orders", "values": {"status": "paid"}, **kwargs}
    conn = sqlite3.connect(":memory:")
    with pytest.raises(ValueError) as info:
        fenced_update(conn, args.pop("table"), 1, 1, args.pop("values"), **args)
    assert repr(bad) in str(info.value)


def test_sql_values_may_not_set_the_id_or_fence():
    conn = sqlite3.connect(":memory:")
    for column in ("id", "fence"):
        with pytest.raises(ValueError, match=f"may not set '{column}'"):
            fenced_update(conn, "orders", 1, 1, {column: 1})
    with pytest.raises(ValueError, match="fencing token"):
        fenced_update(conn, "orders", 1, None, {"status": "x"})


def test_sql_schema_qualified_table(db):
    insert(db, 1)
    schema = "main" if db.name == "sqlite" else "public"
    assert fenced_update(db.conn, f"{schema}.{db.table}", 1, 2, {"status": "paid"})
    db.conn.commit()
    assert row(db, 1) == ("paid", 0, 2)


def test_sql_concurrent_stale_and_current_writers(db):
    # Given 1,000 rows, each written by three owners (two stale, one current), twice each
    cur = db.conn.cursor()
    cur.executemany(f"INSERT INTO {db.table} (id, status, amount, fence) VALUES "
                    f"({'?, ?, ?, ?' if db.name == 'sqlite' else '%s, %s, %s, %s'})",
                    [(r, "new", 0, 0) for r in range(RESOURCES)])
    db.conn.commit()
    local = threading.local()
    conns = []

    def write(r, token):
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = db.connect()
            conns.append(conn)
        try:
            accepted = fenced_update(conn, db.table, r, token, {"amount": token}, raise_on_stale=False)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        return accepted

    # When all writes race from 16 threads, each committing its own transaction
    try:
        log = concurrent_writers(write)
    finally:
        for conn in conns:
            conn.close()
    # Then no row took an older token's write after a newer one, and each ends newest
    cur = db.conn.cursor()
    cur.execute(f"SELECT id, amount, fence FROM {db.table}")
    end = {r: (amount, fence) for r, amount, fence in cur.fetchall()}
    db.conn.commit()
    assert_never_older_after_newer(log, end.__getitem__)


# -- idempotency keys -------------------------------------------------------------


def test_idempotency_key_is_stable_and_distinct():
    task_id = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    key = idempotency_key(task_id, "charge")
    # Stable: the same on every run, in every process and release (a fixed value)
    assert key == idempotency_key(task_id, "charge") == "50b06fde-cec8-50df-b7ce-87cdff0f816f"
    assert uuid.UUID(key).version == 5 and len(key) == 36
    # Distinct per step and per task, and unambiguous across the separator
    assert key != idempotency_key(task_id, "send-receipt")
    assert key != idempotency_key("another-task", "charge")
    assert idempotency_key("a:b", "c") != idempotency_key("a", "b:c")


@pytest.mark.parametrize("task_id, step", [(None, "s"), ("", "s"), ("t", ""), ("t", None)])
def test_idempotency_key_needs_task_id_and_step(task_id, step):
    with pytest.raises(ValueError):
        idempotency_key(task_id, step)
