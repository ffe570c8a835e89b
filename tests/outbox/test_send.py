"""``outbox.send`` on every connection it accepts, and the relay in this process.

No worker here: a row published is a message in the test's queue on the broker (read
with LRANGE) and a ``queued`` record in the lease store (publish tracking recorded it,
under the row's publish id).
"""
from __future__ import annotations

import json
import logging
import sqlite3

import pytest
from celery import chain, chord, group

import celery_leases
from celery_leases import outbox
from celery_leases.outbox import OutboxError, Relay
from celery_leases.outbox.database import Database

ADD = "tests.support.apps.leased_app.add"
TSUM = "tests.support.apps.leased_app.tsum"


@pytest.fixture
def app(outbox_env):
    from tests.support.apps.leased_app import create_app
    app = create_app(outbox_env)
    yield app
    app.close()


def messages(redis_client, queue: str) -> list[dict]:
    """(task id, publish id, task name) of every message waiting in ``queue``."""
    out = []
    for raw in redis_client.lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        out.append((headers["id"], headers.get("lease_publish"), headers["task"]))
    return out


def make_table(url: str, table: str) -> Database:
    database = Database(url, table)
    database.create()
    return database


def pg_connect(url: str, driver: str):
    if driver == "psycopg":
        import psycopg
        return psycopg.connect(url)
    import psycopg2
    return psycopg2.connect(url)


def connections(kind: str, url: str):
    """A connection of ``kind`` to ``url``, and how to commit, roll back and close it."""
    if kind in ("psycopg", "psycopg2"):
        conn = pg_connect(url, kind)
        return conn, conn.commit, conn.rollback, conn.close
    if kind == "sqlite3":
        conn = sqlite3.connect(Database(url).sqlite_path())
        return conn, conn.commit, conn.rollback, conn.close
    from sqlalchemy import create_engine
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    if kind == "sqlalchemy":
        conn = engine.connect()
        return conn, conn.commit, conn.rollback, lambda: (conn.close(), engine.dispose())
    from sqlalchemy.orm import Session
    session = Session(engine)
    return session, session.commit, session.rollback, lambda: (session.close(), engine.dispose())


@pytest.fixture(params=["pg", "sqlite"])
def db_url(request):
    if request.param == "pg":
        return request.getfixturevalue("pg_database")
    return request.getfixturevalue("sqlite_url")


@pytest.mark.parametrize("kind, backend", [("psycopg", "pg"), ("psycopg2", "pg"), ("sqlalchemy", "pg"),
                                           ("sqlite3", "sqlite"), ("sqlalchemy", "sqlite")])
def test_a_task_exists_if_and_only_if_its_transaction_commits(kind, backend, request, app, outbox_table,
                                                               redis_client, key_prefix):
    db_url = request.getfixturevalue("pg_database" if backend == "pg" else "sqlite_url")
    database = make_table(db_url, outbox_table)
    conn, commit, rollback, close = connections(kind, db_url)
    try:
        # Given tasks sent in a transaction that rolls back, then one in a transaction that commits
        add = app.tasks[ADD]
        lost = [outbox.send(conn, add.s(1, 1)), outbox.send(conn, chain(add.s(1, 2), add.s(3)))]
        rollback()
        kept = outbox.send(conn, add.s(2, 2))
        # Then nothing is published before the relay runs, and send returned the task id at once
        assert messages(redis_client, key_prefix) == []
        commit()
    finally:
        close()
    relay = Relay(app, db_url, outbox_table)
    assert relay.status().depth == 1
    # When the relay runs
    assert relay.run_once() == 1
    relay.close()
    # Then only the committed task is published, under its own id and the publish id of its row
    published = messages(redis_client, key_prefix)
    assert [(task_id, name) for task_id, _, name in published] == [(kept.id, ADD)]
    store = celery_leases.store(app)
    assert store.get(kept.id).state == "queued"  # recorded at publish, like any publish
    assert store.client.hget(store.keys.message(kept.id), "pub").decode() == published[0][1]
    assert all(store.get(r.id) is None for r in lost)
    assert relay.status().depth == 0
    relay.close()
    assert database.dialect.name == ("postgresql" if backend == "pg" else "sqlite")


def test_a_chain_a_group_and_a_chord_are_one_row_each_published_with_their_frozen_ids(sqlite_url, app, outbox_table,
                                                                             redis_client, key_prefix):
    make_table(sqlite_url, outbox_table)
    add = app.tasks[ADD]
    conn = sqlite3.connect(Database(sqlite_url).sqlite_path())
    in_chain = outbox.send(conn, chain(add.s(1, 2), add.s(3)))
    in_group = outbox.send(conn, group(add.s(1, 1), add.s(2, 2)))
    in_chord = outbox.send(conn, chord([add.s(3, 3), add.s(4, 4)], app.tasks[TSUM].s()))
    conn.commit()
    assert conn.execute(f"SELECT count(*) FROM {outbox_table}").fetchone()[0] == 3
    conn.close()
    relay = Relay(app, sqlite_url, outbox_table)
    relay.run_once()
    relay.close()
    ids = {task_id for task_id, _, _ in messages(redis_client, key_prefix)}
    # The chain's first task (its second one is sent by the worker), both group members and
    # both chord header tasks (the body is sent once they finished)
    assert ids == {in_chain.parent.id, *(r.id for r in in_group.results), *(r.id for r in in_chord.parent.results)}


def test_a_row_published_twice_carries_the_same_task_id_and_publish_id(pg_database, app, outbox_table,
                                                                         redis_client, key_prefix):
    # Given a relay that published a row and crashed before its delete (its transaction
    # rolled back: the row is there again)
    make_table(pg_database, outbox_table)
    conn = pg_connect(pg_database, "psycopg")
    sent = outbox.send(conn, app.tasks[ADD].s(1, 2))
    conn.commit()
    conn.close()
    from celery_leases.outbox.claims import claim, publish_batch
    relay = Relay(app, pg_database, outbox_table)
    ex = relay.database.executor()
    rows = claim(ex, relay.database.table, 10)
    original = ex.run
    ex.run = lambda sql, params=(): (_ for _ in ()).throw(ConnectionError("killed before the delete"))
    with pytest.raises(ConnectionError):
        publish_batch(app, ex, relay.database.table, rows)
    ex.run = original
    ex.rollback()
    ex.close()
    # When a relay publishes the outbox again
    assert relay.run_once() == 1
    relay.close()
    # Then both copies carry the same ids: the lease store refuses the second at receipt
    first, second = messages(redis_client, key_prefix)
    assert first[:2] == second[:2] and first[0] == sent.id and first[1]


@pytest.mark.parametrize("backend", ["pg", "sqlite"])
def test_a_sqlalchemy_session_publishes_its_rows_right_after_commit(backend, request, app, outbox_table,
                                                                    redis_client, key_prefix):
    url = request.getfixturevalue("pg_database" if backend == "pg" else "sqlite_url")
    make_table(url, outbox_table)
    session, commit, rollback, close = connections("session", url)
    add = app.tasks[ADD]
    try:
        dropped = outbox.send(session, add.s(0, 0))
        rollback()
        sent = [outbox.send(session, add.s(i, i)) for i in range(3)]
        assert messages(redis_client, key_prefix) == []  # nothing before COMMIT
        commit()
        # Published by the session's commit hook, no relay running; the rows are gone
        assert sorted(m[0] for m in messages(redis_client, key_prefix)) == sorted(r.id for r in sent)
        assert dropped.id not in {m[0] for m in messages(redis_client, key_prefix)}
    finally:
        close()
    relay = Relay(app, url, outbox_table)
    assert relay.status().depth == 0
    relay.close()


def test_send_into_a_database_without_the_table_names_the_init_command(db_url, app):
    kind = "sqlite3" if db_url.startswith("sqlite") else "psycopg"
    conn, _, rollback, close = connections(kind, db_url)
    try:
        with pytest.raises(OutboxError, match=r"celery -A proj leases outbox init"):
            outbox.send(conn, app.tasks[ADD].s(1, 2))
        rollback()
    finally:
        close()


def test_send_refuses_an_unknown_connection(app):
    with pytest.raises(TypeError, match="DB-API connection"):
        outbox.send(object(), app.tasks[ADD].s(1, 2))


def test_a_row_that_cannot_be_decoded_is_parked_once_with_a_clear_log(sqlite_url, app, outbox_table,
                                                                      redis_client, key_prefix, caplog):
    database = make_table(sqlite_url, outbox_table)
    conn = sqlite3.connect(database.sqlite_path())
    conn.execute(f"INSERT INTO {outbox_table} (task_id, publish_id, name, payload) VALUES "
                 f"('bad-1', 'p1', 'leased_app.add', '{{not json')")
    conn.execute(f"INSERT INTO {outbox_table} (task_id, publish_id, name, payload) VALUES "
                 f"('bad-2', 'p2', 'leased_app.add', '[1, 2]')")
    good = outbox.send(conn, app.tasks[ADD].s(1, 2))
    conn.commit()
    relay = Relay(app, sqlite_url, outbox_table)
    with caplog.at_level(logging.ERROR, logger="celery_leases.outbox"):
        assert relay.run_once() == 1
        assert relay.run_once() == 0  # never looped
    assert relay.parked == 2
    parked = [r for r in caplog.records if "parked" in r.getMessage()]
    assert len(parked) == 2
    assert "task leased_app.add[bad-1]" in parked[0].getMessage()
    assert "not JSON" in parked[0].getMessage() and "not a Celery signature" in parked[1].getMessage()
    rows = conn.execute(f"SELECT task_id, error FROM {outbox_table}_parked ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["bad-1", "bad-2"]
    assert relay.status().as_dict() == {"depth": 0, "oldest_age_seconds": None, "parked": 2}
    assert [m[0] for m in messages(redis_client, key_prefix)] == [good.id]
    relay.close()
    conn.close()


def test_an_unreachable_database_makes_the_relay_back_off_with_a_bound_and_say_so(app, caplog):
    relay = Relay(app, "postgresql://postgres@127.0.0.1:1/nothing", retry_max_delay=0.2)
    relay.RETRY_DELAY = 0.05
    with caplog.at_level(logging.DEBUG, logger="celery_leases.outbox"):
        relay.start()
        import time
        time.sleep(1.5)
        relay.stop()
    # The delay doubled up to its bound and stayed there
    assert relay.delays[:3] == [0.05, 0.1, 0.2] and set(relay.delays[3:]) == {0.2}, relay.delays
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # said once, not once per try
    assert "outbox relay (postgresql://postgres@127.0.0.1:1/nothing) failed" in errors[0]
    assert "the delay doubling up to 0.2s; the rows wait in the database" in errors[0]


def test_the_lease_store_away_at_commit_keeps_the_rows_until_it_is_back(own_server, outbox_env, sqlite_url,
                                                                        outbox_table, redis_server_url):
    # Given a lease store that is down when the transaction commits
    from tests.support.apps.leased_app import create_app
    store_server = own_server("store")
    app = create_app({**outbox_env, "LEASES_TEST_LEASES_URL": store_server.url})
    database = make_table(sqlite_url, outbox_table)
    conn = sqlite3.connect(database.sqlite_path())
    sent = [outbox.send(conn, app.tasks[ADD].s(i, 1)) for i in range(5)]
    store_server.stop()
    conn.commit()
    relay = Relay(app, sqlite_url, outbox_table)
    # Then the relay publishes nothing: the rows wait in the database
    with pytest.raises(celery_leases.LeaseUnavailable):
        relay.run_once()
    assert relay.status().depth == 5
    # And once the store is back they are published, each recorded at publish
    store_server.start()
    assert relay.run_once() == 5
    store = celery_leases.store(app)
    assert [store.get(r.id).state for r in sent] == ["queued"] * 5
    relay.close()
    conn.close()
    app.close()


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_postgresql_relay_wakes_at_commit(driver, pg_database, app, outbox_table, redis_client, key_prefix,
                                            monkeypatch):
    import sys
    import time
    make_table(pg_database, outbox_table)
    if driver == "psycopg2":
        monkeypatch.setitem(sys.modules, "psycopg", None)  # the relay's connections fall back to psycopg2
    relay = Relay(app, pg_database, outbox_table, poll_interval=30.0).start()
    try:
        time.sleep(0.3)  # listening
        conn = pg_connect(pg_database, driver)
        sent = outbox.send(conn, app.tasks[ADD].s(1, 2))
        time.sleep(0.3)
        assert relay.database.driver == driver
        assert messages(redis_client, key_prefix) == []  # not committed: not woken
        began = time.monotonic()
        conn.commit()
        while not messages(redis_client, key_prefix) and time.monotonic() - began < 5:
            time.sleep(0.005)
        waited = time.monotonic() - began
        assert [m[0] for m in messages(redis_client, key_prefix)] == [sent.id]
        assert waited < 1.0, f"published {waited:.3f}s after COMMIT with a 30s poll interval"
        conn.close()
    finally:
        relay.stop()


def test_mysql_init_send_and_relay(mysql_url, app, outbox_table, redis_client, key_prefix):
    database = make_table(mysql_url, outbox_table)
    conn = database.connect()
    try:
        rolled = outbox.send(conn, app.tasks[ADD].s(1, 1))
        conn.rollback()
        sent = outbox.send(conn, app.tasks[ADD].s(1, 2))
        conn.commit()
        relay = Relay(app, mysql_url, outbox_table)
        assert relay.status().depth == 1
        assert relay.run_once() == 1
        assert [m[0] for m in messages(redis_client, key_prefix)] == [sent.id] != [rolled.id]
        assert relay.status().depth == 0
        relay.close()
    finally:
        cur = conn.cursor()
        cur.execute(f"DROP TABLE IF EXISTS `{outbox_table}`, `{outbox_table}_parked`")
        conn.commit()
        conn.close()


def test_a_relay_without_its_table_names_the_init_command(sqlite_url, app, caplog):
    relay = Relay(app, sqlite_url, "no_such_outbox", retry_max_delay=0.1)
    relay.RETRY_DELAY = 0.05
    with caplog.at_level(logging.ERROR, logger="celery_leases.outbox"):
        relay.start()
        import time
        time.sleep(0.3)
        relay.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "celery -A proj leases outbox init" in errors[0], errors


@pytest.mark.parametrize("setting, value, message", [
    ("leases_outbox_url", "redis://localhost/0", "leases_outbox_url must be None \\(off\\) or the outbox.s database"),
    ("leases_outbox_poll_interval", 0, "leases_outbox_poll_interval must be a positive number of seconds"),
])
def test_a_broken_relay_setting_stops_the_worker_not_a_publisher(setting, value, message):
    from celery import Celery

    from celery_leases import ConfigurationError
    from celery_leases.config import get_config
    app = Celery("cfg", broker="redis://127.0.0.1:1/0")
    app.conf[setting] = value
    celery_leases.install(app)  # a publisher: fine
    with pytest.raises(ConfigurationError, match=message):
        get_config(app)  # what a worker checks at start


def test_a_broken_table_name_fails_install():
    from celery import Celery

    from celery_leases import ConfigurationError
    app = Celery("cfg", broker="redis://127.0.0.1:1/0")
    app.conf.leases_outbox_table = "orders; DROP TABLE users"
    with pytest.raises(ConfigurationError, match="leases_outbox_table must be a table name"):
        celery_leases.install(app)


def test_a_relay_told_not_to_listen_polls_postgresql(pg_database, app, outbox_table):
    # (a gevent or eventlet worker's relay: a blocking LISTEN wait would stall its loop)
    make_table(pg_database, outbox_table)
    relay = Relay(app, pg_database, outbox_table, poll_interval=0.05, listen=False)
    assert relay._listen() is None
    relay._wait(0.05)  # a plain sleep
    assert relay._listener is None
    relay.close()
