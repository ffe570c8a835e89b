"""`celery -A proj leases ...` run as a real subprocess against the real Redis; and the store
helpers it uses (records, scan, purge, held_for)."""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import redis

import celery_leases
from celery_leases import LeaseStore
from celery_leases.protocol.admin import glob_escape
from celery_leases.testing.servers import free_port
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"
ENVELOPE = {"exchange": "", "routing_key": "unused", "headers": {}, "properties": {},
            "content_type": "application/json", "content_encoding": "utf-8"}


@pytest.fixture
def store(client_app) -> LeaseStore:
    return celery_leases.store(client_app)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def finished(store: LeaseStore, task_id: str, outcome: str = "succeeded") -> None:
    acq = store.acquire(task_id, "w-fin", name=f"{TASKS}.add")
    store.finish(task_id, "w-fin", acq.token, outcome)


def dead(store: LeaseStore, task_id: str) -> None:
    """A record declared dead: its only allowed owner expired and a copy came back."""
    acq = store.acquire(task_id, "w-dead", max_recoveries=0, name=f"{TASKS}.add")
    store.release("w-dead", {task_id: acq.token}, started={task_id})
    assert store.acquire(task_id, "w-dead-2", max_recoveries=0).code.name == "DEAD"


def recovering(store: LeaseStore, task_id: str) -> None:
    """A record claimed by recovery, waiting for its re-published copy."""
    acq = store.acquire(task_id, "w-rec", name=f"{TASKS}.add", body=b"{}", envelope=ENVELOPE)
    store.release("w-rec", {task_id: acq.token}, started={task_id})
    (claim,) = store.claim_expired(ids=[task_id])
    store.mark_published([claim])


# -- ls ------------------------------------------------------------------------------


def test_ls_lists_live_leases_soonest_deadline_first_in_a_table_and_as_json(cli, store):
    # Given two live leases (ttl 60 s and 30 s) and a finished record
    store.acquire("late", "host-a:1:aaa", ttl=60, name=f"{TASKS}.add")
    store.acquire("soon", "host-b:2:bbb", ttl=30, name=f"{TASKS}.tsum")
    acquired = time.monotonic()
    finished(store, "done")

    # When the live leases are listed
    out = ok(cli("ls"))

    # Then the table shows both live leases, soonest deadline first, and not the finished one
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["TASK", "ID", "NAME"]
    assert [line.split()[0] for line in lines[1:]] == ["soon", "late"]
    # (a deadline "in 29.xs", less whatever a loaded machine took to get here)
    shown = re.search(r"\bin (\d+(?:\.\d+)?)s", lines[1])
    assert "host-b:2:bbb" in lines[1] and shown and 30 - (time.monotonic() - acquired) - 1 <= float(shown[1]) <= 30
    assert "done" not in out

    # And --json carries the same leases with deadlines relative to the server's now
    data = json.loads(ok(cli("ls", "--json")))
    assert data["source"] == "index"
    assert [r["task_id"] for r in data["leases"]] == ["soon", "late"]
    assert 30 - (time.monotonic() - acquired) - 1 <= data["leases"][0]["deadline_in_s"] <= 30
    assert data["leases"][1]["owner"] == "host-a:1:aaa"


def test_ls_by_state_scans_records_and_limit_caps_the_list(cli, store):
    # Given records in four states
    store.acquire("run", "w", name=f"{TASKS}.add")
    finished(store, "ok1")
    finished(store, "ok2")
    finished(store, "bad", "failed")
    dead(store, "gone")

    # Then --state picks one state, 'finished' all terminal ones, 'all' every record
    def ids(*args):
        return sorted(r["task_id"] for r in json.loads(ok(cli("ls", "--json", *args)))["leases"])

    assert ids("--state", "succeeded") == ["ok1", "ok2"]
    assert ids("--state", "finished") == ["bad", "gone", "ok1", "ok2"]
    assert ids("--state", "all") == ["bad", "gone", "ok1", "ok2", "run"]
    assert len(ids("--state", "all", "--limit", "2")) == 2
    # And the table of dead records says when they finished
    out = ok(cli("ls", "--state", "dead"))
    assert "gone" in out and "ago" in out and "ok1" not in out


# -- show -----------------------------------------------------------------------------


def test_show_prints_the_record_its_owners_and_the_deadline(cli, store):
    # Given a task whose first owner expired and whose lease a second owner took over
    first = store.acquire("t1", "host-a:1:aaa", name=f"{TASKS}.add")
    store.release("host-a:1:aaa", {"t1": first.token}, started={"t1"})
    second = store.acquire("t1", "host-b:2:bbb", ttl=30, name=f"{TASKS}.add")
    assert second.code.name == "TAKEN_OVER"

    # When it is shown
    out = ok(cli("show", "t1"))

    # Then the table has the state, the current owner, the recoveries and a future deadline
    fields = dict(line.split(None, 1) for line in out.split("\n\n")[0].splitlines())
    assert fields["state"] == "active" and fields["owner"] == "host-b:2:bbb"
    assert fields["token"] == str(second.token) and fields["recoveries"] == "1"
    assert fields["deadline"].startswith("in 2")
    # And both owners with their tokens, oldest first
    history = out.split("owners, oldest first:")[1].splitlines()[2:]
    assert [row.split()[:2] for row in history] == [[str(first.token), "host-a:1:aaa"],
                                                    [str(second.token), "host-b:2:bbb"]]

    # And --json carries the same, with times
    data = json.loads(ok(cli("show", "t1", "--json")))
    assert data["recoveries"] == 1 and data["generation"] == 0
    assert [h["owner"] for h in data["history"]] == ["host-a:1:aaa", "host-b:2:bbb"]
    assert data["history"][1]["acquired_at_ms"] <= data["now_ms"] < data["deadline_ms"]


def test_show_of_an_unknown_task_is_one_line_on_stderr_and_a_failure(cli, key_prefix):
    result = cli("show", "no-such-task")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "no lease record for task no-such-task" in result.stderr
    assert key_prefix in result.stderr


@pytest.mark.parametrize("command", ["show", "replay"])
def test_an_empty_task_id_is_a_usage_error_naming_the_argument(cli, command):
    # When show or replay is given an id no lease record can have
    result = cli(command, "")
    # Then it is a usage error (exit 2) naming the argument, not a lookup or a traceback
    assert result.returncode == 2, result.stderr
    assert "TASK_ID" in result.stderr and "not a task id" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unreachable_store_is_one_line_without_the_password(cli):
    # Given an app whose Redis URL carries a password, and nothing listening on its port
    url = f"redis://:pw-s3cret@127.0.0.1:{free_port()}/0"

    # When any command runs
    for command in (["stats"], ["ls"], ["show", "x"]):
        result = cli(*command, LEASES_TEST_BROKER=url)

        # Then it fails with the store's "unreachable" exit status and one line naming the store
        assert result.returncode == 69, (command, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "unreachable" in result.stderr and "127.0.0.1" in result.stderr
        # And the password appears nowhere
        assert "s3cret" not in result.stdout + result.stderr


# -- recover ----------------------------------------------------------------------------


def test_recover_dry_run_claims_nothing_and_recover_republishes(cli, store, client_app, start_worker,
                                                                history, redis_client, key_prefix):
    # Given a task whose worker was SIGKILLed mid-run, so that its lease ran out
    worker = start_worker("a", concurrency=1)
    result = client_app.signature(f"{TASKS}.sleep_then_echo", ("v", 30.0)).delay()
    wait_for(lambda: any(h[0] == "start" and h[1] == result.id for h in history()), 10,
             what="the task to start")
    # (killed once its start mark is in: only a running task is charged a recovery)
    wait_for(lambda: store.get(result.id).started, 10, what="the start mark")
    worker.kill()
    wait_for(lambda: store.expired(), 10, what="the lease to run out")
    assert redis_client.llen(key_prefix) == 0

    # When a dry run lists what is due
    out = ok(cli("recover", "--dry-run"))
    data = json.loads(ok(cli("recover", "--dry-run", "--json")))

    # Then the task is listed as due, and nothing was claimed or published
    assert result.id in out and "dry run" in out
    assert [r["task_id"] for r in data["due"]] == [result.id]
    record = store.get(result.id)
    assert (record.state, record.generation) == ("active", 0)
    assert store.stats().get("recovered", 0) == 0
    assert redis_client.llen(key_prefix) == 0

    # When recovery runs for real
    out = ok(cli("recover"))

    # Then the task was re-published under a new generation
    assert out.startswith("recovered 1, dead 0, publish failed 0")
    record = store.get(result.id)
    assert (record.state, record.generation, record.recoveries) == ("recovering", 1, 1)
    assert redis_client.llen(key_prefix) == 1   # the copy waits in the test's queue
    # (publish tracking on, the default: the undelivered step's figures too; and the
    # kept results recovery wrote)
    assert json.loads(ok(cli("recover", "--json"))) == {"recovered": 0, "dead": 0,
                                                        "publish_failed": 0, "corrupt": 0, "errors": [],
                                                        "undelivered": 0, "undelivered_expired": 0,
                                                        "results_written": 0}


# -- stats and top --------------------------------------------------------------------------


def test_stats_counts_states_counters_and_the_oldest_active_lease(cli, store):
    # Given an older and a newer active lease, and records in other states
    store.acquire("old", "w", ttl=60, name=f"{TASKS}.add")
    time.sleep(0.05)
    store.acquire("new", "w", ttl=60, name=f"{TASKS}.add")
    finished(store, "ok")
    dead(store, "gone")
    recovering(store, "back")

    # When the stats are read
    data = json.loads(ok(cli("stats", "--json")))

    # Then records are counted by state, with the lifetime counters and the oldest lease
    assert data["states"] == {"queued": 0, "active": 2, "recovering": 1, "succeeded": 1, "failed": 0,
                              "dead": 1, "revoked": 0}
    assert data["counters"]["acquired"] == 5 and data["counters"]["dead"] == 1
    assert data["counters"]["recovered"] == 1 and data["counters"]["refused"] == 0
    assert data["oldest_active"]["task_id"] == "old" and data["oldest_active"]["age_s"] >= 0.05
    assert data["indexed"] == 2 and data["due"] == 0
    # And --no-scan counts only what the deadline index holds
    assert json.loads(ok(cli("stats", "--json", "--no-scan")))["states"]["succeeded"] is None
    # And the table says the same
    out = ok(cli("stats"))
    assert "oldest active lease:" in out and "old" in out
    assert [line.split() for line in out.splitlines() if line.split()[:1] == ["dead"]] == \
        [["dead", "1"], ["dead", "1"]]   # one state row, one counter row


def test_stats_explains_each_lifetime_counter_in_its_help_with_explain_and_in_the_docs(cli, store):
    from pathlib import Path
    from celery_leases.cli.counters import COUNTERS
    store.acquire("live", "w", ttl=60, name=f"{TASKS}.add")
    # --help lists every counter with its one line (click wraps it: compared without line breaks)
    help_text = " ".join(ok(cli("stats", "--help")).split())
    for name, meaning in COUNTERS.items():
        assert f"{name} {meaning}" in help_text, name
    # the table says where the meanings are; --explain adds them as a column, one line each
    assert "lifetime counters (what each counts: --explain, or --help):" in ok(cli("stats"))
    out = ok(cli("stats", "--explain"))
    rows = out.split("lifetime counters:\n", 1)[1].splitlines()
    assert rows[0].split() == ["COUNTER", "VALUE", "COUNTS"]
    shown = {row.split()[0]: row.split(None, 2)[2] for row in rows[1:]}
    assert shown == COUNTERS and out.count("\n  acquired ") == 1
    # --json is unchanged: counters only
    assert set(json.loads(ok(cli("stats", "--json", "--explain")))["counters"]) == set(COUNTERS)
    # and docs/operations.md has the same table
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = docs.split("### `stats [--no-scan] [--explain]`", 1)[1].split("\n###", 1)[0]
    table = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, flags=re.MULTILINE))
    assert table == COUNTERS


def test_top_refreshes_until_the_iterations_are_done(cli, store):
    store.acquire("live", "host-a:1:aaa", ttl=60, name=f"{TASKS}.add")
    out = ok(cli("top", "--iterations", "2", "--interval", "0.1"))
    assert out.count("celery leases top") == 2 and "live" in out and "indexed 1" in out
    frames = [json.loads(line) for line in ok(cli("top", "--iterations", "2", "--interval", "0.1",
                                                  "--json")).splitlines()]
    assert len(frames) == 2 and frames[1]["soonest"][0]["task_id"] == "live"
    assert frames[1]["counters"]["acquired"] == 1 and frames[1]["delta"]["acquired"] == 0


# -- purge ------------------------------------------------------------------------------------


def test_purge_removes_only_finished_records(cli, store, redis_client):
    # Given records in every state (active, due, recovering, and the four terminal ones)
    store.acquire("run", "w", ttl=60, name=f"{TASKS}.add")
    due = store.acquire("due", "w", name=f"{TASKS}.add")
    store.release("w", {"due": due.token}, started={"due"})
    recovering(store, "back")
    finished(store, "ok")
    finished(store, "bad", "failed")
    finished(store, "stopped", "revoked")
    dead(store, "gone")

    # When purge is not confirmed, or only older records are asked for, nothing is deleted
    result = cli("purge", input="n\n")
    assert result.returncode != 0 and "Delete 4 finished lease record(s)" in result.stderr
    assert json.loads(ok(cli("purge", "--older-than", "3600", "--yes", "--json"))) == {"purged": 0}
    assert len(store.scan()) == 7

    # When purge is confirmed
    out = ok(cli("purge", input="y\n"))

    # Then exactly the four finished records are gone; active and recovering ones stay
    assert "purged 4" in out
    assert sorted((r.task_id, r.state) for r in store.scan()) == [
        ("back", "recovering"), ("due", "active"), ("run", "active")]
    assert ok(cli("purge", "--yes")).strip() == "purged 0 finished lease record(s)"


# -- the store helpers ---------------------------------------------------------------------------


def test_scan_matches_only_this_prefix_even_with_glob_characters(redis_server_url, key_prefix):
    # Given a prefix holding a glob character and another prefix it would match as a pattern
    client = redis.Redis.from_url(redis_server_url)
    star, other = LeaseStore(client, f"{key_prefix}*"), LeaseStore(client, f"{key_prefix}xy")
    star.acquire("mine", "w")
    other.acquire("theirs", "w")
    finished(other, "theirs-done")
    # Then each store scans and purges only its own records
    assert [r.task_id for r in star.scan()] == ["mine"]
    assert star.purge() == 0 and other.purge(dry_run=True) == 1
    assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"
    client.close()


def test_records_skip_missing_ids_and_carry_the_index_deadline(store):
    store.acquire("a", "w", ttl=30, body=b"msg", envelope={})
    finished(store, "b")
    records = {r.task_id: r for r in store.records(["a", "missing", "b"])}
    assert sorted(records) == ["a", "b"]
    assert records["a"].deadline > store.server_time_ms() and records["a"].has_message
    assert records["b"].deadline == 0 and not records["b"].has_message
    assert records["a"] == store.get("a")


def test_scan_skips_corrupt_records_and_purge_deletes_only_finished_hashes(store, redis_client):
    # Given a good finished record, a finished one with a corrupt token, one whose
    # finished_at is no number, and a key under the record prefix that is no hash
    finished(store, "fine")
    redis_client.hset(store.keys.record("bad-token"), mapping={"state": "succeeded", "token": "x"})
    redis_client.hset(store.keys.record("bad-time"), mapping={"state": "failed", "finished_at": "y"})
    redis_client.set(store.keys.record("not-a-hash"), "x")
    # Then scan lists only the readable record, and the listing does not fail
    assert [r.task_id for r in store.scan()] == ["fine"]
    # And purge deletes the finished hashes it can date, and leaves the others
    assert store.purge() == 2
    assert not redis_client.exists(store.keys.record("bad-token"))
    assert redis_client.exists(store.keys.record("bad-time"), store.keys.record("not-a-hash")) == 2


def test_purge_older_than_uses_finished_at_on_the_server_clock(store):
    finished(store, "early")
    time.sleep(0.3)
    finished(store, "late")
    assert store.purge(older_than=0.2, dry_run=True) == 1
    assert store.purge(older_than=0.2) == 1
    assert [r.task_id for r in store.scan()] == ["late"]


def test_held_for_is_the_time_since_the_last_acquisition(store):
    store.acquire("t", "w")
    time.sleep(0.2)
    assert 0.2 <= store.held_for("t") < 5
    assert store.held_for("missing") is None


# -- parked, replay ----------------------------------------------------------------------


def real_message(client_app, key_prefix, *args):
    """(task id, body, envelope) of a real `add` message, as a worker would have received it."""
    from celery_leases.recovery.messages import envelope_of
    side = f"{key_prefix}-side"
    result = client_app.signature(f"{TASKS}.add", args).apply_async(queue=side)
    with client_app.connection_for_read() as conn:
        message = conn.SimpleQueue(side).get(timeout=5)
        message.ack()
    envelope = envelope_of(message)
    envelope.update(exchange="", routing_key=key_prefix)  # the test worker's queue
    return result.id, message.body, envelope


def test_parked_lists_entries_in_a_table_and_as_json(cli, store):
    store.park("p1", "corrupt lease record", name=f"{TASKS}.add", body=b"b", key="k1", field="token")
    out = ok(cli("parked"))
    assert out.splitlines()[0].split()[:3] == ["TASK", "ID", "NAME"]
    row = out.splitlines()[1].split()
    assert row[0] == "p1" and "k1" in row and "token" in row
    data = json.loads(ok(cli("parked", "--json")))
    (entry,) = data["parked"]
    assert (entry["task_id"], entry["key"], entry["field"], entry["body_size"]) == ("p1", "k1", "token", 1)
    assert ok(cli("parked", "--json", LEASES_TEST_PREFIX="other-prefix")).count("p1") == 0


def test_replay_refuses_while_the_record_is_corrupt_and_reset_record_runs_it(
        cli, store, client_app, key_prefix, start_worker):
    # Given a parked delivery whose lease record is corrupt
    task_id, body, envelope = real_message(client_app, key_prefix, 20, 22)
    key = store.keys.record(task_id)
    store.client.hset(key, mapping={"state": "active", "token": "not-a-number"})
    store.park(task_id, "corrupt lease record", name=f"{TASKS}.add", body=body, envelope=envelope,
               key=key, field="token")

    # When it is replayed without --reset-record
    refused = cli("replay", task_id)
    # Then it is refused, naming the corrupt record and the way out, and stays parked
    assert refused.returncode == 1, refused
    assert key in refused.stderr and "--reset-record" in refused.stderr
    assert store.parked_entry(task_id) is not None
    assert store.client.hget(key, "token") == b"not-a-number"

    # When it is replayed with --reset-record, with a worker running
    start_worker("a")
    out = ok(cli("replay", task_id, "--reset-record"))
    # Then the record was deleted, the task ran under the same id, and it is no longer parked
    assert task_id in out and "deleted" in out
    assert client_app.AsyncResult(task_id).get(timeout=20) == 42
    assert store.get(task_id).state == "succeeded"
    assert store.parked_entry(task_id) is None


def test_a_dead_task_is_kept_for_replay_and_reset_record_runs_it_again(cli, store, client_app, start_worker):
    # Given a task that kills its own pool process the first time it runs, and no recovery to
    # spare (leases_max_recoveries = 0): it goes dead, its waiter gets LeaseExpired
    worker_env = dict(LEASES_TEST_MAX_RECOVERIES="0", LEASES_TEST_WORKER_RECOVERY="1")
    start_worker("a", **worker_env)
    result = client_app.signature(f"{TASKS}.kill_own_child").delay()
    with pytest.raises(celery_leases.LeaseExpired):
        result.get(timeout=30)
    assert store.get(result.id).state == "dead"
    # Then its message is kept, listed with the parked deliveries (the cause of death its reason)
    entry = wait_for(lambda: store.parked_entry(result.id), 5, what="the dead task to be kept")
    assert entry.reason.startswith("dead: abandoned") and entry.body_size > 0
    # And a replay without --reset-record is refused, naming the way out
    refused = cli("replay", result.id)
    assert refused.returncode == 1 and "dead" in refused.stderr and "--reset-record" in refused.stderr
    # When the operator replays it with --reset-record, Then it runs again under the same id
    ok(cli("replay", result.id, "--reset-record"))
    assert client_app.AsyncResult(result.id).get(timeout=30) == "survived"
    assert store.get(result.id).state == "succeeded" and store.parked_entry(result.id) is None


def test_replay_of_an_unknown_id_is_not_found(cli):
    result = cli("replay", "nope")
    assert result.returncode == 1 and "no parked delivery for task nope" in result.stderr


@pytest.mark.parametrize("kind", ["state", "type"])
def test_replay_names_every_kind_of_corrupt_record(cli, store, kind):
    key = store.keys.record("p-bad")
    if kind == "state":
        store.client.hset(key, mapping={"state": "bogus", "token": "1"})
    else:
        store.client.rpush(key, "x")
    store.park("p-bad", "corrupt", name=f"{TASKS}.add", body=b"b", envelope=ENVELOPE, key=key, field=kind)
    refused = cli("replay", "p-bad")
    assert refused.returncode == 1 and key in refused.stderr and "--reset-record" in refused.stderr
    assert store.parked_entry("p-bad") is not None


def test_replay_refuses_a_finished_record_unless_reset(cli, store):
    finished(store, "p-done")
    store.park("p-done", "malformed", name=f"{TASKS}.add", body=b"b", envelope=ENVELOPE)
    refused = cli("replay", "p-done")
    assert refused.returncode == 1 and "succeeded" in refused.stderr and "--reset-record" in refused.stderr
    assert store.parked_entry("p-done") is not None
