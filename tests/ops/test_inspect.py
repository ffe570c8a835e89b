"""`celery -A proj inspect leases` and `celery leases ls --workers` on real `celery worker` processes,
and how `celery inspect` prints other commands' replies once its printing is wrapped."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess

import pytest

from celery_leases import patches
from celery_leases.cli import inspect_leases
from celery_leases.testing import wait_for
from tests.ops.conftest import TASKS
from tests.ops.test_cli import ok
from tests.support.workers import CELERY, ROOT, starts


#: The columns `celery inspect leases` prints, split on spaces ("TASK ID" is two words).
HELD_COLUMNS = ["TASK", "ID", "NAME", "TOKEN", "HELD", "RUNNING", "DEADLINE", "LOST"]


def inspect_cli(celery_env: dict, *args: str) -> subprocess.CompletedProcess:
    """`celery -A tests.support.apps.leased_app inspect ARGS`, which must succeed."""
    done = subprocess.run([CELERY, "-A", TASKS, "inspect", *args], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done


def mine(replies: dict, *names: str) -> dict:
    """The replies of this test's workers (other tests' workers on the same Redis answer too)."""
    return {host: leases for host, leases in replies.items() if host.split("-")[0] in names}


def test_inspect_leases_answers_each_workers_held_leases(cli, celery_env, start_worker, client_app,
                                                         history, key_prefix):
    # Given a worker running two leased tasks, and a worker holding none; the tasks outlast the
    # five CLI calls below (each an interpreter start and a 3 s broadcast, slower on a loaded
    # machine), and the fixture kills the workers at the end
    a, b = f"ia{key_prefix}", f"ib{key_prefix}"
    start_worker(a, concurrency=2)
    results = [client_app.signature(f"{TASKS}.sleep_then_echo", (i, 300.0)).delay() for i in range(2)]
    wait_for(lambda: all(starts(history, r.id) for r in results), 15, what="both tasks to start")
    start_worker(b, concurrency=1)

    # When Celery's own inspect asks them for the data (--json)
    replies = mine(json.loads(inspect_cli(celery_env, "leases", "--json", "--timeout", "3").stdout), a, b)

    # Then the output is the replies alone, in Celery's shape: the busy worker's two leases, the other []
    assert sorted(host.split("-")[0] for host in replies) == sorted([a, b])
    (held,) = [leases for host, leases in replies.items() if host.startswith(a)]
    (idle,) = [leases for host, leases in replies.items() if host.startswith(b)]
    assert idle == []
    assert sorted(entry["task_id"] for entry in held) == sorted(r.id for r in results)
    for entry in held:
        assert entry["name"] == f"{TASKS}.sleep_then_echo"
        assert entry["token"] >= 1 and entry["lost"] is False and entry["started"] is True
        assert entry["running_for"] is not None and 0 <= entry["running_for"] < 60
        assert entry["deadline"].endswith("Z") and entry["deadline_ms"] > 0

    # And `celery inspect leases` prints each worker's leases as a table, the header first and
    # a row per lease (its deadline the reply's ISO time); other inspect commands print as ever
    human = inspect_cli(celery_env, "leases", "--timeout", "3", "-d", ",".join(replies))
    lines = human.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip("-> ").startswith(a))
    assert lines[at].endswith(": OK") and lines[at + 1].split() == HELD_COLUMNS, lines
    rows = [line.split() for line in lines[at + 2:at + 4]]
    assert sorted(row[0] for row in rows) == sorted(r.id for r in results), lines
    for row in rows:
        assert row[1] == f"{TASKS}.sleep_then_echo" and int(row[2]) >= 1
        assert row[3].endswith("s") and row[4].endswith("s") and row[5].endswith("Z")
        assert row[6] == "-"
    assert "{'task_id'" not in human.stdout
    (idle_at,) = [i for i, line in enumerate(lines) if line.lstrip("-> ").startswith(b)]
    assert lines[idle_at + 1].strip() == "- empty -", lines
    active = inspect_cli(celery_env, "active", "--timeout", "3", "-d", ",".join(replies))
    assert sum(f"* {{'id': '{r.id}'" in active.stdout for r in results) == 2, active

    # And `celery leases ls --workers` says the same, as JSON and as a table
    data = mine(json.loads(ok(cli("ls", "--workers", "--json", "--timeout", "3"))), a, b)
    assert {host: sorted(e["task_id"] for e in leases) for host, leases in data.items()} == \
        {host: sorted(e["task_id"] for e in leases) for host, leases in replies.items()}
    table = ok(cli("ls", "--workers", "--timeout", "3", "--worker", f"{a}*"))
    assert table.splitlines()[0].split() == ["WORKER", "TASK", "ID", "NAME", "TOKEN", "HELD", "RUNNING",
                                             "DEADLINE", "LOST"]
    rows = [line.split() for line in table.splitlines()[1:] if line.startswith(a)]
    assert len(rows) == 2 and sorted(row[1] for row in rows) == sorted(r.id for r in results)
    for row in rows:   # every field of the reply: held, running, "in 1.5s" deadline, not lost
        assert row[2] == f"{TASKS}.sleep_then_echo" and int(row[3]) >= 1
        assert row[4].endswith("s") and row[5].endswith("s") and row[6:8] == ["in", row[7]]
        assert row[8] == "-"
    assert b not in table
    listed = inspect_cli(celery_env, "--list")
    assert "leases List the celery-leases leases this worker holds (a table; --json: the data)" \
        in " ".join(listed.stdout.split()), listed.stdout


# -- how `celery inspect` prints, with the wrapper of CLIContext.pretty installed ------------


@pytest.fixture
def wrapped():
    """CLIContext.pretty wrapped as under Celery's command line (importing celery_leases.cli)."""
    installed = inspect_leases.install()
    yield
    if installed:  # leave a wrapper an import of celery_leases.cli made
        patches.undo(inspect_leases.NAME)


def printed(command: str, reply: object) -> str:
    """What `celery inspect COMMAND` prints for one worker's reply (celery/bin/control.py's own code)."""
    from celery import Celery
    from celery.bin.base import CLIContext
    from celery.bin.control import _say_remote_command_reply, inspect

    app = Celery("p", set_as_current=False)
    ctx = inspect.make_context("inspect", [command], obj=CLIContext(app, no_color=True, workdir=None))
    out = io.StringIO()
    with ctx, contextlib.redirect_stdout(out):
        _say_remote_command_reply(ctx, {"celery@a": reply}, show_reply=True)
    return out.getvalue()


LEASE = {"task_id": "8d0f6a1e", "name": "proj.charge", "token": 3, "deadline": "2026-11-29T11:01:48.823Z",
         "deadline_ms": 1795950108823, "running_for": 1.204, "held_for": 61.5, "started": True,
         "lost": False}


@pytest.mark.parametrize("command, reply", [
    ("ping", {"ok": "pong"}),
    ("active", [{"id": "8d0f6a1e", "name": "proj.charge", "args": [1], "kwargs": {}, "acknowledged": True}]),
    ("active", []),
    ("revoked", ["8d0f6a1e", "5c1b"]),
    ("stats", {"pid": 12, "pool": {"max-concurrency": 2}}),
    ("scheduled", [dict(LEASE)]),                       # a lease's shape, but not `inspect leases`
    ("leases", {"error": "No such command"}),           # a worker without celery-leases
    ("leases", []),
])
def test_other_replies_print_as_celery_prints_them(wrapped, monkeypatch, command, reply):
    # Given the wrapper installed, When `celery inspect` prints a reply that is not a list of leases
    shown = printed(command, reply)
    # Then it prints what Celery's own method prints
    from celery.bin.base import CLIContext
    monkeypatch.setattr(CLIContext, "pretty", patches.original(inspect_leases.NAME))
    assert shown == printed(command, reply)


def test_celery_prints_ping_and_active_unchanged(wrapped):
    # Given the wrapper installed, Then ping's and active's replies look as Celery prints them
    assert printed("ping", {"ok": "pong"}) == "->  celery@a: OK\n        pong\n"
    assert printed("active", [{"id": "8d0f6a1e", "name": "proj.charge"}]) == \
        "->  celery@a: OK\n    * {'id': '8d0f6a1e', 'name': 'proj.charge'}\n"


def test_a_workers_leases_print_as_a_table(wrapped):
    # Given the wrapper installed, When `celery inspect leases` prints a worker's two leases
    lost = {**LEASE, "task_id": "5c1b", "running_for": None, "held_for": None, "lost": True}
    shown = printed("leases", [LEASE, lost]).splitlines()
    # Then the header and one row per lease follow the worker's line, every field shown
    assert shown[0] == "->  celery@a: OK"
    assert [line.split() for line in shown[1:]] == [
        HELD_COLUMNS,
        ["8d0f6a1e", "proj.charge", "3", "1m01s", "1.2s", "2026-11-29T11:01:48.823Z", "-"],
        ["5c1b", "proj.charge", "3", "-", "not", "started", "2026-11-29T11:01:48.823Z", "lost"],
    ]
