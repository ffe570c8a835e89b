"""The protocol's hand-written Redis I/O (celery_leases/protocol/transport/) against redis-py.

For each hand-written piece, the same calls made both ways on one throwaway
``redis-server``: the hand-written path as the store uses it, and redis-py's
(``client.evalsha``, or a pool connection's ``send_packed_command`` /
``read_response`` where the reply is read later). redis-py runs twice, in two
child processes: with hiredis (its C reply parser and command packer, from
``.hiredis/``, which ``make test`` fills: ``pip install --target .hiredis hiredis``)
and without (its Python parser). The hand-written direct path reads replies
with hiredis too when it is importable, with resp.py's Scanner otherwise, so it is
measured in both children.

Each figure is the median over ``--runs`` runs of the mean per call over
``--calls`` calls (the paths interleaved within a run): wall time of the round
trip, and this process's CPU time (what a worker pays). Prints one Markdown
table (docs/architecture.md, "Transport: hand-written against redis-py").

    python bench/transport.py [--runs 7] [--calls 2000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from bench._common import ROOT, Cleanup, markdown_table, redis_url, terminate  # noqa: E402
from celery_leases.protocol.queued import QueuedTask, QueuedTasks  # noqa: E402
from celery_leases.protocol.scripts import scripts  # noqa: E402
from celery_leases.protocol.store import LeaseStore  # noqa: E402
from celery_leases.protocol.transitions import AcquireRequest, acquire_call, acquire_many_call  # noqa: E402
from celery_leases.protocol.transport import DirectCaller, Incomplete, open_connection, parse  # noqa: E402

HIREDIS_DIR = ROOT / ".hiredis"
BODY = b"x" * 1024
ENVELOPE = {"headers": {"id": "x"}, "routing_key": "celery", "exchange": ""}
#: A reply the size of a recovery claim of 500 tasks with 1 KiB bodies.
BIG_REPLY = "local t = {} for i = 1, 500 do t[i] = string.rep('x', 1024) end return t"
BATCH = 20

ROWS = {
    "direct": "direct.py: one EVALSHA (acquire.lua, a new task, 1 KiB body)",
    "line": "line.py: an enqueue written before the publish, its reply read after (1 KiB body)",
    "pipelined": f"resp.py: the acquirer's acquire_many of {BATCH} on its own socket",
    "big": "resp.py / direct.py: one reply of 500 x 1 KiB (a recovery claim's size)",
}


# -- the child: one parser, every row ----------------------------------------------

def timed(fn: Callable[[int], None], calls: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per call of ``fn(i)`` over ``calls`` calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(calls):
        fn(i)
    w1, c1 = time.perf_counter(), time.process_time()
    return (w1 - w0) * 1e6 / calls, (c1 - c0) * 1e6 / calls


def child(url: str, runs: int, calls: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    store = LeaseStore(client, f"bench-transport-{uuid.uuid4().hex[:8]}", ttl=600)
    scripts.load_all()
    for script in (scripts.acquire, scripts.acquire_many, scripts.enqueue):
        client.script_load(script.source)
    big_sha = client.script_load(BIG_REPLY)
    direct = DirectCaller(client)
    tracked = QueuedTasks(store, 600)
    tracked.enqueue(QueuedTask("warm-up", "bench.noop", BODY, ENVELOPE))  # loads; send() may go now
    tracked.can_send()
    sock_conn = open_connection(client)
    sock = sock_conn._sock
    run_id = [0]

    def req(tag: str, i: int) -> AcquireRequest:
        return AcquireRequest(f"{tag}-{run_id[0]}-{i}", "bench-worker", name="bench.noop", body=BODY,
                              envelope=ENVELOPE)

    def direct_hand(i: int) -> None:
        _, keys, args = acquire_call(store, req("dh", i))
        direct.call(scripts.acquire.sha, keys, args)

    def direct_redis(i: int) -> None:
        _, keys, args = acquire_call(store, req("dr", i))
        client.evalsha(scripts.acquire.sha, len(keys), *keys, *args)

    def task(tag: str, i: int) -> QueuedTask:
        return QueuedTask(f"{tag}-{run_id[0]}-{i}", "bench.noop", BODY, ENVELOPE)

    def line_hand(i: int) -> None:
        pending = tracked.send(task("lh", i))
        assert pending is not None and pending.conn is tracked._line
        pending.result()

    def line_redis(i: int) -> None:
        keys, args = tracked.enqueue_call(task("lr", i))
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_command("EVALSHA", scripts.enqueue.sha, len(keys), *keys, *args))
            conn.read_response()  # (the message would be published between these two)
        finally:
            pool.release(conn)

    def pipelined_hand(i: int) -> None:
        reqs = [req(f"ph{i}", j) for j in range(BATCH)]
        sock.sendall(store.acquire_many_command([store.acquire_parts(r) for r in reqs]))
        buffer = bytearray()
        while True:
            buffer += sock.recv(65536)
            try:
                parse(buffer)
                return
            except Incomplete:
                continue

    def pipelined_redis(i: int) -> None:
        keys, args = acquire_many_call(store, [req(f"pr{i}", j) for j in range(BATCH)], "", None)
        client.evalsha(scripts.acquire_many.sha, len(keys), *keys, *args)

    def big_hand(i: int) -> None:
        direct.call(big_sha, (), ())

    def big_redis(i: int) -> None:
        client.evalsha(big_sha, 0)

    pairs = {"direct": (direct_hand, direct_redis, calls), "line": (line_hand, line_redis, calls),
             "pipelined": (pipelined_hand, pipelined_redis, max(1, calls // BATCH)),
             "big": (big_hand, big_redis, max(1, calls // 20))}
    out: dict[str, Any] = {row: {"hand": [], "redis": []} for row in pairs}
    run_id[0] = -1
    for hand, red, _ in pairs.values():  # one warm-up call each, not counted
        hand(0), red(0)
    for run in range(runs):
        run_id[0] = run
        for row, (hand, red, n) in pairs.items():
            out[row]["hand"].append(timed(hand, n))
            out[row]["redis"].append(timed(red, n))
    keys = list(client.scan_iter(match=f"*{store.keys.prefix}*", count=1000))
    for k in range(0, len(keys), 1000):
        client.unlink(*keys[k:k + 1000])
    return {"hiredis": redis.utils.HIREDIS_AVAILABLE, "calls": {r: p[2] for r, p in pairs.items()},
            "rows": out}


# -- the parent: a server, two children, one table -----------------------------------

def run_child(url: str, runs: int, calls: int, hiredis: bool) -> dict[str, Any]:
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != HIREDIS_DIR]
    if hiredis:
        path.insert(0, str(HIREDIS_DIR))
    env["PYTHONPATH"] = os.pathsep.join(path)
    out = subprocess.run([sys.executable, __file__, "--child", url, "--runs", str(runs), "--calls", str(calls)],
                         env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["hiredis"] != hiredis:
        raise RuntimeError(f"the child {'with' if hiredis else 'without'} hiredis ran with "
                           f"hiredis={result['hiredis']} (is {HIREDIS_DIR} filled? make test fills it)")
    return result


def median(samples: list, index: int) -> float:
    return statistics.median(s[index] for s in samples)


def cell(samples: list) -> str:
    return f"{median(samples, 0):.1f} ({median(samples, 1):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.runs, args.calls)))
        return 0
    signal.signal(signal.SIGTERM, terminate)
    cleanup = Cleanup()
    try:
        url, _ = redis_url(cleanup)
        fast = run_child(url, args.runs, args.calls, hiredis=True) if (HIREDIS_DIR / "hiredis").is_dir() else None
        slow = run_child(url, args.runs, args.calls, hiredis=False)
    finally:
        cleanup.run()
    header = ["hand-written piece (same calls both ways)", "calls/run",
              "hand-written, µs/call (CPU)", "redis-py + hiredis", "redis-py, Python parser",
              "redis-py + hiredis costs, CPU"]
    rows = []
    for key, title in ROWS.items():
        hand = (fast or slow)["rows"][key]["hand"]
        hand_cell = cell(hand) + ("" if fast else " (no hiredis)")
        if fast and key in ("direct", "big"):  # its reader is hiredis here; resp.py's Scanner without it
            hand_cell += f"; {cell(slow['rows'][key]['hand'])} with resp.py's reader"
        with_hiredis = fast["rows"][key]["redis"] if fast else None
        extra = f"{median(with_hiredis, 1) - median(hand, 1):+.1f} µs" if with_hiredis else "-"
        rows.append([title, str(slow["calls"][key]), hand_cell, cell(with_hiredis) if with_hiredis else "-",
                     cell(slow["rows"][key]["redis"]), extra])
    table = markdown_table(header, rows)
    print(f"Median of {args.runs} runs; wall µs per call, this process's CPU µs in brackets; "
          f"one throwaway redis-server on loopback.\n")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"hiredis": fast, "python": slow}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
