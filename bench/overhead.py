"""Benchmark of the per-task overhead of a lease: the same no-op task, plain and leased.

Usage, from the repository root::

    .venv/bin/python bench/overhead.py [--quick] [--json PATH] [--strict]

Starts a throwaway ``redis-server`` on a free loopback port (no persistence),
or uses ``$REDIS_URL`` if set (then only keys under a fresh prefix, the
benchmark's own result keys and its queues are touched, and the server's
command statistics are read, never reset). Broker, result backend and leases
all live on that one server. Prints one Markdown table and writes the raw
results as JSON (default ``bench/results-overhead.json``, which git ignores).

What is measured:

- **Throughput.** One ``celery worker -P prefork -c 2`` (Celery defaults
  otherwise: prefetch multiplier 4, results stored, log level WARNING) runs
  ``bench.noop`` and ``bench.leased_noop`` (``bench/overhead_app.py``) in
  interleaved rounds: N plain tasks (all sent, then all results awaited), then
  N leased ones, R times; the median over the rounds, and the ratio leased /
  plain. Throughput is N over the time from the first send to the moment the
  last task was done (the ``date_done`` its pool process wrote with its
  result): that is the worker's pace. The time to the last result *received*
  by the sender is printed too, but the sender drains its result messages
  after it sent all N, on the same CPUs, and when the worker is the faster one
  that drain, not the worker, sets the figure. The heartbeat interval of this
  worker is long (200 s), so no renewal falls into a round.
- **A backlog drained by the worker alone.** The same worker is stopped
  (SIGSTOP), N tasks of one kind are queued, and it is released (SIGCONT);
  the rate is N over the time from the release to the last ``date_done``,
  and the CPU per task is that of the worker and redis-server over the
  drain (not a target of the issue; no sender competes for the CPUs here,
  so the worker's main process, through which every message passes, is
  what limits it, and the ratio is lower than the throughput ratio above).
- **Redis commands per task.** Deltas of ``INFO commandstats`` around each
  round, divided by N: every command the server ran, from every client (the
  benchmark's sends and result waits, the worker, its pool processes).
  Commands that the lease scripts run *inside* Redis are counted there too;
  they are measured separately on the store (an acquire + finish pair, the
  path every leased no-op takes) and subtracted, which leaves the top-level
  commands. Extra round trips are counted from them per command: every command
  a leased task sends more often than a plain one counts as a round trip of its
  own (each ``EVALSHA`` is one, never pipelined), and commands it sends less
  often (the result write folded into the finish script) are not credited, so
  the figure is an upper bound.
- **CPU per task.** User + system CPU time, from ``/proc`` (Linux), of the
  worker's main process, its pool processes, the throwaway redis-server and
  this process, over the same rounds, divided by the tasks. Wall-clock rates
  move with whatever else runs on the machine; CPU per task moves much less,
  and when everything shares a few CPUs, plain / leased CPU per task is the
  throughput ratio to expect.
- **Heartbeat calls per tick.** A second worker, ``-P threads -c 100`` (a
  prefork pool of 100 processes is too heavy for a small machine; the
  heartbeat thread lives in the worker's main process whatever the pool),
  with lease ttl 3 s and heartbeat interval 1 s, holds 1, then 10, then 100
  leases of tasks that wait for a stop signal. Over a window of whole ticks
  (it starts and ends half an interval after a tick, which is seen as the
  deadline of a held lease moving on), the ``EVALSHA`` + ``EVAL`` calls are
  counted: nothing else calls a script then.

Exit code 0 unless the run fails; with ``--strict`` also 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
    Cleanup, command_stats, delete_keys, delete_pattern, git_state, markdown_table, redis_url, report,
    stats_delta, terminate, wait_until,
)
from bench.overhead_app import create_app  # noqa: E402
from celery_leases import Code, LeaseStore  # noqa: E402
from tests.workers import Worker  # noqa: E402

#: Sizes of a full run and of a ``--quick`` smoke run.
FULL = {"n": 2_000, "rounds": 3, "warmup": 200, "ticks": 3, "calibrate": 200, "backlog_rounds": 3}
QUICK = {"n": 200, "rounds": 1, "warmup": 50, "ticks": 2, "calibrate": 20, "backlog_rounds": 1}

#: Targets from the issue.
RATIO_TARGET = 0.90
EXTRA_TRIPS_TARGET = 2
HEARTBEAT_SIZES = (1, 10, 100)

#: Worker settings.
POOL, CONCURRENCY = "prefork", 2
HB_POOL, HB_CONCURRENCY = "threads", 100
HB_TTL, HB_INTERVAL = 3.0, 1.0
#: Long enough that no heartbeat tick falls into a throughput round.
QUIET_TTL, QUIET_INTERVAL = 600.0, 200.0


# -- worker subprocesses --------------------------------------------------------

class BenchWorker(Worker):
    """tests/workers.py's Worker with the benchmark's command line (``python -m celery``)."""

    def __init__(self, name: str, env: dict, *, pool: str, concurrency: int, log_dir: Path,
                 loglevel: str) -> None:
        super().__init__(name, env, pool=pool, concurrency=concurrency, app="bench.overhead_app",
                         log_dir=log_dir)
        # bench/overhead_app.py writes "... ready." to the log once the worker consumes.
        self.args = [sys.executable, "-m", "celery", "-A", "bench.overhead_app", "worker",
                     "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", loglevel,
                     "--without-mingle", "--without-gossip", "--without-heartbeat"]


# -- helpers -----------------------------------------------------------------

def calls(delta: dict, *names: str) -> int:
    return sum(delta.get(name, {}).get("calls", 0) for name in names)


#: The whole machine's busy CPU time, beside the benchmark's own processes.
MACHINE = "machine"


class CpuMeter:
    """CPU seconds (user + system) of the benchmark's processes, read from /proc (Linux).

    Groups: the worker's main process, its pool processes (whichever are its
    children at each reading), the throwaway redis-server (unknown with
    $REDIS_URL), and this process, which sends the tasks and waits for results.
    """

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, worker_pid: int, redis_pid: int | None) -> None:
        self.worker_pid, self.redis_pid = worker_pid, redis_pid
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
                  "sender (this process)": [os.getpid()]}
        if self.redis_pid:
            groups["redis-server"] = [self.redis_pid]
        out = {name: {pid: self._cpu(pid) for pid in pids} for name, pids in groups.items()}
        out[MACHINE] = {0: self._machine()}
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, float]:
        """CPU seconds per group, over the processes present at both readings."""
        return {name: sum(t - before[name][pid] for pid, t in pids.items() if pid in before.get(name, {}))
                for name, pids in after.items()}


def bench_env(url: str, prefix: str, ttl: float, interval: float) -> dict[str, str]:
    return {"LEASES_BENCH_BROKER": url, "LEASES_BENCH_PREFIX": prefix,
            "LEASES_BENCH_TTL": str(ttl), "LEASES_BENCH_HEARTBEAT_INTERVAL": str(interval)}


# -- the measurements ----------------------------------------------------------

def run_batch(app: celery.Celery, name: str, n: int, timeout: float) -> dict:
    """Send n tasks, then wait for all n results.

    Returns the ids, the wall-clock time of the first send, and the seconds
    from the first send to the last result received here.
    """
    task = app.tasks[name]
    sent_at, start = time.time(), time.perf_counter()
    results = [task.apply_async() for _ in range(n)]
    sent = time.perf_counter() - start
    wait_all(results, timeout)
    return {"ids": [r.id for r in results], "sent_at": sent_at, "send_seconds": sent,
            "seconds": time.perf_counter() - start}


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


def bench_throughput(app: celery.Celery, client: redis.Redis, n: int, rounds: int,
                     warmup: int, meter: CpuMeter) -> dict:
    """Interleaved rounds of n plain then n leased no-ops; commands counted per round."""
    kinds = {"plain": "bench.noop", "leased": "bench.leased_noop"}
    timeout = max(60.0, n / 20)
    for name in kinds.values():  # pool processes, connections, scripts loaded
        batch = run_batch(app, name, warmup, timeout)
        delete_keys(client, [app.backend.get_key_for_task(i) for i in batch["ids"]])
    out: dict[str, Any] = {kind: {"rounds": [], "commands": {}, "cpu": {}} for kind in kinds}
    for r in range(rounds):
        for kind, name in kinds.items():
            before, cpu_before = command_stats(client), meter.read()
            batch = run_batch(app, name, n, timeout)
            cpu = CpuMeter.delta(cpu_before, meter.read())
            delta = stats_delta(before, command_stats(client))
            for group, seconds in cpu.items():
                out[kind]["cpu"][group] = out[kind]["cpu"].get(group, 0.0) + seconds
            ids = batch.pop("ids")
            done = last_done(app, client, ids) - batch["sent_at"]
            delete_keys(client, [app.backend.get_key_for_task(i) for i in ids])
            out[kind]["rounds"].append({
                **batch, "done_seconds": done, "per_s": n / done,
                "end_to_end_per_s": n / batch["seconds"],
                "commands": sum(v["calls"] for v in delta.values())})
            for cmd, v in delta.items():
                acc = out[kind]["commands"].setdefault(cmd, {"calls": 0, "usec": 0})
                acc["calls"] += v["calls"]
                acc["usec"] += v["usec"]
            print(f"  round {r + 1}/{rounds} {kind:<6}: {n / done:,.0f} tasks/s "
                  f"({n / batch['seconds']:,.0f}/s to the last result received)", flush=True)
    total = n * rounds
    for kind in kinds:
        k = out[kind]
        k["n"], k["total_tasks"] = n, total
        k["median_per_s"] = statistics.median(x["per_s"] for x in k["rounds"])
        k["median_end_to_end_per_s"] = statistics.median(x["end_to_end_per_s"] for x in k["rounds"])
        k["per_task"] = {cmd: v["calls"] / total for cmd, v in sorted(k["commands"].items())}
        k["commands_per_task"] = sum(k["per_task"].values())
        k["scripts_per_task"] = calls(k["commands"], "evalsha", "eval") / total
        cpu = k.pop("cpu")
        machine = cpu.pop(MACHINE, 0.0)
        k["cpu_us_per_task"] = {group: seconds / total * 1e6 for group, seconds in cpu.items()}
        # CPU time other processes (other jobs on the machine) took during the rounds.
        k["other_cpu_us_per_task"] = max(0.0, machine - sum(cpu.values())) / total * 1e6
    out["ratio"] = out["leased"]["median_per_s"] / out["plain"]["median_per_s"]
    out["end_to_end_ratio"] = (out["leased"]["median_end_to_end_per_s"]
                               / out["plain"]["median_end_to_end_per_s"])
    plain_cpu = sum(out["plain"]["cpu_us_per_task"].values())
    leased_cpu = sum(out["leased"]["cpu_us_per_task"].values())
    # Plain over leased CPU per task: the throughput ratio when the CPUs are the limit.
    out["cpu_ratio"] = plain_cpu / leased_cpu if leased_cpu else None
    out["round_ratios"] = [lr["per_s"] / pr["per_s"]
                           for pr, lr in zip(out["plain"]["rounds"], out["leased"]["rounds"])]
    return out


def bench_backlog(app: celery.Celery, client: redis.Redis, worker: "BenchWorker", n: int, rounds: int,
                  meter: CpuMeter) -> dict:
    """A worker draining a backlog alone: n tasks queued while it is stopped, then released.

    No sender competes for the CPUs here, so what limits the worker is its
    own main process, through which every message passes one at a time.
    """
    kinds = {"plain": "bench.noop", "leased": "bench.leased_noop"}
    timeout = max(60.0, n / 20)
    out: dict[str, Any] = {kind: {"rounds": [], "cpu": {}} for kind in kinds}
    for _ in range(rounds):
        for kind, name in kinds.items():
            worker.signal(signal.SIGSTOP)
            try:
                results = [app.tasks[name].apply_async() for _ in range(n)]
                time.sleep(0.2)
                cpu_before = meter.read()
                released = time.time()
            finally:
                worker.signal(signal.SIGCONT)
            ids = [r.id for r in results]
            last = app.backend.get_key_for_task(ids[-1])
            wait_until(lambda: client.exists(last), timeout, f"the backlog of {n} {kind} tasks")
            # Tasks end out of order across two processes: wait for every result key.
            for i in range(0, n, 1000):
                keys = [app.backend.get_key_for_task(t) for t in ids[i:i + 1000]]
                wait_until(lambda keys=keys: client.exists(*keys) == len(keys), timeout, "all results")
            cpu = CpuMeter.delta(cpu_before, meter.read())
            done = last_done(app, client, ids) - released
            wait_all(results, timeout)  # reads the result messages, outside the measurement
            delete_keys(client, [app.backend.get_key_for_task(i) for i in ids])
            cpu.pop(MACHINE, None)
            cpu.pop("sender (this process)", None)
            for group, seconds in cpu.items():
                out[kind]["cpu"][group] = out[kind]["cpu"].get(group, 0.0) + seconds
            out[kind]["rounds"].append({"done_seconds": done, "per_s": n / done})
            print(f"  backlog {kind:<6}: {n / done:,.0f} tasks/s", flush=True)
    for kind in kinds:
        k = out[kind]
        k["median_per_s"] = statistics.median(x["per_s"] for x in k["rounds"])
        k["cpu_us_per_task"] = {g: sec / (n * rounds) * 1e6 for g, sec in k.pop("cpu").items()}
    out["ratio"] = out["leased"]["median_per_s"] / out["plain"]["median_per_s"]
    out["n"], out["rounds_each"] = n, rounds
    return out


def calibrate_scripts(client: redis.Redis, prefix: str, pairs: int) -> dict:
    """Commands run inside Redis by one acquire + finish pair, the path of every leased no-op
    (the finish storing the result record too, as the worker's finish does for a no-op)."""
    store = LeaseStore(client, prefix, ttl=QUIET_TTL)
    envelope = {"exchange": "", "routing_key": prefix, "priority": 0,
                "headers": {"task": "bench.leased_noop"}, "properties": {}}
    body = b"x" * 200
    warm = store.acquire("warm", "calibrate", name="bench.leased_noop", body=body, envelope=envelope)
    store.finish("warm", "calibrate", warm.token, "succeeded")
    before = command_stats(client)
    for i in range(pairs):
        a = store.acquire(f"cal-{i}", "calibrate", name="bench.leased_noop", body=body,
                          envelope=envelope)
        if a.code is not Code.ACQUIRED:
            raise RuntimeError(f"calibration: acquire returned {a.code.name}")
        # As in the worker: the finish script also stores the result record (celery_leases/results.py).
        store.finish(f"cal-{i}", "calibrate", a.token, "succeeded",
                     write=(f"{prefix}:cal-result-{i}", b"r" * 120, 3600))
    delta = stats_delta(before, command_stats(client))
    scripts = calls(delta, "evalsha", "eval")
    if scripts != 2 * pairs:
        raise RuntimeError(f"calibration: {scripts} script calls for {pairs} pairs, expected {2 * pairs}")
    inside = {cmd: v["calls"] / pairs for cmd, v in sorted(delta.items())
              if cmd not in ("evalsha", "eval")}
    return {"pairs": pairs, "inside_per_pair": inside, "inside_total": sum(inside.values())}


def bench_heartbeat(app: celery.Celery, client: redis.Redis, store: LeaseStore,
                    sizes: tuple[int, ...], ticks: int) -> list[dict]:
    """Renew calls per heartbeat tick while the worker holds 1, 10, 100 leases."""
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
    client.set(f"{store.keys.tag}:bench-stop", "1", ex=300)
    wait_all(results, 30)
    delete_keys(client, [app.backend.get_key_for_task(r.id) for r in results])
    return rows


# -- report ------------------------------------------------------------------

def evaluate(results: dict) -> dict[str, dict]:
    t = results["throughput"]
    targets = {f"leased/plain throughput >= {RATIO_TARGET:.2f}": {
        "measured": f"{t['ratio']:.2f}", "result": "PASS" if t["ratio"] >= RATIO_TARGET else "MISS"}}
    c = results["commands"]
    # Top-level commands are whole calls; a difference within 0.05 per task is idle polling noise.
    ok = c["extra_round_trips"] <= EXTRA_TRIPS_TARGET + 0.05
    targets[f"<= {EXTRA_TRIPS_TARGET} extra round trips per task"] = {
        "measured": f"{c['extra_round_trips']:.2f} (EVALSHA {c['leased_scripts_per_task']:.2f})",
        "result": "PASS" if ok else "MISS"}
    hb = results["heartbeat"]
    ok = all(row["calls"] == row["ticks"] for row in hb)
    targets["1 renew call per heartbeat tick (1, 10, 100 leases)"] = {
        "measured": " / ".join(f"{row['calls_per_tick']:g}" for row in hb),
        "result": "PASS" if ok else "MISS"}
    return targets


def command_summary(results: dict, calibration: dict) -> dict:
    t = results["throughput"]
    plain, leased = t["plain"], t["leased"]
    # Every leased no-op runs one acquire and one finish; a plain one runs no lease script.
    inside = calibration["inside_total"] * leased["scripts_per_task"] / 2
    plain_top = plain["commands_per_task"]
    leased_top = leased["commands_per_task"] - inside
    diff = {cmd: leased["per_task"].get(cmd, 0) - plain["per_task"].get(cmd, 0)
            for cmd in sorted(set(plain["per_task"]) | set(leased["per_task"]))}
    # Extra round trips, at most: every top-level command the leased task sends more of
    # (the scripts' own commands taken out) counts as one round trip of its own; the
    # commands it sends fewer of earn nothing back, although Celery pipelines some of
    # them (MULTI/SET/PUBLISH/EXEC is one round trip). Under 0.05 per task is polling noise.
    scale = leased["scripts_per_task"] / 2
    top_diff = {cmd: v - calibration["inside_per_pair"].get(cmd, 0) * scale for cmd, v in diff.items()}
    extra_trips = sum(v for v in top_diff.values() if v >= 0.05)
    return {"plain_per_task": plain["commands_per_task"], "leased_per_task": leased["commands_per_task"],
            "leased_inside_scripts_per_task": inside,
            "plain_top_level_per_task": plain_top, "leased_top_level_per_task": leased_top,
            "plain_scripts_per_task": plain["scripts_per_task"],
            "leased_scripts_per_task": leased["scripts_per_task"],
            "extra_top_level_commands": leased_top - plain_top,
            "extra_round_trips": extra_trips,
            "top_level_difference_by_command": {k: round(v, 3) for k, v in top_diff.items() if abs(v) >= 0.001},
            "difference_by_command": {k: round(v, 3) for k, v in diff.items() if abs(v) >= 0.001}}


def table(results: dict, targets: dict[str, dict]) -> str:
    t, c = results["throughput"], results["commands"]
    ratio_t = f"leased/plain throughput >= {RATIO_TARGET:.2f}"
    trips_t = f"<= {EXTRA_TRIPS_TARGET} extra round trips per task"
    hb_t = "1 renew call per heartbeat tick (1, 10, 100 leases)"
    n, rounds = t["plain"]["n"], len(t["plain"]["rounds"])
    rows: list[tuple[str, ...]] = [
        (f"throughput, tasks/s: first send to last task done (median of {rounds} x {n:,})",
         f"{t['plain']['median_per_s']:,.0f}", f"{t['leased']['median_per_s']:,.0f}",
         f"ratio {t['ratio']:.2f}", ratio_t, targets[ratio_t]["result"]),
        ("  to the last result received by the sender",
         f"{t['plain']['median_end_to_end_per_s']:,.0f}", f"{t['leased']['median_end_to_end_per_s']:,.0f}",
         f"ratio {t['end_to_end_ratio']:.2f}", "", ""),
        ("Redis commands per task (all clients, server count)",
         f"{c['plain_per_task']:.2f}", f"{c['leased_per_task']:.2f}",
         f"+{c['leased_per_task'] - c['plain_per_task']:.2f}", "", ""),
        ("  of which inside the lease scripts", "0", f"{c['leased_inside_scripts_per_task']:.2f}",
         "", "", ""),
        ("  top-level commands per task", f"{c['plain_top_level_per_task']:.2f}",
         f"{c['leased_top_level_per_task']:.2f}", f"{c['extra_top_level_commands']:+.2f}", "", ""),
        ("  extra round trips per task, at most (commands sent more often)", "", "",
         f"+{c['extra_round_trips']:.2f}", trips_t, targets[trips_t]["result"]),
        ("  EVALSHA + EVAL per task", f"{c['plain_scripts_per_task']:.2f}",
         f"{c['leased_scripts_per_task']:.2f}", "acquire + finish", "", ""),
    ]
    pc, lc = t["plain"]["cpu_us_per_task"], t["leased"]["cpu_us_per_task"]
    if pc:
        rows.append(("CPU per task, µs (user + system)", f"{sum(pc.values()):,.0f}",
                     f"{sum(lc.values()):,.0f}",
                     f"{sum(lc.values()) - sum(pc.values()):+,.0f} µs; ratio {t['cpu_ratio']:.2f}", "", ""))
        for group in pc:
            rows.append((f"  {group}", f"{pc[group]:,.0f}", f"{lc[group]:,.0f}",
                         f"{lc[group] - pc[group]:+,.0f} µs", "", ""))
        if results["meta"]["throwaway_server"]:
            rows.append(("  other processes on the machine meanwhile",
                         f"{t['plain']['other_cpu_us_per_task']:,.0f}",
                         f"{t['leased']['other_cpu_us_per_task']:,.0f}", "not in the total", "", ""))
    b = results["backlog"]
    rows.append((f"backlog drained by the worker alone, tasks/s (median of {len(b['plain']['rounds'])} "
                  f"x {b['n']:,})", f"{b['plain']['median_per_s']:,.0f}", f"{b['leased']['median_per_s']:,.0f}",
                  f"ratio {b['ratio']:.2f}", "", ""))
    for group in b["plain"]["cpu_us_per_task"]:
        bp, bl = b["plain"]["cpu_us_per_task"][group], b["leased"]["cpu_us_per_task"][group]
        rows.append((f"  CPU per task, {group}, µs", f"{bp:,.0f}", f"{bl:,.0f}", f"{bl - bp:+,.0f} µs", "", ""))
    for row in results["heartbeat"]:
        rows.append((f"heartbeat, {row['leases']} held lease(s): renew calls / ticks", "",
                     f"{row['calls']} / {row['ticks']}",
                     f"{row['server_us_per_call']:.0f} µs in Redis per call", hb_t,
                     "PASS" if row["calls"] == row["ticks"] else "MISS"))
    return markdown_table(("measurement", "plain", "leased", "ratio / detail", "target", "result"), rows)


# -- main ----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("-n", type=int, help="tasks per round (default 2000, --quick 200)")
    parser.add_argument("--rounds", type=int, help="rounds of each kind (default 3, --quick 1)")
    parser.add_argument("--loglevel", default="WARNING", help="worker log level (default: %(default)s)")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-overhead.json"),
                        help="where to write the raw results (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.n:
        sizes["n"] = args.n
    if args.rounds:
        sizes["rounds"] = args.rounds

    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    log_dir: Path | None = None
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        url, server = redis_url(cleanup)
        client = redis.Redis.from_url(url)
        cleanup.push(client.close)
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        for pattern in (f"{{{prefix}}}*", f"{{{prefix}-hb}}*", f"{{{prefix}-cal}}*"):
            cleanup.push(lambda p=pattern: delete_pattern(client, p))
        for queue in (prefix, f"{prefix}-hb"):
            cleanup.push(lambda q=queue: client.delete(q, f"{q}\x06\x163", f"{q}\x06\x166",
                                                        f"{q}\x06\x169", f"_kombu.binding.{q}",
                                                        f"_kombu.binding_permanent.{q}"))
        log_dir = Path(tempfile.mkdtemp(prefix="leases-bench-overhead-"))
        info = client.info("server")
        results: dict[str, Any] = {
            "meta": {
                "date": started.isoformat(timespec="seconds"),
                "quick": args.quick, "n": sizes["n"], "rounds": sizes["rounds"],
                "pool": f"{POOL} -c {CONCURRENCY}", "heartbeat_pool": f"{HB_POOL} -c {HB_CONCURRENCY}",
                "loglevel": args.loglevel,
                "redis_version": info["redis_version"], "throwaway_server": server is not None,
                "load_average_before": os.getloadavg()[0], **git_state(),
                "python": platform.python_version(), "celery": celery.__version__,
                "redis_py": redis.__version__, "cpus": os.cpu_count(), "machine": platform.platform(),
            },
        }
        print(f"task overhead benchmark: redis {info['redis_version']}"
              f"{' (throwaway)' if server else ''}, celery {celery.__version__}, "
              f"{'quick' if args.quick else 'full'} run", flush=True)
        if os.getloadavg()[0] > 0.5:
            print(f"note: load average {os.getloadavg()[0]:.2f} before the run: other processes "
                  f"compete for the {os.cpu_count()} CPUs and the timings will be noisy", flush=True)

        # Throughput and commands: one prefork worker, no heartbeat tick during a round.
        env = bench_env(url, prefix, QUIET_TTL, QUIET_INTERVAL)
        app = create_app(env)
        cleanup.push(app.close)
        worker = BenchWorker("overhead", env, pool=POOL, concurrency=CONCURRENCY, log_dir=log_dir,
                             loglevel=args.loglevel)
        cleanup.push(worker.kill)
        print(f"throughput: {POOL} -c {CONCURRENCY}, {sizes['rounds']} round(s) of "
              f"{sizes['n']:,} tasks each kind", flush=True)
        worker.start(timeout=60)
        meter = CpuMeter(worker.pid, server.process.pid if server and server.process else None)
        results["throughput"] = bench_throughput(app, client, sizes["n"], sizes["rounds"],
                                                 sizes["warmup"], meter)
        print(f"backlog: {sizes['backlog_rounds']} round(s) of {sizes['n']:,} tasks each kind, "
              f"queued while the worker is stopped", flush=True)
        results["backlog"] = bench_backlog(app, client, worker, sizes["n"], sizes["backlog_rounds"], meter)
        worker.stop()
        calibration = calibrate_scripts(client, f"{prefix}-cal", sizes["calibrate"])
        results["calibration"] = calibration
        results["commands"] = command_summary(results, calibration)

        # Heartbeat: a threads worker holding 1, 10, 100 leases.
        hb_env = bench_env(url, f"{prefix}-hb", HB_TTL, HB_INTERVAL)
        hb_app = create_app(hb_env)
        cleanup.push(hb_app.close)
        hb_worker = BenchWorker("heartbeat", hb_env, pool=HB_POOL, concurrency=HB_CONCURRENCY,
                                log_dir=log_dir, loglevel=args.loglevel)
        cleanup.push(hb_worker.kill)
        print(f"heartbeat: {HB_POOL} -c {HB_CONCURRENCY}, ttl {HB_TTL:g} s, interval {HB_INTERVAL:g} s",
              flush=True)
        hb_worker.start(timeout=60)
        hb_store = LeaseStore(client, f"{prefix}-hb")
        results["heartbeat"] = bench_heartbeat(hb_app, client, hb_store, HEARTBEAT_SIZES, sizes["ticks"])
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
        print("interrupted; workers and redis-server stopped, keys deleted", file=sys.stderr)
        sys.exit(130)
