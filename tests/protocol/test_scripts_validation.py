"""Every script validates what it reads before it writes anything (real redis-server).

Redis does not roll back a script that fails half-way, so a script that wrote
part of a record before it met a corrupt field would leave a half-made lease.
For each script and each key and field it depends on, these tests corrupt it
(a non-number, an unknown state, a key of the wrong type, a missing field) and
check that every key the script touches is byte-for-byte unchanged afterwards
(``DUMP`` before and after), and that the answer names the key and the field.
Batch scripts report the corrupt record for its task alone (see also
tests/protocol/test_corrupt_records.py for the same on real workers).
"""
from __future__ import annotations

import logging

import pytest
import redis

from celery_leases import Claim, Code, CorruptRecord, LeaseStore
from celery_leases.protocol.admin import expire_now
from celery_leases.protocol.fencing import fenced_set

A, B = "worker-a:1:aaa", "worker-b:2:bbb"
ENVELOPE = {"exchange": "", "routing_key": "q", "headers": {}, "properties": {}}


@pytest.fixture
def store(redis_server_url, key_prefix):
    s = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=30,
                   publish_grace=30)
    yield s
    s.client.close()


def spoil(client: redis.Redis, key: str, kind: str, field: str = "") -> None:
    """Corrupt ``key`` the way ``kind`` says."""
    if kind == "type":  # a list where a hash (or a sorted set, or a string) should be
        client.delete(key)
        client.rpush(key, "not", "a", "hash")
    elif kind == "hash":  # a hash where a string or a sorted set should be
        client.delete(key)
        client.hset(key, "x", "y")
    elif kind == "nan":
        client.hset(key, field, "12x")
    elif kind == "state":
        client.hset(key, "state", "bogus")
    elif kind == "missing":
        client.hdel(key, field)
    elif kind == "value":
        client.set(key, "not-a-number")
    else:
        raise AssertionError(kind)


def dumps(client: redis.Redis, keys: list[str]) -> dict:
    return {k: (client.dump(k), client.pttl(k)) for k in keys}


def unchanged(client: redis.Redis, before: dict) -> None:
    after = dumps(client, list(before))
    changed = {k for k in before if before[k][0] != after[k][0]}
    assert changed == set(), f"keys written although the script found a corrupt one: {changed}"
    # A TTL set by a write would show as a new expiry; a countdown alone is fine.
    assert [k for k in before if (before[k][1] < 0) != (after[k][1] < 0)] == []


def expect_corrupt(call, key: str, field: str) -> CorruptRecord:
    with pytest.raises(CorruptRecord) as err:
        call()
    assert err.value.key == key and err.value.field == field, (err.value.key, err.value.field, str(err.value))
    assert key in str(err.value) and field in str(err.value)
    return err.value


def live(store: LeaseStore, task_id: str = "t1", owner: str = A, **kw):
    return store.acquire(task_id, owner, name="proj.add", body=b"body", envelope=ENVELOPE, **kw)


def keys_of(store: LeaseStore, task_id: str = "t1") -> list[str]:
    shard = store.keys.shard_for(task_id)
    return [store.keys.record(task_id), store.keys.message(task_id), shard.deadlines, shard.sequence,
            shard.stats]


RECORD = "record"
#: (what is corrupted, kind, field): "record" is the task's record hash; other names are Keys attributes.
ACQUIRE_CASES = [
    (RECORD, "type", "type"), (RECORD, "state", "state"), (RECORD, "missing", "state"),
    (RECORD, "nan", "token"), (RECORD, "missing", "token"), (RECORD, "nan", "generation"),
    (RECORD, "nan", "recoveries"), (RECORD, "nan", "attempt"), (RECORD, "nan", "hn"),
    ("deadlines", "type", "type"), ("sequence", "hash", "type"), ("sequence", "value", "value"),
    ("message", "type", "type"),
]


def target(store: LeaseStore, what: str, task_id: str = "t1") -> str:
    if what == RECORD:
        return store.keys.record(task_id)
    if what == "message":
        return store.keys.message(task_id)
    return getattr(store.keys.shard_for(task_id), what)


# -- single-task scripts: a CORRUPT answer, nothing written ---------------------------------


#: Each case against a record in each state acquire branches on, or none (where a field
#: of the record cannot be corrupted: only its key's type).
ACQUIRE_PARAMS = [(state, *case) for state in ("active", "recovering", "none") for case in ACQUIRE_CASES
                  if not (state == "none" and case[0] == RECORD and case[1] != "type")]


@pytest.mark.parametrize("record_state,what,kind,field", ACQUIRE_PARAMS,
                         ids=["-".join(p) for p in ACQUIRE_PARAMS])
def test_acquire(store, what, kind, field, record_state):
    # Given a record in each state acquire branches on (or none), and one thing corrupted
    if record_state != "none":
        acq = live(store)
        if record_state == "recovering":
            store.release(A, {"t1": acq.token})
            store.claim_expired(ids=["t1"])
    else:
        live(store, "other")  # the shard's keys exist
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    # When a delivery tries to acquire, Then CORRUPT names key and field, and nothing is written
    expect_corrupt(lambda: live(store, owner=B, generation=1), key, field)
    unchanged(store.client, before)


FINISH_CASES = [(RECORD, "type", "type"), (RECORD, "state", "state"), (RECORD, "missing", "state"),
                (RECORD, "nan", "token"), (RECORD, "missing", "token"), ("deadlines", "type", "type")]


@pytest.mark.parametrize("what,kind,field", FINISH_CASES, ids=[f"{w}-{k}-{f}" for w, k, f in FINISH_CASES])
@pytest.mark.parametrize("outcome", ["succeeded", "retry", "revoked"])
def test_finish(store, what, kind, field, outcome):
    acq = live(store)
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    expect_corrupt(lambda: store.finish("t1", A, acq.token, outcome, next_attempt=1), key, field)
    unchanged(store.client, before)


@pytest.mark.parametrize("kind,field", [("hash", "type"), ("value", "value")])
def test_finish_reasserting_a_vanished_record_checks_the_token_sequence_first(store, kind, field):
    # Given a holder whose record vanished (the store restarted empty) and a corrupt sequence
    acq = live(store)
    store.client.delete(store.keys.record("t1"))
    key = store.keys.shard_for("t1").sequence
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    # When its finish would re-assert the record, Then CORRUPT names the sequence, nothing written
    expect_corrupt(lambda: store.finish("t1", A, acq.token, "succeeded"), key, field)
    unchanged(store.client, before)


REVOKE_CASES = FINISH_CASES + [("message", "type", "type")]


@pytest.mark.parametrize("what,kind,field", REVOKE_CASES, ids=[f"{w}-{k}-{f}" for w, k, f in REVOKE_CASES])
@pytest.mark.parametrize("record_state", ["active", "recovering"])
def test_revoke(store, what, kind, field, record_state):
    acq = live(store)
    if record_state == "recovering":
        store.release(A, {"t1": acq.token})
        store.claim_expired(ids=["t1"])
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    expect_corrupt(lambda: store.revoke("t1"), key, field)
    unchanged(store.client, before)


PROGRESS_CASES = FINISH_CASES + [(RECORD, "nan", "ttl"), (RECORD, "missing", "ttl"),
                                 (RECORD, "nan", "progress_timeout")]


@pytest.mark.parametrize("what,kind,field", PROGRESS_CASES, ids=[f"{w}-{k}-{f}" for w, k, f in PROGRESS_CASES])
def test_progress(store, what, kind, field):
    acq = live(store, progress_timeout=10)
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    expect_corrupt(lambda: store.progress("t1", A, acq.token), key, field)
    unchanged(store.client, before)


STEP_CASES = [(RECORD, "type", "type"), (RECORD, "state", "state"), (RECORD, "missing", "state"),
              (RECORD, "nan", "token"), (RECORD, "missing", "token"), (RECORD, "nan", "step:s")]


@pytest.mark.parametrize("what,kind,field", STEP_CASES, ids=[f"{w}-{k}-{f}" for w, k, f in STEP_CASES])
def test_complete_step(store, what, kind, field):
    acq = live(store)
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, keys_of(store))
    expect_corrupt(lambda: store.complete_step("t1", A, acq.token, "s"), key, field)
    unchanged(store.client, before)


@pytest.mark.parametrize("kind,field", [("type", "type"), ("nan", "token")])
def test_fenced_write(store, kind, field):
    fenced_set(store.client, store.keys, "r", 5, "v")
    key = store.keys.fence("r")
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [key])
    expect_corrupt(lambda: fenced_set(store.client, store.keys, "r", 6, "w"), key, field)
    unchanged(store.client, before)


def test_expired_names_a_deadline_index_of_the_wrong_type(store, caplog):
    live(store)
    key = store.keys.deadlines
    spoil(store.client, key, "type")
    before = dumps(store.client, keys_of(store))
    assert store.expired() == []
    unchanged(store.client, before)
    assert any(key in r.getMessage() and "type" in r.getMessage() for r in caplog.records)


def test_a_corrupt_stats_counter_does_not_refuse_a_task_and_is_named_when_read(store):
    """Decision (docs/failure-modes.md): counters are best effort in the scripts, since a
    shared counter that cannot be counted must not refuse every task of its shard;
    reading the stats names it."""
    live(store, "other")
    stats = store.keys.stats
    store.client.hset(stats, "acquired", "12x")
    before = store.client.dump(stats)
    assert live(store).owned
    assert store.client.dump(stats) == before
    expect_corrupt(store.stats, stats, "acquired")
    spoil(store.client, stats, "type")
    acq = live(store, "t2")
    store.finish("t2", A, acq.token, "succeeded")
    assert store.client.type(stats) == b"list"


# -- batch scripts: the corrupt record is reported for its task alone --------------------


RENEW_CASES = [("type", "type"), ("state", "state"), ("missing", "state"), ("nan", "progress_deadline")]


@pytest.mark.parametrize("kind,field", RENEW_CASES, ids=[f"{k}-{f}" for k, f in RENEW_CASES])
def test_renew_many(store, kind, field, caplog):
    # Given two leases held by A (with progress timeouts), one of them corrupted
    a1, a2 = live(store, progress_timeout=10), live(store, "t2", progress_timeout=10)
    key = store.keys.record("t1")
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [key, store.keys.message("t1")])
    score = store.client.zscore(store.keys.deadlines, "t2")
    # When A renews both
    out = store.renew_many(A, {"t1": a1.token, "t2": a2.token}, ttl=60, check_progress=True)
    # Then t1 alone is not renewed (CORRUPT, logged naming key and field), t2 is, t1's keys untouched
    assert out == {"t1": Code.CORRUPT}
    assert store.client.zscore(store.keys.deadlines, "t2") > score
    unchanged(store.client, before)
    assert any(key in r.getMessage() and field in r.getMessage() for r in caplog.records
               if r.levelno >= logging.ERROR)


def test_renew_many_with_a_corrupt_deadline_index(store):
    a1 = live(store)
    spoil(store.client, store.keys.deadlines, "type")
    before = dumps(store.client, keys_of(store))
    assert store.renew_many(A, {"t1": a1.token}) == {"t1": Code.CORRUPT}
    unchanged(store.client, before)


CLAIM_CASES = [(RECORD, "type", "type"), (RECORD, "state", "state"), (RECORD, "missing", "state"),
               (RECORD, "nan", "generation"), (RECORD, "nan", "recoveries"),
               (RECORD, "nan", "max_recoveries"), (RECORD, "nan", "token"), (RECORD, "missing", "token"),
               ("message", "type", "type")]


@pytest.mark.parametrize("what,kind,field", CLAIM_CASES, ids=[f"{w}-{k}-{f}" for w, k, f in CLAIM_CASES])
def test_claim_expired(store, what, kind, field):
    # Given two expired leases, one with a corrupt record (or message hash)
    for task_id in ("t1", "t2"):
        live(store, task_id)
        expire_now(store, task_id)
    key = target(store, what)
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [store.keys.record("t1"), store.keys.message("t1")])
    # When a recovery pass claims them
    claims = {c.task_id: c for c in store.claim_expired(ids=["t1", "t2"])}
    # Then t2 is recovered, t1 is reported CORRUPT naming key and field, with its message if readable
    assert claims["t2"].code is Code.RECOVERED
    bad = claims["t1"]
    assert bad.code is Code.CORRUPT and (bad.error.key, bad.error.field) == (key, field)
    if what == RECORD:
        assert (bad.body, bad.envelope) == (b"body", ENVELOPE)
    # And t1's record and message are unchanged; it left the deadline index (not claimed every pass)
    unchanged(store.client, before)
    assert store.client.zscore(store.keys.deadlines, "t1") is None


def test_claim_expired_with_a_corrupt_deadline_index(store, caplog):
    live(store)
    spoil(store.client, store.keys.deadlines, "type")
    before = dumps(store.client, keys_of(store))
    assert store.claim_expired(ids=["t1"]) == []
    unchanged(store.client, before)
    assert any(store.keys.deadlines in r.getMessage() for r in caplog.records)


RELEASE_CASES = [("type", "type"), ("state", "state"), ("missing", "state"), ("nan", "token"),
                 ("missing", "token")]


@pytest.mark.parametrize("kind,field", RELEASE_CASES, ids=[f"{k}-{f}" for k, f in RELEASE_CASES])
def test_release(store, kind, field, caplog):
    a1, a2 = live(store), live(store, "t2")
    key = store.keys.record("t1")
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [key, store.keys.message("t1")])
    assert store.release(A, {"t1": a1.token, "t2": a2.token}) == 1
    unchanged(store.client, before)
    assert store.client.zscore(store.keys.deadlines, "t1") is not None  # not made due
    assert any(key in r.getMessage() and field in r.getMessage() for r in caplog.records)


def test_release_with_a_corrupt_deadline_index(store):
    a1 = live(store)
    key = store.keys.deadlines
    spoil(store.client, key, "type")
    before = dumps(store.client, keys_of(store))
    expect_corrupt(lambda: store.release(A, {"t1": a1.token}), key, "type")
    unchanged(store.client, before)


MARK_CASES = [("type", "type"), ("state", "state"), ("missing", "state"), ("nan", "generation")]


@pytest.mark.parametrize("kind,field", MARK_CASES, ids=[f"{k}-{f}" for k, f in MARK_CASES])
def test_mark_published(store, kind, field):
    # Given two claimed leases, one corrupted before its publish is confirmed
    for task_id in ("t1", "t2"):
        live(store, task_id)
        expire_now(store, task_id)
    claims = store.claim_expired(ids=["t1", "t2"])
    key = store.keys.record("t1")
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [key, store.keys.message("t1")])
    # When both are confirmed, Then t2 is, t1 is left (in the index: the next claim reports it)
    assert store.mark_published(claims) == 1
    unchanged(store.client, before)
    assert store.client.zscore(store.keys.deadlines, "t1") is not None
    assert store.client.zscore(store.keys.deadlines, "t2") is None


def test_mark_published_with_a_corrupt_deadline_index(store):
    live(store)
    expire_now(store, "t1")
    claims = store.claim_expired(ids=["t1"])
    spoil(store.client, store.keys.deadlines, "type")
    before = dumps(store.client, keys_of(store))
    assert store.mark_published(claims) == 0
    unchanged(store.client, before)


PURGE_CASES = [("type", "type"), ("state", "state"), ("missing", "state"), ("nan", "finished_at")]


@pytest.mark.parametrize("kind,field", PURGE_CASES, ids=[f"{k}-{f}" for k, f in PURGE_CASES])
def test_purge(store, kind, field, caplog):
    for task_id in ("t1", "t2"):
        acq = live(store, task_id)
        store.finish(task_id, A, acq.token, "succeeded")
    key = store.keys.record("t1")
    spoil(store.client, key, kind, field)
    before = dumps(store.client, [key])
    assert store.purge() == 1
    unchanged(store.client, before)
    assert not store.client.exists(store.keys.record("t2"))
    assert any(key in r.getMessage() and field in r.getMessage() for r in caplog.records)


def test_purge_with_a_corrupt_deadline_index(store, caplog):
    acq = live(store)
    store.finish("t1", A, acq.token, "succeeded")
    spoil(store.client, store.keys.deadlines, "type")
    before = dumps(store.client, keys_of(store))
    assert store.purge() == 0
    unchanged(store.client, before)


# -- recover: the pass goes on, the corrupt one is handed to on_corrupt -----------------


def test_recover_counts_and_hands_a_corrupt_claim_to_on_corrupt(store):
    for task_id in ("t1", "t2", "t3"):
        live(store, task_id)
        expire_now(store, task_id)
    store.client.hset(store.keys.record("t2"), "generation", "x")
    published, parked = [], []
    report = store.recover(publish=published.append, on_corrupt=parked.append)
    assert (report.recovered, report.corrupt, report.publish_failed) == (2, 1, 0)
    assert sorted(c.task_id for c in published) == ["t1", "t3"]
    (claim,) = parked
    assert isinstance(claim, Claim) and claim.task_id == "t2" and claim.error.field == "generation"
    assert claim.body == b"body" and claim.name == "proj.add"
    # And the next pass does not claim it again
    again = store.recover(publish=published.append, on_corrupt=parked.append)
    assert (again.corrupt, len(parked)) == (0, 1)
