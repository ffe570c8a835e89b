"""The chaos checker and schedule, on synthetic histories (no Redis, no workers).

A checker that never fires proves nothing: each invariant is shown to catch
the history that breaks it, and to stay quiet on a clean one.
"""
from __future__ import annotations

import copy
import json

import pytest

from chaos import checker
from chaos.app import expected_result
from chaos.faults import KINDS, MALFORMED, ScheduleParams, make_schedule, make_workload


def event(ev, t, **fields):
    return {"ev": ev, "t": t, "task": "a", "worker": "w0g1", "pid": fields.pop("pid", 100), **fields}


def clean_run(mode="leases"):
    """Task "a": received with token 5, ran once, wrote the sink, outcome accepted and stored."""
    token = 5 if mode == "leases" else 0
    value = {"seq": 1, "result": expected_result(1), "token": token, "exec": "e1", "worker": "w0g1", "pid": 100}
    return {
        "mode": mode, "seed": 0, "t0": 0.0,
        "tasks": [{"seq": 1, "id": "a", "seconds": 1.0, "submit_at": 0.0}],
        "submitted": {"a": 0.0},
        "fault_log": [],
        "history": [
            event("received", 0.1, token=token if mode == "leases" else None, delivery="d1", pid=10),
            event("start", 0.2, exec="e1", token=token, delivery="d1"),
            event("write", 1.2, exec="e1", token=token, t0=1.2, t1=1.25, accepted=True),
            event("end", 1.3, exec="e1", token=token),
            event("accepted", 1.4, exec="e1", token=token, state="SUCCESS"),
        ],
        "final": {
            "backend": {"a": {"status": "SUCCESS", "result": value}},
            "sink": {"a": {"value": json.dumps(value), "fence": token}},
            "records": {"a": {"state": "succeeded", "token": token}} if mode == "leases" else {},
            "pending": [],
        },
    }


def counts(data):
    report = checker.check(data)
    return {k: v for k, v in report.counts.items() if v}


@pytest.mark.parametrize("mode", ["leases", "plain"])
def test_a_clean_history_breaks_nothing(mode):
    assert counts(clean_run(mode)) == {}


def test_a_second_accepted_outcome_is_reported():
    data = clean_run()
    data["history"] += [event("start", 2.0, exec="e2", token=6, delivery="d2"),
                        event("accepted", 3.0, exec="e2", token=6, state="SUCCESS")]
    found = counts(data)
    assert found["double_accepted"] == 1
    assert found["not_newest_token"] == 1  # token 5 was accepted although 6 was given


def test_a_stale_sink_write_after_a_newer_one_is_reported():
    data = clean_run()
    data["history"] += [event("start", 0.5, exec="e0", token=4, delivery="d0"),
                        event("write", 2.0, exec="e0", token=4, t0=2.0, t1=2.1, accepted=True)]
    assert counts(data)["stale_sink_writes"] == 1


def test_a_sink_fence_behind_the_newest_accepted_write_is_reported():
    data = clean_run()
    data["final"]["sink"]["a"]["fence"] = 4
    assert counts(data)["stale_sink_writes"] == 1


def test_plain_mode_orders_owners_by_delivery():
    # Delivery d1 (earlier) runs e1, which writes *after* e2 of the later delivery d2 wrote
    data = clean_run("plain")
    data["history"] = [
        event("received", 0.1, delivery="d1", pid=10),
        event("start", 0.2, exec="e1", token=0, delivery="d1"),
        event("received", 5.0, delivery="d2", pid=11),
        event("start", 5.1, exec="e2", token=0, delivery="d2"),
        event("write", 6.0, exec="e2", token=0, t0=6.0, t1=6.1, accepted=True),
        event("write", 9.0, exec="e1", token=0, t0=9.0, t1=9.1, accepted=True),
    ]
    assert counts(data)["stale_sink_writes"] == 1


def test_a_task_without_result_lease_or_message_is_lost():
    data = clean_run()
    data["final"]["backend"]["a"] = None
    data["final"]["records"]["a"] = None
    assert counts(data) == {"lost": 1}


@pytest.mark.parametrize("where", ["lease", "broker"])
def test_a_task_still_leased_or_queued_after_settling_is_still_active(where):
    data = clean_run()
    data["final"]["backend"]["a"] = None
    if where == "lease":
        data["final"]["records"]["a"] = {"state": "active", "token": 5}
    else:
        data["final"]["records"]["a"] = None
        data["final"]["pending"] = ["a"]
    # (and lost: its waiter never returns; tests below)
    assert counts(data) == {"still_active": 1, "lost": 1}


def test_a_backend_value_of_another_token_disagrees():
    data = clean_run()
    data["final"]["backend"]["a"]["result"] = dict(data["final"]["backend"]["a"]["result"], token=4)
    assert "backend_disagrees" in counts(data)


def test_an_outcome_missing_from_the_backend_is_the_crash_window_only_if_a_kill_explains_it():
    data = clean_run()
    data["final"]["backend"]["a"] = None
    data["history"] = [e for e in data["history"] if e["ev"] != "accepted"]
    assert counts(data) == {"backend_disagrees": 1, "lost": 1}
    explained = copy.deepcopy(data)
    explained["fault_log"] = [{"t": 1.35, "rel": 1.35, "what": "kill_child", "pids": [100]}]
    # The window explains why, but the waiter still never returns: lost, a violation
    assert counts(explained) == {"backend_missing_window": 1, "lost": 1}
    assert checker.check(explained).violations() == {"lost": ["a"]}


def test_duplicates_are_counted_but_are_no_violation():
    data = clean_run()
    data["history"][1:1] = [event("start", 0.15, exec="e0", token=4, delivery="d0"),
                            event("refused", 0.9, exec="e0", token=4, outcome="succeeded")]
    report = checker.check(data)
    assert report.duplicates == 1 and report.refused == 1 and not report.violations()


def test_explain_prints_the_seed_the_command_and_the_full_history():
    data = clean_run()
    data["final"]["backend"]["a"] = None
    data["final"]["records"]["a"] = None
    data["command"] = "python -m chaos.run --seed 0"
    report = checker.check(data)
    text = checker.explain(data, report, report.offenders["lost"])
    assert "seed 0" in text and "python -m chaos.run --seed 0" in text
    assert text.count("\n") >= 6 and "write" in text and "lost:" in text


def test_the_same_seed_gives_the_same_workload_and_faults():
    params = ScheduleParams(workers=3, ttl=3.0)
    assert make_schedule(5, 60, params) == make_schedule(5, 60, params)
    assert make_workload(5, 200, 60) == make_workload(5, 200, 60)
    assert make_schedule(5, 60, params) != make_schedule(6, 60, params)


def test_a_short_schedule_has_every_kind_of_fault():
    faults = make_schedule(1, 60, ScheduleParams(workers=3, ttl=3.0))
    assert {f.kind for f in faults} == set(KINDS)
    assert all(3.0 <= f.at <= 58.0 for f in faults)
    stops = [f for f in faults if f.kind == "stop_worker"]
    assert all(f.seconds > 3.0 for f in stops)  # past the lease ttl


def never_returned(why):
    """Task "a" with no ready state in the backend after settling, for the reason ``why``."""
    data = clean_run()
    data["final"]["backend"]["a"] = None
    if why == "record terminal, no result":
        data["history"] = [e for e in data["history"] if e["ev"] != "accepted"]
    elif why == "crash window":
        data["history"] = [e for e in data["history"] if e["ev"] != "accepted"]
        data["fault_log"] = [{"t": 1.35, "rel": 1.35, "what": "kill_child", "pids": [100]}]
    elif why == "never received":
        data["history"] = []
        data["final"]["records"]["a"] = None
    elif why == "lease still active":
        data["final"]["records"]["a"] = {"state": "recovering", "token": 5}
    elif why == "message still queued":
        data["final"]["records"]["a"] = None
        data["final"]["pending"] = ["a"]
    elif why == "started (STARTED state only)":
        data["final"]["backend"]["a"] = {"status": "STARTED", "result": None}
        data["final"]["records"]["a"] = {"state": "active", "token": 5}
    return data


@pytest.mark.parametrize("why", ["record terminal, no result", "crash window", "never received",
                                 "lease still active", "message still queued",
                                 "started (STARTED state only)"])
def test_a_task_whose_waiter_never_returns_is_lost_whatever_the_reason(why):
    # Given a task whose result backend holds no ready state after settling
    report = checker.check(never_returned(why))
    # Then it is lost (a caller in AsyncResult.get() waits forever), and that breaks an invariant
    assert report.counts["lost"] == 1
    assert "lost" in report.violations()
    assert any("waiter never returns" in r for r in report.reasons["a"])


def test_a_body_run_for_a_malformed_message_breaks_an_invariant():
    # Given a clean run, plus a body that ran for a malformed message (seq < 0, not a submitted task)
    data = clean_run()
    data["history"].append({"ev": "start", "t": 2.0, "task": "1.5", "worker": "w0g1", "pid": 100,
                            "exec": "m1", "token": 0, "seq": -1})
    report = checker.check(data)
    # Then it is counted, as a violation, and the real task is untouched
    assert report.violations() == {"malformed_ran": ["1.5"]}
    assert report.submitted == 1 and report.succeeded == 1


def test_the_schedule_pauses_the_lease_store_past_the_ttl_and_mixes_in_malformed_messages():
    faults = make_schedule(3, 60, ScheduleParams(workers=3, ttl=3.0))
    pauses = [f for f in faults if f.kind == "lease_store_pause"]
    malformed = [f for f in faults if f.kind == "malformed"]
    assert pauses and all(f.seconds > 3.0 for f in pauses)
    assert malformed and all(f.variant in MALFORMED for f in malformed)
    assert {f.server for f in faults if f.kind in ("redis_restart", "redis_pause")} <= {"main", "leases"}
