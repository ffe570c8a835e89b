"""Races on a real redis-server: threads, each with its own client and store object.

The scripts are atomic, so these tests show that the guards inside them (not
luck in the host language) decide who wins.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

from celery_leases import Claim, Code, LeaseStore

THREADS = 8
SHORT = 0.1        #: seconds; a ttl the test waits out
MARGIN = 0.05      #: seconds slept past a deadline before calling it passed


def run_threads(url: str, prefix: str, count: int, body: Callable[[int, LeaseStore], None],
                **store_kwargs) -> None:
    """Run ``body(i, store)`` in ``count`` threads, each with its own client; re-raise errors."""
    errors: list[BaseException] = []

    def target(i: int) -> None:
        client = redis.Redis.from_url(url)
        try:
            body(i, LeaseStore(client, prefix=prefix, **store_kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a racing thread hung"
    if errors:
        raise errors[0]


def test_racing_deliveries_of_one_task_have_exactly_one_owner(redis_server_url, key_prefix):
    # Given 8 workers that receive the same message at the same moment, 200 times over
    rounds = 200
    barrier = threading.Barrier(THREADS)
    results: list[list] = [[None] * THREADS for _ in range(rounds)]

    def worker(i: int, store: LeaseStore) -> None:
        for r in range(rounds):
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                return
            try:
                # When they all try to acquire it
                results[r][i] = store.acquire(f"task-{r}", f"worker-{i}", ttl=30)
            except BaseException:
                barrier.abort()
                raise

    run_threads(redis_server_url, key_prefix, THREADS, worker)

    # Then in every round exactly one acquired, and the others were told its token
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    for r, acqs in enumerate(results):
        codes = Counter(a.code for a in acqs)
        assert codes == {Code.ACQUIRED: 1, Code.BUSY: THREADS - 1}, (r, codes)
        (winner,) = [i for i, a in enumerate(acqs) if a.owned]
        assert {a.token for a in acqs} == {acqs[winner].token}
        rec = store.get(f"task-{r}")
        assert (rec.owner, rec.token) == (f"worker-{winner}", acqs[winner].token)
    store.client.close()


def test_racing_take_overs_of_an_expired_lease_have_exactly_one_winner(
        redis_server_url, key_prefix):
    # Given 50 leases whose worker died
    tasks = 50
    setup = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix,
                       max_recoveries=3)
    dead_tokens = [setup.acquire(f"task-{r}", "dead-worker", ttl=SHORT).token
                   for r in range(tasks)]
    # (their bodies were running: the worker's start marks reached the store)
    setup.mark_started("dead-worker", {f"task-{r}": token for r, token in enumerate(dead_tokens)})
    time.sleep(SHORT + MARGIN)
    barrier = threading.Barrier(THREADS)
    results: list[list] = [[None] * THREADS for _ in range(tasks)]

    def worker(i: int, store: LeaseStore) -> None:
        for r in range(tasks):
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                return
            try:
                # When 8 redeliveries race to take each one over
                results[r][i] = store.acquire(f"task-{r}", f"worker-{i}", ttl=30)
            except BaseException:
                barrier.abort()
                raise

    run_threads(redis_server_url, key_prefix, THREADS, worker, max_recoveries=3)

    # Then exactly one took each over, counting exactly one recovery
    for r, acqs in enumerate(results):
        codes = Counter(a.code for a in acqs)
        assert codes == {Code.TAKEN_OVER: 1, Code.BUSY: THREADS - 1}, (r, codes)
        rec = setup.get(f"task-{r}")
        assert rec.recoveries == 1 and rec.token > dead_tokens[r]
    assert setup.stats()["taken_over"] == tasks
    setup.client.close()


@pytest.mark.parametrize("batch", [500, 37, 10])
def test_concurrent_recovery_passes_claim_each_expired_lease_once(
        redis_server_url, key_prefix, batch):
    # Given 1,000 leases whose workers died
    leases = 1000
    setup = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    for n in range(leases):
        acq = setup.acquire(f"task-{n}", f"worker-{n % 7}", ttl=SHORT, body=b"body")
        setup.mark_started(f"worker-{n % 7}", {f"task-{n}": acq.token})  # they were running
    time.sleep(SHORT + MARGIN)
    published: Counter = Counter()
    lock = threading.Lock()
    reports = []
    barrier = threading.Barrier(2)

    def publish(claim: Claim) -> None:
        with lock:
            published[claim.task_id] += 1

    def recoverer(i: int, store: LeaseStore) -> None:
        barrier.wait(timeout=30)
        # When two recovery passes run at the same time
        reports.append(store.recover(publish=publish))

    run_threads(redis_server_url, key_prefix, 2, recoverer, recover_batch=batch)

    # Then every lease was published exactly once in total
    assert len(published) == leases
    assert {task_id: n for task_id, n in published.items() if n != 1} == {}
    assert sum(r.recovered for r in reports) == leases
    assert sum(r.publish_failed + r.dead for r in reports) == 0
    # And each record counts one recovery and one generation
    for n in range(0, leases, 97):
        rec = setup.get(f"task-{n}")
        assert (rec.state, rec.generation, rec.recoveries) == ("recovering", 1, 1)
    assert setup.active() == []
    setup.client.close()


def test_recovery_running_alongside_heartbeats_claims_only_the_unrenewed(
        redis_server_url, key_prefix):
    # Given a worker that keeps renewing 100 leases (ttl 0.5 s), and 100 leases nobody renews
    setup = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=0.5)
    held = {f"live-{n}": setup.acquire(f"live-{n}", "alive").token for n in range(100)}
    for n in range(100):
        setup.acquire(f"dead-{n}", "dead", ttl=SHORT)
    stop = threading.Event()
    published: Counter = Counter()
    lost: dict = {}
    finished: list = []
    lock = threading.Lock()

    def publish(claim: Claim) -> None:
        with lock:
            published[claim.task_id] += 1

    def thread(i: int, store: LeaseStore) -> None:
        if i == 0:
            # the heartbeat, every 0.05 s
            while not stop.is_set():
                lost.update(store.renew_many("alive", held))
                time.sleep(0.05)
        else:
            # When two recoverers keep running passes for 0.6 s
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                store.recover(publish=publish)
                time.sleep(0.01)
            with lock:
                finished.append(i)
                if len(finished) == 2:
                    stop.set()

    run_threads(redis_server_url, key_prefix, 3, thread, ttl=0.5)

    # Then each unrenewed lease was published once, and no renewed one was touched
    assert sorted(published) == sorted(f"dead-{n}" for n in range(100))
    assert set(published.values()) == {1}
    assert lost == {}
    assert all(setup.get(t).owner == "alive" for t in held)
    setup.client.close()
