"""The lease store and real workers on a real local Redis Cluster, including master failovers.

One cluster for the module: three masters with one replica each on loopback
ports (``RedisClusterServer``), a low ``cluster-node-timeout`` so a killed
master's replica is promoted in about two seconds. The tests that fail a
master over run last, each killing a different master (three in all).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from uuid import uuid4

import pytest
from redis.crc import key_slot

from celery_leases.worker.checks import run_checks
from celery_leases.protocol.codes import Code
from celery_leases.config import get_config
from celery_leases.protocol.connection import connect, describe
from celery_leases.exceptions import ConfigurationError, LeaseLost, LeaseUnavailable
from celery_leases.protocol.keys import Keys
from celery_leases.testing import wait_for
from celery_leases.protocol.admin import expire_now, other_layout
from celery_leases.protocol.store import LeaseStore
from tests.support.cluster import SHARDS, master_port, spread_prefix, task_ids_on_every_shard, wait_replicated
from tests.support.workers import CELERY, ROOT

TASKS = "tests.support.apps.leased_app"


# -- URLs ------------------------------------------------------------------------


def test_cluster_url_errors_name_the_setting_and_hide_the_password():
    with pytest.raises(ConfigurationError, match=r"leases_redis_url redis\+cluster://u:\*\*\*@h:1/3.*database 0"):
        connect("redis+cluster://u:secret@h:1/3")
    with pytest.raises(ConfigurationError, match="port 'x' of node 'h' is not a number") as info:
        connect("redis+cluster://u:secret@h:x")
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="unknown option 'db'"):
        connect("redis+cluster://h:1?db=2")


def test_acl_user_and_password_reach_every_node(cluster):
    # Given a user with a password on every node (the default user is left alone)
    for node in cluster.nodes:
        with node.client() as c:
            c.execute_command("ACL", "SETUSER", "leases", "on", ">s3cret", "~*", "&*", "+@all")
    url = cluster.url.replace("redis+cluster://", "redis+cluster://leases:s3cret@")
    # When the store connects with the URL's credentials
    client = connect(url)
    try:
        store = LeaseStore(client, f"t{uuid4().hex[:10]}", shards=3)
        # Then it works as that user, and describing the store shows no password
        assert store.acquire("a", "w").owned
        assert client.acl_whoami() == "leases"
        assert "s3cret" not in store.description and store.description.startswith("redis+cluster://127.0.0.1:")
    finally:
        client.close()
    refused = "leases_redis_url .*leases:\\*\\*\\*@.*invalid username-password"
    with pytest.raises(LeaseUnavailable, match=refused) as info:
        connect(url.replace("s3cret", "wrong"))
    assert "wrong" not in str(info.value)


# -- the store, sharded over the masters ---------------------------------------------------


def test_one_shard_keeps_todays_key_names_and_one_slot():
    keys = Keys("app")
    assert (keys.record("t"), keys.message("t"), keys.deadlines, keys.sequence, keys.stats) == (
        "{app}:lease:t", "{app}:msg:t", "{app}:deadlines", "{app}:seq", "{app}:stats")
    sharded = Keys("app", 4)
    s = sharded.shard_of("t")
    assert sharded.record("t") == f"{{app:{s}}}:lease:t"
    assert key_slot(sharded.record("t").encode()) == key_slot(sharded.shard(s).deadlines.encode())
    assert sharded.fence("r") == "{app}:fence:r" and sharded.recovery_guard == "{app}:recovery-guard"
    with pytest.raises(ValueError, match="leases_shards must be an integer >= 1"):
        Keys("app", 0)


def test_store_main_paths_across_shards_on_three_masters(client):
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30, publish_grace=5)
    ids = task_ids_on_every_shard(store.keys, per_shard=3)
    assert len({master_port(client, store.keys.record(t)) for t in ids}) == 3

    # acquire: every task of every shard, each token above the clock floor
    tokens = {}
    for t in ids:
        acq = store.acquire(t, "w1", body=b"body-" + t.encode(), envelope={"id": t}, name="job")
        assert acq.code is Code.ACQUIRED
        tokens[t] = acq.token
    # mark_started: one call per shard (the bodies run, so their deaths count recoveries)
    assert store.mark_started("w1", tokens) == len(ids)
    # renew_many: one call per shard, all renewed, deadlines pushed on every shard, even when the
    # masters lost their script cache (as after a restart or failover: NOSCRIPT, then the full source)
    before = {t: store.get(t).deadline for t in ids}
    time.sleep(0.01)
    for node in client.get_primaries():
        client.get_redis_connection(node).script_flush()
    assert store.renew_many("w1", tokens) == {}
    assert all(store.get(t).deadline > before[t] for t in ids)
    # a lease of another owner is reported, not renewed
    assert store.renew_many("w2", {ids[0]: tokens[ids[0]]}) == {ids[0]: Code.LOST}

    # finish: one task per shard succeeds
    finished = ids[::3]
    for t in finished:
        store.finish(t, "w1", tokens[t], "succeeded")
    with pytest.raises(LeaseLost):
        store.finish(finished[0], "w1", tokens[finished[0]], "failed")

    # recover: expire one task per shard; one pass claims them on every shard
    expired = ids[1::3]
    for t in expired:
        assert expire_now(store, t)
    published = []
    report = store.recover(publish=published.append)
    assert report.recovered == len(expired) and sorted(c.task_id for c in published) == sorted(expired)
    assert all(c.body == b"body-" + c.task_id.encode() and c.envelope == {"id": c.task_id} for c in published)
    # the recovered copies acquire again: new tokens, strictly above the old ones of the same task
    for claim in published:
        acq = store.acquire(claim.task_id, "w2", generation=claim.generation)
        assert acq.code is Code.ACQUIRED and acq.token > tokens[claim.task_id]
        assert store.get(claim.task_id).recoveries == 1
    # the old owner's renewal now learns it lost them
    assert store.renew_many("w1", {t: tokens[t] for t in expired}) == {t: Code.LOST for t in expired}

    # stats and listings aggregate every shard
    stats = store.stats()
    assert stats["acquired"] == len(ids) + len(expired)
    assert stats["recovered"] == len(expired) and stats["succeeded"] == len(finished)
    assert stats["indexed"] == len(ids) - len(finished)
    assert sorted(t for t, _ in store.active()) == sorted(set(ids) - set(finished))
    assert {r.task_id for r in store.scan(state="succeeded")} == set(finished)
    assert [r.task_id for r in store.records(ids)] == ids
    assert store.purge(dry_run=True) == len(finished)
    assert store.purge() == len(finished) and store.get(finished[0]) is None
    assert other_layout(store) is None


def test_sharded_store_on_one_server(redis_client, key_prefix):
    # Given a single Redis and four shards: the per-shard calls share one pipelined round trip
    store = LeaseStore(redis_client, key_prefix, shards=4, ttl=30)
    ids = task_ids_on_every_shard(store.keys, per_shard=2)
    tokens = {t: store.acquire(t, "w", body=b"b", envelope={}).token for t in ids}
    assert store.renew_many("w", tokens) == {}
    assert store.renew_many("x", tokens) == {t: Code.LOST for t in ids}
    for t in ids[:4]:
        expire_now(store, t)
    claimed = []
    assert store.recover(publish=claimed.append, limit=3).recovered == 3
    assert store.recover(publish=claimed.append).recovered == 1
    assert sorted(c.task_id for c in claimed) == sorted(ids[:4])
    assert store.release("w", {t: tokens[t] for t in ids[4:]}) == len(ids) - 4
    assert store.stats()["indexed"] == len(ids) - 4 and len(store.scan()) == len(ids)
    assert {r.task_id for r in store.scan()} == set(ids)


def test_tokens_of_different_shards_follow_the_masters_clock(client):
    # Given tasks on different shards (so different masters and sequences), acquired one after another
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS)
    ids = task_ids_on_every_shard(store.keys, per_shard=2)
    tokens = []
    for t in ids:
        tokens.append(store.acquire(t, "w").token)
        time.sleep(0.002)  # more than the clock resolution (1 ms) and the skew of one host's clocks (0)
    # Then each later acquisition has a greater token, whatever its shard
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    # and a fenced write of an earlier owner after a later one is refused, across shards
    from celery_leases.protocol.fencing import fenced_set
    assert fenced_set(client, prefix, "r", tokens[-1], "late")
    assert not fenced_set(client, prefix, "r", tokens[0], "early", raise_on_stale=False)


def test_changing_the_shard_count_is_reported_by_the_startup_check(client):
    from celery import Celery
    prefix = f"t{uuid4().hex[:10]}"
    old = LeaseStore(client, prefix)
    old.acquire("x", "w")
    app = Celery("shards-check", set_as_current=False)
    app.conf.update(leases_redis_url="redis+cluster://127.0.0.1:1", leases_key_prefix=prefix, leases_shards=4)
    new = LeaseStore(client, prefix, shards=4)
    findings = [f for f in run_checks(app, get_config(app), new) if f.check == "shards"]
    assert len(findings) == 1 and "1 live lease(s)" in findings[0].message
    assert "leases_shards=1" in findings[0].message and "leases_shards=4" in findings[0].message
    # Once the old layout holds no live lease the new count is recorded; going back is reported too
    old.finish("x", "w", old.get("x").token, "succeeded")
    assert other_layout(new) is None
    new.acquire("y", "w")
    assert other_layout(old) == (4, 1)


def test_shards_setting_is_validated_with_its_name():
    from celery import Celery
    app = Celery("bad-shards", set_as_current=False)
    app.conf.update(leases_redis_url="redis://127.0.0.1:1/0", leases_shards=0)
    with pytest.raises(ConfigurationError, match="leases_shards must be an integer >= 1, got 0"):
        get_config(app)
    app.conf.update(leases_shards="many")
    with pytest.raises(ConfigurationError, match="leases_shards must be an integer"):
        get_config(app, shards="many")


# -- real workers whose lease store is the cluster ------------------------------------------


def test_worker_on_cluster_survives_a_sigkill_and_a_master_failover(
        cluster, client, celery_env, start_worker, client_app):
    # Given workers whose broker/backend is the suite's standalone Redis and whose lease store is the cluster
    env = {"LEASES_TEST_LEASES_URL": cluster.url, "LEASES_TEST_SHARDS": str(SHARDS),
           "LEASES_TEST_WORKER_RECOVERY": "1"}
    celery_env.update(env)
    app = client_app
    store = LeaseStore(client, celery_env["LEASES_TEST_PREFIX"], shards=SHARDS)
    a = start_worker("a", pool="threads", concurrency=4, **env)
    # When they run leased tasks
    results = [app.send_task(f"{TASKS}.add", (i, i)) for i in range(8)]
    assert [r.get(timeout=20) for r in results] == [2 * i for i in range(8)]
    records = store.records([r.id for r in results])
    assert {r.state for r in records} == {"succeeded"} and len(records) == 8
    assert len({store.keys.shard_of(r.id) for r in results}) > 1
    # and a long task is running when its worker is SIGKILLed
    long = app.send_task(f"{TASKS}.sleep_then_echo", ("survivor", 6.0))
    # (once its start mark is in; on this threads worker -c 4 the death of its process is charged
    # as an uncertain recovery, never a recovery: other tasks could have caused it)
    first = wait_for(lambda: (r := store.get(long.id)) and r.state == "active" and r.started and r, 20,
                     "the long task's lease, marked started")
    a.kill()
    # Then another worker's recovery re-runs it from the cluster's record, under a greater token.
    # (Its ttl, 6 s, outlasts a failover: about 2.5 s with cluster-node-timeout 1.5 s.)
    start_worker("b", pool="threads", concurrency=2, LEASES_TEST_TTL="6", **env)
    again = wait_for(lambda: (r := store.get(long.id)) and r.unstarted_recoveries == 1 and r.state == "active"
                     and r.token > first.token and r, 30, "the recovered task to be running again")
    assert again.token > first.token and again.owner != first.owner
    # When the master holding that lease dies while the task runs, and its replica takes over
    victim = next(n for n in cluster.nodes if n.port == master_port(client, store.keys.record(long.id)))
    wait_replicated(client, victim, cluster.replicas_of(victim)[0])
    cluster.kill_master(victim)
    # Then the worker's heartbeat renews it on the new master and its outcome is accepted
    renewed = store.get(long.id).deadline
    wait_for(lambda: store.get(long.id).deadline > renewed, 10, "a heartbeat after the failover")
    assert long.get(timeout=20) == "survivor"
    done = store.get(long.id)
    assert (done.state, done.token, done.recoveries, done.unstarted_recoveries) == ("succeeded", again.token, 0, 1)
    # and the operators' CLI sees every shard of the cluster, without the URL's password
    out = subprocess.run([CELERY, "-A", TASKS, "leases", "stats", "--json"], cwd=str(ROOT),
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env})
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["store"].startswith("redis+cluster://127.0.0.1:")
    assert stats["counters"]["acquired"] == 10 and stats["counters"]["succeeded"] == 9
    assert stats["counters"]["recovered"] == 1 and stats["indexed"] == 0


# -- failover: a master dies, its replica is promoted ----------------------------------------


def test_leases_replicated_before_a_master_dies_survive_its_failover(cluster, client):
    # Given leases on every shard, and a master with its replica in sync (WAIT)
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30, publish_grace=5)
    ids = task_ids_on_every_shard(store.keys, per_shard=4)
    tokens = {t: store.acquire(t, "w1", body=b"b", envelope={}).token for t in ids}
    victim = next(m for m in cluster.masters() if cluster.replicas_of(m))
    victim_port = victim.port
    (replica,) = cluster.replicas_of(victim)
    on_victim = [t for t in ids if master_port(client, store.keys.record(t)) == victim_port]
    wait_replicated(client, victim, replica)
    # When the master is SIGKILLed and its replica promoted
    promoted = cluster.kill_master(victim)
    assert promoted is replica
    # Then every lease is still there with its token and owner
    records = {r.task_id: r for r in store.records(ids)}
    assert set(records) == set(ids)
    assert all(records[t].token == tokens[t] and records[t].owner == "w1" for t in ids)
    # heartbeat, finish and recovery keep working on the promoted master's shards
    assert store.renew_many("w1", tokens) == {}
    done, lapse = on_victim[0], on_victim[1]
    store.finish(done, "w1", tokens[done], "succeeded")
    assert expire_now(store, lapse)
    published = []
    assert store.recover(publish=published.append).recovered == 1 and published[0].task_id == lapse
    acq = store.acquire(lapse, "w2", generation=published[0].generation)
    assert acq.owned and acq.token > tokens[lapse]
    assert store.renew_many("w1", {lapse: tokens[lapse]}) == {lapse: Code.LOST}


def test_a_lease_not_yet_replicated_when_its_master_dies_is_lost_as_documented(cluster, client):
    # Given a master with a replica that has every write so far, then falls behind: the replica is
    # stopped and a large write fills the replication socket, so what follows stays in the master
    prefix = spread_prefix(client)
    store = LeaseStore(client, prefix, shards=SHARDS, ttl=30)
    masters = {n.port for n in cluster.masters() if cluster.replicas_of(n)}
    ids = [t for t in task_ids_on_every_shard(store.keys, per_shard=4)
           if master_port(client, store.keys.record(t)) in masters]
    kept, lost = ids[0], next(t for t in ids[1:] if master_port(client, store.keys.record(t))
                              == master_port(client, store.keys.record(ids[0])))
    victim = next(n for n in cluster.nodes if n.port == master_port(client, store.keys.record(kept)))
    (replica,) = cluster.replicas_of(victim)
    kept_token = store.acquire(kept, "w1").token
    wait_replicated(client, victim, replica)
    os.kill(replica.process.pid, signal.SIGSTOP)
    try:
        filler = store.keys.shard_for(kept).tag + ":filler"
        client.set(filler, b"x" * (48 << 20))  # beyond the loopback socket buffers
        # When a lease is acquired on the master while the replica cannot receive it, and the master dies
        lost_token = store.acquire(lost, "w1").token
    finally:
        promoted = cluster.kill_master(victim, replicas=[replica],
                                       on_killed=lambda: os.kill(replica.process.pid, signal.SIGCONT))
    assert promoted is replica
    # Then the replicated lease survives, the unreplicated one is gone with the master:
    assert store.get(kept).token == kept_token
    assert store.get(lost) is None
    # its owner learns at its next heartbeat that the record is missing (the worker flags the lease lost)
    assert store.renew_many("w1", {kept: kept_token, lost: lost_token}) == {lost: Code.MISSING}
    # no recovery re-runs it (it is in no deadline index)
    assert lost not in store.expired()
    # a new task on that master still gets a token above the lost one (tokens on a cluster
    # follow the masters' clocks)
    fresh = next(t for t in (f"fresh-{i}" for i in range(10_000))
                 if master_port(client, store.keys.record(t)) == master_port(client, store.keys.record(lost)))
    assert store.acquire(fresh, "w2").token > lost_token
    # and if its body finishes before a heartbeat re-created the record, the finish re-asserts
    # the holder's token: the outcome is accepted under that token, and a later delivery of
    # its message finds the task finished
    store.finish(lost, "w1", lost_token, "succeeded")
    record = store.get(lost)
    assert (record.state, record.token, record.owner) == ("succeeded", lost_token, "w1")
    assert store.acquire(lost, "w2").code is Code.FINISHED
    assert describe(client).startswith("redis+cluster://")


def test_parking_and_a_corrupt_claim_on_a_sharded_store_across_three_masters(client):
    # Given a sharded store on a cluster, expired leases on every shard, one record corrupt
    store = LeaseStore(client, spread_prefix(client), shards=SHARDS, ttl=30)
    ids = task_ids_on_every_shard(store.keys, 1)
    for task_id in ids:
        store.acquire(task_id, "w", body=b"b", envelope={"headers": {}})
        expire_now(store, task_id)
    bad = ids[0]
    client.hset(store.keys.record(bad), "state", "bogus")
    # When a recovery pass runs, Then every other shard's lease is recovered, the corrupt one handed
    # over for parking, and parking it (keys of one slot: the prefix's tag) works on the cluster
    parked: list = []
    report = store.recover(publish=lambda claim: None,
                           on_corrupt=lambda claim: (parked.append(claim.task_id),
                                                     store.park(claim.task_id, "corrupt", body=claim.body,
                                                                key=claim.error.key, field=claim.error.field)))
    assert (report.recovered, report.corrupt) == (len(ids) - 1, 1) and parked == [bad]
    assert len({key_slot(k.encode()) for k in (store.keys.parked, store.keys.parked_meta,
                                              store.keys.parked_body)}) == 1
    (entry,) = store.parked()
    assert (entry.task_id, entry.field) == (bad, "state")
    assert store.unpark(bad).body == b"b" and store.parked() == []
    assert store.reset_record(bad) and store.get(bad) is None
