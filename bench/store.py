"""Benchmark of the lease store alone (no Celery), each figure beside a plain-Redis baseline.

Usage, from the repository root::

    .venv/bin/python bench/store.py [--quick] [--json PATH] [--strict]

Starts a throwaway ``redis-server`` on a free loopback port (no persistence),
or uses ``$REDIS_URL`` if set; then only keys under fresh prefixes are touched
and deleted afterwards, and the server's command statistics are read but not
reset (``CONFIG RESETSTAT`` is sent to the throwaway server only). Prints one Markdown table
and writes the raw results as JSON
(default ``bench/results-store.json``, which git ignores).

What is measured, all on one connection from one client, sequentially:

- acquire+finish pairs per second, against SET+DEL pairs per second;
- ``renew_many`` latency for n leases of one owner, against one ZADD of n members;
- one recovery pass over many expired leases (``publish`` does nothing);
- round trips and the commands run inside the scripts per acquire/renew/finish.

Exit code 0 unless the run fails; with ``--strict`` also 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_leases import Code, LeaseStore  # noqa: E402
from bench._common import (  # noqa: E402
    Cleanup, command_stats, delete_pattern, fmt_rate, markdown_table, redis_url, report, stats_delta,
)

#: Sizes of a full run and of a ``--quick`` smoke run.
FULL = {"pairs": 20_000, "renew_sizes": (1, 100, 1_000, 10_000),
        "renew_repeats": {1: 300, 100: 100, 1_000: 50, 10_000: 30},
        "recover_n": 10_000, "recover_repeats": 3, "lifecycles": 1_000}
QUICK = {"pairs": 500, "renew_sizes": (1, 100, 1_000),
         "renew_repeats": {1: 20, 100: 10, 1_000: 5},
         "recover_n": 1_000, "recover_repeats": 1, "lifecycles": 50}

#: Targets from the design brief.
RENEW_TARGET_N, RENEW_TARGET_MS = 10_000, 50.0
RECOVER_TARGET_N, RECOVER_TARGET_S = 10_000, 2.0

#: A message body of a realistic size, stored by acquire as Celery's wiring would.
BODY = b"x" * 256
ENVELOPE = {"routing_key": "celery", "exchange": "", "headers": {"task": "bench.noop"}}
OWNER = "bench-worker-1"


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends: each is one round trip here (the
    store's own connection, celery_leases/protocol/transport/direct.py, counts its calls itself)."""

    round_trips = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.round_trips += 1
        return super().execute_command(*args, **options)


# -- helpers -----------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def new_store(client: redis.Redis, section: str) -> LeaseStore:
    return LeaseStore(client, f"bench{uuid.uuid4().hex[:8]}-{section}", ttl=60.0)


def warm_scripts(store: LeaseStore) -> None:
    """Load every script used below, so no NOSCRIPT fallback is measured."""
    a = store.acquire("warm", OWNER)
    store.renew_many(OWNER, {"warm": a.token})
    store.finish("warm", OWNER, a.token, "succeeded")
    store.acquire("warm-expired", OWNER, ttl=0.001)
    time.sleep(0.01)
    if store.recover(publish=lambda claim: None).recovered != 1:  # claim_expired, mark_published
        raise RuntimeError("warm-up: the expired lease was not recovered")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# -- the measurements ----------------------------------------------------------

def bench_pairs(client: CountingRedis, n: int) -> dict:
    """Acquire+finish per second, and SET+DEL per second on the same connection."""
    store = new_store(client, "pairs")
    warm_scripts(store)
    ids = [f"task-{i}" for i in range(n)]

    def leased() -> None:
        for task_id in ids:
            a = store.acquire(task_id, OWNER, name="bench.noop", body=BODY, envelope=ENVELOPE)
            store.finish(task_id, OWNER, a.token, "succeeded")

    def plain() -> None:
        for task_id in ids:
            key = f"{store.keys.tag}:plain:{task_id}"
            client.set(key, BODY)
            client.delete(key)

    plain_s, _ = timed(plain)
    leased_s, _ = timed(leased)
    delete_pattern(client, store.keys.tag + "*")
    return {"n": n, "leased_per_s": n / leased_s, "plain_per_s": n / plain_s,
            "leased_s": leased_s, "plain_s": plain_s}


def bench_renew(client: CountingRedis, sizes: tuple[int, ...], repeats: dict[int, int]) -> list[dict]:
    """renew_many latency for n leases of one owner, against one ZADD of n members."""
    rows = []
    for n in sizes:
        store = new_store(client, f"renew{n}")
        warm_scripts(store)
        leases = {}
        for i in range(n):
            task_id = f"task-{i}"
            leases[task_id] = store.acquire(task_id, OWNER, ttl=600).token
        reps = repeats[n]

        before = command_stats(client)
        renew_ms = []
        for _ in range(reps):
            seconds, lost = timed(lambda: store.renew_many(OWNER, leases))
            if lost:
                raise RuntimeError(f"renew_many of {n} leases lost {len(lost)}: {list(lost.items())[:3]}")
            renew_ms.append(seconds * 1000)
        server = stats_delta(before, command_stats(client), own_prefixes=("config",)).get(
            "evalsha", {"calls": 1, "usec": 0})

        zkey = f"{store.keys.tag}:baseline"
        zadd_ms = []
        for _ in range(reps):
            now = time.time() * 1000
            mapping = {task_id: now + 600_000 for task_id in leases}
            seconds, _ = timed(lambda: client.zadd(zkey, mapping))
            zadd_ms.append(seconds * 1000)

        rows.append({
            "n": n, "repeats": reps,
            "renew_median_ms": statistics.median(renew_ms), "renew_p95_ms": percentile(renew_ms, 0.95),
            "renew_server_ms": server["usec"] / server["calls"] / 1000,
            "zadd_median_ms": statistics.median(zadd_ms), "zadd_p95_ms": percentile(zadd_ms, 0.95),
        })
        delete_pattern(client, store.keys.tag + "*")
    return rows


def bench_recover(client: CountingRedis, n: int, repeats: int) -> dict:
    """One recovery pass over n expired leases; publish does nothing."""
    runs = []
    for _ in range(repeats):
        store = new_store(client, "recover")
        warm_scripts(store)
        for i in range(n):
            store.acquire(f"task-{i}", OWNER, ttl=0.001, name="bench.noop", body=BODY, envelope=ENVELOPE)
        # Every deadline passed by the server clock before the pass starts.
        (_, last), = client.zrange(store.keys.deadlines, -1, -1, withscores=True)
        while store.server_time_ms() <= last:
            time.sleep(0.01)
        trips = client.round_trips
        seconds, report = timed(lambda: store.recover(publish=lambda claim: None))
        trips = client.round_trips - trips
        if report.recovered != n or report.errors:
            raise RuntimeError(f"recovery of {n} leases reported {report.as_dict()} {report.errors[:3]}")
        if store.stats()["indexed"] != 0:
            raise RuntimeError("recovered leases left in the deadline index after mark_published")
        runs.append({"seconds": seconds, "round_trips": trips})
        delete_pattern(client, store.keys.tag + "*")
    times = [r["seconds"] for r in runs]
    return {"n": n, "runs": runs, "median_s": statistics.median(times), "worst_s": max(times),
            "per_s": n / statistics.median(times), "batch": store.settings.recover_batch}


def bench_commands(client: CountingRedis, n: int, reset: bool) -> dict:
    """Round trips and in-script commands of n acquire+renew+finish lifecycles.

    Counts are deltas of INFO commandstats around each phase, so they hold on a
    shared server too; ``reset`` (a throwaway server) also zeroes the stats first.
    """
    store = new_store(client, "lifecycle")
    warm_scripts(store)
    if reset:
        client.config_resetstat()
    tokens: dict[str, int] = {}

    def acquire() -> None:
        for i in range(n):
            a = store.acquire(f"task-{i}", OWNER, name="bench.noop", body=BODY, envelope=ENVELOPE)
            assert a.code is Code.ACQUIRED
            tokens[f"task-{i}"] = a.token

    def renew() -> None:
        for task_id, token in tokens.items():
            assert store.renew_many(OWNER, {task_id: token}) == {}

    def finish() -> None:
        for task_id, token in tokens.items():
            store.finish(task_id, OWNER, token, "succeeded")

    per_transition = {}
    for name, phase in (("acquire", acquire), ("renew_many", renew), ("finish", finish)):
        direct = store.calls.direct.calls if store.calls.direct is not None else 0
        before, trips = command_stats(client), client.round_trips + direct
        phase()
        direct = store.calls.direct.calls if store.calls.direct is not None else 0
        trips = client.round_trips + direct - trips
        delta = stats_delta(before, command_stats(client), own_prefixes=("config",))
        per_transition[name] = {
            "round_trips": trips / n,
            "evalsha": delta.pop("evalsha", {"calls": 0})["calls"] / n,
            "eval": delta.pop("eval", {"calls": 0})["calls"] / n,
            "inside": {cmd: v["calls"] / n for cmd, v in sorted(delta.items())},
        }
    delete_pattern(client, store.keys.tag + "*")
    total: dict[str, float] = {}
    for t in per_transition.values():
        for cmd, calls in t["inside"].items():
            total[cmd] = total.get(cmd, 0) + calls
    return {"n": n, "per_transition": per_transition,
            "per_lifecycle": {"round_trips": sum(t["round_trips"] for t in per_transition.values()),
                              "evalsha": sum(t["evalsha"] for t in per_transition.values()),
                              "inside": dict(sorted(total.items())),
                              "inside_total": sum(total.values())}}


# -- report ------------------------------------------------------------------

def fmt_ms(x: float) -> str:
    return f"{x:.2f} ms" if x < 10 else f"{x:.1f} ms"


def fmt_calls(inside: dict[str, float]) -> str:
    return ", ".join(f"{cmd.upper()} {v:g}" for cmd, v in inside.items())


def evaluate(results: dict) -> dict[str, dict]:
    cmds = results["commands"]["per_transition"]
    one_trip = all(t["round_trips"] == 1 and t["evalsha"] == 1 and t["eval"] == 0 for t in cmds.values())
    targets = {"one round trip per transition": {
        "measured": " / ".join(f"{name} {t['round_trips']:g}" for name, t in cmds.items()),
        "result": "PASS" if one_trip else "MISS"}}

    big = [r for r in results["renew"] if r["n"] == RENEW_TARGET_N]
    if big:
        ok = big[0]["renew_p95_ms"] < RENEW_TARGET_MS
        targets[f"renew_many of {RENEW_TARGET_N:,} < {RENEW_TARGET_MS:g} ms"] = {
            "measured": f"p95 {fmt_ms(big[0]['renew_p95_ms'])}", "result": "PASS" if ok else "MISS"}
    else:
        targets[f"renew_many of {RENEW_TARGET_N:,} < {RENEW_TARGET_MS:g} ms"] = {
            "measured": "not run (--quick)", "result": "SKIP"}

    rec = results["recover"]
    name = f"recovery of {RECOVER_TARGET_N:,} < {RECOVER_TARGET_S:g} s"
    if rec["n"] == RECOVER_TARGET_N:
        ok = rec["worst_s"] < RECOVER_TARGET_S
        targets[name] = {"measured": f"worst {rec['worst_s']:.2f} s", "result": "PASS" if ok else "MISS"}
    else:
        targets[name] = {"measured": f"not run at this size (--quick: {rec['n']:,})", "result": "SKIP"}
    return targets


def table(results: dict, targets: dict[str, dict]) -> str:
    rows: list[tuple[str, ...]] = []
    p = results["pairs"]
    rows.append((f"acquire+finish pairs, 1 client ({p['n']:,})", fmt_rate(p["leased_per_s"]),
                 f"SET+DEL {fmt_rate(p['plain_per_s'])}", f"{p['leased_per_s'] / p['plain_per_s']:.2f}x",
                 "", ""))
    renew_target = f"renew_many of {RENEW_TARGET_N:,} < {RENEW_TARGET_MS:g} ms"
    for r in results["renew"]:
        is_target = r["n"] == RENEW_TARGET_N
        rows.append((f"renew_many of {r['n']:,} (median / p95; server)",
                     f"{fmt_ms(r['renew_median_ms'])} / {fmt_ms(r['renew_p95_ms'])}; {fmt_ms(r['renew_server_ms'])}",
                     f"ZADD of {r['n']:,}: {fmt_ms(r['zadd_median_ms'])} / {fmt_ms(r['zadd_p95_ms'])}",
                     f"{r['renew_median_ms'] / r['zadd_median_ms']:.1f}x",
                     renew_target if is_target else "",
                     targets[renew_target]["result"] if is_target else ""))
    rec = results["recover"]
    rec_target = f"recovery of {RECOVER_TARGET_N:,} < {RECOVER_TARGET_S:g} s"
    rows.append((f"recovery pass over {rec['n']:,} expired (median / worst of {len(rec['runs'])})",
                 f"{rec['median_s']:.2f} s / {rec['worst_s']:.2f} s ({fmt_rate(rec['per_s'])})",
                 f"{rec['runs'][0]['round_trips']} round trips (batches of {rec['batch']})", "",
                 rec_target, targets[rec_target]["result"]))
    trip_target = "one round trip per transition"
    for name, t in results["commands"]["per_transition"].items():
        rows.append((f"{name}: round trips; commands inside",
                     f"{t['round_trips']:g} (EVALSHA {t['evalsha']:g})", fmt_calls(t["inside"]), "",
                     trip_target, targets[trip_target]["result"]))
    life = results["commands"]["per_lifecycle"]
    rows.append(("lifecycle (acquire+renew+finish)",
                 f"{life['round_trips']:g} round trips", f"{life['inside_total']:g} commands inside scripts",
                 "", "", ""))

    return markdown_table(("measurement", "lease store", "baseline / detail", "ratio", "target", "result"),
                          rows)


# -- main ----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-store.json"),
                        help="where to write the raw results (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL

    cleanup = Cleanup()
    try:
        url, server = redis_url(cleanup)
        client = CountingRedis.from_url(url, single_connection_client=True)
        info = client.info("server")
        started = datetime.datetime.now(datetime.timezone.utc)
        results: dict[str, Any] = {
            "meta": {
                "date": started.isoformat(timespec="seconds"),
                "quick": args.quick,
                "redis_version": info["redis_version"],
                "redis": f"{client.connection_pool.connection_kwargs.get('host')}:"
                         f"{client.connection_pool.connection_kwargs.get('port')}",
                "throwaway_server": server is not None,
                "python": platform.python_version(),
                "redis_py": redis.__version__,
                "cpus": os.cpu_count(),
                "machine": platform.platform(),
            },
        }
        print(f"lease store benchmark: redis {info['redis_version']} at {results['meta']['redis']}"
              f"{' (throwaway)' if server else ''}, {'quick' if args.quick else 'full'} run",
              flush=True)
        results["pairs"] = bench_pairs(client, sizes["pairs"])
        results["renew"] = bench_renew(client, sizes["renew_sizes"], sizes["renew_repeats"])
        results["recover"] = bench_recover(client, sizes["recover_n"], sizes["recover_repeats"])
        results["commands"] = bench_commands(client, sizes["lifecycles"], reset=server is not None)
        results["meta"]["seconds"] = round(
            (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
        targets = results["targets"] = evaluate(results)
        client.close()
    finally:
        cleanup.run()

    return report(results, targets, table(results, targets), args.json, args.strict)


if __name__ == "__main__":
    sys.exit(main())
