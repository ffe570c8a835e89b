"""The checker: invariants over the execution history and the state after settling.

Input is one run's data (``chaos.run.collect``): the submitted tasks, the
history events, the fault log, and per task the result-backend meta, the sink's
final value (and fence, in leases mode), the lease record (leases mode) and
whether its message is still in the broker.

What is counted, per task:

- **lost**: its waiter never returns: submitted, and after settling the result
  backend holds no ready state (SUCCESS, FAILURE, REVOKED) for it, whatever
  the reason. The rows below that also apply (still active, crash window, lost
  by the broker before receipt) say why; "lost" counts each such task too, since
  a caller blocked in ``AsyncResult.get()`` cannot tell the reasons apart.
- **still active**: not finished after settling, but a lease is active or
  recovering (leases mode) or its message is still in the broker (plain mode).
- **double-accepted**: more than one execution's outcome left the task
  (Celery's ``task_success``/``task_failure`` fired for two executions).
- **not newest token** (leases mode): an accepted outcome (history, lease
  record or backend value) whose token is not the newest token the task was given.
- **stale sink writes**: a sink write by an older owner that *started after* a
  newer owner's write had completed (leases: older = smaller token; plain:
  older = the execution of the earlier delivery of the message), or a final
  sink value that is not the newest owner's write.
- **backend disagrees**: the result backend's value is not the accepted outcome
  (leases: the lease record's state and token, and the sink's final value;
  plain: the sink's final value, i.e. the effect that stuck).
- **backend missing (crash window)**: leases mode only; the lease record holds
  an accepted outcome but the backend never got it, *and* the accepting
  process was SIGKILLed after its body ended and before Celery wrote the
  result, and recovery did not write the result the finish kept (docs/celery.md).
  Without such a kill it is counted under "backend disagrees".
- **malformed bodies run**: bodies that ran for a malformed message (a raw publish with
  a bad id or a non-integer ``lease_generation``/``retries`` header; ``seq`` < 0): such a
  message must be refused or parked, never run. An invariant in leases mode.
- **duplicates executed**: tasks whose body ran more than once. Allowed in
  both modes (a SIGSTOPped owner resumes and runs on: that is by design);
  only accepted duplicates are violations.

In leases mode every count except duplicates, failed and the documented
window is an invariant violation.
"""
from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from chaos.app import expected_result
from chaos.history import by_task, iter_lines

READY = ("SUCCESS", "FAILURE", "REVOKED")
TERMINAL = ("succeeded", "failed", "dead", "revoked")

#: Counts that break an invariant in leases mode.
INVARIANTS = ("lost", "still_active", "double_accepted", "not_newest_token",
              "stale_sink_writes", "backend_disagrees", "malformed_ran")

#: Fault-log entries that count as injected faults.
FAULT_KINDS = ("kill_worker", "kill_child", "stop_worker", "redis_restart", "redis_pause",
               "restart_worker", "lease_store_pause", "malformed", "broker_loss", "kill_sender")


@dataclass
class Report:
    mode: str
    seed: int
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    counts: Counter = field(default_factory=Counter)
    #: kind -> task ids
    offenders: dict = field(default_factory=dict)
    #: task id -> list of reasons
    reasons: dict = field(default_factory=dict)
    executions: Counter = field(default_factory=Counter)
    refused: int = 0
    settle_seconds: float | None = None
    settle_timeout: float = 0.0
    faults: Counter = field(default_factory=Counter)
    #: Workers that exited on their own (and were restarted by the harness's supervisor).
    worker_exits: int = 0
    #: Tasks that never finished (lost or still active): not in settle_seconds.
    unsettled: int = 0

    def add(self, kind: str, task_id: str, reason: str) -> None:
        """Record one finding; counts are of tasks (a task counts once per kind)."""
        offenders = self.offenders.setdefault(kind, [])
        if task_id not in offenders:
            offenders.append(task_id)
            self.counts[kind] += 1
        self.reasons.setdefault(task_id, []).append(f"{kind}: {reason}")

    @property
    def duplicates(self) -> int:
        return sum(n for runs, n in self.executions.items() if runs > 1)

    @property
    def extra_executions(self) -> int:
        return sum((runs - 1) * n for runs, n in self.executions.items() if runs > 1)

    def violations(self) -> dict[str, list[str]]:
        """Invariant violations (leases mode): kind -> task ids."""
        return {k: self.offenders[k] for k in INVARIANTS if self.offenders.get(k)}

    def as_dict(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "submitted": self.submitted,
                "succeeded": self.succeeded, "failed": self.failed, "dead": self.dead,
                "counts": dict(self.counts), "executions": {str(k): v for k, v in sorted(self.executions.items())},
                "duplicates": self.duplicates, "extra_executions": self.extra_executions,
                "refused": self.refused, "settle_seconds": self.settle_seconds,
                "unsettled": self.unsettled,
                "faults": dict(self.faults), "worker_exits": self.worker_exits,
                "offenders": self.offenders}


def _meta_result(meta: dict | None) -> Any:
    return (meta or {}).get("result")


def _sink_value(raw: Any) -> dict | None:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return {"unparsable": str(raw)[:200]}


def check(data: dict) -> Report:
    mode, seed = data["mode"], data["seed"]
    leased = mode == "leases"
    report = Report(mode, seed, settle_seconds=data.get("settle_seconds"),
                    settle_timeout=data.get("settle_timeout", 0.0))
    report.faults = Counter(f["what"] for f in data.get("fault_log", [])
                            if not f.get("skipped") and f["what"] in FAULT_KINDS)
    report.worker_exits = sum(1 for f in data.get("fault_log", []) if f["what"] == "worker_exited")
    history = by_task(data["history"])
    kills = [f for f in data.get("fault_log", []) if f["what"] in ("kill_worker", "kill_child")
             and not f.get("skipped")]
    final = data["final"]
    # Malformed messages are not tasks the run expects: none may run a body (seq < 0).
    for event in data["history"]:
        if event.get("ev") == "start" and int(event.get("seq", 0) or 0) < 0:
            report.add("malformed_ran", str(event.get("task")),
                       f"a body ran for a malformed message (exec {event.get('exec')})")
    finished_at: list[float] = []
    for task in data["tasks"]:
        task_id = task["id"]
        if task_id not in data["submitted"]:
            report.counts["not_submitted"] += 1
            continue
        report.submitted += 1
        events = history.get(task_id, [])
        _check_task(report, leased, task, events, final["backend"].get(task_id),
                    _sink_value(final["sink"].get(task_id, {}).get("value")),
                    final["sink"].get(task_id, {}).get("fence", 0),
                    final["records"].get(task_id), task_id in final["pending"], kills)
        finished_at.append(_finished_at(leased, final["backend"].get(task_id), final["records"].get(task_id)))
    report.settle_seconds = _settle_seconds(data, finished_at)
    report.unsettled = sum(1 for t in finished_at if t == float("inf"))
    return report


def _finished_at(leased: bool, meta: dict | None, record: dict | None) -> float:
    """When nothing more was going to happen to a task (epoch seconds; inf: never).

    Leases: the lease record's finish (server clock, same host); without a record,
    the result's. Plain: when the backend stored the result it kept.
    """
    if leased and record is not None:
        if record.get("state") in TERMINAL and record.get("finished_at"):
            return int(record["finished_at"]) / 1000.0
        return float("inf")
    if meta and meta.get("status") in READY and meta.get("date_done"):
        done = datetime.fromisoformat(str(meta["date_done"]))
        return (done if done.tzinfo else done.replace(tzinfo=timezone.utc)).timestamp()
    return float("inf")


def _settle_seconds(data: dict, finished_at: list[float]) -> float | None:
    """Seconds from the end of the fault window until the last task that finished did
    (the tasks that never finished are counted apart, in ``Report.unsettled``)."""
    window_end = data.get("window_end")
    done = [t for t in finished_at if t != float("inf")]
    if window_end is None or not done:
        return data.get("settle_seconds")
    return round(max(0.0, max(done) - float(window_end)), 2)


def _check_task(report: Report, leased: bool, task: dict, events: list[dict], meta: dict | None,
                sink: dict | None, fence: int, record: dict | None, pending: bool,
                kills: list[dict]) -> None:
    task_id = task["id"]
    starts = [e for e in events if e["ev"] == "start"]
    report.executions[len(starts)] += 1
    report.refused += sum(1 for e in events if e["ev"] == "refused")
    status = (meta or {}).get("status")
    state = (record or {}).get("state")

    if status == "SUCCESS":
        report.succeeded += 1
    elif status == "FAILURE":
        if leased and state == "dead":
            report.dead += 1
        else:
            report.failed += 1

    # -- lost / still active ------------------------------------------------------
    if status not in READY:
        if leased and state in ("active", "recovering"):
            report.add("still_active", task_id, f"lease still {state} after settling")
        elif leased and state in TERMINAL:
            _backend_missing(report, task_id, record, events, kills)
        elif pending:
            report.add("still_active", task_id, "message still in the broker after settling")
        elif not any(e["ev"] == "received" for e in events):
            # The broker lost it before any worker received it (broker_loss, or Redis
            # handed the message to a connection that had just died). Leases mode
            # re-publishes it from its queued record (publish tracking), so there
            # it is a broken promise like any loss. Counted on its own row.
            report.add("lost_before_receipt", task_id,
                       "never received by any worker, no message left in the broker: "
                       "lost by the broker before any worker could lease it")
        else:
            report.add("lost", task_id, f"no result, lease record {state or 'missing'}, "
                                        f"no message left in the broker")
        # Whatever the reason above, a caller waiting on the result never returns.
        report.add("lost", task_id, "its waiter never returns: no ready state in the backend "
                                    "after settling")
    elif leased and state in ("active", "recovering"):
        report.add("backend_disagrees", task_id, f"backend holds {status} while the lease is {state}")

    # -- accepted outcomes -------------------------------------------------------------
    accepted = [e for e in events if e["ev"] == "accepted"]
    accepting = {(e.get("exec"), e.get("state")) for e in accepted}
    if len(accepting) > 1:
        report.add("double_accepted", task_id,
                   f"{len(accepting)} outcomes accepted: " +
                   ", ".join(f"{s} of exec {x}" for x, s in sorted(accepting, key=str)))

    # -- tokens (leases) ----------------------------------------------------------------
    if leased:
        given = [int(e["token"]) for e in events if e["ev"] in ("received", "acquire", "start") and e.get("token")]
        if record and record.get("token"):
            given.append(int(record["token"]))
        newest = max(given, default=0)
        stale = sorted({int(e["token"]) for e in accepted if e.get("token") is not None
                        and int(e["token"]) != newest})
        if state in ("succeeded", "failed") and int(record.get("token", 0)) != newest:
            stale.append(int(record["token"]))
        result = _meta_result(meta)
        if status == "SUCCESS" and isinstance(result, dict) and int(result.get("token", -1)) != newest:
            stale.append(int(result.get("token", -1)))
        if stale:
            report.add("not_newest_token", task_id,
                       f"accepted token(s) {sorted(set(stale))}, newest token {newest}")

    # -- the sink ---------------------------------------------------------------------------
    writes = [e for e in events if e["ev"] == "write" and e.get("accepted")]
    # Who is the newer owner: leases, the larger token; plain, the later delivery (both are
    # decided at receipt: the lease is acquired there, and that is when the broker handed over).
    received_at = {e.get("delivery"): e["t"] for e in events if e["ev"] == "received"}
    delivered_at = {e.get("exec"): received_at.get(e.get("delivery"), e["t"]) for e in starts}

    def age(w: dict) -> float:
        return float(w.get("token") or 0) if leased else delivered_at.get(w.get("exec"), w["t0"])

    for newer in writes:
        late = [older for older in writes if age(older) < age(newer) and older["t0"] > newer["t1"]]
        if late:
            report.add("stale_sink_writes", task_id,
                       f"write of exec {late[0].get('exec')} (token {late[0].get('token')}) started "
                       f"after exec {newer.get('exec')} (token {newer.get('token')}), a newer owner, "
                       f"had written")
            break
    if writes:
        newest_write = max(writes, key=age)
        if sink is None:
            report.add("stale_sink_writes", task_id, "accepted sink writes, but the sink is empty")
        elif leased and int(fence) != int(newest_write.get("token") or 0):
            report.add("stale_sink_writes", task_id,
                       f"sink fence {fence}, newest accepted write token {newest_write.get('token')}")
        elif sink.get("exec") not in {w.get("exec") for w in writes if age(w) == age(newest_write)}:
            report.add("stale_sink_writes", task_id,
                       f"sink holds exec {sink.get('exec')}'s value, the newest write was exec "
                       f"{newest_write.get('exec')}'s")

    # -- the result backend against the accepted outcome ---------------------------------------
    if status == "SUCCESS":
        result = _meta_result(meta)
        if not isinstance(result, dict) or result.get("result") != expected_result(task["seq"]):
            report.add("backend_disagrees", task_id, f"backend result {result!r} is not "
                                                     f"{expected_result(task['seq'])!r}")
        elif leased and state != "succeeded":
            report.add("backend_disagrees", task_id, f"backend SUCCESS, lease record {state}")
        elif leased and int(result.get("token", -1)) != int(record.get("token", 0)):
            report.add("backend_disagrees", task_id, f"backend token {result.get('token')}, "
                                                     f"lease record token {record.get('token')}")
        elif sink is not None and sink.get("exec") != result.get("exec"):
            report.add("backend_disagrees", task_id, f"backend holds exec {result.get('exec')}'s "
                                                     f"result, the sink exec {sink.get('exec')}'s")
    elif status == "FAILURE" and leased and state not in ("failed", "dead"):
        report.add("backend_disagrees", task_id, f"backend FAILURE, lease record {state}")


def _backend_missing(report: Report, task_id: str, record: dict, events: list[dict],
                     kills: list[dict]) -> None:
    """The lease accepted an outcome the backend never got: the documented crash window, or a bug."""
    token = int(record.get("token") or 0)
    ends = [e for e in events if e["ev"] == "end" and int(e.get("token") or 0) == token]
    for end in ends:
        for kill in kills:
            if end["pid"] in kill.get("pids", []) and kill["t"] >= end["t"]:
                report.add("backend_missing_window", task_id,
                           f"outcome {record.get('state')} (token {token}) accepted; process "
                           f"{end['pid']} killed {kill['t'] - end['t']:.3f}s after the body ended, "
                           f"before the result was written")
                return
    report.add("backend_disagrees", task_id,
               f"lease record {record.get('state')} (token {token}) but no result in the backend, "
               f"and no kill explains it")


# -- output -------------------------------------------------------------------------------------


def _cell(report: Report | None, key: str) -> str:
    if report is None:
        return "-"
    plain = report.mode == "plain"
    if key == "duplicates":
        return f"{report.duplicates} ({report.extra_executions} extra runs)"
    if key == "executions":
        return " ".join(f"{runs}:{n}" for runs, n in sorted(report.executions.items()))
    if key == "settle":
        if report.settle_seconds is None:
            return f"> {report.settle_timeout:.0f} s (not settled)"
        never = f" ({report.unsettled} never finished)" if report.unsettled else ""
        return f"{report.settle_seconds:.1f} s{never}"
    if key == "not_newest_token" and plain:
        return "n/a (no tokens)"
    if key == "backend_missing_window" and plain:
        return "n/a"
    if key == "refused":
        return "n/a" if plain else str(report.refused)
    if key == "succeeded":
        return f"{report.succeeded}/{report.failed}/{report.dead}" if not plain else \
            f"{report.succeeded}/{report.failed}/-"
    if key == "submitted":
        return str(report.submitted)
    if key == "worker_exits":
        return str(report.worker_exits)
    return str(report.counts.get(key, 0))


ROWS = (
    ("submitted", "tasks submitted"),
    ("succeeded", "succeeded / failed / dead"),
    ("lost", "lost (waiter never returns)"),
    ("lost_before_receipt", "lost by the broker before receipt **"),
    ("still_active", "still active after settling"),
    ("double_accepted", "double-accepted outcomes"),
    ("not_newest_token", "accepted with an older token"),
    ("stale_sink_writes", "stale sink writes"),
    ("backend_disagrees", "backend disagrees with outcome"),
    ("backend_missing_window", "backend missing (crash window)"),
    ("malformed_ran", "bodies run for malformed messages"),
    ("executions", "executions per task (runs:tasks)"),
    ("duplicates", "duplicates executed *"),
    ("refused", "stale outcomes refused"),
    ("settle", "time to settle (after the faults)"),
    ("worker_exits", "workers that exited on their own"),
)


def table(reports: Iterable[Report]) -> str:
    """One table, the modes side by side."""
    reports = list(reports)
    by_mode = {r.mode: r for r in reports}
    modes = [m for m in ("leases", "plain") if m in by_mode]
    width = max(len(label) for _, label in ROWS) + 2
    cols = [max(24, *(len(_cell(by_mode[m], k)) + 2 for k, _ in ROWS)) for m in modes]
    header = "".ljust(width) + "".join(
        (f"{m} (celery-leases)" if m == "leases" else f"{m} (acks_late)").ljust(c) for m, c in zip(modes, cols))
    lines = [header, "-" * len(header)]
    for key, label in ROWS:
        lines.append(label.ljust(width) + "".join(_cell(by_mode[m], key).ljust(c) for m, c in zip(modes, cols)))
    seed = reports[0].seed if reports else "?"
    faults = reports[0].faults if reports else {}
    lines.append("")
    lines.append(f"seed {seed}; faults injected: " + ", ".join(f"{k} x{v}" for k, v in sorted(faults.items())))
    lines.append("* duplicates are by design when a timeout fires while the old process keeps running "
                 "(SIGSTOP past the ttl,")
    lines.append("  a redelivery after visibility_timeout): the body runs again; what must never happen "
                 "is a second accepted outcome.")
    lines.append("** never received by any worker, no message left in the broker: the broker lost it "
                 "(broker_loss, or a message")
    lines.append("   handed to a worker connection that had just died); leases mode re-publishes such "
                 "tasks (publish tracking, docs/chaos.md).")
    return "\n".join(lines)


def explain(data: dict, report: Report, task_ids: Iterable[str], limit: int = 5) -> str:
    """Full history of offending tasks, with the faults around them: enough to reproduce and debug."""
    history = by_task(data["history"])
    t0 = data.get("t0", 0.0)
    out = [f"seed {data['seed']}, mode {data['mode']}; reproduce with: {data.get('command', '?')}",
           f"run directory (logs, history, result.json): {data.get('run_dir', '?')}"]
    final = data["final"]
    tasks = {t["id"]: t for t in data["tasks"]}
    for task_id in list(task_ids)[:limit]:
        events = history.get(task_id, [])
        task = tasks.get(task_id, {})
        out.append("")
        out.append(f"== task {task_id} (seq {task.get('seq')}, {task.get('seconds')} s): "
                   + "; ".join(report.reasons.get(task_id, [])))
        if task_id in data["submitted"]:
            out.append(f"  submitted at {data['submitted'][task_id] - t0:.3f}s")
        else:
            out.append("  not submitted by the harness (a malformed message of the 'malformed' fault)")
        out.extend(iter_lines(events, since=t0))
        submitted = data["submitted"].get(task_id)
        if events or submitted:
            lo = min([e["t"] for e in events] + ([submitted] if submitted else [])) - 3
            hi = max([e["t"] for e in events] + ([submitted] if submitted else [])) + 3
            near = [f for f in data.get("fault_log", []) if lo <= f["t"] <= hi]
            for f in near:
                rest = {k: v for k, v in f.items() if k not in ("t", "rel", "what")}
                out.append(f"  {f['t'] - t0:9.3f}s  FAULT     {f['what']} {rest}")
        out.append(f"  lease record: {final['records'].get(task_id)}")
        out.append(f"  backend: {final['backend'].get(task_id)}")
        out.append(f"  sink: {final['sink'].get(task_id)}")
        out.append(f"  message still in broker: {task_id in final['pending']}")
    return "\n".join(out)
