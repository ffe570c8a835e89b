"""Benchmark of the transactional outbox (celery_leases.outbox) on PostgreSQL and SQLite.

Usage, from the repository root::

    .venv/bin/python bench/outbox.py [--tasks N] [--rows R] [--samples S] [--runs K] [--quick] [--json PATH] [--strict]

Starts a throwaway ``redis-server`` (or uses ``$REDIS_URL``; broker db 0, results db 1,
lease store db 2) and makes a PostgreSQL database of its own (``$LEASES_BENCH_PG_URL``,
default the local server; dropped at the end). Three measurements, each the median of
``K`` runs:

1. **Sending**: ``N`` requests, each one transaction that updates a row and sends one
   leased task, with ``outbox.send`` in the transaction against a plain ``delay`` after
   COMMIT (publish tracking on in both), alternated in slices of 100; no worker runs.
2. **Relay**: ``R`` committed rows published by one relay (this process), then by two
   relays (two processes at once); every row published exactly once (the queue holds
   ``R`` messages with ``R`` distinct ids).
3. **Commit-to-start**: ``S`` tasks sent one at a time, each from the sender's COMMIT to
   the first line of its body in a real prefork worker that relays the outbox: on
   PostgreSQL (woken by NOTIFY), on SQLite (poll interval 0.1 s), and a plain ``delay``
   after COMMIT for comparison.

Targets: relay >= 2,000 tasks/s on PostgreSQL; commit-to-start p50 <= 20 ms on PostgreSQL.
Exit 0 unless the run fails; with ``--strict`` also 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench._common import (Cleanup, bench_worker, delete_pattern, markdown_table, redis_url, report,  # noqa: E402
                           terminate, wait_until)
from celery_leases import outbox  # noqa: E402
from celery_leases.outbox import Relay  # noqa: E402
from celery_leases.outbox.database import Database  # noqa: E402

PG_URL = os.environ.get("LEASES_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
TASK = "bench.outbox.started"
SLICE = 100


def env_for(redis: str, prefix: str, **extra: str) -> dict:
    return {"OUTBOX_BENCH_REDIS": redis.rsplit("/", 1)[0] if redis.count("/") > 2 else redis,
            "OUTBOX_BENCH_PREFIX": prefix, "OUTBOX_BENCH_TABLE": f"ob_{prefix.replace('-', '_')}", **extra}


def make_app(env: dict):
    from bench.outbox_app import create_app
    return create_app(env)


def pg_database(cleanup: Cleanup) -> str:
    admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=5)
    name = f"outbox_bench_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')

    def drop() -> None:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    cleanup.push(drop)
    return PG_URL.rsplit("/", 1)[0] + "/" + name


def purge(app, queue: str) -> None:
    """Empty this run's queue and lease records (only its own keys: $REDIS_URL may be shared)."""
    from redis import Redis
    Redis.from_url(app.conf.broker_url).delete(queue)
    delete_pattern(Redis.from_url(app.conf.leases_redis_url), f"{{{app.conf.leases_key_prefix}}}:*")


# -- 1. sending -------------------------------------------------------------------

def sending(app, url: str, table: str, tasks: int) -> dict:
    """Requests per second: a transaction with the send in it, against delay after COMMIT."""
    task = app.tasks[TASK]
    conn = psycopg.connect(url)
    conn.execute("CREATE TABLE IF NOT EXISTS bench_orders (id int PRIMARY KEY, n bigint NOT NULL)")
    conn.execute("INSERT INTO bench_orders VALUES (1, 0) ON CONFLICT DO NOTHING")
    conn.commit()
    spent = {"outbox": 0.0, "delay": 0.0}
    done = 0
    while done < tasks:
        for mode in ("outbox", "delay"):
            began = time.perf_counter()
            for _ in range(SLICE):
                conn.execute("UPDATE bench_orders SET n = n + 1 WHERE id = 1")
                if mode == "outbox":
                    outbox.send(conn, task.s())
                    conn.commit()
                else:
                    conn.commit()
                    task.delay()
            spent[mode] += time.perf_counter() - began
        done += SLICE
    conn.execute(f"DELETE FROM {table}")  # not relayed here
    conn.commit()
    conn.close()
    return {mode: done / seconds for mode, seconds in spent.items()}


# -- 2. relay ---------------------------------------------------------------------

def fill(app, url: str, rows: int) -> None:
    task = app.tasks[TASK]
    conn = Database(url).connect()
    for i in range(rows):
        outbox.send(conn, task.s(i))
        if i % 1000 == 999:
            conn.commit()
    conn.commit()
    conn.close()


def _relay_process(env: dict, url: str, table: str, start: float, out) -> None:
    app = make_app(env)
    relay = Relay(app, url, table)
    while time.time() < start:
        time.sleep(0.001)
    began = time.perf_counter()
    published = relay.run_once()
    out.put((published, time.perf_counter() - began, time.perf_counter()))
    relay.close()


def relay_rate(app, env: dict, url: str, table: str, rows: int, relays: int) -> dict:
    """Rows per second, wall time from start to the last relay done; checks each row went once."""
    from redis import Redis
    queue = env["OUTBOX_BENCH_PREFIX"]
    broker = Redis.from_url(app.conf.broker_url)
    broker.delete(queue)
    fill(app, url, rows)
    if relays == 1:
        relay = Relay(app, url, table)
        began = time.perf_counter()
        published = relay.run_once()
        seconds = time.perf_counter() - began
        relay.close()
        counts = [published]
    else:
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        start = time.time() + 2.0
        procs = [ctx.Process(target=_relay_process, args=(env, url, table, start, out)) for _ in range(relays)]
        for p in procs:
            p.start()
        results = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(30)
        counts = [r[0] for r in results]
        seconds = max(r[1] for r in results)
    messages = broker.lrange(queue, 0, -1)
    import json
    ids = {json.loads(m)["headers"]["id"] for m in messages}
    if sum(counts) != rows or len(messages) != rows or len(ids) != rows:
        raise RuntimeError(f"{relays} relay(s): published {counts}, {len(messages)} messages, "
                           f"{len(ids)} distinct ids, for {rows} rows")
    broker.delete(queue)
    return {"rate": rows / seconds, "per_relay": counts}


# -- 3. commit-to-start ---------------------------------------------------------------

def latency(app, url: str | None, samples: int, mode: str) -> list[float]:
    """Seconds from COMMIT to the body's start, per task, one task at a time."""
    from redis import Redis
    task = app.tasks[TASK]
    sink = Redis.from_url(app.conf.leases_redis_url)
    key = f"{app.conf.leases_key_prefix}:started"
    committed: dict[str, float] = {}
    if mode == "delay":
        conn = psycopg.connect(PG_URL)
    else:
        conn = Database(url).connect()
    for i in range(samples):
        if mode == "delay":
            conn.execute("SELECT 1")
            conn.commit()
            committed_at = time.time()
            result = task.delay(i)
        else:
            result = outbox.send(conn, task.s(i))
            conn.commit()
            committed_at = time.time()
        committed[result.id] = committed_at
        wait_until(lambda: sink.hexists(key, result.id), 30, f"task {i} started")
        # A random gap: commits that follow the relay's rounds in step would measure the
        # phase of its poll, not the latency.
        time.sleep(0.01 + random.random() * 0.1)
    conn.close()
    started = {k.decode(): float(v) for k, v in sink.hgetall(key).items()}
    sink.delete(key)
    return [started[t] - c for t, c in committed.items()]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-outbox.json"))
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, one run (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.rows, args.samples, args.runs = 200, 1000, 20, 1
    began_all = time.monotonic()
    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    try:
        redis, _ = redis_url(cleanup)
        pg = pg_database(cleanup)
        prefix = f"ob-{uuid.uuid4().hex[:8]}"
        env = env_for(redis, prefix)
        table = env["OUTBOX_BENCH_TABLE"]
        Database(pg, table).create()
        app = make_app(env)
        runs: dict[str, list] = {"outbox": [], "delay": [], "relay1": [], "relay2": []}
        for run in range(args.runs):
            sent = sending(app, pg, table, args.tasks)
            runs["outbox"].append(sent["outbox"])
            runs["delay"].append(sent["delay"])
            purge(app, prefix)
            runs["relay1"].append(relay_rate(app, env, pg, table, args.rows, 1)["rate"])
            runs["relay2"].append(relay_rate(app, env, pg, table, args.rows, 2)["rate"])
            purge(app, prefix)
            print(f"run {run + 1}: send outbox {sent['outbox']:,.0f}/s, delay {sent['delay']:,.0f}/s; "
                  f"relay x1 {runs['relay1'][-1]:,.0f}/s, x2 {runs['relay2'][-1]:,.0f}/s", flush=True)
        # Commit-to-start, with a real worker relaying each database.
        sqlite_dir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
        sqlite_url = f"sqlite:///{sqlite_dir / 'outbox.db'}"
        Database(sqlite_url, table).create()
        with sqlite3.connect(sqlite_url.split(":///", 1)[1]) as conn:
            conn.execute("PRAGMA journal_mode=WAL")  # what docs/outbox.md recommends for SQLite
        lat: dict[str, list[float]] = {}
        for name, url, poll in (("postgresql", pg, "1"), ("sqlite", sqlite_url, "0.1"), ("delay", None, "1")):
            worker_env = {**os.environ, **env, "OUTBOX_BENCH_POLL": poll}
            if url:
                worker_env["OUTBOX_BENCH_URL"] = url
            worker = bench_worker(f"lat-{name}", "bench.outbox_app", worker_env, pool="prefork", concurrency=2,
                                  log_dir=sqlite_dir)
            cleanup.push(worker.kill)
            worker.start()
            time.sleep(1.0)  # the relay is listening
            lat[name] = latency(app, url, args.samples, "delay" if url is None else "outbox")
            worker.stop()
            print(f"commit-to-start {name}: p50 {pct(lat[name], 0.5) * 1000:.1f} ms", flush=True)
    finally:
        cleanup.run()

    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["outbox"] / med["delay"]
    rows = [
        ["sending, outbox.send in the transaction", f"{med['outbox']:,.0f} req/s",
         f"{min(runs['outbox']):,.0f} .. {max(runs['outbox']):,.0f}"],
        ["sending, delay after COMMIT", f"{med['delay']:,.0f} req/s",
         f"{min(runs['delay']):,.0f} .. {max(runs['delay']):,.0f}"],
        ["outbox / delay", f"{ratio:.2f}", ""],
        [f"relay, 1 relay, {args.rows:,} rows (PostgreSQL)", f"{med['relay1']:,.0f} tasks/s",
         f"{min(runs['relay1']):,.0f} .. {max(runs['relay1']):,.0f}"],
        [f"relay, 2 relays, {args.rows:,} rows (PostgreSQL)", f"{med['relay2']:,.0f} tasks/s",
         f"{min(runs['relay2']):,.0f} .. {max(runs['relay2']):,.0f}"],
    ]
    for name, values in lat.items():
        rows.append([f"commit-to-start, {name} (ms: p50 / p95 / p99 / max)",
                     " / ".join(f"{pct(values, q) * 1000:.1f}" for q in (0.5, 0.95, 0.99, 1.0)),
                     f"{len(values)} tasks"])
    table_text = markdown_table(["measurement", f"result (median of {args.runs})", "spread"], rows)
    targets = {
        "relay >= 2,000 tasks/s on PostgreSQL": {"measured": f"{med['relay1']:,.0f} tasks/s (one relay)",
                                                 "result": "PASS" if med["relay1"] >= 2000 else "MISS"},
        "commit-to-start p50 <= 20 ms on PostgreSQL": {
            "measured": f"{pct(lat['postgresql'], 0.5) * 1000:.1f} ms",
            "result": "PASS" if pct(lat["postgresql"], 0.5) <= 0.020 else "MISS"},
    }
    results = {"runs": runs, "median": med, "ratio_outbox_over_delay": ratio,
               "latency_ms": {k: [round(v * 1000, 2) for v in vals] for k, vals in lat.items()},
               "meta": {"tasks": args.tasks, "rows": args.rows, "samples": args.samples, "runs": args.runs,
                        "quick": args.quick,
                        "seconds": round(time.monotonic() - began_all, 1)}}
    return report(results, targets, table_text, args.json, args.strict)


if __name__ == "__main__":
    sys.exit(main())
