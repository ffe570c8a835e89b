"""Benchmark of publish tracking: publisher throughput with tracking over without, in one run.

Usage, from the repository root::

    .venv/bin/python bench/tracking.py [--tasks N] [--runs R] [--group G] [--json PATH] [--strict]

Starts a throwaway ``redis-server`` (or uses ``$REDIS_URL``): the broker in db 0,
the lease store in db 2. One process publishes ``N`` leased no-op tasks with
``apply_async`` (``leases_delivery_timeout`` on: each publish is recorded in the
lease store first, one script call) and ``N`` with tracking off, alternating
in slices of 100 (so both see the same load on a shared machine), ``R`` runs;
the broker queue and the store are emptied between runs. No worker runs: this
is the publisher's cost alone. Prints each run's rates (and the publishing thread's
CPU per task, which a machine shared with other work disturbs less) and the
median and spread of the ratio (target >= 0.85), and the store's memory per
queued task (it holds the serialized message), for no-op, small and 10 KiB
arguments (``MEMORY USAGE`` of the record, the message and the index entry). ``--group G`` publishes the tasks as groups
of ``G`` (``group(...).apply_async``): tracking records a group's members in one batch.

Exit code 0 unless the run fails; with ``--strict`` also 1 when the target is missed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

import celery_leases  # noqa: E402
from bench._common import Cleanup, redis_url  # noqa: E402

TARGET = 0.85


def make_app(url: str, prefix: str, tracking: bool) -> Celery:
    base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
    app = Celery("bench_tracking", broker=f"{base}/0", backend=None)
    app.conf.update(task_default_queue=prefix, leases_redis_url=f"{base}/2", leases_key_prefix=prefix,
                    leases_delivery_timeout=600.0 if tracking else 0, task_ignore_result=True)
    celery_leases.install(app)

    @app.task(base=celery_leases.LeasedTask, name="bench.noop", shared=False)
    def noop(i: int) -> None:
        return None

    return app


#: Each run alternates the two apps in slices this big, so both see the same machine load
#: (the benchmark machine may be shared: a load that drifts within a run cancels out).
SLICE = 100


def publish_rates(apps: dict, n: int, group_size: int = 0) -> dict:
    """Tasks per second of each app (True: tracking on), publishing ``n`` each in alternating slices
    (as groups of ``group_size`` when set), and the publishing thread's CPU per task (µs)."""
    from celery import group
    elapsed = dict.fromkeys(apps, 0.0)
    cpu = dict.fromkeys(apps, 0.0)
    tasks = {k: app.tasks["bench.noop"] for k, app in apps.items()}
    with apps[True].producer_or_acquire() as on, apps[False].producer_or_acquire() as off:
        producers = {True: on, False: off}
        for k in apps:
            tasks[k].apply_async((0,), producer=producers[k])  # connections and scripts warm
        for start in range(0, n, SLICE):
            for k in (True, False) if start // SLICE % 2 else (False, True):
                began, began_cpu = time.perf_counter(), time.thread_time()
                if group_size:
                    for g in range(start, min(n, start + SLICE), group_size):
                        group(tasks[k].s(i) for i in range(g, min(n, start + SLICE, g + group_size))
                              ).apply_async(producer=producers[k])
                else:
                    for i in range(start, min(n, start + SLICE)):
                        tasks[k].apply_async((i,), producer=producers[k])
                elapsed[k] += time.perf_counter() - began
                cpu[k] += time.thread_time() - began_cpu
    return {k: n / elapsed[k] for k in apps}, {k: cpu[k] / n * 1e6 for k in apps}


#: Arguments of the tasks whose queued footprint is measured: a small one, and 10 KiB.
MEMORY_ARGS = {"small (one int)": 7, "10 KiB (one str)": "x" * 10240}


def memory_per_task(app: Celery, store, prefix: str, arg, n: int = 200) -> dict:
    """Bytes a queued task holds in the lease store (``MEMORY USAGE ... SAMPLES 0``, mean of
    ``n``): its record, its message (body + envelope) and its share of the queued index."""
    task = app.tasks["bench.noop"]
    with app.producer_or_acquire() as producer:
        ids = [task.apply_async((arg,), producer=producer).id for _ in range(n)]
    client, keys = store.client, store.keys
    record = sum(client.memory_usage(keys.record(t), samples=0) or 0 for t in ids) / n
    message = sum(client.memory_usage(keys.message(t), samples=0) or 0 for t in ids) / n
    index = (client.memory_usage(keys.shard(0).queued, samples=0) or 0) / client.zcard(keys.shard(0).queued)
    for key in store.client.scan_iter(match=f"{{{prefix}}}:*", count=1000):
        store.client.delete(key)
    return {"record": record, "message": message, "index": index, "total": record + message + index}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results-tracking.json")
    parser.add_argument("--group", type=int, default=0, help="publish as groups of this size")
    parser.add_argument("--strict", action="store_true")
    args = parser.parse_args()
    cleanup = Cleanup()
    try:
        url, _ = redis_url(cleanup)
        prefix = f"bench-tracking-{uuid.uuid4().hex[:8]}"
        apps = {True: make_app(url, prefix, True), False: make_app(url, prefix + "-off", False)}
        store = celery_leases.store(apps[True])
        broker = apps[True].connection_for_write().default_channel.client
        rows, ratios, cpu_ratios = [], [], []
        memory = None
        for run in range(args.runs):
            rates, cpu = publish_rates(apps, args.tasks, args.group)
            if memory is None:
                used = sum(store.client.memory_usage(k) or 0 for k in store.client.scan_iter(
                    match=f"{{{prefix}}}:*", count=1000))
                memory = used / (args.tasks + 1)
            broker.delete(prefix, prefix + "-off")
            for key in store.client.scan_iter(match=f"{{{prefix}}}:*", count=1000):
                store.client.delete(key)
            ratios.append(rates[True] / rates[False])
            cpu_ratios.append(cpu[False] / cpu[True])
            rows.append((run + 1, rates[False], rates[True], ratios[-1], cpu[False], cpu[True], cpu_ratios[-1]))
        app_on = apps[True]
        footprint = {name: memory_per_task(app_on, store, prefix, arg) for name, arg in MEMORY_ARGS.items()}
        app_on.connection_for_write().default_channel.client.delete(prefix)
        median = statistics.median(ratios)
        how = f"groups of {args.group}" if args.group else "apply_async"
        print(f"publisher throughput, {args.tasks} leased no-op tasks per run ({how}, one process)\n")
        print("| run | tracking off (tasks/s) | tracking on (tasks/s) | on / off | CPU/task off | CPU/task on "
              "| CPU off / on |")
        print("|---|---|---|---|---|---|---|")
        for run, off, on, ratio, cpu_off, cpu_on, cpu_ratio in rows:
            print(f"| {run} | {off:,.0f} | {on:,.0f} | {ratio:.3f} | {cpu_off:,.0f} µs | {cpu_on:,.0f} µs "
                  f"| {cpu_ratio:.3f} |")
        print(f"\non/off ratio: median {median:.3f}, spread {min(ratios):.3f}..{max(ratios):.3f} "
              f"over {len(ratios)} runs (target >= {TARGET})")
        print(f"publisher CPU per task, off/on: median {statistics.median(cpu_ratios):.3f}, "
              f"spread {min(cpu_ratios):.3f}..{max(cpu_ratios):.3f}")
        print(f"lease store memory per queued task (all keys / tasks, no-op args): {memory:,.0f} bytes\n")
        print("| task arguments | record | message (body + envelope) | queued index entry | per queued task |")
        print("|---|---|---|---|---|")
        for name, f in footprint.items():
            print(f"| {name} | {f['record']:,.0f} B | {f['message']:,.0f} B | {f['index']:,.0f} B "
                  f"| {f['total']:,.0f} B |")
        args.json.write_text(json.dumps({"group": args.group, "runs": rows, "median_ratio": median,
                                         "min_ratio": min(ratios), "max_ratio": max(ratios), "target": TARGET,
                                         "median_cpu_ratio": statistics.median(cpu_ratios),
                                         "bytes_per_queued_task": memory, "footprint": footprint}, indent=2))
        return 1 if args.strict and median < TARGET else 0
    finally:
        cleanup.run()


if __name__ == "__main__":
    sys.exit(main())
