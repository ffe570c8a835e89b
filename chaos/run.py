"""Run the chaos suite: ``python -m chaos.run --seed S --tasks N --duration D --mode both``.

One run per mode, with the same seed, so the same workload and fault schedule:

1. start three Redis servers on free ports: one for results and sink and one for the
   lease store alone (AOF on, ``appendfsync everysec``), one for the broker alone
   without persistence (the ``broker_loss`` fault restarts it empty), and N workers;
2. submit the tasks evenly over the fault window while the fault
   schedule runs against the workers and Redis;
3. at the end of the window, heal: resume stopped workers, unpause Redis, fill
   every worker slot;
4. wait until every task is finished (time to settle), then until nothing runs
   and the broker is drained;
5. collect the final state (result backend, sink, lease records, broker) and
   check it with the history (``chaos.checker``).

Prints the modes side by side. Exits 1 when an invariant is broken in leases mode,
after printing the seed and the offending tasks' full history.

``--scenario no-persistence`` runs the unsupported setup instead: leases on a
Redis *without* persistence, restarted once mid-run (docs/chaos.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from chaos import checker, senders
from chaos.app import (
    BACKEND_DB,
    BROKER_DB,
    QUEUE,
    SINK_DB,
    TASK_NAME,
    create_app,
    sink_resource,
)
from chaos.cluster import Cluster, pid_alive
from chaos.faults import Fault, ScheduleParams, make_schedule, make_workload
from chaos.history import read_history

logger = logging.getLogger("chaos.run")


@dataclass
class RunConfig:
    seed: int = 1
    tasks: int = 200
    duration: float = 60.0
    workers: int = 3
    ttl: float = 3.0
    #: Plain mode's visibility_timeout: shorter than the longest task (up to 10 s).
    visibility_timeout: float = 5.0
    prefetch: int = 2
    #: Seconds after the fault window within which every task must have finished.
    settle_timeout: float = 60.0
    #: Seconds to wait, once settled, for running duplicates to end and the broker to drain.
    quiet_timeout: float = 20.0
    out: Path | None = None

    def command(self, mode: str) -> str:
        return (f"python -m chaos.run --seed {self.seed} --tasks {self.tasks} "
                f"--duration {self.duration:g} --workers {self.workers} --mode {mode}")


# -- one run ----------------------------------------------------------------------------------


def run_mode(config: RunConfig, mode: str, *, scenario: str = "faults") -> tuple[dict, checker.Report]:
    """Run the workload under the fault schedule in one mode; returns (data, report)."""
    base = Path(config.out) if config.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    run_dir = base / f"{scenario}-{mode}-seed{config.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    tasks = make_workload(config.seed, config.tasks, config.duration)
    if scenario == "faults":
        schedule = make_schedule(config.seed, config.duration,
                                 ScheduleParams(workers=config.workers, ttl=config.ttl))
    else:
        # One fault: the lease Redis restarted mid-run, without persistence.
        schedule = [Fault(round(config.duration / 2, 2), "lease_redis_restart", seconds=0.5,
                          variant="graceful")]
    cluster = Cluster(run_dir, mode, config.workers, ttl=config.ttl,
                      visibility_timeout=config.visibility_timeout, prefetch=config.prefetch,
                      separate_lease_redis=True, lease_appendonly=scenario == "faults",
                      separate_broker_redis=scenario == "faults")
    logger.info("chaos %s/%s seed %s: %d tasks, %d faults, %d workers, run dir %s", scenario, mode,
                config.seed, len(tasks), len(schedule), config.workers, run_dir)
    app = submit_app = None
    data: dict[str, Any] = {}
    try:
        senders.prepare(cluster)
        cluster.start()
        app = create_app(cluster.client_env())
        submit_app = create_app(cluster.client_env(), results=False)
        submitted: dict[str, float] = {}
        t0 = time.time()
        cluster.t0 = t0
        window_end = t0 + config.duration
        stop = threading.Event()
        submitter = threading.Thread(target=_submit, args=(submit_app, tasks, t0, submitted, stop,
                                                           window_end + config.settle_timeout),
                                     name="chaos-submitter", daemon=True)
        faulter = threading.Thread(target=_run_faults, args=(cluster, schedule, t0, window_end),
                                   name="chaos-faults", daemon=True)
        submitter.start()
        faulter.start()
        faulter.join(max(0.0, window_end - time.time()) + 60)
        _sleep_until(window_end)
        cluster.heal()
        # A fault may outlast the window (a warm shutdown that needed its SIGKILL): the tasks
        # get their settle time from when every worker is up again.
        healed_at = time.time()
        submitter.join(config.settle_timeout)
        stop.set()
        settle = _wait_settled(app, mode, list(submitted), window_end, healed_at + config.settle_timeout)
        _wait_quiet(app, cluster, mode, config.quiet_timeout)
        with cluster.lock:  # the tasks the kill_sender faults committed join the workload
            tasks = tasks + list(cluster.sender_tasks)
            submitted.update(cluster.sender_submitted)
        final = collect(app, mode, [t.id for t in tasks])
        data = {
            "mode": mode, "seed": config.seed, "scenario": scenario,
            "config": {k: str(v) if isinstance(v, Path) else v
                       for k, v in dataclasses.asdict(config).items()},
            "command": config.command(mode) + ("" if scenario == "faults" else f" --scenario {scenario}"),
            "run_dir": str(run_dir), "t0": t0, "window_end": window_end,
            "tasks": [dataclasses.asdict(t) for t in tasks],
            "schedule": [f.as_dict() for f in schedule],
            "submitted": submitted, "fault_log": cluster.log,
            "settle_seconds": settle, "settle_timeout": config.settle_timeout,
            "history": read_history(cluster.history_dir), "final": final,
        }
    finally:
        for a in (app, submit_app):
            if a is not None:
                a.close()
        cluster.shutdown()
    (run_dir / "result.json").write_text(json.dumps(data, default=str))
    report = checker.check(data)
    (run_dir / "report.json").write_text(json.dumps(report.as_dict(), default=str, indent=1))
    return data, report


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))


def _submit(app: Any, tasks: list, t0: float, submitted: dict, stop: threading.Event,
            give_up_at: float) -> None:
    """Submit each task at its time, with its own id; retried (same id) through Redis faults."""
    policy = {"max_retries": 30, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 1.0}
    for task in tasks:
        _sleep_until(t0 + task.submit_at)
        while not stop.is_set():
            try:
                app.send_task(TASK_NAME, args=(task.seq, task.seconds), task_id=task.id,
                              retry=True, retry_policy=policy)
                submitted[task.id] = time.time()
                break
            except Exception as exc:  # noqa: BLE001 - Redis is down or paused: try again
                logger.warning("submit %s failed, retrying: %r", task.id, exc)
                if time.time() > give_up_at:
                    logger.error("submit %s: giving up", task.id)
                    break
                time.sleep(0.5)


def _run_faults(cluster: Cluster, schedule: list[Fault], t0: float, window_end: float) -> None:
    for fault in schedule:
        _sleep_until(t0 + fault.at)
        if time.time() >= window_end:
            break
        try:
            apply_fault(cluster, fault)
        except Exception as exc:
            cluster._record("fault_error", fault=fault.kind, error=repr(exc)[:300])
            logger.exception("fault %s failed", fault.describe())


def apply_fault(cluster: Cluster, fault: Fault) -> None:
    if fault.kind == "kill_worker":
        cluster.kill_worker(fault.slot, fault.seconds)
    elif fault.kind == "kill_child":
        cluster.kill_child(fault.slot, fault.pick)
    elif fault.kind == "stop_worker":
        cluster.stop_worker(fault.slot, fault.seconds)
    elif fault.kind == "redis_restart":
        cluster.redis_restart(fault.variant, fault.seconds, server=cluster.server(fault.server))
    elif fault.kind == "redis_pause":
        cluster.redis_pause(fault.seconds, server=cluster.server(fault.server))
    elif fault.kind == "lease_store_pause":
        cluster.lease_store_pause(fault.seconds)
    elif fault.kind == "malformed":
        cluster.publish_malformed(fault.variant, fault.pick)
    elif fault.kind == "restart_worker":
        cluster.restart_worker(fault.slot)
    elif fault.kind == "broker_loss":
        cluster.broker_loss(fault.seconds)
    elif fault.kind == "kill_sender":
        senders.kill_sender(cluster, fault.pick)
    elif fault.kind == "lease_redis_restart":
        assert cluster.lease_redis is not None
        cluster.redis_restart(fault.variant, fault.seconds, server=cluster.lease_redis)
    else:
        raise ValueError(f"unknown fault {fault.kind!r}")


# -- settling ------------------------------------------------------------------------------------


def _redis(app: Any, db: int) -> redis.Redis:
    """A database of the main Redis (results, sink); BROKER_DB: the broker, wherever it is."""
    url = app.conf.broker_url if db == BROKER_DB else f"{app.conf.result_backend.rsplit('/', 1)[0]}/{db}"
    return redis.Redis.from_url(url, socket_timeout=10)


def _finished(app: Any, mode: str, ids: list[str]) -> set[str]:
    """Ids nothing more will happen to: plain, a result is in the backend; leases, the lease
    record is terminal (or, without a record, a result is in the backend)."""
    backend = _redis(app, BACKEND_DB)
    keys = [app.backend.get_key_for_task(i) for i in ids]
    done = set()
    try:
        for i in range(0, len(ids), 500):
            for task_id, raw in zip(ids[i:i + 500], backend.mget(keys[i:i + 500])):
                if raw and json.loads(raw).get("status") in checker.READY:
                    done.add(task_id)
        if mode == "leases":
            import celery_leases
            store = celery_leases.store(app)
            pipe = store.client.pipeline(transaction=False)
            for task_id in ids:
                pipe.hget(store.keys.record(task_id), "state")
            for task_id, state in zip(ids, pipe.execute()):
                if state is None:
                    continue
                if state.decode() in checker.TERMINAL:
                    done.add(task_id)
                else:
                    done.discard(task_id)
    finally:
        backend.close()
    return done


def _wait_settled(app: Any, mode: str, ids: list[str], window_end: float, deadline: float) -> float | None:
    """Seconds from the end of the fault window until every submitted task finished (None: not
    by ``deadline``, epoch seconds)."""
    remaining = set(ids)
    while True:
        try:
            remaining -= _finished(app, mode, sorted(remaining))
        except redis.RedisError as exc:
            logger.warning("settle poll failed: %r", exc)
        if not remaining:
            return round(max(0.0, time.time() - window_end), 2)
        if time.time() > deadline:
            logger.warning("%d task(s) not finished %.0fs after the fault window", len(remaining),
                           deadline - window_end)
            return None
        time.sleep(0.5)


def _in_flight(cluster: Cluster) -> list[str]:
    """Executions that started, did not end, and whose process still lives."""
    ended = set()
    started = {}
    for e in read_history(cluster.history_dir):
        if e["ev"] == "start":
            started[e.get("exec")] = e
        elif e["ev"] == "end":
            ended.add(e.get("exec"))
    return [x for x, e in started.items() if x not in ended and pid_alive(e["pid"])]


def _wait_quiet(app: Any, cluster: Cluster, mode: str, timeout: float) -> None:
    """Until no execution runs and no message waits in the broker (plain: nor in unacked)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            waiting = pending_ids(app, include_unacked=mode == "plain")
        except redis.RedisError:
            waiting = {"?"}
        if not waiting and not _in_flight(cluster):
            break
        time.sleep(0.5)
    time.sleep(1.0)  # outcome signals fire just after the body's "end" event


# -- the final state ------------------------------------------------------------------------------


def pending_ids(app: Any, include_unacked: bool = True) -> set[str]:
    """Task ids whose message is still in the broker: queued, or (optionally) delivered but unacked."""
    broker = _redis(app, BROKER_DB)
    ids: set[str] = set()
    try:
        for key in broker.scan_iter(match=f"{QUEUE}*"):
            if broker.type(key) == b"list":
                for raw in broker.lrange(key, 0, -1):
                    ids.add(_message_id(raw))
        if include_unacked:
            for raw in broker.hvals("unacked"):
                try:
                    ids.add(_message_id(json.dumps(json.loads(raw)[0])))
                except (ValueError, IndexError, TypeError):
                    continue
    finally:
        broker.close()
    ids.discard("")
    return ids


def _message_id(raw: Any) -> str:
    try:
        return (json.loads(raw).get("headers") or {}).get("id", "")
    except (ValueError, AttributeError):
        return ""


def collect(app: Any, mode: str, ids: list[str]) -> dict:
    """Per task: the backend's meta, the sink's value (and fence), the lease record; the broker's leftovers."""
    backend_client = _redis(app, BACKEND_DB)
    sink_client = _redis(app, SINK_DB)
    backend: dict[str, Any] = {}
    sink: dict[str, Any] = {}
    records: dict[str, Any] = {}
    try:
        for task_id in ids:
            raw = backend_client.get(app.backend.get_key_for_task(task_id))
            backend[task_id] = json.loads(raw) if raw else None
        if mode == "leases":
            import celery_leases
            store = celery_leases.store(app)
            for task_id in ids:
                value, fence = celery_leases.fenced_get(sink_client, store.keys, sink_resource(task_id))
                sink[task_id] = {"value": value.decode() if value else None, "fence": fence}
                record = store.get(task_id)
                records[task_id] = dataclasses.asdict(record) if record else None
            stats = store.stats()
        else:
            for task_id in ids:
                value = sink_client.get(sink_resource(task_id))
                sink[task_id] = {"value": value.decode() if value else None, "fence": 0}
            stats = {}
    finally:
        backend_client.close()
        sink_client.close()
    return {"backend": backend, "sink": sink, "records": records,
            "pending": sorted(pending_ids(app, include_unacked=True) & set(ids)), "lease_stats": stats}


# -- both modes, and the unsupported scenario ------------------------------------------------------


def run_both(config: RunConfig, modes: tuple[str, ...] = ("leases", "plain")) -> list[tuple[dict, checker.Report]]:
    return [run_mode(config, mode) for mode in modes]


def summarize(results: list[tuple[dict, checker.Report]]) -> tuple[str, bool]:
    """The side-by-side table, and the explanation of leases-mode violations; (text, ok)."""
    reports = [r for _, r in results]
    text = [checker.table(reports)]
    for data, report in results:
        text.append(f"{report.mode}: {data.get('run_dir', '?')} (result.json, report.json, logs/, history/)")
    ok = True
    for data, report in results:
        if report.mode != "leases":
            continue
        violations = report.violations()
        if violations:
            ok = False
            text.append("")
            text.append(f"INVARIANTS BROKEN in leases mode (seed {report.seed}): " +
                        ", ".join(f"{k}: {len(v)}" for k, v in violations.items()))
            offenders = [t for ids in violations.values() for t in ids]
            text.append(checker.explain(data, report, dict.fromkeys(offenders)))
    return "\n".join(text), ok


def _wipe_time(events: list[dict], restart_at: float) -> float:
    """When the empty lease store took over: the first token, after the restart began, below
    one handed out before it (the counter started again). The restart is logged just before
    the server is stopped, so a lease can still be acquired from the old one after that."""
    highest = 0
    for e in events:
        if e["ev"] != "received" or not e.get("token"):
            continue
        token = int(e["token"])
        if e["t"] >= restart_at and token < highest:
            return e["t"]
        highest = max(highest, token)
    return restart_at


def no_persistence_summary(data: dict, report: checker.Report) -> str:
    """What the restart of a lease Redis without persistence lost, task by task."""
    restart = next((f for f in data["fault_log"] if f["what"] == "redis_restart"), None)
    events = data["history"]
    at = _wipe_time(events, restart["t"] if restart else float("inf"))
    received_before = {e["task"] for e in events if e["ev"] == "received" and e["t"] < at and e.get("token")}
    finished_before = {e["task"] for e in events if e["ev"] == "accepted" and e["t"] < at}
    at_risk = received_before - finished_before
    lost = set(report.offenders.get("lost", []))
    no_record = {t for t in report.offenders.get("backend_disagrees", [])
                 if data["final"]["records"].get(t) is None}
    tokens_before = [int(e["token"]) for e in events if e["ev"] == "received" and e.get("token") and e["t"] < at]
    tokens_after = [int(e["token"]) for e in events if e["ev"] == "received" and e.get("token") and e["t"] >= at]
    lines = [
        ("UNSUPPORTED SETUP: the lease store on a Redis without persistence (no AOF, no RDB), "
         f"restarted once at t={restart['rel'] if restart else '?'}s; broker, results and sink "
         "on a Redis with AOF."),
        (f"  tasks submitted: {report.submitted}; succeeded: {report.succeeded}; "
         f"dead: {report.dead}; lost: {len(lost)}"),
        (f"  leased by a worker before the restart and not finished by then: {len(at_risk)}; "
         f"lost among them: {len(lost & at_risk)}; lost among all other tasks: {len(lost - at_risk)}"),
        (f"  finished before the restart: {len(finished_before)}; their results are kept, their "
         f"lease records are gone ({len(no_record & finished_before)} of the 'backend disagrees' "
         "rows: a result, no lease record)"),
        (f"  token counter: highest token before the restart {max(tokens_before, default=0)}, "
         f"first tokens after it {sorted(tokens_after)[:3]} (the counter started again from 1)"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--mode", choices=("leases", "plain", "both"), default="both")
    parser.add_argument("--scenario", choices=("faults", "no-persistence"), default="faults")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease ttl (leases mode)")
    parser.add_argument("--settle-timeout", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    parser.add_argument("--check", type=Path, nargs="+", metavar="RESULT_JSON",
                        help="re-check saved runs (result.json of each mode) instead of running")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.check:
        results = []
        for path in args.check:
            data = json.loads(Path(path).read_text())
            results.append((data, checker.check(data)))
        text, ok = summarize(results)
        print(text)
        return 0 if ok else 1
    config = RunConfig(seed=args.seed, tasks=args.tasks, duration=args.duration, workers=args.workers,
                       ttl=args.ttl, out=args.out,
                       settle_timeout=args.settle_timeout or (
                           30.0 if args.scenario == "no-persistence" else max(90.0, args.duration / 2)))
    if args.scenario == "no-persistence":
        data, report = run_mode(config, "leases", scenario="no-persistence")
        print(checker.table([report]))
        print(no_persistence_summary(data, report))
        lost = report.offenders.get("lost", [])
        if lost:
            print(checker.explain(data, report, lost, limit=3))
        return 0
    modes = ("leases", "plain") if args.mode == "both" else (args.mode,)
    results = run_both(config, modes)
    text, ok = summarize(results)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
