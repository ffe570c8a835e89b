"""The CLI as a well-kept Unix tool: closed pipes, arguments, "not counted", RUNNING, filters,
JSON errors, refused deliveries counted."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

import celery_leases
from celery_leases import LeaseStore
from celery_leases.testing.servers import free_port
from tests.ops.conftest import TASKS
from tests.ops.test_cli import finished, ok
from tests.support.workers import CELERY, ROOT


@pytest.fixture
def store(client_app) -> LeaseStore:
    return celery_leases.store(client_app)


@pytest.mark.parametrize("command", ["ls --limit 5000", "ls --limit 5000 --json",
                                     "top --rows 50 --interval 0.1 --iterations 100"])
def test_a_closed_pipe_ends_the_command_quietly(celery_env, store, command):
    # Given more leases than a reader will take
    pipe = store.client.pipeline(transaction=False)
    for i in range(3000):
        pipe.zadd(store.keys.shard_for(f"t{i}").deadlines, {f"t{i}": 10**13})
        pipe.hset(store.keys.record(f"t{i}"), mapping={"state": "active", "token": 1, "owner": "w",
                                                       "name": f"{TASKS}.add"})
    pipe.execute()

    # When its output goes to `head -1` through a real pipe
    shell = f"'{CELERY}' -A {TASKS} leases {command} | head -1; echo \"status ${{PIPESTATUS[0]}}\" >&2"
    result = subprocess.run(["bash", "-c", shell], cwd=str(ROOT), capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})

    # Then it exits 0 (the whole output fitted in the pipe) or 141 (SIGPIPE's status), silently
    assert result.stdout.count("\n") == 1
    status = result.stderr.strip().splitlines()[-1]
    assert status in ("status 0", "status 141"), result.stderr
    assert "Broken pipe" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip() == status


def test_show_help_lists_task_id_as_an_argument(cli):
    out = ok(cli("show", "--help"))
    arguments, options = out.split("Options:")
    assert "TASK_ID" in arguments.split("rguments:")[1] and "Celery task id" in arguments
    assert "TASK_ID" not in options


def test_the_group_help_names_every_command_in_its_summary(cli):
    from celery_leases.cli import leases
    out = ok(cli("--help"))
    summary = out.split("Options:")[0]
    missing = [name for name in leases.commands if name not in summary]
    assert not missing, (missing, summary)


def test_stats_without_the_scan_says_not_counted(cli, store):
    store.acquire("live", "w", ttl=60, name=f"{TASKS}.add")
    finished(store, "done")
    data = json.loads(ok(cli("stats", "--no-scan", "--json")))
    assert data["states"]["active"] == 1 and data["states"]["recovering"] == 0
    assert data["states"]["succeeded"] is None and data["states"]["dead"] is None
    states = ok(cli("stats", "--no-scan")).split("lifetime counters")[0]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in states.splitlines()
            if line.startswith("  ") and line.split()[0] in ("active", "succeeded")}
    assert rows == {"active": "1", "succeeded": "not counted"}


def test_ls_and_top_show_how_long_a_task_has_been_running(cli, store):
    # Given a lease whose body started 0.3 s ago, and one not started yet
    acq = store.acquire("running", "w", ttl=60, name=f"{TASKS}.add")
    store.mark_started("w", {"running": acq.token})
    store.acquire("waiting", "w", ttl=60, name=f"{TASKS}.add")
    time.sleep(0.3)
    data = {r["task_id"]: r for r in json.loads(ok(cli("ls", "--json")))["leases"]}
    assert 0.3 <= data["running"]["running_for_s"] < 30 and data["running"]["started"] is True
    assert data["waiting"]["running_for_s"] is None
    out = ok(cli("ls"))
    assert "RUNNING" in out.splitlines()[0]
    (row,) = [line for line in out.splitlines() if line.startswith("running")]
    assert "s  " in row and "not started" in [line for line in out.splitlines()
                                              if line.startswith("waiting")][0]
    assert "RUNNING" in ok(cli("top", "--iterations", "1"))


def test_ls_and_top_filter_by_name_worker_and_state(cli, store):
    store.acquire("c1", "celery@web-1:11:aaaaaa", ttl=60, name="proj.tasks.charge")
    store.acquire("c2", "celery@web-2:22:bbbbbb", ttl=60, name="proj.tasks.charge")
    store.acquire("r1", "celery@web-1:11:aaaaaa", ttl=60, name="proj.reports.build")
    finished(store, "done")

    def ids(*args: str) -> list[str]:
        return sorted(r["task_id"] for r in json.loads(ok(cli("ls", "--json", *args)))["leases"])

    assert ids("--name", "proj.tasks.charge") == ["c1", "c2"]
    assert ids("--name", "proj.*", "--worker", "celery@web-1") == ["c1", "r1"]
    assert ids("--worker", "celery@web-2:22:bbbbbb") == ["c2"]
    assert ids("--worker", "celery@web-*", "--name", "*.build") == ["r1"]
    assert ids("--state", "all", "--name", f"{TASKS}.*") == ["done"]
    assert "matching the filters" in ok(cli("ls", "--name", "nothing"))
    frame = json.loads(ok(cli("top", "--iterations", "1", "--json", "--worker", "celery@web-2")))
    assert [r["task_id"] for r in frame["soonest"]] == ["c2"]


def test_errors_under_json_are_json_on_stderr(cli):
    missing = cli("show", "nope", "--json")
    assert missing.returncode == 1 and missing.stdout == ""
    error = json.loads(missing.stderr)
    assert error["kind"] == "not_found" and "nope" in error["error"] and error["status"] == 1
    down = cli("ls", "--json", LEASES_TEST_BROKER=f"redis://:pw-s3cret@127.0.0.1:{free_port()}/0")
    assert down.returncode == 69 and down.stdout == ""
    error = json.loads(down.stderr)
    assert error["kind"] == "unavailable" and error["command"] == "ls" and "s3cret" not in down.stderr


def test_deliveries_refused_as_finished_are_counted(cli, store):
    # Given a finished task, delivered again (a late duplicate)
    finished(store, "done")
    assert store.acquire("done", "w-late", name=f"{TASKS}.add").code.name == "FINISHED"
    # Then the refusal is counted, and stats shows it
    assert json.loads(ok(cli("stats", "--json")))["counters"]["finished_deliveries"] == 1
    assert [line.split() for line in ok(cli("stats")).splitlines()
            if line.split()[:1] == ["finished_deliveries"]] == [["finished_deliveries", "1"]]
