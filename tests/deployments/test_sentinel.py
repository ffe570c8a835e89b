"""Redis Sentinel: ``leases_redis_url = "sentinel://..."`` follows a failover.

A real group on loopback (one master, one replica, three Sentinels,
``tests.support.sentinel.RedisSentinelGroup``); the master is SIGKILLed and
Sentinel promotes the replica. Broker and results stay on the suite's plain
Redis. ``make sentinel`` runs the long variant (several failovers in a row).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

import celery_leases
from celery_leases import ConfigurationError, LeaseStore
from celery_leases.protocol.codes import Code
from celery_leases.config import get_config
from celery_leases.protocol.connection import connect, describe, redact
from celery_leases.testing.servers import free_port
from tests.support.workers import CELERY, ROOT, Worker
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"
ENVELOPE = {"exchange": "", "routing_key": "unused", "headers": {}, "properties": {},
            "content_type": "application/json", "content_encoding": "utf-8"}
#: Failovers in a row for the long variant (``make sentinel``); 1 in ``make test``.
ROUNDS = int(os.environ.get("LEASES_SENTINEL_ROUNDS", "1"))


# -- settings: no servers needed ------------------------------------------------------


def test_a_sentinel_url_without_master_name_is_an_error_naming_the_setting():
    app = Celery("s", broker="redis://127.0.0.1:1/0")
    app.conf.update(leases_redis_url="sentinel://:s3cret@127.0.0.1:1;sentinel://127.0.0.1:2")
    with pytest.raises(ConfigurationError, match="leases_redis_transport_options has no master_name") as err:
        get_config(app)
    assert "s3cret" not in str(err.value)


def test_a_sentinel_broker_lends_its_transport_options_to_the_lease_store():
    # Given a Sentinel broker and no leases_redis_url: the broker's options apply
    app = Celery("s", broker="sentinel://127.0.0.1:1;sentinel://127.0.0.1:2")
    app.conf.broker_transport_options = {"master_name": "mymaster", "visibility_timeout": 7200}
    config = get_config(app)
    assert config.redis_url == app.conf.broker_url
    assert config.redis_transport_options["master_name"] == "mymaster"

    # ... but a lease store of its own does not borrow them
    other = Celery("s", broker="sentinel://127.0.0.1:1")
    other.conf.update(broker_transport_options={"master_name": "mymaster"},
                      leases_redis_url="sentinel://127.0.0.1:3")
    with pytest.raises(ConfigurationError, match="leases_redis_transport_options"):
        get_config(other)

    # ... and a broker without master_name is named as the source of the problem
    bare = Celery("s", broker="sentinel://127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="broker_transport_options has no master_name"):
        get_config(bare)


def test_django_settings_name_the_transport_options_as_written():
    class Settings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_LEASES_REDIS_URL = "sentinel://127.0.0.1:1"
        CELERY_LEASES_REDIS_TRANSPORT_OPTIONS = {"master_name": "django-master"}

    app = Celery("django_proj")
    app.config_from_object(Settings, namespace="CELERY")
    assert get_config(app).redis_transport_options == {"master_name": "django-master"}

    del Settings.CELERY_LEASES_REDIS_TRANSPORT_OPTIONS
    app = Celery("django_proj")
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="CELERY_LEASES_REDIS_TRANSPORT_OPTIONS has no master_name"):
        get_config(app)


@pytest.mark.parametrize("url, options, named", [
    ("sentinel://127.0.0.1:1;redis://127.0.0.1:2", {"master_name": "m"}, "part 2"),
    ("sentinel://:a@127.0.0.1:1;sentinel://:b@127.0.0.1:2", {"master_name": "m"}, "only the first"),
    ("sentinel://127.0.0.1:1", {"master_name": "m", "sentinel_kwargs": "password"}, "sentinel_kwargs"),
    ("sentinel://127.0.0.1:1", {"master_name": "m", "min_other_sentinels": -1}, "min_other_sentinels"),
    ("sentinel://127.0.0.1:1", ["master_name", "m"], "must be a dict"),
])
def test_bad_sentinel_settings_are_refused_at_install(url, options, named):
    app = Celery("s", broker="redis://127.0.0.1:1/0")
    app.conf.update(leases_redis_url=url, leases_redis_transport_options=options)
    with pytest.raises(ConfigurationError, match=named) as err:
        celery_leases.install(app)
    assert ":a@" not in str(err.value) and ":b@" not in str(err.value)


def test_a_worker_with_a_sentinel_url_but_no_master_name_does_not_start(celery_env, redis_server_url, tmp_path):
    worker = Worker("no-master", {**celery_env, "LEASES_TEST_LEASES_URL": "sentinel://:s3cret@127.0.0.1:1",
                                  "LEASES_TEST_HISTORY_URL": redis_server_url}, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="leases_redis_transport_options has no master_name") as err:
        worker.start(timeout=30)
    worker.kill()
    assert "s3cret" not in str(err.value)


def test_the_sentinel_client_carries_the_data_node_password_and_sentinel_kwargs():
    # (no server: the client is built without connecting)
    client = connect("sentinel://:nodepw@127.0.0.1:1/3;sentinel://127.0.0.1:2",
                     transport_options={"master_name": "m", "sentinel_kwargs": {"password": "sentpw"}},
                     socket_timeout=1.5)
    pool = client.connection_pool
    assert (pool.service_name, pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == \
        ("m", "nodepw", 3)
    assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [1, 2]
    # Sentinel's own password and the socket timeouts reach the Sentinel connections
    sentinel_kwargs = pool.sentinel_manager.sentinel_kwargs
    # (redis-py >= 8.2 adds a "retry" of its own when none is given)
    assert {k: sentinel_kwargs[k] for k in sentinel_kwargs if k != "retry"} == \
        {"password": "sentpw", "socket_timeout": 1.5}
    assert describe(client) == "Sentinel master m/3 (via 127.0.0.1:1, 127.0.0.1:2)"
    assert redact("sentinel://:nodepw@127.0.0.1:1/3;sentinel://127.0.0.1:2") == \
        "sentinel://:***@127.0.0.1:1/3;sentinel://127.0.0.1:2"


def test_a_sentinel_store_never_writes_results_for_a_backend_on_localhost():
    # The finish script writes the result itself only when the backend is the store's own
    # server; a Sentinel client has no fixed host, which must not read as localhost:6379.
    from celery_leases.task.results import shares_server
    app = Celery("s", backend="redis://127.0.0.1:6379/0", set_as_current=False)
    store = LeaseStore(connect("sentinel://127.0.0.1:26379/0", transport_options={"master_name": "m"}))
    assert not shares_server(app.backend, store)
    assert shares_server(app.backend, LeaseStore(connect("redis://localhost:6379/0")))


# -- a real failover --------------------------------------------------------------------


def test_store_and_worker_follow_a_sentinel_failover(sentinel_group, celery_env, start_worker, history,
                                                     redis_server_url, key_prefix):
    group = sentinel_group
    ttl = 6.0
    env = {"LEASES_TEST_LEASES_URL": group.url,
           "LEASES_TEST_LEASES_TRANSPORT": json.dumps(group.transport_options),
           "LEASES_TEST_HISTORY_URL": redis_server_url, "LEASES_TEST_TTL": str(ttl)}
    from tests.support.apps.leased_app import create_app
    app = create_app({**celery_env, **env})
    worker = start_worker("s", concurrency=1, **env)
    group.wait_ready()
    # Given a store through the Sentinel URL, as the worker uses it
    claims: list = []
    store = LeaseStore.from_url(group.url, transport_options=group.transport_options,
                                prefix=f"{key_prefix}-store", ttl=ttl, publish=claims.append)
    assert store.description.startswith("Sentinel master leases/0")
    tokens: list[int] = []

    for round_ in range(ROUNDS):
        # ... leases that are held, one to finish, one to recover, and a running leased task
        held = {f"renew-{round_}": 0, f"finish-{round_}": 0, f"recover-{round_}": 0}
        for task_id in held:
            acq = store.acquire(task_id, "owner-1", name=f"{TASKS}.add", body=b"{}", envelope=ENVELOPE)
            assert acq.code is Code.ACQUIRED
            held[task_id] = acq.token
        tokens += held.values()
        result = app.signature(f"{TASKS}.sleep_then_echo", (f"v{round_}",), {"seconds": 8}).delay()
        wait_for(lambda: any(h[0] == "start" and h[1] == result.id for h in history()), 20,
                 what="the leased task to start")
        task_token = store_for(app).get(result.id).token
        group.wait_replicated()
        before = store_for(app).get(result.id).deadline

        # When the master is SIGKILLed and Sentinel promotes the replica
        old = group.kill_master()
        promoted = group.wait_for_failover(old.port)
        assert promoted.port != old.port
        # (the CLI runs meanwhile, through the same settings: it reads the promoted master)
        stats = subprocess.Popen([CELERY, "-A", TASKS, "leases", "stats", "--json"], cwd=str(ROOT),
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), **celery_env, **env})

        # Then the same store client renews, finishes and recovers on the new master
        assert store.renew_many("owner-1", {t: held[t] for t in (f"renew-{round_}", f"finish-{round_}")}) == {}
        store.finish(f"finish-{round_}", "owner-1", held[f"finish-{round_}"], "succeeded")
        assert store.get(f"finish-{round_}").state == "succeeded"
        store.release("owner-1", {f"recover-{round_}": held[f"recover-{round_}"]})
        report = store.recover()
        assert report.recovered == 1 and claims[-1].task_id == f"recover-{round_}"
        assert store.get(f"renew-{round_}").state == "active"
        # ... tokens keep growing: the sequence counter was replicated too
        fresh = store.acquire(f"fresh-{round_}", "owner-2", name=f"{TASKS}.add")
        assert fresh.token > max(tokens)
        tokens.append(fresh.token)

        # ... the worker's heartbeat renews its lease on the new master, while the task runs
        wait_for(lambda: store_for(app).get(result.id).deadline > before, ttl,
                 what="the worker to renew its lease on the promoted master")
        # ... and the task finishes once, under the token it started with
        assert result.get(timeout=30) == f"v{round_}"
        out, err = stats.communicate(timeout=60)
        assert stats.returncode == 0, (out, err)
        assert json.loads(out)["store"].startswith("Sentinel master leases/0 (via 127.0.0.1:")
        record = store_for(app).get(result.id)
        assert (record.state, record.token) == ("succeeded", task_token)
        assert [h[0] for h in history() if h[1] == result.id] == ["start", "end"]
        tokens.append(task_token)
        # (finished, so they do not expire into the next round's recovery pass)
        store.finish(f"renew-{round_}", "owner-1", held[f"renew-{round_}"], "succeeded")
        store.finish(f"fresh-{round_}", "owner-2", fresh.token, "succeeded")

        if round_ + 1 < ROUNDS:
            # The old master comes back; Sentinel turns it into a replica of the new one
            old.start()
            wait_for(lambda: old.client().info("replication").get("role") == "slave" and
                     old.client().info("replication").get("master_link_status") == "up", 30,
                     what="the old master to rejoin as a replica")

    assert "Traceback" not in worker.log(), worker.log()[-3000:]
    # the start-up checks ran through the Sentinel client too, naming the store without a password
    assert "lease store Sentinel master leases/0 (via 127.0.0.1:" in worker.log()
    app.close()


def store_for(app) -> LeaseStore:
    return celery_leases.store(app)


def test_no_sentinel_answering_is_a_clear_unavailable_error(key_prefix):
    # (no retries: redis-py's default backoff would only make the test slower)
    no_retry = Retry(NoBackoff(), 0)
    client = connect(f"sentinel://:pw@127.0.0.1:{free_port()}",
                     transport_options={"master_name": "mymaster", "sentinel_kwargs": {"retry": no_retry}},
                     retry=no_retry)
    store = LeaseStore(client, key_prefix)
    with pytest.raises(celery_leases.LeaseUnavailable, match="Sentinel master mymaster/0") as err:
        store.server_time_ms()
    assert "No master found for 'mymaster'" in str(err.value) and ":pw" not in str(err.value)
