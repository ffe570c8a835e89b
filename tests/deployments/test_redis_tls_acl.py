"""TLS (``rediss://``) and ACL (``redis://user:password@...``) lease stores, and secret redaction.

Real servers: a ``redis-server`` with a TLS port and a throwaway CA made with
``openssl`` in the test's directory, and one whose default user is disabled
and whose only user has a password. The store and a real ``celery worker``
run through each (broker and results stay on the suite's plain Redis). The
password must never appear in the worker's log or in ``celery leases``
output, on the happy path or on the error paths.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from celery import Celery

import celery_leases
from celery_leases import ConfigurationError, LeaseStore, LeaseUnavailable
from celery_leases.protocol.connection import redact
from celery_leases.testing.servers import RedisServer, RedisServerError, free_port
from tests.support.services import skip_or_fail
from tests.support.workers import CELERY, ROOT, Worker

TASKS = "tests.support.apps.leased_app"
#: The ACL user's password: characters that must be %-encoded in a URL, so both forms are checked.
PASSWORD = "s3cr#t/pw@9"
ENCODED = quote(PASSWORD, safe="")
#: A wrong password for the error paths: it must not be printed either.
WRONG = "Wr0ng#pw"


# -- servers --------------------------------------------------------------------------


def make_certificates(dir: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost (EC keys: fast)."""
    if shutil.which("openssl") is None:
        skip_or_fail("openssl not found: it makes the test CA and server certificate")
    paths = {name: dir / f"{name}" for name in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                "server.crt", "san.cnf")}
    paths["san.cnf"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        ["req", "-x509", *ec, "-keyout", paths["ca.key"], "-out", paths["ca.crt"], "-days", "1",
         "-subj", "/CN=celery-leases test CA"],
        ["req", *ec, "-keyout", paths["server.key"], "-out", paths["server.csr"],
         "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", paths["server.csr"], "-CA", paths["ca.crt"], "-CAkey", paths["ca.key"],
         "-CAcreateserial", "-out", paths["server.crt"], "-days", "1", "-extfile", paths["san.cnf"]],
    ):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)
    return paths


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """(server, rediss URL that verifies the certificate, CA path): a plain port for readiness,
    a TLS port for the test."""
    dir = tmp_path_factory.mktemp("tls")
    certs = make_certificates(dir)
    tls_port = free_port()
    server = RedisServer(dir=dir / "redis", extra_args=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs["server.crt"]),
        "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
        "--tls-auth-clients", "no"))
    try:
        server.start()
    except RedisServerError as exc:
        if "tls" in str(exc).lower():
            skip_or_fail(f"{server.executable} was built without TLS support (it refuses "
                         f"--tls-port): {str(exc).splitlines()[-1]}")
        raise
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs['ca.crt']}"
    yield server, url, certs["ca.crt"]
    server.stop()


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    """(server, URL of the ACL user): the default user is disabled."""
    server = RedisServer(dir=tmp_path_factory.mktemp("acl")).start()
    admin = server.client()
    # The least the store needs (docs/redis-deployments.md): its keys (the test prefixes start
    # with "t"), reads, writes and scripts; no @admin or @dangerous (CONFIG, FLUSHALL, ...).
    admin.execute_command("ACL", "SETUSER", "leases", "on", f">{PASSWORD}", "~{t*",
                          "+@read", "+@write", "+@scripting", "+@connection", "+time", "-@dangerous")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin.close()
    yield server, f"redis://leases:{ENCODED}@127.0.0.1:{server.port}/0"
    server.stop()


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in (PASSWORD, ENCODED, WRONG, quote(WRONG, safe="")):
            assert secret not in text, (secret, text[-3000:])


def cli(env: dict, *args: str) -> subprocess.Popen:
    """``celery leases ARGS`` started; ``finish()`` collects it (the runs overlap: ~2 s each)."""
    return subprocess.Popen([CELERY, "-A", TASKS, "leases", *args], cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# -- redaction, no server ------------------------------------------------------------------


@pytest.mark.parametrize("url, shown", [
    ("redis://leases:pw@127.0.0.1:6379/0", "redis://leases:***@127.0.0.1:6379/0"),
    ("rediss://:pw@h:6380/1?ssl_cert_reqs=required", "rediss://:***@h:6380/1?ssl_cert_reqs=required"),
    # an unencoded "/", "?" or "@" in a password: hidden up to the last "@"
    ("redis://u:p/w?x#y@h:1/0", "redis://u:***@h:1/0"),
    ("redis://u:p@w@h:1/0", "redis://u:***@h:1/0"),
    ("sentinel://:pw@a:1;sentinel://:pw@b:2", "sentinel://:***@a:1;sentinel://:***@b:2"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://leases@h:6379/0", "redis://leases@h:6379/0"),
])
def test_redact_hides_every_password(url, shown):
    assert redact(url) == shown


def test_a_malformed_url_is_refused_without_quoting_the_password():
    # An unencoded "/" makes the rest of the password the "port": the parser's message would quote it
    app = celery_leases.install(Celery("r", broker="redis://127.0.0.1:1/0", set_as_current=False))
    app.conf.leases_redis_url = "redis://:topsecret/tail@127.0.0.1:1/0"
    with pytest.raises(ConfigurationError, match="leases_redis_url") as err:
        celery_leases.store(app)
    assert "topsecret" not in str(err.value) and "tail" not in str(err.value)


# -- TLS ----------------------------------------------------------------------------------


def test_store_over_tls_verifies_the_server_certificate(tls_server, key_prefix):
    server, url, ca = tls_server
    # Given a rediss:// URL whose query options ask to verify the certificate against our CA
    store = LeaseStore.from_url(url, prefix=key_prefix)
    assert store.description == f"rediss://127.0.0.1:{url.split(':')[2].split('/')[0]}/0"
    # When leases are taken and finished, Then it works over TLS
    acq = store.acquire("t1", "w1", name="t")
    store.finish("t1", "w1", acq.token, "succeeded")
    assert store.get("t1").state == "succeeded"
    # ... the port speaks TLS only: a plain connection gets no answer
    plain = redis.Redis.from_url(url.replace("rediss://", "redis://").split("?")[0], socket_timeout=2)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    # ... and the options really reach the TLS layer: without our CA the certificate is refused
    unverified = LeaseStore.from_url(url.split("?")[0] + "?ssl_cert_reqs=required", prefix=key_prefix)
    with pytest.raises(LeaseUnavailable, match="certificate verify failed"):
        unverified.get("t1")


def test_worker_runs_a_leased_task_over_tls(tls_server, celery_env, start_worker, redis_server_url):
    server, url, ca = tls_server
    env = {"LEASES_TEST_LEASES_URL": url, "LEASES_TEST_HISTORY_URL": redis_server_url}
    from tests.support.apps.leased_app import create_app
    app = create_app({**celery_env, **env})
    worker = start_worker("tls", concurrency=1, **env)
    result = app.signature(f"{TASKS}.add", (20, 22)).delay()
    assert result.get(timeout=20) == 42
    record = celery_leases.store(app).get(result.id)
    assert record.state == "succeeded" and record.token > 0
    # the record is on the TLS server (read through its plain port), not on the broker's Redis
    assert server.client().exists(celery_leases.store(app).keys.record(result.id))
    assert not redis.Redis.from_url(redis_server_url).exists(celery_leases.store(app).keys.record(result.id))
    assert "Traceback" not in worker.log(), worker.log()[-3000:]
    app.close()


# -- ACL and redaction ---------------------------------------------------------------------


def test_store_with_an_acl_user_and_password(acl_server, key_prefix):
    server, url = acl_server
    store = LeaseStore.from_url(url, prefix=key_prefix)
    assert store.description == f"redis://leases@127.0.0.1:{server.port}/0"
    acq = store.acquire("t1", "w1", name="t")
    assert store.get("t1").token == acq.token
    # the default user is disabled: without the ACL user nothing gets in
    with pytest.raises(LeaseUnavailable) as anonymous:
        LeaseStore.from_url(f"redis://127.0.0.1:{server.port}/0", prefix=key_prefix).get("t1")
    assert "authenticat" in str(anonymous.value).lower()
    # a wrong password is a clear error that does not quote any password
    wrong = url.replace(ENCODED, "not-it")
    with pytest.raises(LeaseUnavailable, match="invalid username-password") as refused:
        LeaseStore.from_url(wrong, prefix=key_prefix).get("t1")
    assert "not-it" not in str(refused.value)


def test_worker_and_cli_never_print_the_password(acl_server, celery_env, start_worker, redis_server_url,
                                                tmp_path):
    server, url = acl_server
    env = {**celery_env, "LEASES_TEST_LEASES_URL": url, "LEASES_TEST_HISTORY_URL": redis_server_url}
    from tests.support.apps.leased_app import create_app
    app = create_app(env)

    # Given a worker whose lease store URL carries the ACL password, running a task
    worker = start_worker("acl", concurrency=1, **env)
    result = app.signature(f"{TASKS}.add", (1, 2)).delay()
    assert result.get(timeout=20) == 3
    assert celery_leases.store(app).get(result.id).state == "succeeded"
    # (the start-up checks, refused INFO by the ACL, said so naming the store: a place a URL could leak)
    assert f"INFO memory refused by redis://leases@127.0.0.1:{server.port}/0" in worker.log(), worker.log()

    # When the CLI counts the leases (its output names the store); and on the error paths, with a wrong
    # password and with an unreachable store (the right password still in its URL),
    # the CLI and a worker fail
    bad_password = {**env, "LEASES_TEST_LEASES_URL": url.replace(ENCODED, quote(WRONG, safe=""))}
    unreachable = {**env, "LEASES_TEST_LEASES_URL": url.replace(str(server.port), str(free_port()))}
    running = [cli(env, "stats", "--json"), cli(bad_password, "ls"), cli(unreachable, "stats")]
    broken = Worker("acl-bad", bad_password, concurrency=1, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="leases_redis_url"):
        broken.start(timeout=30)
    broken.kill()
    outputs = [finish(proc) for proc in running]
    assert [o.returncode for o in outputs] == [0, 69, 69], [(o.stdout, o.stderr) for o in outputs]
    assert f"redis://leases@127.0.0.1:{server.port}/0" in outputs[0].stdout
    assert "invalid username-password" in outputs[1].stderr and "unreachable" in outputs[2].stderr

    # Then the password is nowhere: not in stdout, stderr, nor any worker log
    assert_no_secret(*(o.stdout + o.stderr for o in outputs))
    assert_no_secret(*(p.read_text(errors="replace") for p in tmp_path.glob("*.log")))
    assert len(list(tmp_path.glob("*.log"))) == 2
    app.close()
