"""``celery -A proj leases outbox init | status | relay --once``, and the relay's gauges."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from celery_leases import outbox

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
ADD = "tests.support.apps.leased_app.add"


def leases(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CELERY, "-A", "tests.support.apps.leased_app", "leases", "outbox", *args],
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


def test_init_status_and_relay_once(pg_database, outbox_env, outbox_table, redis_client, key_prefix):
    url, table = pg_database, f"s_{outbox_table}.{outbox_table}"  # in a schema of its own
    env = {**outbox_env, "LEASES_TEST_OUTBOX_URL": url, "LEASES_TEST_OUTBOX_TABLE": table}
    # init prints its statements with --print and runs them without
    printed = leases(env, "init", "--print")
    assert printed.returncode == 0 and "CREATE TABLE IF NOT EXISTS" in printed.stdout, printed.stderr
    done = leases(env, "init")
    assert done.returncode == 0, done.stderr
    assert f"outbox table {table} (and {table}_parked) ready" in done.stdout
    # Two rows waiting
    from tests.support.apps.leased_app import create_app
    app = create_app(env)
    from celery_leases.outbox.database import Database
    conn = Database(url).connect()
    sent = [outbox.send(conn, app.tasks[ADD].s(i, i)) for i in range(2)]
    conn.commit()
    conn.close()
    status = leases(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    found = json.loads(status.stdout)
    assert found["depth"] == 2 and found["parked"] == 0 and found["oldest_age_seconds"] >= 0
    assert found["table"] == table
    # relay --once publishes them and exits
    relayed = leases(env, "relay", "--once")
    assert relayed.returncode == 0 and "published 2, parked 0" in relayed.stdout, relayed.stderr
    ids = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange(key_prefix, 0, -1)]
    assert sorted(ids) == sorted(r.id for r in sent)
    table_out = leases(env, "status").stdout
    assert table_out.split("\n")[1].split() == [table, "0", "-", "0"], table_out
    app.close()


def test_an_unreachable_database_is_a_one_line_error_without_its_password(outbox_env):
    down = leases(outbox_env, "status", "--url", "postgresql://postgres:secret@127.0.0.1:1/x")
    assert down.returncode == 1 and "OperationalError" in down.stderr and "Traceback" not in down.stderr
    assert "secret" not in down.stderr


def test_the_relay_sets_the_outbox_gauges(sqlite_url, outbox_env, outbox_table):
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_leases.ops.metrics import LeaseMetrics
    from celery_leases.outbox import Relay
    from celery_leases.outbox.database import Database
    from tests.support.apps.leased_app import create_app
    app = create_app(outbox_env)
    registry = prometheus_client.CollectorRegistry()
    metrics = LeaseMetrics(app, registry)
    try:
        database = Database(sqlite_url, outbox_table)
        database.create()
        conn = sqlite3.connect(database.sqlite_path())
        conn.execute(f"INSERT INTO {outbox_table} (task_id, publish_id, name, payload) VALUES ('x', 'p', 'n', 'bad')")
        conn.commit()
        relay = Relay(app, sqlite_url, outbox_table)
        relay.run_once()  # parks the row, then reads the status
        relay.close()
        conn.close()
        assert registry.get_sample_value("celery_leases_outbox_parked") == 1
        assert registry.get_sample_value("celery_leases_outbox_depth") == 0
        assert registry.get_sample_value("celery_leases_outbox_oldest_age_seconds") == 0
    finally:
        metrics.disable()
        app.close()
