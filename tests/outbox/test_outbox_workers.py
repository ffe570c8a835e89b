"""The outbox with real ``celery worker`` processes, real PostgreSQL and processes that die.

- a sender SIGKILLed right after COMMIT (raw connection, and a Session before its commit
  hook ran): every task runs once; SIGKILLed before COMMIT: none runs;
- a relay SIGKILLed between its publish and its delete: the next relay publishes the rows
  again under the same ids; each task runs once, the second copy refused at receipt;
- two workers' relays and a few hundred rows: each task runs once, no row published twice;
- the broker down at COMMIT: the rows wait in the database and are published when it is
  back; the waiters get their results.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import chain, chord, group

import celery_leases
from celery_leases import outbox
from celery_leases.outbox import Relay
from celery_leases.outbox.database import Database
from celery_leases.testing import wait_for
from tests.support.workers import assert_ran_once_with_a_lease, results_of, run_counts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ADD = "tests.support.apps.leased_app.add"


@pytest.fixture
def app(outbox_env):
    from tests.support.apps.leased_app import create_app
    app = create_app(outbox_env)
    yield app
    app.close()


@pytest.fixture
def pg_outbox(pg_database, outbox_table) -> str:
    Database(pg_database, outbox_table).create()
    return pg_database


def run_sender(mode: str, url: str, count: int, env: dict, tmp_path: Path) -> list[str]:
    """Run tests/support/outbox_sender.py; it must die by SIGKILL. The task ids it wrote."""
    ids_file = tmp_path / f"{mode}.ids"
    proc = subprocess.run([sys.executable, "-m", "tests.support.outbox_sender", mode, url, str(count),
                           str(ids_file)], env={**os.environ, **env}, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == -9, f"the {mode} sender did not die by SIGKILL: {proc.returncode}\n{proc.stderr}"
    return [line for line in ids_file.read_text().splitlines() if line]


def depth(url: str, table: str) -> int:
    relay = Relay(None, url, table)
    try:
        return relay.status().depth
    finally:
        relay.close()


def test_senders_killed_after_commit_run_every_task_once_and_before_commit_none(
        pg_outbox, outbox_env, outbox_table, app, start_worker, history, tmp_path):
    # Given a worker that relays the outbox
    start_worker("relay", LEASES_TEST_OUTBOX_URL=pg_outbox, LEASES_TEST_OUTBOX_TABLE=outbox_table)
    # When senders are SIGKILLed right after COMMIT (a raw connection; a Session before its
    # commit hook could publish) and one before COMMIT
    after = run_sender("after", pg_outbox, 20, outbox_env, tmp_path)
    in_session = run_sender("session-after", pg_outbox, 10, outbox_env, tmp_path)
    before = run_sender("before", pg_outbox, 20, outbox_env, tmp_path)
    # Then every committed task runs once, under a lease, and its waiter gets the result
    results = [app.AsyncResult(i) for i in after + in_session]
    store = celery_leases.store(app)
    assert sorted(results_of(results, store, timeout=30)) == sorted(
        [2 * i for i in range(20)] + [2 * i for i in range(10)])
    assert_ran_once_with_a_lease(history, results)
    # And none of the uncommitted ones ever runs: the outbox is empty, nothing was recorded
    time.sleep(1.0)  # five relay polls
    assert depth(pg_outbox, outbox_table) == 0
    assert not set(before) & set(run_counts(history))
    assert all(store.get(i) is None for i in before)


def test_a_relay_killed_between_publish_and_delete_gives_one_run(pg_outbox, outbox_env, outbox_table, app,
                                                                 start_worker, history, tmp_path):
    # Given committed rows and a worker that runs tasks (it relays nothing itself)
    conn = Database(pg_outbox).connect()
    sent = [outbox.send(conn, app.tasks[ADD].s(i, 1)) for i in range(10)]
    conn.commit()
    conn.close()
    start_worker("runner")
    # When a relay publishes them and is SIGKILLed before it deleted them
    published = run_sender("relay-crash", pg_outbox, 0, outbox_env, tmp_path)
    assert sorted(published) == sorted(r.id for r in sent)
    assert depth(pg_outbox, outbox_table) == 10
    # And another relay publishes the same rows again
    relay = Relay(app, pg_outbox, outbox_table)
    assert relay.run_once() == 10
    relay.close()
    # Then each task ran once; the second copy of each was refused at receipt
    store = celery_leases.store(app)
    assert results_of(sent, store, timeout=30) == [i + 1 for i in range(10)]
    assert_ran_once_with_a_lease(history, sent)

    def refused() -> int:
        stats = store.stats()
        return sum(int(stats.get(k, 0)) for k in ("busy_deliveries", "finished_deliveries", "stale_deliveries"))
    wait_for(lambda: refused() >= 10, timeout=20, what="the ten second copies refused at receipt")
    assert run_counts(history) == {r.id: 1 for r in sent}


def test_two_relays_share_the_outbox_and_each_task_and_canvas_runs_once(pg_outbox, outbox_table, app, start_worker,
                                                            history):
    # Given two workers, each relaying the outbox
    for name in ("a", "b"):
        start_worker(name, LEASES_TEST_OUTBOX_URL=pg_outbox, LEASES_TEST_OUTBOX_TABLE=outbox_table)
    # When 300 tasks are sent in 6 transactions
    conn = Database(pg_outbox).connect()
    sent = []
    for batch in range(6):
        sent += [outbox.send(conn, app.tasks[ADD].s(batch, i)) for i in range(50)]
        conn.commit()
    # and a chain, a group and a chord, one row each
    add, tsum = app.tasks[ADD], app.tasks["tests.support.apps.leased_app.tsum"]
    in_chain = outbox.send(conn, chain(add.s(1, 2), add.s(10)))
    in_group = outbox.send(conn, group(add.s(1, 1), add.s(2, 2)))
    in_chord = outbox.send(conn, chord([add.s(3, 3), add.s(4, 4)], tsum.s()))
    conn.commit()
    conn.close()
    # Then each runs once and the waiters get their results
    store = celery_leases.store(app)
    assert results_of(sent, store, timeout=60) == [b + i for b in range(6) for i in range(50)]
    assert_ran_once_with_a_lease(history, sent)
    assert results_of([in_chain, in_chord], store, timeout=30) == [13, 14]
    assert in_group.get(timeout=30) == [2, 4]
    # And no row was published twice (no second copy reached a worker)
    stats = store.stats()
    assert sum(int(stats.get(k, 0)) for k in ("busy_deliveries", "finished_deliveries", "stale_deliveries")) == 0
    assert depth(pg_outbox, outbox_table) == 0


@pytest.mark.long
def test_two_relays_and_10000_rows_each_task_runs_once(pg_outbox, outbox_table, app, start_worker, history):
    # Given two workers, each relaying the outbox
    for name in ("a", "b"):
        start_worker(name, LEASES_TEST_OUTBOX_URL=pg_outbox, LEASES_TEST_OUTBOX_TABLE=outbox_table)
    # When 10,000 tasks are sent in 20 transactions of 500
    conn = Database(pg_outbox).connect()
    ids = []
    for batch in range(20):
        ids += [outbox.send(conn, app.tasks[ADD].s(batch, i)).id for i in range(500)]
        conn.commit()
    conn.close()
    # Then every one succeeds (its lease record), each ran once with a lease, and no row was
    # published twice (no second copy reached a worker)
    store = celery_leases.store(app)

    def done() -> bool:
        return all(r.state == "succeeded" for r in store.records(ids))
    wait_for(done, timeout=240, what="the 10,000 tasks to succeed", interval=1.0)
    counts = run_counts(history)
    assert sum(1 for i in ids if counts[i] == 1) == len(ids)
    stats = store.stats()
    assert sum(int(stats.get(k, 0)) for k in ("busy_deliveries", "finished_deliveries", "stale_deliveries")) == 0
    assert depth(pg_outbox, outbox_table) == 0


def test_the_broker_down_at_commit_the_rows_wait_and_are_published_when_it_is_back(
        pg_outbox, outbox_env, outbox_table, own_server, redis_server_url, start_worker, history, caplog):
    # Given a broker that is down when the transaction commits (results and leases elsewhere)
    from tests.support.apps.leased_app import create_app
    broker = own_server("broker")
    env = {**outbox_env, "LEASES_TEST_BROKER": broker.url, "LEASES_TEST_BACKEND": redis_server_url,
           "LEASES_TEST_LEASES_URL": redis_server_url}
    app = create_app(env)
    relay = Relay(app, pg_outbox, outbox_table, poll_interval=0.1, retry_max_delay=0.5)
    relay.RETRY_DELAY = 0.1
    broker.stop()
    conn = Database(pg_outbox).connect()
    sent = [outbox.send(conn, app.tasks[ADD].s(i, 2)) for i in range(10)]
    conn.commit()
    conn.close()
    try:
        with caplog.at_level(logging.WARNING, logger="celery_leases.outbox"):
            relay.start()
            # Then the relay publishes nothing and says so; the rows wait
            wait_for(lambda: relay.delays, timeout=20, what="the relay's first failed publish")
            assert depth(pg_outbox, outbox_table) == 10
            # When the broker is back, they are published
            broker.start()
            wait_for(lambda: depth(pg_outbox, outbox_table) == 0, timeout=30, what="the outbox drained")
        messages = [r.getMessage() for r in caplog.records]
        assert any("failed" in m and "the rows wait in the database" in m for m in messages), messages
        assert any("works again" in m for m in messages), messages
    finally:
        relay.stop()
    # And a worker runs each once; the waiters get their results
    start_worker("late", LEASES_TEST_BROKER=broker.url, LEASES_TEST_BACKEND=redis_server_url,
                 LEASES_TEST_LEASES_URL=redis_server_url)
    assert results_of(sent, celery_leases.store(app), timeout=30) == [i + 2 for i in range(10)]
    assert_ran_once_with_a_lease(history, sent)
    app.close()
