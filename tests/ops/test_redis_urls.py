"""The lease store's URL: one rule (celery_leases/config/urls.py), the same message at every entry point.

Each bad form is tried where a user meets it:

- ``install(app)`` with the setting (before or after the app read its configuration);
- a real ``celery -A ... worker`` whose app gets the URL after ``install(app)`` (a later
  ``config_from_object``, Django settings): it exits 78 with the message in one CRITICAL line;
- ``celery -A ... leases stats`` with the same app: exit 78, the message on stderr;
- either command with the URL set before ``install(app)``: the app module does not import,
  and Celery exits 2 ("Unable to load celery application"), quoting the same message.

Every worker and command here runs against the session's throwaway redis-server (the broker
of tests/support/apps/misuse_app.py), never a shared one.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from celery import Celery

import celery_leases
from celery_leases import ConfigurationError
from celery_leases.config import client_config
from celery_leases.config.urls import ACCEPTED, redis_url_error
from celery_leases.protocol.connection import SCHEMES, connect
from tests.support.workers import CELERY, ROOT

APP = "tests.support.apps.misuse_app"

#: (id, URL, what the message says is wrong). No URL here points at a server that exists.
BAD = [
    ("not-redis", "http://127.0.0.1:6390/2", "the scheme 'http' is not one of them"),
    ("one-slash", "redis:/127.0.0.1:6390/2", "'redis:' must be followed by '//'"),
    ("no-slashes", "rediss:127.0.0.1:6390", "'rediss:' must be followed by '//'"),
    ("empty-host", "redis://:6390/2", "no host"),
    ("empty-host-with-password", "redis://:s3cret@:6390/2", "no host"),
    ("port-not-a-number", "redis://127.0.0.1:63a0/2", "the port must be a number from 1 to 65535"),
    ("port-out-of-range", "redis://127.0.0.1:99999/2", "the port must be a number from 1 to 65535"),
    ("db-not-a-number", "redis://127.0.0.1:6390/two", "the database must be a number"),
    ("db-two-levels", "redis://127.0.0.1:6390/2/3", "the database must be a number"),
    ("password-with-a-slash", "redis://:s3cret/x@127.0.0.1:6390/2", "must be %-encoded"),
    ("socket-without-path", "unix://", "no socket path"),
    ("sentinel-one-slash", "sentinel://127.0.0.1:26379;sentinel:/127.0.0.1:26380",
     "part 2: 'sentinel:' must be followed by '//'"),
    ("cluster-empty-node", "redis+cluster://127.0.0.1:7000,:7001", "a node has no host"),
    ("cluster-db", "redis+cluster://127.0.0.1:7000/2", "a Redis Cluster has only database 0"),
]
BAD_IDS = [case[0] for case in BAD]


def expected(url: str, setting: str = "leases_redis_url") -> str:
    message = redis_url_error(url, setting)
    assert message is not None, url
    return message


# -- the rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, url, why", BAD, ids=BAD_IDS)
def test_each_bad_form_is_named_with_the_setting_every_scheme_and_the_value_masked(name, url, why):
    message = expected(url)
    assert message.startswith(f"leases_redis_url must be a Redis URL ({ACCEPTED}): ")
    assert why in message
    assert "s3cret" not in message
    assert all(f"{s}://" in message for s in SCHEMES)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://localhost", "redis://h:6379/", "redis://[::1]:6379/15",
    "redis://leases:p%2Fw@h:6379/2", "redis://u:p@w@h:1/0", "rediss://h:6380/1?ssl_cert_reqs=required",
    "unix:///run/redis.sock", "unix:///run/redis.sock?db=3", "redis+socket:///run/redis.sock",
    "sentinel://h1:26379;sentinel://h2:26379", "sentinel://:pw@h1:26379/2;sentinel://:pw@h2:26379/2",
    "redis+cluster://a:7000,b:7001", "rediss+cluster://u:pw@a:7000/0?ssl_cert_reqs=none",
])
def test_every_form_the_connection_code_takes_is_accepted(url):
    assert redis_url_error(url) is None
    if "cluster" not in url:  # (a cluster client reads the slot map at once: tests/deployments)
        connect(url, transport_options={"master_name": "m"})  # builds the client, connects to nothing


def test_redis_socket_is_kombus_name_for_a_unix_socket():
    client = connect("redis+socket:///run/redis.sock?db=3")
    assert client.connection_pool.connection_kwargs["path"] == "/run/redis.sock"
    assert client.connection_pool.connection_kwargs["db"] == 3


# -- install(app) --------------------------------------------------------------------------------


@pytest.mark.parametrize("configured", [True, False], ids=["configured", "pending"])
@pytest.mark.parametrize("name, url, why", BAD, ids=BAD_IDS)
def test_install_refuses_each_bad_form_with_the_message(name, url, why, configured):
    app = Celery("urls", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.leases_redis_url = url
    if configured:
        app.conf.get("leases_ttl")
    with pytest.raises(ConfigurationError) as err:
        celery_leases.install(app)
    assert str(err.value) == expected(url)


@pytest.mark.parametrize("setting", ["broker_url", "result_backend"])
def test_a_bad_url_the_store_fell_back_to_is_named_by_its_own_setting(setting):
    url = "redis://:6390/0"
    conf = {"broker_url": "amqp://guest@localhost//", setting: url}
    app = Celery("urls", set_as_current=False)
    app.conf.update(conf)
    app.conf.get("leases_ttl")   # configured: (pending, a later config_from_object may set leases_redis_url)
    with pytest.raises(ConfigurationError) as err:
        celery_leases.install(app)
    setting_named = f"{setting} (the lease store's URL while leases_redis_url is not set)"
    assert str(err.value) == expected(url, setting_named)


def test_under_django_the_setting_is_named_as_written():
    class Settings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_LEASES_REDIS_URL = "redis:/127.0.0.1:6390/2"

    app = Celery("django_urls", set_as_current=False)
    celery_leases.install(app)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=re.escape("CELERY_LEASES_REDIS_URL must be a Redis URL")):
        client_config(app)


# -- a real worker, the CLI ----------------------------------------------------------------------


def run(args: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CELERY, "-A", APP, *args], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


#: A worker that must not start: solo (no children to leave behind), no mingle or gossip.
WORKER = ["worker", "-P", "solo", "-l", "info", "--without-mingle", "--without-gossip"]


@pytest.fixture
def env(redis_server_url, key_prefix) -> dict:
    return {"MISUSE_BROKER": redis_server_url, "MISUSE_PREFIX": key_prefix}


@pytest.mark.parametrize("name, url, why", BAD, ids=BAD_IDS)
def test_a_worker_given_a_bad_url_after_install_exits_78_with_the_message(env, redis_client, key_prefix,
                                                                        name, url, why):
    # Given a leased task waiting in the queue (sent by a correctly configured publisher)
    publisher = run(["call", f"{APP}.leased", "--args", "[7]"], env)
    assert publisher.returncode == 0, publisher.stderr
    assert redis_client.llen(key_prefix) == 1
    late = {**env, "MISUSE_LATE_SETTINGS": json.dumps({"leases_redis_url": url})}

    # When a worker starts with the URL set after install(app), Then it exits 78 in one line
    worker = run(WORKER, late)
    log = worker.stdout + worker.stderr
    assert worker.returncode == 78, log
    assert log.count(f"CRITICAL/MainProcess] celery-leases: worker not started: {expected(url)}\n") == 1, log
    assert "Traceback" not in log and " ready." not in log and "s3cret" not in log
    assert redis_client.llen(key_prefix) == 1 and redis_client.llen(f"{key_prefix}:ran") == 0

    # And `celery leases stats` says the same on stderr, exit 78 (EX_CONFIG, as the worker)
    stats = run(["leases", "stats"], late)
    assert (stats.returncode, stats.stdout) == (78, ""), stats
    assert stats.stderr == f"celery leases stats: error: {expected(url)}\n"
    stats = run(["leases", "stats", "--json"], late)
    assert stats.returncode == 78 and json.loads(stats.stderr) == {
        "error": expected(url), "kind": "configuration", "command": "stats", "status": 78}


@pytest.mark.parametrize("name, url, why", [BAD[1], BAD[9]], ids=[BAD_IDS[1], BAD_IDS[9]])
def test_a_bad_url_set_before_install_fails_the_app_import_with_the_message(env, name, url, why):
    # install(app) raises at import, so no celery command gets an app: Celery's own
    # "Unable to load celery application" (exit 2, a usage error) quotes the message.
    early = {**env, "MISUSE_SETTINGS": json.dumps({"leases_redis_url": url})}
    for args in (WORKER, ["leases", "stats"]):
        result = run(args, early)
        assert result.returncode == 2, (args, result)
        assert "Unable to load celery application" in result.stderr
        assert f"ConfigurationError: {expected(url)}" in result.stderr or expected(url) in result.stderr
        assert "s3cret" not in result.stdout + result.stderr
