"""Benchmark of recovery: SIGKILL-to-rerun delay, and re-publish throughput beside send_task.

Usage, from the repository root::

    .venv/bin/python bench/recovery.py [--quick] [--json PATH] [--strict]

Starts a throwaway ``redis-server`` on a free loopback port (no persistence),
or uses ``$REDIS_URL`` if set (then only keys under two fresh prefixes, the
benchmark's own queues, bindings and result keys are touched and deleted
afterwards). Broker, result backend and leases all live on that one server.
Prints one Markdown table and writes the raw results as JSON (default
``bench/results-recovery.json``, which git ignores).

What is measured:

- **SIGKILL to running again.** Two ``celery worker -P prefork -c 1``
  processes of ``bench/recovery_app.py`` (lease ttl 2 s, recovery interval
  1 s, the workers' fallback recovery thread on, no beat, prefetch 1) consume
  one queue. A trial sends one ``bench.recovery.hold`` task, waits until it
  starts (the task appends ``time.time()`` to a Redis list), SIGKILLs the
  process group of the worker that runs it (main process and pool child at
  once: a host or OOM kill), notes the kill time, and waits for the task's
  second start: the survivor is the standby, its recovery thread claims the
  expired lease and re-publishes the message, and it runs the task again. The
  delay is second start minus kill time (both ``time.time()`` on this
  machine). The killed worker is then replaced (and the next trial starts
  only once it is ready, so no worker start-up shares the CPUs with a
  measurement). 20 trials (``--quick``: 3); min / median / max, against
  ttl + interval + 1 s. Per trial the JSON also splits the delay: lease time
  left at the kill (its deadline in the index, server clock), and the
  re-acquire at receipt by the survivor (its lease history).
- **Re-publish throughput.** N expired leases holding real messages (10,000;
  ``--quick``: 1,000), then one timed ``celery_leases.store(app).recover()``
  with the app's own publisher, beside N timed ``app.send_task`` calls to
  another queue in the same run; R rounds (3; ``--quick``: 1), alternating
  which goes first; median of each and the ratio. No worker runs then. The
  expired leases are made the way a worker makes them: N ``send_task``
  messages of a leased task are parked in a queue nobody consumes, read back
  with kombu (``Queue.get``, the same ``Message`` a worker receives), and
  each is acquired with ``message.body`` and ``messages.envelope_of(message)``
  as the worker's ``task_received`` hook does, by an owner that then never
  renews (a dead worker). After the ttl passed on the server clock the pass
  runs. The re-published copies land back in the parked queue; all N are
  checked (same ids, same body bytes, ``lease_generation`` 1).

Exit code 0 unless the run fails; with ``--strict`` also 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import kombu  # noqa: E402

import celery_leases  # noqa: E402
from bench._common import (  # noqa: E402
    Cleanup, bench_worker, delete_keys, delete_pattern, fmt_rate, git_state, markdown_table, redis_url, report,
    terminate, wait_until,
)
from bench.recovery_app import HOLD, NOOP, create_app, starts_key  # noqa: E402
from celery_leases.config import get_config  # noqa: E402
from celery_leases.recovery.messages import envelope_of  # noqa: E402
from celery_leases.testing import Worker  # noqa: E402

#: Sizes of a full run and of a ``--quick`` smoke run.
FULL = {"trials": 20, "n": 10_000, "rounds": 5, "warmup": 200}
QUICK = {"trials": 3, "n": 1_000, "rounds": 1, "warmup": 50}

#: Settings from the issue.
TTL, INTERVAL = 2.0, 1.0
POOL_SIZE, POOL, CONCURRENCY = 2, "prefork", 1

#: Targets from the issue.
RERUN_TARGET_S = TTL + INTERVAL + 1.0
RATIO_TARGET = 0.8

#: The parked messages' arguments (a body of about 300 bytes), the same for send_task.
PAYLOAD = "x" * 200
DEAD_OWNER = "bench-dead-worker"


# -- helpers -----------------------------------------------------------------

def clock_offset(client: redis.Redis) -> float:
    """Server clock minus this machine's time.time(), seconds (the best of 5 readings)."""
    best = None
    for _ in range(5):
        before = time.time()
        seconds, micros = client.time()
        after = time.time()
        sample = (after - before, int(seconds) + int(micros) / 1e6 - (before + after) / 2)
        if best is None or sample[0] < best[0]:
            best = sample
    return best[1]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_env(url: str, prefix: str, worker_recovery: bool) -> dict[str, str]:
    return {"LEASES_BENCH_BROKER": url, "LEASES_BENCH_PREFIX": prefix,
            "LEASES_BENCH_TTL": str(TTL), "LEASES_BENCH_RECOVERY_INTERVAL": str(INTERVAL),
            "LEASES_BENCH_WORKER_RECOVERY": "1" if worker_recovery else "0"}


def start_workers(names: list[str], env: dict, log_dir: Path) -> list[Worker]:
    """Start workers in parallel; each is ready (consuming) on return."""
    workers = [bench_worker(name, "bench.recovery_app", env, pool=POOL, concurrency=CONCURRENCY,
                            log_dir=log_dir) for name in names]
    errors: list[BaseException] = []

    def start(w: Worker) -> None:
        try:
            w.start(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        for w in workers:
            w.kill()
        raise errors[0]
    return workers


class CpuMeter:
    """CPU seconds (user + system) of this process and of the throwaway redis-server (Linux /proc)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, redis_pid: int | None) -> None:
        self.redis_pid = redis_pid

    def _proc(self, pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self.TICK

    def read(self) -> dict[str, float | None]:
        times = os.times()
        return {"client": times.user + times.system,
                "redis": self._proc(self.redis_pid) if self.redis_pid else None}

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, float | None]:
        return {k: (after[k] - before[k]) if after[k] is not None and before[k] is not None else None
                for k in after}


def summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# -- SIGKILL to running again ---------------------------------------------------

def watch_guard(client: redis.Redis, guard: str, key: str, timeout: float, what: str) -> list[float]:
    """Poll until the task's second start; return when the recovery guard was set (time.time()).

    Each pass of the fallback recoverer begins by setting the guard (``SET NX
    PX interval``), so a jump up of its PTTL is a pass that began.
    """
    sets: list[float] = []
    last = -2
    deadline = time.monotonic() + timeout
    while True:
        pipe = client.pipeline(transaction=False)
        pipe.pttl(guard)
        pipe.llen(key)
        now = time.time()
        pttl, runs = pipe.execute()
        if pttl > 0 and (last <= 0 or pttl > last):
            sets.append(now - (INTERVAL * 1000 - pttl) / 1000)
        last = pttl
        if runs >= 2:
            return sets
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.005)


def bench_rerun(url: str, client: redis.Redis, trials: int, log_dir: Path, cleanup: Cleanup,
                seed: int) -> dict:
    prefix = f"benchrec{uuid.uuid4().hex[:8]}"
    env = bench_env(url, prefix, worker_recovery=True)
    app = create_app(env)
    store = celery_leases.store(app)
    result_ids: list[str] = []

    def clean() -> None:
        delete_pattern(client, "{" + prefix + "}*")
        delete_keys(client, [prefix, f"_kombu.binding.{prefix}"]
                    + [f"celery-task-meta-{t}" for t in result_ids])
        app.close()

    cleanup.push(clean)
    pool: list[Worker] = []

    def stop_pool() -> None:
        for w in pool:
            w.kill()

    cleanup.push(stop_pool)
    count = 0

    def names(k: int) -> list[str]:
        nonlocal count
        out = [f"w{count + i}" for i in range(k)]
        count += k
        return out

    pool.extend(start_workers(names(POOL_SIZE), env, log_dir))
    rng = random.Random(seed)
    rows = []
    for trial in range(trials):
        offset = clock_offset(client)
        # A worker's recovery passes tick at its start time + k intervals, and the
        # replacement is ready a few ms after its loop starts: sending at once would
        # put every lease deadline at the same point of the survivor's cycle.
        pause = rng.uniform(0, INTERVAL)
        time.sleep(pause)
        res = app.send_task(HOLD, kwargs={"max_seconds": 30.0})
        result_ids.append(res.id)
        key = starts_key(prefix, res.id)
        wait_until(lambda key=key: client.llen(key) >= 1, 20, f"trial {trial + 1}: the task to start",
                   interval=0.01)
        first = json.loads(client.lindex(key, 0))
        victim = next((w for w in pool if w.pid == first["ppid"]), None)
        if victim is None:
            raise RuntimeError(f"trial {trial + 1}: the task started in pid {first['pid']} "
                               f"(parent {first['ppid']}), not in a pool child of a bench worker")
        survivors = [w for w in pool if w is not victim]
        # Killed once the store knows the body started (its start mark, batched by the
        # heartbeat): only a running task is charged a recovery.
        started_by = time.monotonic() + 5
        while not getattr(store.get(res.id), "started", True) and time.monotonic() < started_by:
            time.sleep(0.01)

        os.killpg(victim.pid, signal.SIGKILL)
        killed_at = time.time()
        victim.proc.wait(10)
        deadline_ms = client.zscore(store.keys.deadlines, res.id)

        guard_sets = watch_guard(client, store.keys.recovery_guard, key, 30,
                                 f"trial {trial + 1}: the task to run again")
        second = json.loads(client.lindex(key, 1))
        if res.get(timeout=15) != 2:
            raise RuntimeError(f"trial {trial + 1}: the waiter did not get the re-run's result")
        record = store.get(res.id)
        if record is None or record.recoveries != 1 or record.state != "succeeded":
            raise RuntimeError(f"trial {trial + 1}: unexpected lease record after the re-run: {record}")
        reacquired_ms = record.history[-1][2] if record.history else None
        kill_srv = killed_at + offset
        deadline_local = deadline_ms / 1000 - offset if deadline_ms else None
        # The pass that recovered the task: the last guard set before its second start;
        # a refused turn shows as a gap of about two intervals before it.
        before_rerun = [t for t in guard_sets if t <= second["t"]]
        gaps = [b - a for a, b in zip(before_rerun, before_rerun[1:])]
        rows.append({
            "trial": trial + 1,
            "task_id": res.id,
            "delay_s": second["t"] - killed_at,
            "lease_left_at_kill_s": (deadline_ms / 1000 - kill_srv) if deadline_ms else None,
            "kill_to_reacquired_s": (reacquired_ms / 1000 - kill_srv) if reacquired_ms else None,
            "deadline_to_running_s": (second["t"] + offset - deadline_ms / 1000) if deadline_ms else None,
            "pause_before_send_s": pause,
            "passes_after_kill_s": [t - killed_at for t in guard_sets],
            "recovering_pass_after_deadline_s": (before_rerun[-1] - deadline_local)
            if before_rerun and deadline_local else None,
            "largest_gap_between_passes_s": max(gaps) if gaps else None,
            "reran_on": "survivor" if any(w.pid == second["ppid"] for w in survivors) else "other",
            "first_generation": first["generation"], "second_generation": second["generation"],
            "clock_offset_ms": round(offset * 1000, 3),
        })
        print(f"  trial {trial + 1:2d}/{trials}: running again {rows[-1]['delay_s']:.2f} s after "
              f"the SIGKILL", flush=True)
        pool.remove(victim)
        if trial + 1 < trials:
            pool.extend(start_workers(names(1), env, log_dir))

    delays = [r["delay_s"] for r in rows]
    left = [r["lease_left_at_kill_s"] for r in rows if r["lease_left_at_kill_s"] is not None]
    reacq = [r["kill_to_reacquired_s"] for r in rows if r["kill_to_reacquired_s"] is not None]
    after_deadline = [r["deadline_to_running_s"] for r in rows if r["deadline_to_running_s"] is not None]
    # One pass per interval: a gap of more than 1.5 intervals between passes is a turn
    # that no worker took (the guard refused it).
    skipped = sum((r["largest_gap_between_passes_s"] or 0) > 1.5 * INTERVAL for r in rows)
    gaps = [r["largest_gap_between_passes_s"] for r in rows if r["largest_gap_between_passes_s"]]
    # Passes come one interval apart (plus about 1 ms a cycle): a recovering pass later than
    # that after the deadline means the turn in between was refused, and the rerun waited.
    delayed = sum((r["recovering_pass_after_deadline_s"] or 0) > 1.05 * INTERVAL for r in rows)
    return {"trials": rows, "ttl": TTL, "recovery_interval": INTERVAL,
            "heartbeat_interval": store.settings.ttl / 3, "pool": f"{POOL_SIZE} x -P {POOL} -c {CONCURRENCY}",
            "delay": summary(delays), "lease_left_at_kill": summary(left) if left else None,
            "deadline_to_running": summary(after_deadline) if after_deadline else None,
            "kill_to_reacquired": summary(reacq) if reacq else None,
            "trials_with_a_skipped_pass": skipped,
            "trials_delayed_by_a_skipped_pass": delayed,
            "largest_gap_between_passes": summary(gaps) if gaps else None,
            "seed": seed,
            "reran_on_survivor": sum(r["reran_on"] == "survivor" for r in rows)}


# -- re-publish throughput ------------------------------------------------------

def park_messages(app: celery.Celery, queue: str, n: int) -> list[kombu.Message]:
    """n real messages of a leased task, sent and read back as a worker would receive them."""
    for i in range(n):
        app.send_task(NOOP, (i, PAYLOAD), queue=queue)
    messages = []
    with app.connection_for_read() as conn:
        bound = app.amqp.queues[queue](conn.default_channel)
        while True:
            message = bound.get(no_ack=True)
            if message is None:
                break
            messages.append(message)
    if len(messages) != n:
        raise RuntimeError(f"parked {n} messages in {queue}, read back {len(messages)}")
    return messages


def expire(store: celery_leases.LeaseStore, messages: list, config: Any) -> None:
    """Acquire each message's lease as worker.on_received does, then let the ttl run out."""
    for message in messages:
        headers = message.headers or {}
        acq = store.acquire(headers["id"], DEAD_OWNER, ttl=config.ttl,
                            generation=int(headers.get("lease_generation") or 0),
                            attempt=int(headers.get("retries") or 0),
                            max_recoveries=config.max_recoveries, name=headers["task"],
                            body=message.body, envelope=envelope_of(message))
        if not acq.owned:
            raise RuntimeError(f"acquire of {headers['id']} returned {acq.code.name}")
    (_, last), = store.client.zrange(store.keys.deadlines, -1, -1, withscores=True)
    while store.server_time_ms() <= last:
        time.sleep(0.01)


def check_republished(client: redis.Redis, queue: str, messages: list) -> None:
    """Every parked message is back in its queue once: same id and body, generation 1."""
    originals = {m.headers["id"]: m.body for m in messages}
    raw = client.lrange(queue, 0, -1)
    if len(raw) != len(originals):
        raise RuntimeError(f"{len(originals)} leases recovered, {len(raw)} messages in {queue}")
    seen = set()
    for item in raw:
        payload = json.loads(item)
        headers = payload["headers"]
        body = payload["body"]
        if payload["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        elif isinstance(body, str):
            body = body.encode()
        task_id = headers["id"]
        if (originals.get(task_id) != body or headers.get("lease_generation") != 1 or task_id in seen
                or payload["properties"].get("correlation_id") != task_id):
            raise RuntimeError(f"re-published message of {task_id} differs from the original "
                               f"(generation {headers.get('lease_generation')})")
        seen.add(task_id)


def bench_republish(url: str, client: redis.Redis, n: int, rounds: int, warmup: int,
                    cleanup: Cleanup, cpu: CpuMeter) -> dict:
    prefix = f"benchpub{uuid.uuid4().hex[:8]}"
    app = create_app(bench_env(url, prefix, worker_recovery=False))
    config = get_config(app)
    store = celery_leases.store(app)
    park, plain = f"{prefix}-park", f"{prefix}-plain"
    queues = [park, plain]

    def clean() -> None:
        delete_pattern(client, "{" + prefix + "}*")
        delete_keys(client, queues + [f"_kombu.binding.{q}" for q in queues])
        app.close()

    cleanup.push(clean)

    def reset() -> None:
        delete_pattern(client, "{" + prefix + "}*")
        delete_keys(client, queues)

    def time_plain() -> tuple[float, dict]:
        before = cpu.read()
        start = time.perf_counter()
        for i in range(n):
            app.send_task(NOOP, (i, PAYLOAD), queue=plain)
        seconds = time.perf_counter() - start
        used = CpuMeter.delta(before, cpu.read())
        if client.llen(plain) != n:
            raise RuntimeError(f"sent {n} with send_task, {client.llen(plain)} in {plain}")
        return seconds, used

    def time_recover(messages: list) -> tuple[float, float, dict]:
        publish_s = 0.0
        real = store.publish

        def publish(claim: Any) -> None:  # the app's own publisher, timed
            nonlocal publish_s
            t = time.perf_counter()
            real(claim)
            publish_s += time.perf_counter() - t

        before = cpu.read()
        start = time.perf_counter()
        report = store.recover(publish=publish)
        seconds = time.perf_counter() - start
        used = CpuMeter.delta(before, cpu.read())
        if report.recovered != len(messages) or report.dead or report.publish_failed:
            raise RuntimeError(f"recovery of {len(messages)} expired leases reported "
                               f"{report.as_dict()} {report.errors[:3]}")
        if store.stats()["indexed"] != 0:
            raise RuntimeError("recovered leases left in the deadline index after the pass")
        return seconds, publish_s, used

    # Warm-up: connections, producer pool, queue declarations and scripts loaded.
    warm = park_messages(app, park, warmup)
    for i in range(warmup):
        app.send_task(NOOP, (i, PAYLOAD), queue=plain)
    expire(store, warm, config)
    time_recover(warm)
    reset()

    print(f"  parking {n:,} messages of {NOOP} and reading them back ...", flush=True)
    messages = park_messages(app, park, n)
    runs = []
    for r in range(rounds):
        expire(store, messages, config)
        plain_first = r % 2 == 0
        if plain_first:
            plain_s, plain_cpu = time_plain()
        recover_s, publish_s, recover_cpu = time_recover(messages)
        if not plain_first:
            plain_s, plain_cpu = time_plain()
        check_republished(client, park, messages)
        runs.append({"round": r + 1, "plain_first": plain_first, "recover_s": recover_s,
                     "publish_s": publish_s, "send_task_s": plain_s,
                     "recover_per_s": n / recover_s, "send_task_per_s": n / plain_s,
                     "ratio": plain_s / recover_s,
                     "recover_cpu_s": recover_cpu, "send_task_cpu_s": plain_cpu})
        print(f"  round {r + 1}/{rounds}: recover {n / recover_s:,.0f}/s, send_task "
              f"{n / plain_s:,.0f}/s", flush=True)
        reset()
    body = len(messages[0].body)
    rec = statistics.median(r["recover_per_s"] for r in runs)
    plain_rate = statistics.median(r["send_task_per_s"] for r in runs)
    return {"n": n, "rounds": runs, "batch": store.settings.recover_batch, "body_bytes": body,
            "recover_median_per_s": rec, "send_task_median_per_s": plain_rate,
            "recover_median_s": statistics.median(r["recover_s"] for r in runs),
            "publish_median_s": statistics.median(r["publish_s"] for r in runs),
            "ratio": rec / plain_rate,
            "round_ratios": [r["ratio"] for r in runs],
            "cpu_us_per_message": {
                kind: {part: (statistics.median(r[f"{kind}_cpu_s"][part] for r in runs) / n * 1e6
                              if runs[0][f"{kind}_cpu_s"][part] is not None else None)
                       for part in ("client", "redis")}
                for kind in ("recover", "send_task")}}


# -- report ------------------------------------------------------------------

def fmt_s(d: dict) -> str:
    return f"{d['min']:.2f} s / {d['median']:.2f} s / {d['max']:.2f} s"


def evaluate(results: dict) -> dict[str, dict]:
    rerun, pub = results["rerun"], results["republish"]
    rerun_name = (f"worst SIGKILL-to-rerun <= ttl + interval + 1 s = {RERUN_TARGET_S:g} s")
    ratio_name = f"re-publish >= {RATIO_TARGET:g} x send_task throughput"
    return {
        rerun_name: {"measured": f"max {rerun['delay']['max']:.2f} s over {len(rerun['trials'])} trials",
                     "result": "PASS" if rerun["delay"]["max"] <= RERUN_TARGET_S else "MISS"},
        ratio_name: {"measured": f"{pub['ratio']:.2f} x at {pub['n']:,}",
                     "result": "PASS" if pub["ratio"] >= RATIO_TARGET else "MISS"},
    }


def table(results: dict, targets: dict[str, dict]) -> str:
    rerun, pub = results["rerun"], results["republish"]
    names = list(targets)
    rows: list[tuple[str, ...]] = [
        (f"SIGKILL -> running again, {len(rerun['trials'])} trials (min / median / max)",
         fmt_s(rerun["delay"]),
         f"ttl {TTL:g} s, interval {INTERVAL:g} s, heartbeat {rerun['heartbeat_interval']:.2f} s",
         "", names[0], targets[names[0]]["result"]),
    ]
    if rerun["lease_left_at_kill"]:
        rows.append(("  of which: lease time left at the kill", fmt_s(rerun["lease_left_at_kill"]),
                     "ttl minus time since the last renewal", "", "", ""))
        rows.append(("  of which: deadline -> running again", fmt_s(rerun["deadline_to_running"]),
                     "wait for a pass + publish + delivery + start", "", "", ""))
    if rerun["largest_gap_between_passes"]:
        rows.append(("  gap between recovery passes after the kill (min / median / max)",
                     fmt_s(rerun["largest_gap_between_passes"]),
                     f"> {1.5 * INTERVAL:g} s (a turn refused) in {rerun['trials_with_a_skipped_pass']} "
                     f"of {len(rerun['trials'])} trials, after the deadline (rerun one interval "
                     f"later) in {rerun['trials_delayed_by_a_skipped_pass']}", "", "", ""))
    if rerun["kill_to_reacquired"]:
        rows.append(("  SIGKILL -> re-acquired at receipt (server clock)",
                     fmt_s(rerun["kill_to_reacquired"]), "", "", "", ""))
    n = pub["n"]
    rows.append((f"re-publish of {n:,} expired leases, store.recover() (median of {len(pub['rounds'])})",
                 f"{fmt_rate(pub['recover_median_per_s'])} ({pub['recover_median_s']:.2f} s)",
                 f"send_task x {n:,}: {fmt_rate(pub['send_task_median_per_s'])}",
                 f"{pub['ratio']:.2f}x", names[1], targets[names[1]]["result"]))
    ratios = pub["round_ratios"]
    if len(ratios) > 1:
        rows.append(("  ratio per round (wall clock)", ", ".join(f"{r:.2f}" for r in ratios),
                     "rounds alternate which goes first", "", "", ""))
    cpu = pub["cpu_us_per_message"]

    def cpu_cell(kind: str) -> str:
        c = cpu[kind]
        total = c["client"] + (c["redis"] or 0)
        return (f"{total:.0f} us" + (f" ({c['client']:.0f} client + {c['redis']:.0f} redis)"
                                     if c["redis"] is not None else " (client; redis not measured)"))

    rec_cpu = cpu["recover"]["client"] + (cpu["recover"]["redis"] or 0)
    plain_cpu = cpu["send_task"]["client"] + (cpu["send_task"]["redis"] or 0)
    rows.append(("  CPU per message (median)", cpu_cell("recover"), f"send_task: {cpu_cell('send_task')}",
                 f"{plain_cpu / rec_cpu:.2f}x", "", ""))
    rows.append(("  of which: publishing (Recoverer.publish)", f"{pub['publish_median_s']:.2f} s",
                 f"rest: store scripts, batches of {pub['batch']}: "
                 f"{pub['recover_median_s'] - pub['publish_median_s']:.2f} s", "", "", ""))

    return markdown_table(("measurement", "recovery", "baseline / detail", "ratio", "target", "result"),
                          rows)


# -- main ----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-recovery.json"),
                        help="where to write the raw results (default: %(default)s)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--trials", type=int, help="override the number of SIGKILL trials")
    parser.add_argument("-n", type=int, help="override the number of expired leases")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random pause before each "
                        "trial's send (default: %(default)s)")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.trials:
        sizes["trials"] = args.trials
    if args.n:
        sizes["n"] = args.n

    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    log_dir = Path(tempfile.mkdtemp(prefix="leases-bench-recovery-"))
    failed = True
    try:
        url, server = redis_url(cleanup)
        client = redis.Redis.from_url(url)
        cleanup.push(client.close)
        info = client.info("server")
        started = datetime.datetime.now(datetime.timezone.utc)
        host = client.connection_pool.connection_kwargs
        results: dict[str, Any] = {
            "meta": {
                "date": started.isoformat(timespec="seconds"),
                "quick": args.quick,
                "redis_version": info["redis_version"],
                "redis": f"{host.get('host')}:{host.get('port')}",
                "throwaway_server": server is not None,
                "python": platform.python_version(),
                "celery": celery.__version__, "kombu": kombu.__version__,
                "redis_py": redis.__version__,
                "cpus": os.cpu_count(),
                "machine": platform.platform(),
                "loadavg_start": loadavg(),
                **git_state(),
            },
        }
        print(f"recovery benchmark: redis {info['redis_version']} at {results['meta']['redis']}"
              f"{' (throwaway)' if server else ''}, {'quick' if args.quick else 'full'} run, "
              f"worker logs in {log_dir}", flush=True)
        print(f"SIGKILL -> running again, {sizes['trials']} trials:", flush=True)
        results["rerun"] = bench_rerun(url, client, sizes["trials"], log_dir, cleanup, args.seed)
        results["meta"]["loadavg_after_rerun"] = loadavg()
        print(f"re-publish of {sizes['n']:,} expired leases vs send_task, {sizes['rounds']} round(s):",
              flush=True)
        cpu = CpuMeter(server.process.pid if server is not None and server.process else None)
        results["republish"] = bench_republish(url, client, sizes["n"], sizes["rounds"],
                                               sizes["warmup"], cleanup, cpu)
        results["meta"]["loadavg_end"] = loadavg()
        results["meta"]["seconds"] = round(
            (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
        targets = results["targets"] = evaluate(results)
        failed = False
    finally:
        cleanup.run()
        if failed:
            print(f"benchmark failed; worker logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)  # worker logs and ready marks

    return report(results, targets, table(results, targets), args.json, args.strict)


if __name__ == "__main__":
    sys.exit(main())
