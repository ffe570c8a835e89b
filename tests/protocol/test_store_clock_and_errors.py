"""The store's clock (worker clock skew changes nothing) and its errors (corrupt records, an unreachable server).

Against a real redis-server. Each test reads Given / When / Then. Times are the
Redis server's clock; short ttls (0.1 s) and sleeps of ttl + 50 ms make a lease
"expired" by a margin. Shared helpers: tests/protocol/scripts_support.py; the
``store`` and ``make_store`` fixtures: tests/protocol/conftest.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_leases import Code, CorruptRecord, LeaseStore, LeaseUnavailable
from celery_leases.testing.servers import free_port
from tests.support.skew import skewed_env
from tests.protocol.scripts_support import A, B, BODY, REPO, SHORT, Recorder, acquire, wait_out


# -- clock skew ------------------------------------------------------------------

SKEW_CHILD = r"""
import json, sys, time
import redis
from celery_leases import LeaseStore

url, prefix = sys.argv[1], sys.argv[2]
store = LeaseStore(redis.Redis.from_url(url), prefix=prefix, ttl=0.6)
out = {"local_ms": int(time.time() * 1000), "monotonic": time.monotonic()}
acq = store.acquire("t1", "skewed-worker")
out["token"] = acq.token
out["server_ms"] = store.server_time_ms()
out["deadline"] = store.get("t1").deadline
out["expired_at_once"] = store.expired()
time.sleep(0.3)
out["expired_before_ttl"] = store.expired()
assert store.renew_many("skewed-worker", {"t1": acq.token}) == {}
out["renew_server_ms"] = store.server_time_ms()
out["renewed_deadline"] = store.get("t1").deadline
time.sleep(0.3)
out["expired_before_renewed_ttl"] = store.expired()
time.sleep(0.45)
out["expired_after_ttl"] = store.expired()
print(json.dumps(out))
"""


@pytest.mark.parametrize("offset", ["-5h", "+7h"])
def test_a_worker_whose_clock_is_hours_off_gets_server_clock_deadlines(
        redis_server_url, key_prefix, offset):
    # Given a worker process whose clock is hours off (libfaketime; tests/support/skew.py)
    env = skewed_env(offset, {**os.environ, "PYTHONPATH": str(REPO)})

    # When it acquires, renews and then stops renewing a 0.6 s lease
    done = subprocess.run([sys.executable, "-c", SKEW_CHILD, redis_server_url, key_prefix],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)

    # Then its clock really was hours off
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix)
    assert abs(out["local_ms"] - store.server_time_ms()) > 3600_000
    # And its deadlines are server time + ttl, to within a second
    assert abs(out["deadline"] - (out["server_ms"] + 600)) < 1000
    assert abs(out["renewed_deadline"] - (out["renew_server_ms"] + 600)) < 1000
    # And the lease expired only after the real ttl from its last renewal
    assert out["expired_at_once"] == out["expired_before_ttl"] == []
    assert out["expired_before_renewed_ttl"] == []
    assert out["expired_after_ttl"] == ["t1"]
    store.client.close()


@pytest.mark.parametrize("offset_s", [-6 * 3600, 9 * 3600])
def test_a_skewed_local_clock_in_process_changes_nothing(store, monkeypatch, offset_s):
    # Given this process's clocks are hours off
    real_time, real_monotonic = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + offset_s)
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset_s)

    # When it acquires and renews a lease
    acq = acquire(store, "t1", A, ttl=0.3)
    server = store.server_time_ms()
    deadline = store.get("t1").deadline
    store.renew_many(A, {"t1": acq.token}, ttl=0.3)
    renewed_at = store.server_time_ms()
    renewed = store.get("t1").deadline

    # Then its deadlines come from the server clock
    assert abs(deadline - (server + 300)) < 1000
    assert abs(renewed - (renewed_at + 300)) < 1000
    # And it expires after the real ttl, not before
    assert store.expired() == []
    wait_out(0.3)
    assert store.expired() == ["t1"]


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", [None, "", 42, b"t1", "t\udc80"])
@pytest.mark.parametrize("call", ["get", "acquire", "finish", "revoke", "reset_record"])
def test_a_call_about_a_task_refuses_an_id_no_record_can_have_naming_it(store, task_id, call):
    # Given a store holding a record for "t1"
    acquire(store, "t1", A)
    # When a call about one task is given an id that is not a non-empty UTF-8 str
    args = {"get": (task_id,), "acquire": (task_id, A), "finish": (task_id, A, 1, "succeeded"),
            "revoke": (task_id,), "reset_record": (task_id,)}[call]
    with pytest.raises(TypeError) as info:
        getattr(store, call)(*args)
    # Then the error names the field and the value, and nothing was written under a made-up key
    assert "task id" in str(info.value) and repr(task_id) in str(info.value)
    assert store.get("t1").state == "active"
    assert store.client.keys(store.keys.record("*")) == [store.keys.record("t1").encode()]


def test_an_empty_member_in_the_deadline_index_does_not_stop_a_recovery_pass(store):
    # Given an expired lease, and an empty member (no task can have it) in its deadline
    # index and in the queued index, written by something other than this protocol
    acquire(store, "t1", A, ttl=SHORT)
    shard = store.keys.shard_for("t1")
    store.client.zadd(shard.deadlines, {"": 1})
    store.client.zadd(shard.queued, {"": 1})
    wait_out()
    # When a recovery pass runs
    published = []
    report = store.recover(publish=lambda claim: published.append(claim.task_id))
    # Then the expired lease is recovered all the same: only calls that name a task refuse
    # such an id, not the passes over the store's own indexes
    assert published == ["t1"] and report.recovered == 1, report
    assert store.get("t1").state == "recovering"


def test_a_key_of_the_wrong_type_is_a_corrupt_record_naming_the_key(store):
    # Given a string where t1's record hash should be
    key = store.keys.record("t1")
    store.client.set(key, b"not a hash")

    # When the store touches that record, Then each call names the key
    for call in (lambda: store.get("t1"),
                 lambda: store.acquire("t1", A),
                 lambda: store.finish("t1", A, 1, "succeeded"),
                 lambda: store.progress("t1", A, 1)):
        with pytest.raises(CorruptRecord) as corrupt:
            call()
        assert key in str(corrupt.value)


def test_a_non_numeric_token_is_a_corrupt_record_naming_key_and_field(store):
    # Given a record whose token is not a number
    acquire(store, "t1", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")

    # When a script reads it, Then the error names the key and the field
    for call in (lambda: store.acquire("t1", B),
                 lambda: store.finish("t1", A, 1, "succeeded"),
                 lambda: store.progress("t1", A, 1)):
        with pytest.raises(CorruptRecord) as corrupt:
            call()
        assert key in str(corrupt.value) and "token" in str(corrupt.value)


def test_reading_a_non_numeric_token_names_key_and_field(store):
    """(Was a bug: get() did not name the field and check() raised a bare ValueError.)"""
    # Given a record whose token is not a number
    acq = acquire(store, "t1", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")

    # When it is read
    errors = {}
    for name, call in (("get", lambda: store.get("t1")),
                       ("check", lambda: store.check("t1", A, acq.token))):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test reports what came out
            errors[name] = exc

    # Then each call raises CorruptRecord naming the key and the field
    assert {n: type(e).__name__ for n, e in errors.items()} == \
        {"get": "CorruptRecord", "check": "CorruptRecord"}
    for name, exc in errors.items():
        assert key in str(exc) and "token" in str(exc), (name, str(exc))


def test_release_skips_a_non_numeric_token_and_names_key_and_field(store, caplog):
    """release cannot check ownership of a corrupt record: it leaves it alone and says so,
    naming key and field (one bad record affects one task: the others are released).
    renew_many deliberately reads only 'holder' and 'state' (a 10,000-lease renewal stays
    under 50 ms), so a corrupt token field alone is not its concern."""
    # Given a record whose token is not a number, and a healthy one
    acq = acquire(store, "t1", A)
    other = acquire(store, "t2", A)
    key = store.keys.record("t1")
    store.client.hset(key, "token", "abc")
    before = store.client.dump(key)

    # When the worker releases both
    released = store.release(A, {"t1": acq.token, "t2": other.token})

    # Then the healthy one is released, the corrupt one left as it was and reported
    assert released == 1
    assert store.client.dump(key) == before
    assert any(key in r.getMessage() and "token" in r.getMessage() for r in caplog.records)


def test_batch_scripts_name_a_key_of_the_wrong_type_and_go_on(store, caplog):
    """(Was a bug: the batch scripts' errors named neither the key nor the task; then
    one such record failed the whole batch.)"""
    # Given a string where t1's record hash should be, t1 due in the deadline index,
    # and a healthy live lease t2
    key = store.keys.record("t1")
    store.client.set(key, b"not a hash")
    store.client.zadd(store.keys.deadlines, {"t1": 0})
    t2 = acquire(store, "t2", A)

    # When the batch scripts touch both
    renewed = store.renew_many(A, {"t1": 1, "t2": t2.token})
    released = store.release(A, {"t1": 1})
    claims = store.claim_expired()

    # Then each reports t1 alone, naming the key, and goes on with t2
    assert renewed == {"t1": Code.CORRUPT}
    assert released == 0
    (claim,) = claims
    assert claim.task_id == "t1" and claim.code is Code.CORRUPT
    assert isinstance(claim.error, CorruptRecord) and claim.error.key == key and key in str(claim.error)
    assert [r for r in caplog.records if "t1" in r.getMessage() and key not in r.getMessage()] == []
    assert store.client.get(key) == b"not a hash"


def test_a_corrupt_envelope_is_a_corrupt_record_naming_the_key(store):
    # Given an expired lease whose stored envelope is not JSON
    acquire(store, "t1", A, ttl=SHORT)
    key = store.keys.message("t1")
    store.client.hset(key, "envelope", b"{not json")
    wait_out()

    # When a recovery pass claims it without an on_corrupt handler, Then it reports a
    # CorruptRecord naming the key (and claims it again after the publish grace)
    report = store.recover(publish=Recorder().publish)
    assert report.publish_failed == 1
    [(task_id, error)] = report.errors
    assert task_id == "t1" and isinstance(error, CorruptRecord) and key in str(error)


def test_a_corrupt_envelope_is_parked_once_with_an_on_corrupt_handler(make_store):
    # Given an expired lease whose stored envelope is not JSON
    store = make_store(publish_grace=SHORT)
    acquire(store, "t1", A, ttl=SHORT)
    key = store.keys.message("t1")
    store.client.hset(key, "envelope", b"{not json")
    wait_out()
    # When recovery passes run with an on_corrupt handler (the Celery side parks)
    parked, rec = [], Recorder()
    report = store.recover(publish=rec.publish, on_corrupt=parked.append)
    wait_out()
    again = store.recover(publish=rec.publish, on_corrupt=parked.append)
    # Then it is handed over once, naming the key and field, and leaves the index
    assert (report.corrupt, report.publish_failed, again.corrupt) == (1, 0, 0)
    (claim,) = parked
    assert claim.error.key == key and claim.error.field == "envelope" and claim.body == BODY
    assert rec.published == [] and store.client.zscore(store.keys.deadlines, "t1") is None


def test_a_corrupt_envelope_does_not_starve_the_healthy_leases_of_its_batch(make_store):
    """(Was a bug: one corrupt envelope stopped the whole batch from being published.)"""
    # Given two expired leases, one with a corrupt envelope
    store = make_store(publish_grace=SHORT)
    acquire(store, "healthy", A, ttl=SHORT)
    acquire(store, "corrupt", A, ttl=SHORT)
    store.client.hset(store.keys.message("corrupt"), "envelope", b"{not json")
    wait_out()

    # When two recovery passes run
    rec = Recorder()
    reported = []
    for _ in range(2):
        try:
            report = store.recover(publish=rec.publish)
            reported += [str(exc) for _task, exc in report.errors]
        except CorruptRecord as exc:
            reported.append(str(exc))
        wait_out()

    # Then the corrupt record is reported by key, and the healthy lease re-published
    assert any(store.keys.message("corrupt") in r for r in reported)
    assert [c.task_id for c in rec.published] == ["healthy"]


def test_an_unreachable_server_is_lease_unavailable_naming_the_address():
    # Given a store pointing at a closed port
    port = free_port()
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0))
    store = LeaseStore(client, prefix="unreachable")

    # When any call is made, Then it raises LeaseUnavailable naming host and port
    for call in (lambda: store.acquire("t1", A),
                 lambda: store.renew_many(A, {"t1": 1}),
                 lambda: store.get("t1"),
                 lambda: store.recover(publish=Recorder().publish)):
        with pytest.raises(LeaseUnavailable) as unavailable:
            call()
        assert f"127.0.0.1:{port}" in str(unavailable.value)


def test_finish_with_an_unknown_outcome_is_a_value_error_naming_the_task(store):
    # Given A holds a lease
    acq = acquire(store, "t1", A)

    # When A finishes with an outcome that does not exist
    with pytest.raises(ValueError, match="t1") as bad:
        store.finish("t1", A, acq.token, "exploded")

    # Then the error names the outcome, and the lease is untouched
    assert "exploded" in str(bad.value)
    assert store.get("t1").state == "active"


