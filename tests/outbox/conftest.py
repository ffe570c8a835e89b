"""The outbox's tests: a PostgreSQL database of this run's own, SQLite files, MariaDB.

PostgreSQL (``$LEASES_TEST_PG_URL``, default the local server's ``test`` database) and
MariaDB (``$LEASES_TEST_MYSQL_URL``) are services of the machine: a test that needs one
skips with the reason when it does not answer, and fails under ``CI=true``. Each test
session makes a database of its own on PostgreSQL (dropped at the end), and each test a
table of its own (named after its key prefix).
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support.services import skip_or_fail

PG_URL = os.environ.get("LEASES_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("LEASES_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")


def _with_db(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """URL of a PostgreSQL database made for this session (dropped afterwards)."""
    try:
        import psycopg
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except Exception as exc:  # noqa: BLE001 - not there: skip (locally) or fail (CI)
        skip_or_fail(f"PostgreSQL not reachable at {PG_URL.split('@')[-1]} (set LEASES_TEST_PG_URL): {exc!r}")
    name = f"leases_outbox_{uuid.uuid4().hex[:12]}"
    with admin:
        # template0: no session ever connects to it, so a CREATE DATABASE of another run
        # (or anything connected to template1) cannot make this one fail.
        for attempt in range(5):
            try:
                admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
                break
            except psycopg.errors.ObjectInUse:
                if attempt == 4:
                    raise
                time.sleep(0.5)
        try:
            yield _with_db(PG_URL, name)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def outbox_table(key_prefix: str) -> str:
    """The test's own outbox table name."""
    return f"ob_{key_prefix}"


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'outbox.db'}"


@pytest.fixture(scope="session")
def mysql_url() -> str:
    try:
        import pymysql  # noqa: F401 - only whether it is installed
    except ImportError:
        skip_or_fail("PyMySQL not installed (pip install -e '.[test]')")
    from celery_leases.outbox.database import Database
    try:
        Database(MYSQL_URL).connect().close()
    except Exception as exc:  # noqa: BLE001
        skip_or_fail(f"MySQL/MariaDB not reachable at {MYSQL_URL.split('@')[-1]} "
                     f"(set LEASES_TEST_MYSQL_URL): {exc!r}")
    return MYSQL_URL


@pytest.fixture
def outbox_env(celery_env: dict, outbox_table: str) -> dict:
    """``celery_env`` with the test's outbox table (no relay in the workers unless a test
    adds ``LEASES_TEST_OUTBOX_URL``)."""
    return {**celery_env, "LEASES_TEST_OUTBOX_TABLE": outbox_table}
