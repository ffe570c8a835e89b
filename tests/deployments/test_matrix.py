"""The compatibility matrix: the core promises on one Celery version, pool and broker.

``make matrix`` runs this module in one tox env per Celery version, for every
pool and broker that version supports (docs/compatibility.md holds the latest
table). The cell comes from the environment:

- ``LEASES_MATRIX_POOL``: comma-separated pools (``prefork,threads,solo,gevent,eventlet``);
- ``LEASES_MATRIX_BROKER``: comma-separated brokers (``redis,amqp``).

Without them (the default ``make test``) only prefork on Redis runs, and only
the three quick checks (about 9 s): the pairing is covered in depth by
tests/worker/test_worker_integration.py, whose versions of the two slow checks (the
stale owner, the killed pool child) would otherwise run twice. The two skip
there with that reason. Leases and results always live on the test's own
Redis; only the broker changes.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import time

import pytest

import celery_leases
from tests.support.services import broker_env
from celery_leases.testing import wait_for
from tests.support.workers import stale_owner_race, starts

TASKS = "tests.support.apps.leased_app"
KNOWN_POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
KNOWN_BROKERS = ("redis", "amqp")
#: Pools whose tasks run in a separate child process that can be SIGKILLed alone.
CHILD_PROCESS_POOLS = {"prefork"}


def _cells(variable: str, default: str, known: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in os.environ.get(variable, default).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{variable}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


#: True under ``make matrix`` (tox sets the variables); False in the default ``make test``.
IN_MATRIX = "LEASES_MATRIX_POOL" in os.environ or "LEASES_MATRIX_BROKER" in os.environ
POOLS = _cells("LEASES_MATRIX_POOL", "prefork", KNOWN_POOLS)
BROKERS = _cells("LEASES_MATRIX_BROKER", "redis", KNOWN_BROKERS)


def _pool_unavailable(pool: str) -> str | None:
    """Why this Celery cannot run ``pool`` here, or None."""
    from celery.concurrency import ALIASES
    if pool not in ALIASES:
        import celery
        return f"celery {celery.__version__} has no {pool} pool"
    # Looked up, not imported: a green library imported into the test process
    # itself is not what is tested, and it made pytest crash at session end
    # (CPython 3.11 "AST constructor recursion depth mismatch").
    if pool in ("gevent", "eventlet") and importlib.util.find_spec(pool) is None:
        return f"{pool} is not installed (pip install {pool})"
    return None


@pytest.fixture(params=POOLS)
def pool(request) -> str:
    reason = _pool_unavailable(request.param)
    if reason:
        pytest.skip(f"not supported: {reason}")
    return request.param


@pytest.fixture(params=BROKERS)
def broker(request) -> str:
    return request.param


@pytest.fixture
def celery_env(celery_env, broker, redis_server_url, key_prefix):
    """The conftest environment with this cell's broker (leases and results stay on Redis)."""
    with broker_env(celery_env, broker, redis_server_url, queue=key_prefix) as env:
        yield env


@pytest.fixture(autouse=True)
def _collect_results_while_redis_is_up():
    """Collect the test's AsyncResults now: their ``__del__`` talks to the result
    backend, which after the session's Redis has stopped only yields noise."""
    yield
    gc.collect()


def matrix_only(equivalent: str) -> None:
    """Skip a slow check outside the matrix, naming the default-suite test that covers it."""
    if not IN_MATRIX:
        pytest.skip(f"runs under make matrix; prefork+Redis is covered in make test by {equivalent}")


def test_leased_task_runs_once_and_finishes_with_its_token(pool, client_app, start_worker, history):
    # Given one worker of this pool
    start_worker("a", pool=pool)
    store = celery_leases.store(client_app)
    # When a leased task is sent
    result = client_app.signature(f"{TASKS}.add", (2, 3)).delay()
    # Then it returns its result, ran once, and its lease finished with that run's token
    assert result.get(timeout=20) == 5
    runs = starts(history, result.id)
    assert len(runs) == 1, runs
    record = store.get(result.id)
    assert record.state == "succeeded"
    assert record.token == int(runs[0][3]["token"]) > 0


def test_task_longer_than_its_ttl_keeps_its_lease(pool, client_app, start_worker, history):
    # Given a worker with a 1.5 s lease ttl
    start_worker("a", pool=pool, LEASES_TEST_TTL="1.5")
    store = celery_leases.store(client_app)
    # When a task runs for 4.5 s (three ttls)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("v", 4.5)).delay()
    began = wait_for(lambda: starts(history, result.id), 20, what="the task to start")[0]
    time.sleep(2.5)
    # Then, past its ttl, the heartbeat has kept the lease active with a future deadline
    record = store.get(result.id)
    assert record.state == "active" and record.deadline > store.server_time_ms()
    assert store.expired() == []
    # And it succeeds once, never having lost its lease
    assert result.get(timeout=20) == "v"
    assert len(starts(history, result.id)) == 1
    end = [h for h in history() if h[0] == "end" and h[1] == result.id][0]
    assert end[3]["lost"] == "False"
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == int(began[3]["token"])


def test_stale_owner_outcome_is_refused(pool, client_app, start_worker, history):
    matrix_only("test_worker_integration.py::test_stale_owner_cannot_overwrite_the_new_owner")
    # Given worker A running a 3 s task with a link callback; A's prefetch window
    # is full while it runs (one slot, late ack), because RabbitMQ pushes messages
    # to a paused consumer with a free slot, recovered copies included
    # (docs/compatibility.md, "RabbitMQ and a paused worker")
    a = start_worker("a", pool=pool, concurrency=1, LEASES_TEST_ACKS_LATE="1")
    store = celery_leases.store(client_app)
    callback = client_app.signature(f"{TASKS}.note_callback")
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("out", 3.0)).apply_async(link=callback)
    first = wait_for(lambda: starts(history, result.id), 20, what="A to start")[0]
    # When A is paused (SIGSTOP) past its ttl and the lease is recovered, worker B runs
    # the recovered copy with a higher token, and A resumes and finishes its body
    # while B is still running
    b, second = stale_owner_race(a, lambda: start_worker("b", pool=pool), store, history,
                                 result.id, first)
    # Then the waiter gets B's outcome, the record carries B's token,
    assert result.get(timeout=20) == "out"
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == int(second[3]["token"])
    # and A's outcome was refused: one callback, A's refusal logged and counted
    time.sleep(0.5)
    callbacks = [h for h in history() if h[0] == "callback"]
    assert len(callbacks) == 1, callbacks
    assert "refused" in a.log()
    assert store.stats()["refused"] >= 1
    b.stop()


def test_killed_pool_child_is_released_and_recovered(pool, client_app, start_worker, history):
    if pool not in CHILD_PROCESS_POOLS:
        pytest.skip(f"not applicable: {pool} runs tasks in the worker process, no pool child to kill")
    matrix_only("test_worker_integration.py::"
                "test_pool_child_killed_stores_no_failure_and_releases_the_lease")
    # Given a worker with a long (30 s) ttl running a task that SIGKILLs its own pool child
    start_worker("a", pool=pool, LEASES_TEST_TTL="30")
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.kill_own_child", (0.5,)).delay()
    wait_for(lambda: starts(history, result.id), 20, what="the task to start")
    # When the child dies, the lease is released at once (no 30 s wait) with no FAILURE stored
    wait_for(lambda: store.get(result.id).owner == "", 15, what="the lease to be released")
    assert store.get(result.id).deadline <= store.server_time_ms()
    assert client_app.backend.get_task_meta(result.id)["status"] != "FAILURE"
    # Then recovery re-runs it and the waiter gets the re-run's result
    assert store.recover().recovered == 1
    assert result.get(timeout=20) == "survived"
    assert store.get(result.id).recoveries == 1


def test_retry_hands_the_lease_to_the_next_attempt(pool, client_app, start_worker, history):
    # Given one worker of this pool
    start_worker("a", pool=pool)
    store = celery_leases.store(client_app)
    # When a task retries twice, then succeeds
    result = client_app.signature(f"{TASKS}.retry_twice").delay()
    assert result.get(timeout=30) == "done"
    # Then each attempt acquired a strictly higher token, and only the last one's outcome stands
    runs = starts(history, result.id)
    assert [h[3]["retries"] for h in runs] == ["0", "1", "2"]
    tokens = [int(h[3]["token"]) for h in runs]
    assert tokens == sorted(set(tokens))
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == tokens[-1]
    stats = store.stats()
    assert stats.get("succeeded") == 1 and stats.get("retried") == 2


@pytest.fixture(scope="session", autouse=True)
def _record_versions(record_testsuite_property) -> None:
    """Put the installed versions in the junit report (docs/compatibility.md shows them)."""
    from importlib.metadata import PackageNotFoundError, version
    for package in ("celery", "kombu", "billiard", "redis", "amqp", "gevent", "eventlet"):
        try:
            record_testsuite_property(f"version.{package}", version(package))
        except PackageNotFoundError:
            record_testsuite_property(f"version.{package}", "not installed")
