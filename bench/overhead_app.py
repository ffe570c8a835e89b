"""The Celery app of ``bench/overhead.py``: one no-op task plain, one leased, same app;
each also with its result ignored.

Workers import it as ``bench.overhead_app`` (``PYTHONPATH`` = the repository
root); the benchmark builds its client side with ``create_app(env)`` from the
same variables:

LEASES_BENCH_BROKER: Redis URL of the broker and the result backend;
LEASES_BENCH_BACKEND: Redis URL of the result backend when the broker is RabbitMQ (the
ignored-result tasks count themselves done there);
LEASES_BENCH_LEASES: Redis URL of the lease store (default: the broker's);
LEASES_BENCH_PREFIX: lease key prefix, also the queue name;
LEASES_BENCH_TTL / LEASES_BENCH_HEARTBEAT_INTERVAL: lease ttl and heartbeat, seconds;
LEASES_BENCH_DELIVERY_TIMEOUT: publish tracking, seconds (default 600, the package's
default; 0 turns it off); it changes only what a publisher does;
LEASES_BENCH_PROFILE: a directory: the worker's main thread and each prefork pool
process run under cProfile (CPU time of the thread) and write ``main-PID.prof`` / ``pool-PID.prof`` there
when they exit (``python -m pstats FILE``); with LEASES_BENCH_PROFILE_THREADS=1 also every
thread started later (a threads pool's), merged into ``threads-PID.prof``.

Everything else is Celery's default (prefetch multiplier 4, results stored,
acks early; ``bench.noop_ignored`` and ``bench.leased_noop_ignored`` have
``ignore_result=True``), except ``leases_worker_recovery=False`` (no recovery loop runs in
the worker, so the only lease calls are the ones measured) and
``worker_enable_remote_control=False`` (see below).
"""
from __future__ import annotations

import os
import time
from typing import Mapping

import redis
from celery import Celery

from bench._common import bench_app, client_for
from celery_leases import LeasedTask

def create_app(env: Mapping[str, str]) -> Celery:
    get = env.get
    app = bench_app(
        "overhead_app", env,
        leases_ttl=float(get("LEASES_BENCH_TTL", "600")),
        leases_heartbeat_interval=float(get("LEASES_BENCH_HEARTBEAT_INTERVAL", "200")),
        leases_worker_recovery=False,
        # The default users get: each publish is recorded in the lease store (publish tracking).
        leases_delivery_timeout=float(get("LEASES_BENCH_DELIVERY_TIMEOUT", "600")),
        # Lease-held deliveries (worker/held.py): on by default; LEASES_BENCH_HELD=0 for kombu's copy.
        leases_held_deliveries=get("LEASES_BENCH_HELD", "1") == "1",
        # No remote control: its reply queues expire, and kombu then refreshes their
        # bindings with Lua scripts of its own every few seconds, which would be
        # counted with the lease scripts. Nothing per task changes.
        worker_enable_remote_control=False,
    )
    prefix, broker = app.conf["leases_key_prefix"], app.conf.broker_url
    stop_key = f"{{{prefix}}}:bench-stop"
    backend = get("LEASES_BENCH_BACKEND") or broker  # always a Redis (the broker may be RabbitMQ)

    @app.task(name="bench.noop", shared=False)
    def noop():
        return None

    @app.task(name="bench.leased_noop", base=LeasedTask, shared=False)
    def leased_noop():
        return None

    # With its result ignored, nothing tells the benchmark a task is done but the task itself:
    # each counts itself done (one INCR, plain and leased alike), and the one that brings the
    # count to 0 notes the time (the benchmark sets the count to -n before a batch).
    @app.task(name="bench.noop_ignored", shared=False, ignore_result=True)
    def noop_ignored():
        count_done(client_for(backend), prefix)

    @app.task(name="bench.leased_noop_ignored", base=LeasedTask, shared=False, ignore_result=True)
    def leased_noop_ignored():
        count_done(client_for(backend), prefix)

    @app.task(name="bench.leased_hold", base=LeasedTask, shared=False)
    def leased_hold(max_seconds=60.0):
        """Holds its lease until the benchmark sets the stop key (or max_seconds pass)."""
        client = client_for(backend)  # (the benchmark's Redis, also when the broker is RabbitMQ)
        deadline = time.monotonic() + max_seconds
        while time.monotonic() < deadline and not client.exists(stop_key):
            time.sleep(0.2)

    return app


def done_keys(prefix: str) -> tuple[str, str]:
    """The count of a batch's tasks still to be done (results ignored), and the time the
    last one was done."""
    return f"{{{prefix}}}:bench-to-do", f"{{{prefix}}}:bench-last-done"


def count_done(client: redis.Redis, prefix: str) -> None:
    """One task of a batch done: the last one (the count reaches 0) notes the time."""
    to_do, last_done = done_keys(prefix)
    if client.incr(to_do) == 0:
        client.set(last_done, repr(time.time()))


def _profile(directory: str) -> None:
    """cProfile the worker's main thread (from its init to its shutdown) and each prefork
    pool process (from its init to its exit), one file each in ``directory``."""
    import cProfile
    from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown

    profiles: dict = {}

    def start(kind: str) -> None:
        # CPU time of the profiled thread, not wall time: on a shared machine a process
        # waits for a CPU after most system calls, and wall time would charge that to them.
        profiles[kind] = cProfile.Profile(time.thread_time)
        profiles[kind].enable()

    def dump(kind: str) -> None:
        profile = profiles.pop(kind, None)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(directory, f"{kind}-{os.getpid()}.prof"))

    threads: list = []

    def in_each_thread(*args: object) -> None:
        # A thread started after worker_init (a threads pool's, the heartbeat's) profiles
        # itself from its first call: one profile per thread, merged at shutdown.
        import sys
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time)
        threads.append(profile)
        profile.enable()

    def dump_threads() -> None:
        import pstats
        import threading
        threading.setprofile(None)
        stats = None
        for profile in threads:
            profile.create_stats()
            stats = pstats.Stats(profile) if stats is None else stats.add(profile) or stats
        if stats is not None:
            stats.dump_stats(os.path.join(directory, f"threads-{os.getpid()}.prof"))

    def start_main(**kw: object) -> None:
        start("main")
        if os.environ.get("LEASES_BENCH_PROFILE_THREADS"):
            import threading
            threading.setprofile(in_each_thread)

    worker_init.connect(start_main, weak=False)
    worker_shutdown.connect(lambda **kw: (dump("main"), dump_threads()), weak=False)
    worker_process_init.connect(lambda **kw: start("pool"), weak=False)
    worker_process_shutdown.connect(lambda **kw: dump("pool"), weak=False)


app = create_app(os.environ)
if os.environ.get("LEASES_BENCH_PROFILE"):
    _profile(os.environ["LEASES_BENCH_PROFILE"])
