"""Benchmark of the per-task overhead of a lease: the same no-op task, plain and leased.

Usage, from the repository root::

    .venv/bin/python bench/overhead.py [--quick] [--rounds R] [-n N] [--pools P,..] [--layout apart|shared|amqp]
                                       [--results stored,ignored] [--json PATH] [--strict]

Starts two throwaway ``redis-server`` processes on free loopback ports (no
persistence): one for the broker and the result backend (or ``$REDIS_URL``
if set: then only keys under a fresh prefix, the benchmark's own result keys
and its queues are touched), and one for the lease store alone, as a user
who keeps leases apart would run it (``--layout apart``, the default). With
``--layout shared`` the lease store is on the broker's server too, the
simplest deployment: a leased success's result is then written by its finish
script (docs/celery.md) instead of Celery's own write, and the lease-store
round trips are the script calls alone (the broker's commands go to the same
server). With ``--layout amqp`` the broker is RabbitMQ (``$LEASES_BENCH_AMQP_URL``,
default the local guest account; only the benchmark's own queues are declared
and deleted) and the results and leases share the throwaway Redis. Each layout
has its own ratio targets (``RATIO_TARGETS``). Prints one Markdown table and writes the raw results as JSON
(default ``bench/results-overhead.json``, which git ignores).

Three kinds of the same no-op task (``bench/overhead_app.py``), each round in
a new order, on one worker per pool (``-P prefork -c 2``, ``-P threads -c 8``,
``-P solo -c 1``; Celery's defaults otherwise: prefetch multiplier 4, early
acks, log level WARNING), with its result stored or ignored (``--results``):

- ``plain``: ``bench.noop``, a plain Celery task;
- ``leased``: ``bench.leased_noop`` published with the package's defaults,
  publish tracking on (``leases_delivery_timeout`` 600 s): the publisher
  records each task in the lease store before it publishes it;
- ``leased, untracked``: the same, published with tracking off.

Results (``--results``, default ``ignored``; ``stored,ignored`` measures both,
each round both in turn, and takes about twice as long):

- ``stored``: Celery's default, the result in the Redis result backend; a
  task is done at its result's ``date_done`` (with ``--layout shared`` the
  leased kinds' finish script writes it);
- ``ignored``: the same tasks with ``ignore_result=True`` (``bench.noop_ignored``,
  ``bench.leased_noop_ignored``): nothing is written for the result, so each
  task counts itself done with one ``INCR`` on the results' Redis (plain and
  leased alike; the benchmark sets the count to -N before a batch) and the
  task that brings it to 0 notes the time: the last task's time done.

Two cases, each round, each kind, N tasks:

- **Publisher-bound.** The sender publishes N tasks one by one while the
  worker runs, then waits for each result (or the count); the rate is N over
  the time from the first send to the last task's time done in the worker.
  One sender process and the worker share the CPUs.
- **Backlog drain.** The worker is stopped (SIGSTOP, main process and pool),
  N tasks are queued, and it is released (SIGCONT); the rate is N over the
  time from the release to the last task's time done. Nothing else runs: the
  worker and the two servers alone.

Reported for each pool, results variant and case: the median rate of each
kind over the rounds, and the median and range of the per-round ratios leased / plain (the
kinds of one round ran within seconds of each other, so their ratio is what
a shared machine cannot move much). For the backlog drain: CPU per task
(user + system, ``/proc``) of the worker's main process, its pool processes
(prefork's children; ``solo`` and ``threads`` have none, their tasks run in
the main process), the broker's redis-server and the lease store's, and the
lease store's round trips per task (``INFO commandstats`` on its own server: ``EVALSHA`` +
``EVAL`` calls, and every other command a client sent; the commands a script
runs inside Redis left out), those of the publisher (sent while the worker was
stopped) and the worker's.

Heartbeat calls per tick: a second worker, ``-P threads -c 100``, lease ttl
3 s, heartbeat interval 1 s, holds 1, then 10, then 100 leases of tasks that
wait for a stop signal; over a window of whole ticks (seen as the deadline of
a held lease moving on) the script calls on the lease store are counted:
nothing else calls one then.

Exit code 0 unless the run fails; with ``--strict`` also 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import celery  # noqa: E402

from bench._common import (  # noqa: E402
    Cleanup, bench_worker, command_stats, delete_keys, delete_pattern, git_state, markdown_table, redis_url, report,
    stats_delta, terminate, wait_until,
)
from bench.overhead_app import create_app, done_keys  # noqa: E402
from celery_leases import LeaseStore  # noqa: E402
from celery_leases.testing import RedisServer, Worker  # noqa: E402

#: Sizes of a full run and of a ``--quick`` smoke run.
FULL = {"n": 2_000, "rounds": 5, "warmup": 200, "ticks": 3, "pools": "prefork,threads,solo",
        "results": "ignored"}
QUICK = {"n": 100, "rounds": 1, "warmup": 20, "ticks": 1, "pools": "prefork", "results": "ignored"}

#: The lowest leased/plain ratio (median, the default kind: tracked) each layout must reach,
#: per case: with the store on the broker's server, leases replace kombu's unacked copy and the
#: publish record rides with the LPUSH (faster than plain); apart, and with RabbitMQ (nothing
#: of the broker's to replace), the lease costs its round trips.
RATIO_TARGETS = {"shared": {"publisher-bound": 1.00, "backlog drain": 1.10},
                 "apart": {"publisher-bound": 0.95, "backlog drain": 0.95},
                 "amqp": {"publisher-bound": 0.90, "backlog drain": 0.90}}
#: The layout of this run (set by main).
LAYOUT = "apart"
LEASE_TRIPS_TARGET = 2.0
PUBLISH_TRIPS = 1.0
HEARTBEAT_SIZES = (1, 10, 100)

#: Worker pools: name -> concurrency.
POOLS = {"prefork": 2, "threads": 8, "solo": 1}
#: The pools the ratio targets are for: all three (solo has the same targets: it pays the same
#: lease calls per task and is spared the same kombu bookkeeping, in its one process).
TARGET_POOLS = ("prefork", "threads", "solo")
HB_POOL, HB_CONCURRENCY = "threads", 100
HB_TTL, HB_INTERVAL = 3.0, 1.0
#: Long enough that no heartbeat tick falls into a round.
QUIET_TTL, QUIET_INTERVAL = 600.0, 200.0

#: The kinds: task name, publish tracking of the sending app.
KINDS = {"plain": ("bench.noop", True), "leased": ("bench.leased_noop", True),
         "leased, untracked": ("bench.leased_noop", False)}
LEASED_KINDS = ("leased", "leased, untracked")
CASES = ("publisher-bound", "backlog drain")
#: Results of the tasks: stored in the result backend (Celery's default), or ignored
#: (``ignore_result=True``: the task names with ``_ignored``).
RESULTS = ("stored", "ignored")


def task_name(kind: str, results: str) -> str:
    name = KINDS[kind][0]
    return f"{name}_ignored" if results == "ignored" else name


# -- helpers -----------------------------------------------------------------

def calls(delta: dict, *names: str) -> int:
    return sum(delta.get(name, {}).get("calls", 0) for name in names)


#: Commands the lease scripts run inside Redis (``redis.call('X'`` in their source):
#: ``INFO commandstats`` counts those too, under each command's own name.
INSIDE_SCRIPTS = frozenset(
    m.lower() for path in (ROOT / "celery_leases" / "protocol" / "scripts").glob("*.lua")
    for m in re.findall(r"redis\.p?call\('([A-Za-z]+)'", path.read_text()))


def round_trips(delta: dict) -> float:
    """Commands clients sent to the lease store (each a round trip unless pipelined): the
    script calls, and every command no lease script runs (the benchmark's own INFO left out
    by ``stats_delta``). A command a client sends that a script also runs (TIME, a clock
    reading) is not counted: none is sent per task."""
    if SHARED:  # the broker's commands reach the same server: count the script calls alone
        return sum(v["calls"] for cmd, v in delta.items() if cmd in ("evalsha", "eval"))
    return sum(v["calls"] for cmd, v in delta.items() if cmd not in INSIDE_SCRIPTS)


#: --layout shared: the lease store on the broker's server (set by main).
SHARED = False


#: The whole machine's busy CPU time, beside the benchmark's own processes.
MACHINE = "machine"


class CpuMeter:
    """CPU seconds (user + system) of the benchmark's processes, read from /proc (Linux).

    Groups: the worker's main process, its pool processes (whichever are its
    children at each reading), each throwaway redis-server (unknown with
    $REDIS_URL), and this process (the sender).
    """

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, worker_pid: int, servers: dict[str, int | None]) -> None:
        self.worker_pid = worker_pid
        self.servers = {name: pid for name, pid in servers.items() if pid}
        self.available = Path(f"/proc/{worker_pid}/stat").exists()

    def _cpu(self, pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.TICK

    def _children(self) -> list[int]:
        try:
            with open(f"/proc/{self.worker_pid}/task/{self.worker_pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def _machine(self) -> float:
        """CPU seconds the whole machine was busy (all processes, all CPUs)."""
        try:
            with open("/proc/stat") as f:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        except (OSError, ValueError):
            return 0.0
        return (user + nice + system + irq + softirq + steal) / self.TICK

    def read(self) -> dict[str, dict[int, float]]:
        if not self.available:
            return {}
        groups = {"worker main": [self.worker_pid], "pool processes": self._children(),
                  "sender": [os.getpid()]}
        for name, pid in self.servers.items():
            groups[name] = [pid]
        out = {name: {pid: self._cpu(pid) for pid in pids} for name, pids in groups.items()}
        out[MACHINE] = {0: self._machine()}
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, float]:
        """CPU seconds per group, over the processes present at both readings."""
        return {name: sum(t - before[name][pid] for pid, t in pids.items() if pid in before.get(name, {}))
                for name, pids in after.items()}


def bench_env(url: str, leases_url: str, prefix: str, ttl: float, interval: float,
              broker_url: str | None = None) -> dict[str, str]:
    """The apps' environment: results on ``url``, the broker there too unless ``broker_url``."""
    return {"LEASES_BENCH_BROKER": broker_url or url, "LEASES_BENCH_BACKEND": url,
            "LEASES_BENCH_LEASES": leases_url, "LEASES_BENCH_PREFIX": prefix,
            "LEASES_BENCH_TTL": str(ttl), "LEASES_BENCH_HEARTBEAT_INTERVAL": str(interval)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": [round(v, 4) for v in values]}


def delete_amqp_queues(url: str, names: list[str]) -> None:
    """The benchmark's own queues on the shared RabbitMQ (nothing else is touched)."""
    from kombu import Connection
    with Connection(url, connect_timeout=5) as conn:
        channel = conn.default_channel
        for name in names:
            try:
                channel.queue_delete(name)
            except Exception:  # noqa: BLE001 - never declared: nothing to delete
                channel = conn.channel()


# -- the measurements ----------------------------------------------------------

def wait_all(results: list, timeout: float) -> list:
    """Each result in turn (``ResultSet.get`` would add up to half a second of polling)."""
    deadline = time.monotonic() + timeout
    return [r.get(timeout=max(0.1, deadline - time.monotonic())) for r in results]


def last_done(app: celery.Celery, client: redis.Redis, ids: list[str]) -> float:
    """Wall-clock time at which the last of these tasks was done (``date_done`` of its result)."""
    latest = 0.0
    for i in range(0, len(ids), 1000):
        for raw in client.mget([app.backend.get_key_for_task(t) for t in ids[i:i + 1000]]):
            meta = json.loads(raw)
            if meta["status"] != "SUCCESS":
                raise RuntimeError(f"task {meta['task_id']} ended {meta['status']}: {meta.get('result')}")
            done = datetime.datetime.fromisoformat(meta["date_done"])
            if done.tzinfo is None:
                done = done.replace(tzinfo=datetime.timezone.utc)
            latest = max(latest, done.timestamp())
    return latest


class Bench:
    """One worker of one pool, the sending apps, and the two servers' clients."""

    def __init__(self, apps: dict[str, celery.Celery], client: redis.Redis, lease_client: redis.Redis,
                 worker: Worker, meter: CpuMeter, n: int, prefix: str) -> None:
        self.apps, self.client, self.lease_client = apps, client, lease_client
        self.worker, self.meter, self.n, self.prefix = worker, meter, n, prefix
        self.timeout = max(60.0, n / 20)

    def _send(self, kind: str, n: int, results: str) -> list:
        tracked = KINDS[kind][1]
        task = self.apps["tracked" if tracked else "untracked"].tasks[task_name(kind, results)]
        if results == "ignored":  # each task counts itself done (bench/overhead_app.py)
            to_do, last = done_keys(self.prefix)
            self.client.delete(last)
            self.client.set(to_do, -n)
        return [task.apply_async() for _ in range(n)]

    def _ignored_done(self, what: str) -> float:
        """Wait until each task of the batch counted itself done; the time the last one was."""
        to_do, last = done_keys(self.prefix)
        # The task that brings the count to 0 notes the time just after (its second command).
        done = wait_until(lambda: self.client.get(last), self.timeout, what)
        if int(self.client.get(to_do) or 0) != 0:
            raise RuntimeError(f"{what}: {self.client.get(to_do)!r} tasks counted past the batch")
        return float(done)

    def _results_done(self, ids: list[str]) -> None:
        backend = self.apps["tracked"].backend
        for i in range(0, len(ids), 1000):
            keys = [backend.get_key_for_task(t) for t in ids[i:i + 1000]]
            wait_until(lambda keys=keys: self.client.exists(*keys) == len(keys), self.timeout, "all results")

    def _forget(self, ids: list[str]) -> None:
        backend = self.apps["tracked"].backend
        delete_keys(self.client, [backend.get_key_for_task(i) for i in ids])

    def warm_up(self, n: int, variants: list[str]) -> None:
        for results in variants:
            for kind in KINDS:  # pool processes, connections, scripts loaded
                sent = self._send(kind, n, results)
                if results == "ignored":
                    self._ignored_done(f"the warm-up's {n} {kind} tasks")
                else:
                    wait_all(sent, self.timeout)
                    self._forget([r.id for r in sent])

    def publisher_bound(self, kind: str, results: str) -> dict:
        """Send n tasks one by one while the worker runs, then wait for all n done."""
        time.sleep(0.3)  # the previous batch's batched start marks must not count here
        stats, cpu = command_stats(self.lease_client), self.meter.read()
        sent_at = time.time()
        sent = self._send(kind, self.n, results)
        if results == "ignored":
            done = self._ignored_done(f"{self.n} {kind} tasks (results ignored)") - sent_at
            cpu = CpuMeter.delta(cpu, self.meter.read())
            lease = stats_delta(stats, command_stats(self.lease_client))
        else:
            wait_all(sent, self.timeout)
            cpu = CpuMeter.delta(cpu, self.meter.read())
            lease = stats_delta(stats, command_stats(self.lease_client))
            ids = [r.id for r in sent]
            done = last_done(self.apps["tracked"], self.client, ids) - sent_at
            self._forget(ids)
        return {"per_s": self.n / done, "seconds": done, "lease_calls": round_trips(lease) / self.n,
                "cpu_us": {g: sec / self.n * 1e6 for g, sec in cpu.items()}}

    def backlog(self, kind: str, results: str) -> dict:
        """n tasks queued while the worker is stopped, then drained by the worker alone."""
        time.sleep(0.3)
        self.worker.signal(signal.SIGSTOP)
        try:
            stats0 = command_stats(self.lease_client)
            sent = self._send(kind, self.n, results)
            time.sleep(0.2)
            stats1, cpu = command_stats(self.lease_client), self.meter.read()
            released = time.time()
        finally:
            self.worker.signal(signal.SIGCONT)
        what = f"the backlog of {self.n} {kind} tasks (results {results})"
        if results == "ignored":
            last_at = self._ignored_done(what)
            cpu = CpuMeter.delta(cpu, self.meter.read())
        else:
            ids = [r.id for r in sent]
            last = self.apps["tracked"].backend.get_key_for_task(ids[-1])
            wait_until(lambda: self.client.exists(last), self.timeout, what)
            self._results_done(ids)  # tasks end out of order: wait for every result key
            cpu = CpuMeter.delta(cpu, self.meter.read())
        time.sleep(0.1)  # batched start marks of the last tasks (25 ms)
        stats2 = command_stats(self.lease_client)
        window = time.time() - released
        if results == "stored":
            last_at = last_done(self.apps["tracked"], self.client, ids)
            wait_all(sent, self.timeout)  # reads the result messages, outside the measurement
            self._forget(ids)
        done = last_at - released
        machine = cpu.pop(MACHINE, 0.0)
        cpu.pop("sender", None)  # it only polls for the last result (or the count) meanwhile
        publish, drain = stats_delta(stats0, stats1), stats_delta(stats1, stats2)
        return {"per_s": self.n / done, "seconds": done,
                "publish_lease_calls": round_trips(publish) / self.n,
                "worker_lease_calls": round_trips(drain) / self.n,
                # Seconds the drain's counts cover: batched start marks and heartbeat ticks
                # scale with it, not with the number of tasks.
                "window_s": window,
                "lease_calls": (round_trips(publish) + round_trips(drain)) / self.n,
                "worker_lease_commands": {k: round(v["calls"] / self.n, 3) for k, v in sorted(drain.items())},
                # Redis's own time per task in each command (scripts include what they call).
                "worker_lease_usec": {k: round(v["usec"] / self.n, 1) for k, v in sorted(drain.items())},
                "cpu_us": {g: sec / self.n * 1e6 for g, sec in cpu.items()},
                "other_cpu_us": max(0.0, machine - sum(cpu.values())) / self.n * 1e6}


def bench_pool(bench: Bench, pool: str, rounds: int, variants: list[str]) -> dict:
    """Interleaved rounds: each results variant, each kind, both cases; the order of the kinds
    rotates each round. Returns a summary per results variant."""
    out: dict[str, Any] = {v: {case: {kind: [] for kind in KINDS} for case in CASES} for v in variants}
    kinds = list(KINDS)
    for r in range(rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for v in variants:
            for kind in order:
                out[v]["publisher-bound"][kind].append(bench.publisher_bound(kind, v))
            for kind in order:
                out[v]["backlog drain"][kind].append(bench.backlog(kind, v))
            line = "; ".join(f"{case}: " + ", ".join(f"{out[v][case][k][-1]['per_s']:,.0f}" for k in kinds)
                             for case in CASES)
            print(f"  {pool} results {v}, round {r + 1}/{rounds} (tasks/s, {' / '.join(kinds)}): {line}",
                  flush=True)
    return {v: summarize(out[v]) for v in variants}


def summarize(out: dict) -> dict:
    """Medians over the rounds of each kind and case, and the per-round ratios leased / plain."""
    summary: dict[str, Any] = {}
    for case in CASES:
        rows = out[case]
        s: dict[str, Any] = {"rounds": rows}
        for kind in KINDS:
            s[kind] = {"per_s": statistics.median(x["per_s"] for x in rows[kind]),
                       "lease_calls": statistics.median(x["lease_calls"] for x in rows[kind]),
                       "cpu_us": {g: statistics.median(x["cpu_us"].get(g, 0.0) for x in rows[kind])
                                  for g in rows[kind][0]["cpu_us"] if g != MACHINE}}
            if case == "backlog drain":
                s[kind]["worker_lease_calls"] = statistics.median(x["worker_lease_calls"] for x in rows[kind])
                s[kind]["publish_lease_calls"] = statistics.median(x["publish_lease_calls"] for x in rows[kind])
        for kind in LEASED_KINDS:
            s[f"ratio {kind}"] = spread([lr["per_s"] / pr["per_s"] for pr, lr in zip(rows["plain"], rows[kind])])
        summary[case] = s
    return summary


def bench_heartbeat(app: celery.Celery, broker: redis.Redis, client: redis.Redis, store: LeaseStore,
                    sizes: tuple[int, ...], ticks: int) -> list[dict]:
    """Renew calls per heartbeat tick while the worker holds 1, 10, 100 leases
    (``client``: the lease store's server, ``broker``: the broker's)."""
    hold = app.tasks["bench.leased_hold"]
    results: list = []
    rows = []
    for k in sizes:
        results += [hold.apply_async((120.0,)) for _ in range(k - len(results))]
        wait_until(lambda k=k: store.client.zcard(store.keys.deadlines) >= k, 60,
                   f"the worker to hold {k} leases")
        probe = results[0].id

        def deadline(probe: str = probe) -> float | None:
            return client.zscore(store.keys.deadlines, probe)

        # Start half an interval after a tick, count `ticks` ticks, end half an interval after.
        first = deadline()
        wait_until(lambda first=first: deadline() != first, 5 * HB_INTERVAL, "a heartbeat tick")
        time.sleep(HB_INTERVAL / 2)
        before, start = command_stats(client), time.perf_counter()
        last, seen = deadline(), 0
        while seen < ticks:
            time.sleep(0.02)
            now = deadline()
            if now != last:
                seen, last = seen + 1, now
            if time.perf_counter() - start > (ticks + 3) * HB_INTERVAL:
                raise RuntimeError(f"heartbeat with {k} leases: {seen} ticks in "
                                   f"{time.perf_counter() - start:.1f} s, expected {ticks}")
        time.sleep(HB_INTERVAL / 2)
        if deadline() != last:
            seen += 1
        delta = stats_delta(before, command_stats(client))
        elapsed = time.perf_counter() - start
        if store.client.zcard(store.keys.deadlines) != k:
            raise RuntimeError(f"heartbeat with {k} leases: the index no longer holds {k} leases")
        n_calls = calls(delta, "evalsha", "eval")
        usec = delta.get("evalsha", {}).get("usec", 0) + delta.get("eval", {}).get("usec", 0)
        rows.append({"leases": k, "ticks": seen, "calls": n_calls, "seconds": elapsed,
                     "calls_per_tick": n_calls / seen if seen else float("nan"),
                     "server_us_per_call": usec / n_calls if n_calls else 0.0})
        print(f"  {k:>3} leases: {n_calls} renew call(s) in {seen} tick(s)", flush=True)
    broker.set(f"{store.keys.tag}:bench-stop", "1", ex=300)
    wait_all(results, 30)
    delete_keys(broker, [app.backend.get_key_for_task(r.id) for r in results])
    return rows


# -- report ------------------------------------------------------------------

def ratio_bound(case: str) -> float:
    return RATIO_TARGETS[LAYOUT][case]


def ratio_target(case: str) -> str:
    pools, results = ", ".join(TARGET_POOLS), " and ".join(RESULTS)
    return f"{case}: leased/plain >= {ratio_bound(case):.2f} ({pools}; results {results})"


TRIPS_TARGET = f"<= {LEASE_TRIPS_TARGET:g} lease-store round trips per task in the worker"
#: Publish tracking's own bound (issue #18): the record made at publish, one call per task.
PUBLISH_TRIPS_TARGET = f"<= {PUBLISH_TRIPS:g} lease-store round trip per published task"
HB_TARGET = "1 renew call per heartbeat tick (1, 10, 100 leases)"


def evaluate(results: dict) -> dict[str, dict]:
    targets: dict[str, dict] = {}
    pools = results["pools"]
    # Each cell: a pool and a results variant.
    cells = [(f"{pool} {v}", p[v]) for pool, p in pools.items() for v in RESULTS if v in p]
    for case in CASES:
        measured, ok = [], True
        for pool in TARGET_POOLS:
            if pool not in pools:
                continue
            for v in RESULTS:
                if v not in pools[pool]:
                    continue
                for kind in LEASED_KINDS:
                    r = pools[pool][v][case][f"ratio {kind}"]["median"]
                    measured.append(f"{pool} {v} {kind} {r:.2f}")
                    if kind == "leased":  # the default (tracked); the untracked kind is reported
                        ok = ok and r >= ratio_bound(case)
        if measured:
            targets[ratio_target(case)] = {"measured": "; ".join(measured), "result": "PASS" if ok else "MISS"}
    # The worker's calls and the publisher's, tracking on (the default), each against its own
    # bound (the table shows their sum too); a difference within 0.05 is polling noise.
    for target, field, bound in ((TRIPS_TARGET, "worker_lease_calls", LEASE_TRIPS_TARGET),
                                 (PUBLISH_TRIPS_TARGET, "publish_lease_calls", PUBLISH_TRIPS)):
        trips = {cell: c["backlog drain"]["leased"][field] for cell, c in cells}
        targets[target] = {
            "measured": "; ".join(f"{cell} {v:.2f}" for cell, v in trips.items()),
            "result": "PASS" if all(v <= bound + 0.05 for v in trips.values()) else "MISS"}
    hb = results["heartbeat"]
    if hb:
        targets[HB_TARGET] = {"measured": " / ".join(f"{row['calls_per_tick']:g}" for row in hb),
                              "result": "PASS" if all(row["calls"] == row["ticks"] for row in hb) else "MISS"}
    return targets


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def table(results: dict, targets: dict[str, dict]) -> str:
    rows: list[tuple[str, ...]] = []
    rounds = results["meta"]["rounds"]
    n = results["meta"]["n"]
    cells = [(pool, v, p[v]) for pool, p in results["pools"].items() for v in RESULTS if v in p]
    for pool, v, p in cells:
        conc = POOLS[pool]
        for case in CASES:
            s = p[case]
            t = ratio_target(case)
            rows.append((f"{pool} -c {conc}, results {v}, {case}: tasks/s (median of {rounds} x {n:,})",
                         f"{s['plain']['per_s']:,.0f}", f"{s['leased']['per_s']:,.0f}",
                         f"{s['leased, untracked']['per_s']:,.0f}",
                         f"{fmt_ratio(s['ratio leased'])} / {fmt_ratio(s['ratio leased, untracked'])}",
                         t if pool in TARGET_POOLS else "",
                         ("PASS" if s["ratio leased"]["median"] >= ratio_bound(case)
                          else "MISS") if pool in TARGET_POOLS else ""))
        b = p["backlog drain"]
        rows.append(("  lease-store round trips per task: publisher + worker",
                     "0", f"{b['leased']['publish_lease_calls']:.2f} + {b['leased']['worker_lease_calls']:.2f}",
                     f"{b['leased, untracked']['publish_lease_calls']:.2f} + "
                     f"{b['leased, untracked']['worker_lease_calls']:.2f}",
                     f"{b['leased']['lease_calls']:.2f} in all", f"{TRIPS_TARGET}; {PUBLISH_TRIPS_TARGET}",
                     "PASS" if b["leased"]["worker_lease_calls"] <= LEASE_TRIPS_TARGET + 0.05 and
                     b["leased"]["publish_lease_calls"] <= PUBLISH_TRIPS + 0.05 else "MISS"))
        for group in b["plain"]["cpu_us"]:
            cells = [b[k]["cpu_us"].get(group, 0.0) for k in KINDS]
            if not any(cells):
                continue
            rows.append((f"  drain CPU per task, {group}, µs", *(f"{c:,.0f}" for c in cells),
                         f"{cells[1] - cells[0]:+,.0f} / {cells[2] - cells[0]:+,.0f} µs", "", ""))
        total = [sum(b[k]["cpu_us"].values()) for k in KINDS]
        rows.append(("  drain CPU per task, all of the above, µs", *(f"{c:,.0f}" for c in total),
                     f"{total[1] - total[0]:+,.0f} / {total[2] - total[0]:+,.0f} µs", "", ""))
    for row in results["heartbeat"]:
        rows.append((f"heartbeat, {row['leases']} held lease(s): renew calls / ticks", "",
                     f"{row['calls']} / {row['ticks']}", "",
                     f"{row['server_us_per_call']:.0f} µs in Redis per call", HB_TARGET,
                     "PASS" if row["calls"] == row["ticks"] else "MISS"))
    return markdown_table(("measurement", "plain", "leased", "leased, untracked",
                           "ratio leased / untracked: median (range)", "target", "result"), rows)


# -- main ----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, prefork only: a smoke test")
    parser.add_argument("-n", type=int, help="tasks per batch (default 2000, --quick 100)")
    parser.add_argument("--rounds", type=int, help="rounds of each kind and case (default 5, --quick 1)")
    parser.add_argument("--pools", help="comma-separated pools (default prefork,threads,solo; --quick prefork)")
    parser.add_argument("--layout", choices=("apart", "shared", "amqp"), default="apart",
                        help="apart: the lease store on a redis-server of its own; shared: on the broker's")
    parser.add_argument("--results", help="comma-separated: stored (in the result backend), ignored "
                        "(ignore_result=True); default ignored (both take twice as long)")
    parser.add_argument("--no-heartbeat", action="store_true", help="skip the heartbeat measurement")
    parser.add_argument("--loglevel", default="WARNING", help="worker log level (default: %(default)s)")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-overhead.json"),
                        help="where to write the raw results (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    for key in ("n", "rounds", "pools", "results"):
        if getattr(args, key):
            sizes[key] = getattr(args, key)
    pools = list(dict.fromkeys(p.strip() for p in sizes["pools"].split(",") if p.strip()))
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        parser.error(f"unknown pool(s) {', '.join(unknown)}; known: {', '.join(POOLS)}")
    variants = list(dict.fromkeys(v.strip() for v in sizes["results"].split(",") if v.strip()))
    unknown = [v for v in variants if v not in RESULTS]
    if unknown or not variants:
        parser.error(f"unknown results variant(s) {', '.join(unknown)}; known: {', '.join(RESULTS)}")

    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    log_dir: Path | None = None
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        url, server = redis_url(cleanup)
        client = redis.Redis.from_url(url)
        cleanup.push(client.close)
        lease_server: RedisServer | None = None
        broker_url = None
        if args.layout == "amqp":
            # RabbitMQ as the broker; results and leases on the throwaway Redis.
            broker_url = os.environ.get("LEASES_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
        if args.layout in ("shared", "amqp"):
            leases_url, lease_client = url, client
        else:
            lease_server = RedisServer()
            cleanup.push(lease_server.cleanup)
            lease_server.start()
            leases_url = lease_server.url
            lease_client = redis.Redis.from_url(leases_url)
            cleanup.push(lease_client.close)
        global SHARED, LAYOUT
        # Other commands reach the lease store's server too (the broker's, or the results'):
        # its round trips are the script calls alone.
        SHARED = args.layout in ("shared", "amqp")
        LAYOUT = results_layout = args.layout
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        for pattern in (f"{{{prefix}}}*", f"{{{prefix}-hb}}*"):
            cleanup.push(lambda p=pattern: delete_pattern(client, p))
        for queue in (prefix, f"{prefix}-hb"):
            cleanup.push(lambda q=queue: client.delete(q, f"{q}\x06\x163", f"{q}\x06\x166",
                                                        f"{q}\x06\x169", f"_kombu.binding.{q}",
                                                        f"_kombu.binding_permanent.{q}"))
        if broker_url is not None:
            cleanup.push(lambda: delete_amqp_queues(broker_url, [prefix, f"{prefix}-hb"]))
        log_dir = Path(tempfile.mkdtemp(prefix="leases-bench-overhead-"))
        info = client.info("server")
        results: dict[str, Any] = {
            "meta": {
                "date": started.isoformat(timespec="seconds"),
                "quick": args.quick, "n": sizes["n"], "rounds": sizes["rounds"],
                "pools": {p: POOLS[p] for p in pools}, "results": variants,
                "heartbeat_pool": f"{HB_POOL} -c {HB_CONCURRENCY}",
                "loglevel": args.loglevel, "layout": results_layout,
                "redis_version": info["redis_version"], "throwaway_server": server is not None,
                "load_average_before": os.getloadavg()[0], **git_state(),
                "python": platform.python_version(), "celery": celery.__version__,
                "redis_py": redis.__version__, "cpus": os.cpu_count(), "machine": platform.platform(),
            },
            "pools": {},
        }
        print(f"task overhead benchmark: {'RabbitMQ broker, ' if broker_url else ''}"
              f"redis {info['redis_version']}"
              f"{' (throwaway)' if server else ''}"
              f"{' + a throwaway lease store' if lease_server else ', the lease store on it too'}, "
              f"celery {celery.__version__}, "
              f"{'quick' if args.quick else 'full'} run", flush=True)
        if os.getloadavg()[0] > 0.5:
            print(f"note: load average {os.getloadavg()[0]:.2f} before the run: other processes "
                  f"compete for the {os.cpu_count()} CPUs and the timings will be noisy", flush=True)

        env = bench_env(url, leases_url, prefix, QUIET_TTL, QUIET_INTERVAL, broker_url)
        apps = {"tracked": create_app({**env, "LEASES_BENCH_DELIVERY_TIMEOUT": "600"}),
                "untracked": create_app({**env, "LEASES_BENCH_DELIVERY_TIMEOUT": "0"})}
        for app in apps.values():
            cleanup.push(app.close)
        servers = {"redis-server, broker": server.process.pid if server and server.process else None}
        if lease_server is not None:
            servers["redis-server, leases"] = lease_server.process.pid if lease_server.process else None
        for pool in pools:
            worker = bench_worker(f"overhead-{pool}", "bench.overhead_app", env, pool=pool,
                                  concurrency=POOLS[pool], log_dir=log_dir, loglevel=args.loglevel)
            cleanup.push(worker.kill)
            print(f"{pool} -c {POOLS[pool]}: {sizes['rounds']} round(s) of {sizes['n']:,} tasks, each kind, "
                  f"case and results variant ({', '.join(variants)})", flush=True)
            worker.start(timeout=60)
            bench = Bench(apps, client, lease_client, worker, CpuMeter(worker.pid, servers), sizes["n"], prefix)
            bench.warm_up(sizes["warmup"], variants)
            results["pools"][pool] = bench_pool(bench, pool, sizes["rounds"], variants)
            worker.stop()

        results["heartbeat"] = []
        if not args.no_heartbeat:
            hb_env = bench_env(url, leases_url, f"{prefix}-hb", HB_TTL, HB_INTERVAL, broker_url)
            hb_app = create_app(hb_env)
            cleanup.push(hb_app.close)
            hb_worker = bench_worker("heartbeat", "bench.overhead_app", hb_env, pool=HB_POOL,
                                     concurrency=HB_CONCURRENCY, log_dir=log_dir, loglevel=args.loglevel)
            cleanup.push(hb_worker.kill)
            print(f"heartbeat: {HB_POOL} -c {HB_CONCURRENCY}, ttl {HB_TTL:g} s, interval {HB_INTERVAL:g} s",
                  flush=True)
            hb_worker.start(timeout=60)
            hb_store = LeaseStore(lease_client, f"{prefix}-hb")
            results["heartbeat"] = bench_heartbeat(hb_app, client, lease_client, hb_store, HEARTBEAT_SIZES,
                                                   sizes["ticks"])
            hb_worker.stop()

        results["meta"]["load_average_after"] = os.getloadavg()[0]
        results["meta"]["seconds"] = round(
            (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
        targets = results["targets"] = evaluate(results)
    except BaseException:
        if log_dir is not None:
            print(f"worker logs kept in {log_dir}", file=sys.stderr)
            log_dir = None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        cleanup.run()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)

    return report(results, targets, table(results, targets), args.json, args.strict)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; workers and redis-servers stopped, keys deleted", file=sys.stderr)
        sys.exit(130)
