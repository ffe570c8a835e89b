"""The lease store's server cost per task, counted in instructions (valgrind), beside kombu's.

Usage, from the repository root::

    .venv/bin/python bench/script_cost.py [-n 300] [--batch 4] [--json PATH] [--keep DIR] [--wall 5]

Wall-clock server time (``INFO commandstats``) moves by half on a shared
two-core machine; instructions do not. This starts a throwaway ``redis-server``
under ``valgrind --tool=callgrind``, and counts the instructions the server
executes for each phase of ``n`` tracked tasks (callgrind dumps its counts
before and after each phase, ``callgrind_control --dump``):

- ``enqueue``: the publish record (enqueue.lua), as tracking sends it;
- ``acquire``: the worker's acquires, ``--batch`` per ``acquire_many`` call,
  with the previous batch's start marks riding along (as the acquirer sends them);
- ``finish``: each task's finish, with the result record written in the same
  call (one Redis), and ``finish, no result``: without it (the lease store apart);
- ``finish, no result, in the background``: the same finishes ``--batch`` per
  ``finish_many`` call, as a threads worker's background finishes send them;
- the baselines, measured in the same run: kombu's Redis ack emulation for one
  message (``QoS.append``'s pipeline of ZADD + HSET at delivery, ``QoS.ack``'s
  ZREM + HDEL), which lease-held deliveries replace; Celery's own result write
  (SET with expiry + PUBLISH); a ``PING``; floors of the Lua runtime (an
  EVALSHA of ``return 1``, and one of a single ``redis.call``); and the floor
  of the scripts' design: the commands of the acquire (batched as above, with
  the marks) and of the finish without a result, run for their own tasks with
  the same keys and arguments but none of the scripts' Lua around them.

The table gives instructions per task and each phase's ratio against kombu's
ack bookkeeping. With ``--wall ROUNDS``, a second table reads the same in the
target's unit, the server's µs per task (``INFO commandstats`` of a plain
redis-server, alternated rounds): the lease's acquire and finish, their
commands alone, and those of a packed record (a design weighed, not built).
Instructions are not microseconds: the same run's ``PING`` and ``return 1``
calibrate them (see docs/benchmarks.md, "Lease store cost").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_leases import LeaseStore  # noqa: E402
from celery_leases.protocol.queued import QueuedTask, QueuedTasks  # noqa: E402
from celery_leases.protocol.transitions import FinishRequest, acquire_many_call, finish_call  # noqa: E402
from bench._common import git_state, markdown_table  # noqa: E402

BODY = b"x" * 300
TARGET_USEC = 50  # a lease's own server time per task (acquire + finish), docs/benchmarks.md
ENVELOPE = {"routing_key": "celery", "exchange": "", "headers": {"task": "bench.noop"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counted:
    """A redis-server under callgrind, its instruction counter read around each phase."""

    def __init__(self, out_dir: str, keep: bool = False) -> None:
        for tool in ("valgrind", "callgrind_control", "redis-server"):
            if shutil.which(tool) is None:
                raise SystemExit(f"script_cost: {tool} is not installed (apt-get install valgrind redis-server)")
        self.port, self.out_dir, self.dumps, self.keep = _free_port(), out_dir, 0, keep
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind",
             f"--callgrind-out-file={out_dir}/callgrind.%p.out",
             "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("script_cost: redis-server under valgrind did not start") from None
                time.sleep(0.2)

    def _control(self, *args: str) -> str:
        return subprocess.run(["callgrind_control", *args, str(self.proc.pid)], capture_output=True,
                              text=True, check=True).stdout

    def dump(self, name: str = "") -> int:
        """Instructions executed since the previous dump: callgrind writes them to a new file,
        whose ``summary:`` line is read once the file is complete. (The server is idle while it
        dumps, so each dump ends exactly where a phase's last reply left; switching
        instrumentation on and off instead takes effect late and can cut a phase short.)
        With ``keep``, a named phase's file stays, as ``script-cost.<name>.callgrind``, for
        ``callgrind_annotate`` (which functions of the server the phase's instructions ran in)."""
        self.dumps += 1
        path = Path(f"{self.out_dir}/callgrind.{self.proc.pid}.out.{self.dumps}")
        self._control(f"--dump=phase{self.dumps}")
        deadline = time.monotonic() + 60
        while True:
            text = path.read_text() if path.exists() else ""
            for line in text.splitlines():
                if line.startswith("summary:") or line.startswith("totals:"):
                    if self.keep and name:
                        kept = name.replace(" ", "-").replace(",", "")
                        path.rename(Path(self.out_dir) / f"script-cost.{kept}.callgrind")
                    else:
                        path.unlink()
                    return int(line.split()[1])
            if time.monotonic() > deadline:
                raise SystemExit(f"script_cost: callgrind wrote no {path}")
            time.sleep(0.05)

    def count(self, run: Callable[[], Any], name: str = "") -> int:
        """Instructions the server executed while ``run`` ran."""
        self.dump()
        run()
        return self.dump(name)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# The floor of the scripts as they are: the commands an acquire_many call and a finish
# without a result run for tracked tasks recorded at publish (the same keys and arguments,
# the same writes), with none of the Lua around them (no validation, no decisions).
# What the real phases cost above these is the scripts' own Lua.
ACQUIRE_COMMANDS = """
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = t[1] * 1000
for k = 1, m do
  local key = KEYS[6 * n + 1 + k]
  redis.call('HMGET', key, 'holder', 'progress_timeout', 'progress_deadline')
  redis.call('HSET', key, 'started', '1')
end
if m > 0 then redis.call('HINCRBY', KEYS[6 * n + 1], 'started', m) end
for i = 1, n do
  local kb, ab = 6 * (i - 1), 3 + m + 15 * (i - 1)
  redis.call('HMGET', KEYS[kb + 1], 'state', 'token', 'generation', 'recoveries', 'attempt', 'hn', 'pub')
  redis.call('ZSCORE', KEYS[kb + 2], ARGV[ab + 1])
  if i == 1 then redis.call('TYPE', KEYS[kb + 6]) end
  redis.call('HGET', KEYS[kb + 5], 'pub')
  local tok = redis.call('INCR', KEYS[kb + 3])
  redis.call('HSET', KEYS[kb + 1], 'state', 'active', 'token', tok, 'owner', ARGV[ab + 2],
             'holder', tok .. '@' .. ARGV[ab + 2], 'ttl', ARGV[ab + 3], 'acquired_at', now,
             'max_recoveries', ARGV[ab + 6], 'started', '0', 'h:0', tok .. '@' .. ARGV[ab + 2] .. '@' .. now,
             'hn', 1, 'pub', ARGV[ab + 13])
  redis.call('ZADD', KEYS[kb + 2], now + ARGV[ab + 3], ARGV[ab + 1])
  redis.call('HINCRBY', KEYS[kb + 4], 'acquired', 1)
  redis.call('ZREM', KEYS[kb + 6], ARGV[ab + 1])
end
return 1
"""
FINISH_COMMANDS = """
redis.call('HMGET', KEYS[1], 'state', 'token', 'owner')
local t = redis.call('TIME')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'finished_at', t[1] * 1000, 'holder', '')
redis.call('DEL', KEYS[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""


# A design weighed, not built: the lease's hot fields packed into one field of the record
# (token@owner, ttl, acquire time, counts), no per-task counters and no start mark's read.
# The same calls otherwise; its commands alone, as FLOOR's are.
PACKED_ACQUIRE_COMMANDS = """
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = t[1] * 1000
for k = 1, m do redis.call('HSET', KEYS[6 * n + 1 + k], 'started', '1') end
for i = 1, n do
  local kb, ab = 6 * (i - 1), 3 + m + 15 * (i - 1)
  redis.call('HMGET', KEYS[kb + 1], 'state', 'lease', 'pub')
  redis.call('ZSCORE', KEYS[kb + 2], ARGV[ab + 1])
  redis.call('HGET', KEYS[kb + 5], 'pub')
  local tok = redis.call('INCR', KEYS[kb + 3])
  redis.call('HSET', KEYS[kb + 1], 'state', 'active', 'started', '0',
             'lease', tok .. '@' .. ARGV[ab + 2] .. ' ' .. ARGV[ab + 3] .. ' ' .. now .. ' 0 0 0 3 1')
  redis.call('ZADD', KEYS[kb + 2], now + ARGV[ab + 3], ARGV[ab + 1])
  redis.call('ZREM', KEYS[kb + 6], ARGV[ab + 1])
end
return 1
"""
PACKED_FINISH_COMMANDS = """
redis.call('HMGET', KEYS[1], 'state', 'lease')
local t = redis.call('TIME')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'lease', t[1])
redis.call('DEL', KEYS[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _lifecycles(c: redis.Redis, store: LeaseStore, ids: list[str], batch: int,
                scripts: tuple[str, str] | None) -> None:
    """Acquire (``batch`` per call, the previous batch's marks riding along) and finish
    (no result) each of ``ids``: with the store's scripts (``scripts`` None), or with the
    two bare scripts of ``scripts`` (SHAs) given the same keys and arguments."""
    tokens: dict[str, int] = {}
    for k in range(0, len(ids), batch):
        reqs = [dict(task_id=i, owner="w1", name="bench.noop", body=BODY, envelope=ENVELOPE,
                     publish="p" + i, recorded=True) for i in ids[k:k + batch]]
        starts = {i: tokens.get(i, 1) for i in ids[max(0, k - batch):k]} if k else None
        if scripts is None:
            results, _ = store.acquire_many(reqs, owner="w1", starts=starts)
            tokens.update((i, acq.token) for i, acq in zip(ids[k:k + batch], results))
        else:
            keys, args = acquire_many_call(store, reqs, "w1", starts)
            c.evalsha(scripts[0], len(keys), *keys, *args)
    for i in ids:
        if scripts is None:
            store.finish(i, "w1", tokens[i], "succeeded")
        else:
            _, keys, args = finish_call(store, FinishRequest(i, "w1", 1, "succeeded"))
            c.evalsha(scripts[1], len(keys), *keys, *args)


def measure_wall(n: int, batch: int, rounds: int) -> dict[str, list[float]]:
    """Server time per task (``INFO commandstats``, the scripts' µs) of a lease's acquire and
    finish, of their commands alone, and of the packed design's commands alone: ``rounds``
    alternated rounds of ``n`` tasks each on a throwaway redis-server (no valgrind)."""
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                c.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit("script_cost: redis-server did not start") from None
                time.sleep(0.05)
        store = LeaseStore(c, prefix="wall")
        queued = QueuedTasks(store, 3600)
        kinds: dict[str, tuple[str, str] | None] = {
            "lease (acquire + finish, no result)": None,
            "floor: their commands alone": (c.script_load(ACQUIRE_COMMANDS), c.script_load(FINISH_COMMANDS)),
            "packed record, commands alone (weighed)": (c.script_load(PACKED_ACQUIRE_COMMANDS),
                                                        c.script_load(PACKED_FINISH_COMMANDS)),
        }
        out: dict[str, list[float]] = {name: [] for name in kinds}

        def script_usec() -> int:
            stats = c.info("commandstats")
            return sum(stats.get(k, {}).get("usec", 0) for k in ("cmdstat_evalsha", "cmdstat_eval"))

        for r in range(rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for name in order:
                ids = [uuid.uuid4().hex for _ in range(n)]
                for i in ids:  # (recorded at publish first, not counted: enqueue is its own phase)
                    queued.enqueue(QueuedTask(i, "bench.noop", BODY, ENVELOPE, publish="p" + i))
                before = script_usec()
                _lifecycles(c, store, ids, batch, kinds[name])
                out[name].append((script_usec() - before) / n)
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def measure(n: int, batch: int, out_dir: str, keep: bool = False) -> dict[str, float]:
    server = Counted(out_dir, keep)
    try:
        c = server.client
        store = LeaseStore(c, prefix="cost")
        queued = QueuedTasks(store, 60)
        ids = [uuid.uuid4().hex for _ in range(n)]
        bare = [uuid.uuid4().hex for _ in range(n)]
        warm = store.acquire("warm", "w1", body=BODY, envelope=ENVELOPE)   # scripts loaded outside
        store.finish("warm", "w1", warm.token, "succeeded", write=("cost:r:warm", "{}", 60))
        queued.enqueue(QueuedTask("warm2", "bench.noop", BODY, ENVELOPE))
        floor_ids = [uuid.uuid4().hex for _ in range(n)]
        grouped = [uuid.uuid4().hex for _ in range(n)]
        tokens: dict[str, int] = {}
        per: dict[str, float] = {}

        def enqueue() -> None:
            for i in ids + bare + floor_ids + grouped:
                queued.enqueue(QueuedTask(i, "bench.noop", BODY, ENVELOPE, publish="p" + i))

        def acquire(which: list[str]) -> Callable[[], None]:
            def run() -> None:
                for k in range(0, len(which), batch):
                    calls = [dict(task_id=i, owner="w1", name="bench.noop", body=BODY, envelope=ENVELOPE,
                                  publish="p" + i, recorded=True) for i in which[k:k + batch]]
                    starts = {i: tokens[i] for i in which[max(0, k - batch):k]} if k else None
                    results, _ = store.acquire_many(calls, owner="w1", starts=starts)
                    for i, acq in zip(which[k:k + batch], results):
                        tokens[i] = acq.token
            return run

        def finish(which: list[str], write: bool) -> Callable[[], None]:
            def run() -> None:
                for i in which:
                    result = json.dumps({"status": "SUCCESS", "result": None, "task_id": i})
                    store.finish(i, "w1", tokens[i], "succeeded",
                                 write=(f"celery-task-meta-{i}", result, 86400) if write else None)
            return run

        def finish_grouped() -> None:
            # The background finishes' write (worker/background.py): `batch` in one finish_many call.
            for k in range(0, len(grouped), batch):
                store.finish_many([FinishRequest(i, "w1", tokens[i], "succeeded") for i in grouped[k:k + batch]])

        def kombu_acks() -> None:
            # kombu.transport.redis.QoS.append and .ack, as Celery runs them per message.
            for i in ids:
                payload = json.dumps([{"body": "x" * 300, "headers": {"id": i}}, "", "celery"])
                with c.pipeline() as pipe:
                    pipe.zadd("unacked_index", {i: time.time()}).hset("unacked", i, payload).execute()
                with c.pipeline() as pipe:
                    pipe.zrem("unacked_index", i).hdel("unacked", i).execute()

        def result_writes() -> None:
            for i in ids:
                result = json.dumps({"status": "SUCCESS", "result": None, "task_id": i})
                c.set(f"plain-meta-{i}", result, ex=86400)
                c.publish(f"plain-meta-{i}", result)

        def pings() -> None:
            for _ in ids:
                c.ping()

        def floor(which: list[str]) -> Callable[[], None]:
            bare_scripts = (c.script_load(ACQUIRE_COMMANDS), c.script_load(FINISH_COMMANDS))
            return lambda: _lifecycles(c, store, which, batch, bare_scripts)

        one_call = c.script_load("return redis.call('EXISTS', KEYS[1])")
        empty = c.script_load("return 1")

        def lua_floor(sha: str) -> Callable[[], None]:
            def run() -> None:
                for i in ids:
                    c.evalsha(sha, 1, i)
            return run

        phases: list[tuple[str, Callable[[], None]]] = [
            ("enqueue", enqueue), ("acquire", acquire(ids)), ("finish", finish(ids, True)),
            ("finish, no result", finish(bare, False)),
            ("finish, no result, in the background (finish_many)", finish_grouped),
            ("kombu ack bookkeeping", kombu_acks), ("Celery result write", result_writes),
            ("PING", pings), ("EVALSHA return 1", lua_floor(empty)),
            ("EVALSHA, one redis.call", lua_floor(one_call)),
            ("floor: acquire + finish, commands alone", floor(floor_ids)),
        ]
        for name, run in phases:
            if name == "finish, no result":
                acquire(bare)()  # (not counted: the same acquires as above)
            if name.startswith("finish, no result, in the background"):
                acquire(grouped)()
            per[name] = server.count(run, name) / n
        per["enqueue"] /= 4  # it recorded every set of ids
        return per
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="tasks per phase (default 300)")
    parser.add_argument("--batch", type=int, default=4, help="acquires per acquire_many call (default 4)")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results-script-cost.json"))
    parser.add_argument("--keep", metavar="DIR", help="keep each phase's callgrind file in DIR "
                        "(script-cost.<phase>.callgrind) for callgrind_annotate")
    parser.add_argument("--wall", type=int, metavar="ROUNDS", default=0,
                        help="also read the server's µs per task (INFO commandstats, no valgrind) "
                        "in ROUNDS alternated rounds of 2,000 tasks")
    args = parser.parse_args(argv)
    out_dir = args.keep or os.environ.get("TMPDIR", "/tmp")
    per = measure(args.n, args.batch, out_dir, keep=bool(args.keep))
    base = per["kombu ack bookkeeping"]
    lease = per["acquire"] + per["finish, no result"]
    rows = [[name, f"{ir:,.0f}", f"{ir / base:.2f}"] for name, ir in per.items()]
    rows.append(["lease per task (acquire + finish, no result)", f"{lease:,.0f}", f"{lease / base:.2f}"])
    lua = lease - per["floor: acquire + finish, commands alone"]
    rows.append(["of which the scripts' Lua (lease per task - floor)", f"{lua:,.0f}", f"{lua / base:.2f}"])
    table = markdown_table(["phase (per task)", "instructions", "/ kombu acks"], rows)
    print(table)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": platform.platform(), "n": args.n, "batch": args.batch,
               "instructions_per_task": per, **git_state()}
    if args.wall:
        wall = measure_wall(2000, args.batch, args.wall)
        lease = statistics.median(wall["lease (acquire + finish, no result)"])
        rows = [[name, f"{statistics.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}",
                 f"{statistics.median(v) / lease:.2f}"] for name, v in wall.items()]
        print()
        print(markdown_table(["server time per task (scripts' µs, INFO commandstats)", "median",
                              "range", "/ lease"], rows))
        print(f"target: a lease's acquire + finish <= {TARGET_USEC} µs of server time per task: "
              f"{'PASS' if lease <= TARGET_USEC else 'MISS'} ({lease:.1f} µs)")
        results["usec_per_task"] = wall
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
