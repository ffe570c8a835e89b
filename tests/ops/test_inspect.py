"""`celery -A proj inspect leases` and `celery leases ls --workers` on real `celery worker` processes."""
from __future__ import annotations

import json
import os
import subprocess

from celery_leases.testing import wait_for
from tests.ops.conftest import TASKS
from tests.ops.test_cli import ok
from tests.support.workers import CELERY, ROOT, starts


def mine(replies: dict, *names: str) -> dict:
    """The replies of this test's workers (other tests' workers on the same Redis answer too)."""
    return {host: leases for host, leases in replies.items() if host.split("-")[0] in names}


def test_inspect_leases_answers_each_workers_held_leases(cli, celery_env, start_worker, client_app,
                                                         history, key_prefix):
    # Given a worker running two leased tasks, and a worker holding none
    a, b = f"ia{key_prefix}", f"ib{key_prefix}"
    start_worker(a, concurrency=2)
    results = [client_app.signature(f"{TASKS}.sleep_then_echo", (i, 20.0)).delay() for i in range(2)]
    wait_for(lambda: all(starts(history, r.id) for r in results), 15, what="both tasks to start")
    start_worker(b, concurrency=1)

    # When Celery's own inspect asks them
    inspected = subprocess.run(
        [CELERY, "-A", TASKS, "inspect", "leases", "--json", "--timeout", "3"], cwd=str(ROOT),
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})
    assert inspected.returncode == 0, (inspected.stdout, inspected.stderr)
    replies = mine(json.loads(inspected.stdout), a, b)

    # Then the busy worker answers both leases, in Celery's reply shape, and the other []
    assert sorted(host.split("-")[0] for host in replies) == sorted([a, b])
    (held,) = [leases for host, leases in replies.items() if host.startswith(a)]
    (idle,) = [leases for host, leases in replies.items() if host.startswith(b)]
    assert idle == []
    assert sorted(entry["task_id"] for entry in held) == sorted(r.id for r in results)
    for entry in held:
        assert entry["name"] == f"{TASKS}.sleep_then_echo"
        assert entry["token"] >= 1 and entry["lost"] is False and entry["started"] is True
        assert entry["running_for"] is not None and 0 <= entry["running_for"] < 30
        assert entry["deadline"].endswith("Z") and entry["deadline_ms"] > 0

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

    # And Celery's own inspect prints the reply as it prints `inspect active`'s (the table is
    # `leases ls --workers`, which `inspect --list` names next to the command)
    human = subprocess.run(
        [CELERY, "-A", TASKS, "inspect", "leases", "--timeout", "3", "-d", ",".join(replies)],
        cwd=str(ROOT), capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})
    assert human.returncode == 0 and human.stdout.count("* {'task_id': ") == 2, human
    listed = subprocess.run([CELERY, "-A", TASKS, "inspect", "--list"], cwd=str(ROOT), capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})
    assert "celery leases ls --workers" in " ".join(listed.stdout.split()), listed
    for r in results:
        r.revoke()
