"""Start-up checks against throwaway redis-servers configured the way operators get it wrong."""
from __future__ import annotations

import logging

import pytest
import redis
from celery import Celery

import celery_leases
from celery_leases import LeaseStore, LeaseUnavailable
from celery_leases.worker.checks import _CHECKS, FINDINGS, found, run_checks
from celery_leases.config import get_config
from celery_leases.worker.service import LeaseWorker
from celery_leases.testing.servers import RedisServer, free_port


@pytest.fixture
def server(tmp_path):
    """server("--maxmemory-policy", "allkeys-lru") -> a started RedisServer with those arguments."""
    started = []

    def start(*extra_args: str, appendonly: bool = False) -> RedisServer:
        srv = RedisServer(dir=tmp_path / f"redis-{len(started)}", appendonly=appendonly,
                          extra_args=extra_args)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.cleanup()


def app_for(url: str, **conf) -> Celery:
    app = Celery("checks", broker=url, backend=url)
    app.conf.update(leases_key_prefix="checks", **conf)
    return app


def check(url: str, **conf) -> dict:
    """Run the checks for an app on ``url``: {check name: finding}."""
    app = app_for(url, **conf)
    store = LeaseStore(redis.Redis.from_url(url), "checks")
    try:
        return {f.check: f for f in run_checks(app, get_config(app), store)}
    finally:
        store.client.close()


# -- eviction -------------------------------------------------------------------------


def test_an_evicting_policy_is_an_error_naming_it(server, caplog):
    srv = server("--maxmemory-policy", "allkeys-lru")
    with caplog.at_level(logging.INFO, logger="celery_leases.checks"):
        findings = check(srv.url)
    finding = findings["eviction"]
    assert finding.level == logging.ERROR and finding.severity == "ERROR" and not finding.skipped
    assert "allkeys-lru" in finding.message and "noeviction" in finding.message
    assert "never recovered" in finding.message
    assert ("celery_leases.checks", logging.ERROR) in [(r.name, r.levelno) for r in caplog.records
                                                       if "allkeys-lru" in r.getMessage()]


def test_a_volatile_policy_warns_about_finished_records(server):
    srv = server("--maxmemory-policy", "volatile-lru", "--maxmemory", "100mb")
    message = check(srv.url)["eviction"].message
    assert "volatile-lru" in message and "maxmemory is 104857600 bytes" in message
    assert "Records of running tasks have none" in message and "finished records" in message


def test_the_default_policy_is_no_eviction_finding(server):
    srv = server()
    assert "eviction" not in check(srv.url)


# -- persistence ------------------------------------------------------------------------


def test_no_aof_and_no_snapshots_is_a_persistence_error(server):
    srv = server()   # the test servers run with --save '' --appendonly no
    finding = check(srv.url)["persistence"]
    assert (finding.kind, finding.severity, finding.level) == ("no_persistence", "ERROR", logging.ERROR)
    assert "appendonly yes" in finding.message and "never recovered" in finding.message


def test_aof_satisfies_the_persistence_check_and_snapshots_alone_are_a_warning(server):
    assert "persistence" not in check(server(appendonly=True).url)
    assert "persistence" not in check(server("--save", "900 1", appendonly=True).url)
    finding = check(server("--save", "900 1").url)["persistence"]
    assert (finding.kind, finding.severity, finding.level) == ("rdb_only", "WARNING", logging.WARNING)
    assert "RDB snapshots only (save '900 1'" in finding.message


def test_a_renamed_config_command_skips_the_persistence_check_at_info(server, caplog):
    # Given a managed-Redis style server where CONFIG is renamed away
    srv = server("--rename-command", "CONFIG", "")
    with pytest.raises(redis.ResponseError):
        srv.client().config_get("save")
    # When the checks run
    with caplog.at_level(logging.INFO, logger="celery_leases.checks"):
        findings = check(srv.url)
    # Then the persistence check is skipped at INFO, and eviction is still checked (INFO memory)
    finding = findings["persistence"]
    assert finding.skipped and finding.level == logging.INFO
    assert "skipped" in finding.message and "CONFIG GET save" in finding.message
    assert "eviction" not in findings
    assert any(r.levelno == logging.INFO and "persistence check skipped" in r.getMessage()
               for r in caplog.records)


def test_an_acl_user_without_config_and_info_skips_both_without_showing_its_password(server):
    # Given a user allowed everything but CONFIG and INFO
    srv = server()
    srv.client().acl_setuser("limited", enabled=True, passwords=["+pw-s3cret"], keys=["*"],
                             channels=["*"], commands=["+@all", "-config", "-info"])
    url = f"redis://limited:pw-s3cret@127.0.0.1:{srv.port}/0"
    # When the checks run
    findings = check(url)
    # Then both Redis checks are skipped, saying why, and never print the password
    assert findings["eviction"].skipped and findings["persistence"].skipped
    assert "NOPERM" in findings["eviction"].message or "permission" in findings["eviction"].message
    assert all("s3cret" not in f.message for f in findings.values())


# -- Celery settings ---------------------------------------------------------------------------


def test_a_redis_visibility_timeout_below_the_ttl_is_a_warning(redis_server_url):
    findings = check(redis_server_url, leases_ttl=60,
                     broker_transport_options={"visibility_timeout": 30})
    finding = findings["visibility_timeout"]
    assert finding.level == logging.WARNING and finding.severity == "WARNING"
    assert "visibility_timeout (30s)" in finding.message and "leases_ttl (60s)" in finding.message
    # And the default (one hour) and non-Redis brokers are fine
    assert "visibility_timeout" not in check(redis_server_url, leases_ttl=60)
    assert "visibility_timeout" not in check(
        redis_server_url, leases_ttl=60, leases_redis_url=redis_server_url,
        broker_url="amqp://guest@localhost//", broker_transport_options={"visibility_timeout": 30})


def test_retention_not_above_the_visibility_timeout_is_a_warning(redis_server_url):
    finding = check(redis_server_url, leases_retention=600,
                    broker_transport_options={"visibility_timeout": 3600})["retention"]
    assert "leases_retention (600s)" in finding.message
    assert "retention" not in check(redis_server_url)   # one day > one hour


def test_a_heartbeat_interval_above_half_the_ttl_is_a_warning(redis_server_url):
    finding = check(redis_server_url, leases_ttl=10, leases_heartbeat_interval=6)["heartbeat"]
    assert "leases_heartbeat_interval (6s)" in finding.message and "ttl / 3" in finding.message
    assert "heartbeat" not in check(redis_server_url, leases_ttl=10, leases_heartbeat_interval=5)
    assert "heartbeat" not in check(redis_server_url, leases_ttl=10)   # ttl / 3


# -- wiring --------------------------------------------------------------------------------------


def test_worker_start_runs_the_checks_and_still_fails_without_redis(server, caplog):
    # Given an evicting lease store
    srv = server("--maxmemory-policy", "allkeys-random")
    app = app_for(srv.url, leases_worker_recovery=False)
    worker = LeaseWorker(app, get_config(app))
    # When the worker starts, Then it logs the finding at its severity (ERROR) and runs
    with caplog.at_level(logging.WARNING, logger="celery_leases.checks"):
        worker.start()
    try:
        assert any(r.name == "celery_leases.checks" and "allkeys-random" in r.getMessage()
                   and r.levelno == logging.ERROR for r in caplog.records)
    finally:
        worker.stop()
    # And with Redis unreachable, the start fails naming leases_redis_url, as before
    down = app_for(f"redis://:pw@127.0.0.1:{free_port()}/0", broker_connection_retry_on_startup=False)
    with pytest.raises(LeaseUnavailable, match="leases_redis_url"):
        LeaseWorker(down, get_config(down)).start()


def test_a_check_that_breaks_is_skipped_not_raised(redis_server_url, monkeypatch):
    app = app_for(redis_server_url)
    store = celery_leases.store(app)
    monkeypatch.setattr(store.client, "info", lambda *a, **k: 1 / 0)
    findings = {f.check: f for f in run_checks(app, get_config(app), store)}
    assert findings["eviction"].skipped and "ZeroDivisionError" in findings["eviction"].message


# -- severities ------------------------------------------------------------------------------------


def test_each_finding_has_one_severity_and_every_check_names_a_kind_of_finding():
    assert {k.severity for k in FINDINGS.values()} == {"ERROR", "WARNING"}
    for kind in FINDINGS:
        finding = found(kind, "x")
        assert finding.severity == FINDINGS[kind].severity and not finding.skipped
        assert finding.level == {"ERROR": logging.ERROR, "WARNING": logging.WARNING}[finding.severity]
    startup = {k.check for k in FINDINGS.values() if k.at_worker_start}
    assert startup == {name for name, _ in _CHECKS}


def test_the_worker_logs_each_finding_at_the_level_the_doctor_reports_it(server, caplog):
    # Given a store that evicts, has no persistence, and settings that weaken the lease
    srv = server("--maxmemory-policy", "allkeys-lru")
    app = app_for(srv.url, leases_ttl=60, leases_retention=30, leases_heartbeat_interval=40,
                  broker_transport_options={"visibility_timeout": 30})
    store = LeaseStore(redis.Redis.from_url(srv.url), "checks")
    # When a worker's start-up checks run, and the doctor looks at the same deployment
    with caplog.at_level(logging.INFO, logger="celery_leases.checks"):
        findings = run_checks(app, get_config(app), store)
    from celery_leases.ops.diagnosis import diagnose
    doctor = {(f.check, f.message): f.severity for f in diagnose(app, scan=False, observe=0)}
    # Then each finding has one level: the worker's log line, the doctor's line, the table
    logged = {r.getMessage().removeprefix("celery-leases: "): r.levelname for r in caplog.records}
    assert {f.kind for f in findings} == {"eviction", "no_persistence", "visibility_timeout",
                                          "retention", "heartbeat"}
    for f in findings:
        assert logged[f.message] == doctor[(f.check, f.message)] == FINDINGS[f.kind].severity, f
    store.client.close()


def test_the_table_of_severities_in_the_operations_guide_is_the_code_s():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = text.split("### Findings and their severities", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            kind, check, severity, at_start = cells[0].strip("`"), cells[1].strip("`"), cells[2], cells[3]
            rows[kind] = (check, severity, at_start == "yes")
    assert rows == {kind: (k.check, k.severity, k.at_worker_start) for kind, k in FINDINGS.items()}
