"""Scale benchmark: 100,000 active leases of 50 workers on one Redis (or a local cluster).

Usage, from the repository root::

    .venv/bin/python bench/scale.py [--quick] [--json PATH] [--cluster [--shards N]]

Starts a throwaway ``redis-server`` on a free loopback port (no persistence),
or uses ``$REDIS_URL`` if set (then only keys under fresh prefixes are touched
and deleted afterwards, and the memory and CPU figures, which are server-wide,
also count the other clients of that server). ``--cluster`` starts a
throwaway local Redis Cluster of three masters instead
(``celery_leases.testing.cluster.RedisClusterServer``) and shards the store over
its slots (``LeaseStore(..., shards=N)``). Prints one Markdown table and
writes the raw results as JSON (default ``bench/results-scale.json``, which
git ignores). Exit status 1 when a target is missed.

What is measured, from one client process, sequentially:

- **Set-up.** N active leases (100,000; ``--quick``: 1,000) held by W
  simulated workers (owners; 50, ``--quick``: 10), N / W each, every one
  made by ``LeaseStore.acquire`` with the message a worker stores: the body
  and envelope of a real Celery message (sent through kombu's in-memory
  transport and read back as a worker receives it, about 550 B of body and
  1,150 B of envelope), each with its own task id. The store's ttl is 600 s, so
  nothing expires while the run lasts.
- **Heartbeat.** T ticks (5; ``--quick``: 2); in a tick every worker renews
  all its leases with one ``LeaseStore.renew_many`` call, as the heartbeat
  does. Per call: wall time in this client, Redis time inside the script
  (``INFO commandstats``, EVALSHA) and Redis process CPU (``INFO cpu``, user
  + system, so also the reading and parsing of the call's arguments); beside
  it, the least a renewal must do: one plain ``ZADD`` of the same members
  into a copy of the deadline index, in one round trip. A tick
  is the W calls in turn: achievable ticks per second from one client is one
  over the median tick, and Redis CPU per tick bounds what one Redis core
  serves. The derived target: at the default settings (ttl 30 s, heartbeat
  every 10 s) a tick must fit in its interval.
- **Memory per active lease.** ``MEMORY USAGE ... SAMPLES 0`` of the record
  hash and of the stored message hash of a sample of leases (2,000; all in
  ``--quick``), plus the lease's share of the deadline index (every sorted
  set under the prefix, divided by N). Separately, ``INFO memory``
  ``used_memory`` after the set-up minus before it, divided by N (this
  includes the message and Redis's own per-key overhead). Target: under
  1 KiB per lease plus the stored message.
- **Recovery.** 10% of the workers (5 of 50, so 10,000 leases) die: their
  last ``renew_many`` sets a ttl of 1 ms, so all their leases expire at
  once while the other workers' stay live. After the deadlines passed on the
  server clock, one timed ``LeaseStore.recover`` pass with a cheap publish
  that still does a broker's round trip: it LPUSHes the raw message (task id
  and stored body) to a list on the same Redis, one call per message (a real
  Celery publish costs more: ``bench/recovery.py``). Then every dead lease
  must be in the list exactly once, in state recovering with generation 1,
  and only the live ones left in the deadline index. Three rounds, five more
  workers dying each time (``--quick``: one round of one worker); the time
  spent in the store's calls and in the publish is reported apart. Target:
  10,000 leases recovered in under 2 s (the worst round).

The machine's load average is recorded; on a shared machine the times are
noisy (see docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import kombu  # noqa: E402

from celery_leases import LeaseStore, defaults  # noqa: E402
from celery_leases.protocol.records import Claim  # noqa: E402
from celery_leases.recovery.messages import envelope_of  # noqa: E402
from bench._common import (  # noqa: E402
    Cleanup, delete_keys, delete_pattern, git_state, markdown_table, redis_url, report, terminate,
)

#: Sizes of a full run and of a ``--quick`` smoke run.
FULL = {"leases": 100_000, "owners": 50, "ticks": 5, "dead_owners": 5, "rounds": 3,
        "memory_sample": 2_000}
QUICK = {"leases": 1_000, "owners": 10, "ticks": 2, "dead_owners": 1, "rounds": 1,
         "memory_sample": 2_000}

#: Targets from the issue.
MEMORY_TARGET_B = 1024
RECOVER_TARGET_N, RECOVER_TARGET_S = 10_000, 2.0
#: The derived heartbeat target: a tick of every worker fits in the default heartbeat interval.
DEFAULT_HEARTBEAT_S = defaults.TTL / 3

#: Lease ttl of the run: long enough that no live lease expires while it lasts.
TTL_S = 600.0
TASK = "proj.emails.send_welcome_email"


# -- the stored message ----------------------------------------------------------

def template_message() -> tuple[str, bytes, str]:
    """(task id, body, envelope JSON) of one real Celery message of a typical task.

    Sent with ``send_task`` through kombu's in-memory transport and read back
    as a worker receives it; the envelope is what the worker's acquire stores.
    """
    app = celery.Celery("proj", broker="memory://")
    kwargs = {
        "template": "welcome-v3", "locale": "en-GB",
        "context": {"first_name": "Alexandra", "last_name": "Montgomery-Smith",
                    "email": "alexandra.montgomery-smith@example.com", "plan": "team-annual",
                    "seats": 12, "referrer": "newsletter-2026-11",
                    "utm": {"source": "email", "medium": "newsletter", "campaign": "winter-promo"},
                    "features": ["sso", "audit-log", "priority-support", "api-access"],
                    "signup_ip": "203.0.113.42", "signup_at": "2026-11-29T13:06:29Z"},
    }
    try:
        result = app.send_task(TASK, args=(48213977, "acct_7f3a9c2e"), kwargs=kwargs, queue="scale")
        with app.connection_for_read() as conn:
            message = kombu.Queue("scale")(conn.default_channel).get(no_ack=True)
    finally:
        app.close()
    if message is None:
        raise RuntimeError("the template message did not come back from the memory transport")
    return result.id, message.body, json.dumps(envelope_of(message), separators=(",", ":"))


# -- redis bookkeeping (one server or every master of a cluster) -------------------

def node_infos(client: Any, section: str) -> list[dict]:
    """INFO ``section`` of the server, or of every master of a cluster."""
    if hasattr(client, "nodes_manager"):
        from redis.cluster import RedisCluster
        raw = client.info(section, target_nodes=RedisCluster.PRIMARIES)
        if raw and all(isinstance(v, dict) for v in raw.values()):
            return list(raw.values())
        return [raw]
    return [client.info(section)]


def redis_cpu_s(client: Any) -> float:
    return sum(i["used_cpu_user"] + i["used_cpu_sys"] for i in node_infos(client, "cpu"))


def used_memory(client: Any) -> int:
    return sum(int(i["used_memory"]) for i in node_infos(client, "memory"))


def script_usec(client: Any) -> tuple[int, int]:
    """(calls, usec) of EVALSHA + EVAL, summed over the nodes."""
    calls = usec = 0
    for info in node_infos(client, "commandstats"):
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            if name in info:
                calls += int(info[name]["calls"])
                usec += int(info[name]["usec"])
    return calls, usec


def prefix_keys(client: Any, prefix: str, type_: str | None = None) -> list[str]:
    """Keys of a store prefix, whatever its sharding (tags ``{prefix}`` and ``{prefix:N}``).

    Not the keys of other prefixes that merely begin the same way (the
    warm-up's ``{prefix-warm}``, the publish list's ``{prefix-published}``).
    """
    own = re.compile(r"\{" + re.escape(prefix) + r"(:\d+)?\}")
    keys = {k.decode() if isinstance(k, bytes) else k
            for k in client.scan_iter(match="{" + prefix + "*", count=1000, _type=type_)}
    return sorted(k for k in keys if own.match(k))


def wait_server_past(store: LeaseStore, deadline_ms: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while store.server_time_ms() <= deadline_ms:
        if time.monotonic() > end:
            raise RuntimeError(f"the server clock did not pass {deadline_ms} ms within {timeout:g} s")
        time.sleep(0.005)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- the measurements ----------------------------------------------------------

def populate(store: LeaseStore, leases: int, owners: int) -> tuple[dict[str, dict[str, int]], dict]:
    """``leases`` acquired by ``owners`` owners; returns {owner: {task id: token}} and timings."""
    template_id, body, envelope_json = template_message()
    per_owner = leases // owners
    held: dict[str, dict[str, int]] = {}
    start = time.perf_counter()
    for w in range(owners):
        owner = f"scale-worker-{w:02d}:{os.getpid()}"
        mine = held[owner] = {}
        for _ in range(per_owner):
            task_id = str(uuid.uuid4())
            envelope = json.loads(envelope_json.replace(template_id, task_id))
            a = store.acquire(task_id, owner, name=TASK, body=body, envelope=envelope)
            if not a.owned:
                raise RuntimeError(f"set-up: acquire of {task_id} by {owner} returned {a.code.name}")
            mine[task_id] = a.token
        if (w + 1) % max(1, owners // 5) == 0:
            print(f"  set-up: {(w + 1) * per_owner:,} leases acquired", flush=True)
    seconds = time.perf_counter() - start
    n = per_owner * owners
    return held, {"leases": n, "owners": owners, "per_owner": per_owner, "seconds": seconds,
                  "acquire_per_s": n / seconds, "body_bytes": len(body),
                  "envelope_bytes": len(envelope_json)}


def bench_memory(client: Any, store: LeaseStore, prefix: str, held: dict[str, dict[str, int]],
                 sample: int, used_before: int, seed: int) -> dict:
    """MEMORY USAGE of records, messages and the deadline index; used_memory delta per lease."""
    used_after = used_memory(client)
    ids = [t for leases in held.values() for t in leases]
    n = len(ids)
    picked = random.Random(seed).sample(ids, min(sample, n))
    record = [int(client.memory_usage(store.keys.record(t), samples=0)) for t in picked]
    message = [int(client.memory_usage(store.keys.message(t), samples=0)) for t in picked]
    zsets = prefix_keys(client, prefix, "zset")
    indexed = sum(int(client.zcard(k)) for k in zsets)
    if indexed != n:
        raise RuntimeError(f"{n} leases acquired, {indexed} in the deadline index ({zsets})")
    index_bytes = sum(int(client.memory_usage(k, samples=0)) for k in zsets)
    record_mean = statistics.mean(record)
    message_mean = statistics.mean(message)
    index_share = index_bytes / n
    per_lease_used = (used_after - used_before) / n
    return {
        "sampled": len(picked),
        "record_mean_b": record_mean, "record_max_b": max(record),
        "record_encoding": _decode(client.object("encoding", store.keys.record(picked[0]))),
        "message_mean_b": message_mean, "message_max_b": max(message),
        "message_encoding": _decode(client.object("encoding", store.keys.message(picked[0]))),
        "index_keys": zsets, "index_bytes": index_bytes, "index_share_b": index_share,
        "index_encoding": _decode(client.object("encoding", zsets[0])),
        "per_lease_without_message_b": record_mean + index_share,
        "per_lease_with_message_b": record_mean + index_share + message_mean,
        "used_memory_before": used_before, "used_memory_after": used_after,
        "used_memory_per_lease_b": per_lease_used,
        "used_memory_per_lease_without_message_b": per_lease_used - message_mean,
    }


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def bench_heartbeat(client: Any, store: LeaseStore, held: dict[str, dict[str, int]], ticks: int) -> dict:
    """``ticks`` heartbeat ticks: every owner renews all its leases in one renew_many call."""
    # One untimed tick first: the allocator and the client warm up.
    for owner, leases in held.items():
        store.renew_many(owner, leases)
    tick_s: list[float] = []
    call_ms: list[float] = []
    client_cpu_ms: list[float] = []
    calls0, usec0 = script_usec(client)
    cpu0 = redis_cpu_s(client)
    for _ in range(ticks):
        tick_start = time.perf_counter()
        for owner, leases in held.items():
            c0, t0 = time.process_time(), time.perf_counter()
            lost = store.renew_many(owner, leases)
            call_ms.append((time.perf_counter() - t0) * 1000)
            client_cpu_ms.append((time.process_time() - c0) * 1000)
            if lost:
                raise RuntimeError(f"renew_many of {owner} lost {len(lost)} leases: {list(lost.items())[:3]}")
        tick_s.append(time.perf_counter() - tick_start)
    cpu = redis_cpu_s(client) - cpu0
    calls1, usec1 = script_usec(client)
    # The INFO calls in between are not scripts; the script calls are exactly ours (a sharded
    # store makes one per shard a call touches).
    n_calls = ticks * len(held)
    if calls1 - calls0 < n_calls:
        raise RuntimeError(f"{n_calls} renew_many calls made, the server counted {calls1 - calls0} scripts")
    per_owner = len(next(iter(held.values())))
    zadd_ms = zadd_baseline(client, store, held)
    median_tick = statistics.median(tick_s)
    redis_cpu_per_tick = cpu / ticks
    return {
        "ticks": ticks, "calls": n_calls, "leases_per_call": per_owner, "owners": len(held),
        "call_median_ms": statistics.median(call_ms), "call_max_ms": max(call_ms),
        "zadd_median_ms": statistics.median(zadd_ms), "zadd_max_ms": max(zadd_ms),
        "client_cpu_per_call_ms": statistics.median(client_cpu_ms),
        "script_per_call_ms": (usec1 - usec0) / n_calls / 1000,
        "scripts_per_call": (calls1 - calls0) / n_calls,
        "redis_cpu_per_call_ms": cpu / n_calls * 1000,
        "tick_median_s": median_tick, "tick_max_s": max(tick_s),
        "ticks_per_s": 1 / median_tick,
        "calls_per_s": len(held) / median_tick,
        "redis_cpu_per_tick_s": redis_cpu_per_tick,
        "redis_bound_ticks_per_s": 1 / redis_cpu_per_tick if redis_cpu_per_tick > 0 else None,
        "default_interval_s": DEFAULT_HEARTBEAT_S,
        "redis_share_at_default_interval": redis_cpu_per_tick / DEFAULT_HEARTBEAT_S,
    }


def zadd_baseline(client: Any, store: LeaseStore, held: dict[str, dict[str, int]]) -> list[float]:
    """Wall ms of one plain ZADD per owner of its leases' new deadlines, into a copy of the index.

    The least any renewal must do, in the same run. The copy (ZUNIONSTORE, same
    hash tag, so same slot) has the index's size, so each ZADD updates members
    of a sorted set as large as the real one; with a sharded store it is a
    copy of the largest shard's index, and one ZADD covers all of an owner's
    leases in one slot.
    """
    zsets = prefix_keys(client, store.keys.prefix, "zset")
    source = max(zsets, key=lambda k: int(client.zcard(k)))
    copy = source + "-baseline"
    client.zunionstore(copy, [source])
    try:
        out = []
        for leases in held.values():
            deadline = store.server_time_ms() + int(TTL_S * 1000)
            mapping = dict.fromkeys(leases, deadline)
            t0 = time.perf_counter()
            client.zadd(copy, mapping)
            out.append((time.perf_counter() - t0) * 1000)
        return out
    finally:
        client.delete(copy)


def raw_publish(client: Any, queue: str) -> Callable[[Claim], None]:
    """A cheap publish that still does a broker's round trip: LPUSH the raw message to a list.

    The list item is the task id, a newline, and the stored body as it was
    received; the envelope (already decoded by ``claim_expired``) is not sent.
    """
    def publish(claim: Claim) -> None:
        client.lpush(queue, claim.task_id.encode() + b"\n" + claim.body)
    return publish


class PhaseTimer:
    """Wall time spent in named methods of one store instance (wrapped on the instance only)."""

    def __init__(self, store: LeaseStore, names: tuple[str, ...]) -> None:
        self.seconds = dict.fromkeys(names, 0.0)
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            setattr(store, name, self._wrap(name, getattr(store, name)))
        self.store, self.names = store, names

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed

    def remove(self) -> None:
        for name in self.names:
            delattr(self.store, name)


def recovery_round(client: Any, store: LeaseStore, dead: dict[str, dict[str, int]], live: int,
                   queue: str) -> dict:
    """The ``dead`` owners die at once; one timed recovery pass re-publishes their leases."""
    expected = {t for leases in dead.values() for t in leases}
    for owner, leases in dead.items():
        # The owner's last heartbeat: a ttl of 1 ms, as if it then died.
        lost = store.renew_many(owner, leases, ttl=0.001)
        if lost:
            raise RuntimeError(f"the last renew_many of {owner} lost {len(lost)} leases")
    wait_server_past(store, store.server_time_ms() + 2)
    delete_keys(client, [queue])
    inner = raw_publish(client, queue)
    publish_s = 0.0

    def publish(claim: Claim) -> None:
        nonlocal publish_s
        t0 = time.perf_counter()
        inner(claim)
        publish_s += time.perf_counter() - t0

    # A sharded store lists due leases shard by shard (expired_by_shard) instead of expired().
    phases = PhaseTimer(store, tuple(n for n in ("expired", "expired_by_shard", "claim_expired",
                                                   "mark_published") if hasattr(store, n)))
    cpu0 = redis_cpu_s(client)
    start = time.perf_counter()
    try:
        result = store.recover(publish=publish)
    finally:
        seconds = time.perf_counter() - start
        phases.remove()
    cpu = redis_cpu_s(client) - cpu0
    if result.recovered != len(expected) or result.dead or result.publish_failed or result.errors:
        raise RuntimeError(f"recovery of {len(expected)} leases reported {result.as_dict()} "
                           f"{result.errors[:3]}")
    published = [raw.split(b"\n", 1)[0].decode() for raw in client.lrange(queue, 0, -1)]
    if len(published) != len(expected) or set(published) != expected:
        raise RuntimeError(f"{len(expected)} leases recovered, {len(published)} messages published, "
                           f"{len(set(published) & expected)} of them the dead workers' tasks")
    indexed = sum(int(client.zcard(k)) for k in prefix_keys(client, store.keys.prefix, "zset"))
    if indexed != live:
        raise RuntimeError(f"after recovery {indexed} leases in the deadline index, expected the "
                           f"{live} live ones")
    sample = random.Random(0).sample(sorted(expected), min(200, len(expected)))
    states = {(r.state, r.generation) for r in store.records(sample)}
    if states != {("recovering", 1)}:
        raise RuntimeError(f"recovered leases are in (state, generation) {states}, expected recovering, 1")
    return {"n": len(expected), "live_left": live, "seconds": seconds,
            "per_s": len(expected) / seconds, "publish_s": publish_s,
            "phases_s": phases.seconds, "phase_calls": phases.calls, "redis_cpu_s": cpu}


def bench_recovery(client: Any, store: LeaseStore, held: dict[str, dict[str, int]], dead_owners: int,
                   rounds: int, queue: str) -> dict:
    """``rounds`` times, ``dead_owners`` more owners die at once and one pass recovers their leases."""
    owners = list(held)
    live = sum(len(v) for v in held.values())
    runs = []
    for r in range(rounds):
        dead = {o: held[o] for o in owners[r * dead_owners:(r + 1) * dead_owners]}
        live -= sum(len(v) for v in dead.values())
        runs.append(recovery_round(client, store, dead, live, queue))
        print(f"  recovery round {r + 1}/{rounds}: {runs[-1]['n']:,} leases in "
              f"{runs[-1]['seconds']:.2f} s", flush=True)
    times = [x["seconds"] for x in runs]
    median = statistics.median(times)
    mid = sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2]
    return {"n": runs[0]["n"], "dead_owners": dead_owners, "runs": runs, "median_s": median,
            "worst_s": max(times), "per_s": runs[0]["n"] / median, "median_run": mid,
            "batch": store.settings.recover_batch}


# -- report ------------------------------------------------------------------

def fmt_b(x: float) -> str:
    return f"{x:,.0f} B"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def evaluate(results: dict) -> dict[str, dict]:
    mem, hb, rec = results["memory"], results["heartbeat"], results["recovery"]
    targets: dict[str, dict] = {}
    targets[f"memory per lease without the message < {MEMORY_TARGET_B:,} B (MEMORY USAGE)"] = {
        "measured": fmt_b(mem["per_lease_without_message_b"]),
        "result": verdict(mem["per_lease_without_message_b"] < MEMORY_TARGET_B)}
    targets[f"memory per lease < {MEMORY_TARGET_B:,} B + the message (used_memory)"] = {
        "measured": f"{fmt_b(mem['used_memory_per_lease_b'])} = "
                    f"{fmt_b(mem['used_memory_per_lease_without_message_b'])} + {fmt_b(mem['message_mean_b'])}",
        "result": verdict(mem["used_memory_per_lease_without_message_b"] < MEMORY_TARGET_B)}
    name = f"recovery of {RECOVER_TARGET_N:,} < {RECOVER_TARGET_S:g} s"
    if rec["n"] >= RECOVER_TARGET_N:
        targets[name] = {"measured": f"worst of {len(rec['runs'])}: {rec['worst_s']:.2f} s",
                         "result": verdict(rec["worst_s"] < RECOVER_TARGET_S)}
    else:
        targets[name] = {"measured": f"not run at this size ({rec['n']:,})", "result": "SKIP"}
    targets[f"a tick of all workers fits the default heartbeat interval ({DEFAULT_HEARTBEAT_S:g} s; derived)"] = {
        "measured": f"max tick {hb['tick_max_s']:.2f} s",
        "result": verdict(hb["tick_max_s"] < DEFAULT_HEARTBEAT_S)}
    return targets


def table(results: dict, targets: dict[str, dict]) -> str:
    setup, mem, hb, rec = results["setup"], results["memory"], results["heartbeat"], results["recovery"]
    mid = rec["median_run"]
    t_mem, t_used, t_rec, t_hb = list(targets)
    rows: list[tuple[str, ...]] = [
        (f"set-up: {setup['leases']:,} leases acquired by {setup['owners']} workers",
         f"{setup['seconds']:.1f} s", f"{setup['acquire_per_s']:,.0f} acquires/s; message "
         f"{setup['body_bytes']} B body + {setup['envelope_bytes']} B envelope", "", ""),
        (f"renew_many of {hb['leases_per_call']:,} leases (median / max)",
         f"{hb['call_median_ms']:.1f} / {hb['call_max_ms']:.1f} ms",
         f"ZADD of {hb['leases_per_call']:,}: {hb['zadd_median_ms']:.1f} / {hb['zadd_max_ms']:.1f} ms "
         f"(ratio {hb['call_median_ms'] / hb['zadd_median_ms']:.1f}x)", "", ""),
        ("  in Redis, and in this client, per call", "",
         f"in {hb['scripts_per_call']:g} script(s) {hb['script_per_call_ms']:.1f} ms; "
         f"Redis CPU {hb['redis_cpu_per_call_ms']:.1f} ms; "
         f"client CPU {hb['client_cpu_per_call_ms']:.1f} ms", "", ""),
        (f"heartbeat tick: {hb['owners']} calls (median / max of {hb['ticks']})",
         f"{hb['tick_median_s']:.2f} / {hb['tick_max_s']:.2f} s",
         f"{hb['ticks_per_s']:.2f} ticks/s = {hb['calls_per_s']:.0f} calls/s from one client",
         t_hb, targets[t_hb]["result"]),
        ("  Redis CPU per tick",
         f"{hb['redis_cpu_per_tick_s']:.2f} s",
         f"one core serves {hb['redis_bound_ticks_per_s'] or 0:.1f} ticks/s; "
         f"{hb['redis_share_at_default_interval']:.1%} of a core at one tick per "
         f"{hb['default_interval_s']:g} s", "", ""),
        ("memory per lease: record (MEMORY USAGE, mean)", fmt_b(mem["record_mean_b"]),
         f"{mem['record_encoding']}; max {fmt_b(mem['record_max_b'])}; {mem['sampled']:,} sampled", "", ""),
        ("  + share of the deadline index", fmt_b(mem["index_share_b"]),
         f"{len(mem['index_keys'])} sorted set(s), {mem['index_encoding']}, {mem['index_bytes'] / 1e6:.1f} MB",
         "", ""),
        ("  = per lease without the message", fmt_b(mem["per_lease_without_message_b"]), "",
         t_mem, targets[t_mem]["result"]),
        ("  stored message (MEMORY USAGE, mean)", fmt_b(mem["message_mean_b"]),
         f"{mem['message_encoding']}; with it {fmt_b(mem['per_lease_with_message_b'])} per lease", "", ""),
        ("used_memory delta / leases", fmt_b(mem["used_memory_per_lease_b"]),
         f"without the message {fmt_b(mem['used_memory_per_lease_without_message_b'])}; "
         f"{(mem['used_memory_after'] - mem['used_memory_before']) / 2**20:.0f} MiB in all",
         t_used, targets[t_used]["result"]),
        (f"recovery pass: {rec['n']:,} expired at once ({rec['dead_owners']} dead workers; "
         f"median / worst of {len(rec['runs'])})",
         f"{rec['median_s']:.2f} / {rec['worst_s']:.2f} s",
         f"{rec['per_s']:,.0f}/s; {mid['live_left']:,} live leases left indexed; Redis CPU "
         f"{mid['redis_cpu_s']:.2f} s", t_rec, targets[t_rec]["result"]),
        ("  of which: publish (one LPUSH of the raw message each)", f"{mid['publish_s']:.2f} s",
         "the median round", "", ""),
        ("  of which: store calls (list due, claim, confirm)",
         f"{sum(mid['phases_s'].values()):.2f} s",
         "; ".join(f"{k.lstrip('_')} {v:.2f} s x {mid['phase_calls'][k]}"
                   for k, v in mid["phases_s"].items() if mid["phase_calls"][k]), "", ""),
    ]
    return markdown_table(("measurement", "value", "detail", "target", "result"), rows)


# -- main ----------------------------------------------------------------------

def start_cluster(cleanup: Cleanup) -> tuple[Any, str]:
    """A throwaway local Redis Cluster of three masters, and a client of it."""
    try:
        from celery_leases.testing.cluster import RedisClusterServer
    except ImportError:
        raise SystemExit("bench/scale.py --cluster: celery_leases.testing.cluster.RedisClusterServer is not "
                         "available in this version of the package") from None
    cluster = RedisClusterServer(masters=3)
    cleanup.push(cluster.stop)
    cluster.start()
    return cluster.client(), cluster.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--cluster", action="store_true",
                        help="run on a throwaway local Redis Cluster of three masters")
    parser.add_argument("--shards", type=int, default=None,
                        help="store shards (default: 1; 12 with --cluster, 4 x the masters as docs/cluster.md advises)")
    parser.add_argument("--json", default=None,
                        help="where to write the raw results (default: bench/results-scale.json, "
                             "bench/results-scale-cluster.json with --cluster)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the memory sample")
    parser.add_argument("--leases", type=int, default=None, help="active leases (default: 100,000)")
    parser.add_argument("--owners", type=int, default=None, help="simulated workers (default: 50)")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.leases is not None:
        sizes["leases"] = args.leases
    if args.owners is not None:
        sizes["owners"] = args.owners
        sizes["dead_owners"] = max(1, args.owners // 10)
    if sizes["owners"] < sizes["dead_owners"] * sizes["rounds"] + 1 or sizes["leases"] < sizes["owners"]:
        parser.error(f"--owners {sizes['owners']} and --leases {sizes['leases']}: need at least "
                     f"{sizes['dead_owners'] * sizes['rounds'] + 1} owners and one lease per owner")
    shards = args.shards if args.shards is not None else (12 if args.cluster else 1)
    if shards < 1:
        parser.error(f"--shards must be at least 1, got {shards}")
    json_path = args.json or str(ROOT / "bench" / ("results-scale-cluster.json" if args.cluster
                                                   else "results-scale.json"))

    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    try:
        server = None
        if args.cluster:
            client, url = start_cluster(cleanup)
        else:
            url, server = redis_url(cleanup)
            client = redis.Redis.from_url(url, single_connection_client=True)
            cleanup.push(client.close)
        prefix = f"scale{uuid.uuid4().hex[:8]}"
        queue = f"{{{prefix}-published}}:queue"
        store_kwargs: dict[str, Any] = {"ttl": TTL_S}
        if shards > 1:
            store_kwargs["shards"] = shards
        store = LeaseStore(client, prefix, **store_kwargs)

        def clean() -> None:
            delete_pattern(client, "{" + prefix + "*")
            delete_keys(client, [queue])

        cleanup.push(clean)
        version = node_infos(client, "server")[0]["redis_version"]
        started = datetime.datetime.now(datetime.timezone.utc)
        results: dict[str, Any] = {"meta": {
            "date": started.isoformat(timespec="seconds"), "quick": args.quick,
            "command": " ".join([Path(sys.executable).name, "bench/scale.py", *(argv or sys.argv[1:])]),
            **git_state(),
            "redis_version": version, "redis": url if args.cluster else url.rsplit("@", 1)[-1],
            "cluster": args.cluster, "shards": shards,
            "throwaway_server": args.cluster or server is not None,
            "python": platform.python_version(), "redis_py": redis.__version__,
            "celery": celery.__version__, "cpus": os.cpu_count(), "machine": platform.platform(),
            "loadavg_before": loadavg(),
        }}
        print(f"scale benchmark: redis {version} at {results['meta']['redis']}"
              f"{' (cluster, %d shards)' % shards if args.cluster else ''}"
              f"{' (throwaway)' if server else ''}, {'quick' if args.quick else 'full'} run; "
              f"load average {results['meta']['loadavg_before']}", flush=True)

        # Warm-up on a prefix of its own: script cache and client, before the memory baseline.
        warm = LeaseStore(client, f"{prefix}-warm", **store_kwargs)
        a = warm.acquire("warm", "warm-owner", ttl=0.001)
        warm.renew_many("warm-owner", {"warm": a.token}, ttl=0.001)
        wait_server_past(warm, warm.server_time_ms() + 2)
        warm.recover(publish=lambda claim: None)
        used_before = used_memory(client)

        held, results["setup"] = populate(store, sizes["leases"], sizes["owners"])
        results["memory"] = bench_memory(client, store, prefix, held, sizes["memory_sample"],
                                         used_before, args.seed)
        print("  memory measured; heartbeat ticks", flush=True)
        results["heartbeat"] = bench_heartbeat(client, store, held, sizes["ticks"])
        print("  heartbeat measured; recovery", flush=True)
        results["recovery"] = bench_recovery(client, store, held, sizes["dead_owners"],
                                              sizes["rounds"], queue)
        results["meta"]["loadavg_after"] = loadavg()
        results["meta"]["seconds"] = round(
            (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
        targets = results["targets"] = evaluate(results)
    finally:
        cleanup.run()

    code = report(results, targets, table(results, targets), json_path, strict=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
