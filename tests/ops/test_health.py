"""The worker's health endpoint (``leases_http_port``: /livez, /readyz, /metrics), its health
file (``leases_health_file``), Prometheus served by the worker, and the Kubernetes example.

The probes are read from real ``celery worker`` processes over HTTP, with a lease store on a
redis-server of the test's own (never the session's: one test stops and restarts it) and a
broker apart from it. tests/support/apps/health_app.py is the workers' app module: the suite's
leased app with the settings and the ``enable_prometheus(app)`` call docs/operations.md shows.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from celery_leases import testing
from celery_leases.config import get_config
from celery_leases.testing import report_worker_logs, wait_for
from celery_leases.testing.servers import free_port
from celery_leases.worker.health import Health
from celery_leases.worker.loop import LOOP_WEDGED_AFTER
from tests.support.workers import CELERY, ROOT, Worker

prometheus_parser = pytest.importorskip("prometheus_client.parser",
                                        reason="pip install -e '.[test]' installs prometheus-client")
from celery_leases.ops.metrics import enable_prometheus  # noqa: E402

HEALTH_APP = "tests.support.apps.health_app"
#: health_app.WEDGE_TASK (the module is not imported here: its enable_prometheus(app) would
#: fill prometheus_client's global registry of this test process).
WEDGE_TASK = "health_app.wedge_loop"
K8S = ROOT / "examples" / "kubernetes"


def probe(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET ``path`` on the worker's endpoint; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as reply:
        return reply.code, reply.read().decode()
    except OSError as exc:   # not serving yet (connection refused)
        return 0, repr(exc)


def wait_probe(port: int, path: str, status: int, timeout: float) -> str:
    """The body of ``path`` once it answers ``status``."""
    seen: list = []

    def answered() -> str | None:
        seen[:] = [probe(port, path)]
        return seen[0][1] if seen[0][0] == status else None
    try:
        return wait_for(answered, timeout, what=f"{path} to answer {status}", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer: {seen}") from None


def samples(port: int) -> dict:
    """{(metric sample name, sorted labels): value} of the worker's /metrics."""
    status, text = probe(port, "/metrics")
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def exec_probes(path: Path) -> list[int]:
    """Exit statuses of the two exec probes docs/operations.md gives for the health file."""
    commands = [["sh", "-c", f'test -n "$(find {path} -mmin -1)"'],
                [sys.executable, "-c", "import os, sys, time; "
                 f"sys.exit(time.time() - os.path.getmtime({str(path)!r}) > 60)"]]
    return [subprocess.run(c, capture_output=True, timeout=30).returncode for c in commands]


@pytest.fixture
def health_worker(celery_env, own_server, tmp_path, request):
    """Factory: health_worker(pool=..., **env) -> (Worker, port, health file) of health_app.py,
    its broker and its lease store two redis-servers of the test's own (``.store``: the latter)."""
    started: list = []
    report_worker_logs(request.node, started)
    broker, store = own_server("broker"), own_server("leases")

    def start(pool: str = "prefork", concurrency: int = 1, wait: bool = True, **env: str):
        port, health_file = free_port(), tmp_path / "worker.live"
        # The worker's temporary files (prefork's metrics directory) in the test's directory:
        # a worker killed at the end leaves its own behind.
        (tmp_path / "tmp").mkdir(exist_ok=True)
        env = {**celery_env, "LEASES_TEST_BROKER": broker.url, "LEASES_TEST_LEASES_URL": store.url,
               "LEASES_TEST_HTTP_PORT": str(port), "LEASES_TEST_HEALTH_FILE": str(health_file),
               "TMPDIR": str(tmp_path / "tmp"), **env}
        worker = Worker(f"h{len(started) + 1}", env, pool=pool, concurrency=concurrency, app=HEALTH_APP,
                        log_dir=tmp_path)
        started.append(worker)
        worker.start() if wait else worker.launch()
        return worker, port, health_file

    start.store = store
    start.env = lambda: {**celery_env, "LEASES_TEST_BROKER": broker.url, "LEASES_TEST_LEASES_URL": store.url}
    yield start
    for worker in started:
        worker.kill()


@pytest.mark.slow
def test_a_lease_store_down_at_start_or_later_makes_the_worker_unready_never_unlive(health_worker):
    # Given a prefork worker starting while its lease store (a redis-server apart from the
    # broker) is down: it waits for the store, live but not ready
    health_worker.store.stop()
    worker, port, health_file = health_worker("prefork", wait=False)
    assert wait_probe(port, "/livez", 200, 20) == "live: starting (the lease heartbeat has not started yet)\n"
    assert probe(port, "/readyz") == (503, "not ready: starting (not consuming yet)\n")
    # And once the store is there, it consumes and serves its probes
    health_worker.store.start()
    wait_probe(port, "/readyz", 200, 20)
    status, body = probe(port, "/livez")
    assert status == 200 and body == "live: consuming\n", body
    # And its health file is touched: both documented exec probes pass
    wait_for(lambda: health_file.exists(), 5, what="the health file")
    assert exec_probes(health_file) == [0, 0]

    # When the lease store stops
    health_worker.store.stop()
    stopped_at = time.time()
    # Then /readyz turns 503 within two heartbeat intervals (ttl 2 s: 1.3 s), naming the store
    body = wait_probe(port, "/readyz", 503, 10)
    assert body.startswith("not ready: the lease store has not answered for "), body
    assert "two heartbeat intervals" in body and f":{health_worker.store.port}" in body, body
    # And /livez stays 200 all along: a restart would not bring Redis back
    for _ in range(10):
        status, body = probe(port, "/livez")
        assert status == 200, body
        time.sleep(0.2)
    # And the worker, live, keeps touching its health file
    wait_for(lambda: health_file.stat().st_mtime > stopped_at + 1, 5, what="a touch during the outage")

    # When the lease store is back
    health_worker.store.start()
    # Then the worker is ready again, and was live throughout
    assert wait_probe(port, "/readyz", 200, 10).startswith("ready: consuming; the lease store answered")
    assert probe(port, "/livez")[0] == 200

    # And a warm shutdown removes the health file: the exec probes fail from then on
    worker.stop()
    assert not health_file.exists()
    assert exec_probes(health_file) == [1, 1]


@pytest.mark.slow
def test_a_wedged_event_loop_fails_livez_and_readyz(health_worker, tmp_path):
    """The loop is wedged for real: health_app.py's ``task_received`` handler blocks the thread
    that sends it, which is the worker's main thread running Celery's event loop, until the test
    creates a file. (SIGSTOP would stop the whole process, the HTTP server's threads too.) The
    heartbeat and the endpoint's threads run on, as they would beside a deadlocked main thread
    or a broker read that never returns."""
    from tests.support.apps.leased_app import create_app
    # Given a threads-pool worker, live and ready
    worker, port, health_file = health_worker("threads")
    wait_probe(port, "/readyz", 200, 30)
    client = create_app(health_worker.env())
    release = tmp_path / "release"
    try:
        # When a message makes the main thread block inside the event loop
        wedged_at = time.monotonic()
        client.send_task(WEDGE_TASK, args=[str(release)])
        # Then /livez turns 503 once the loop has not gone round for LOOP_WEDGED_AFTER seconds
        body = wait_probe(port, "/livez", 503, LOOP_WEDGED_AFTER + 15)
        assert time.monotonic() - wedged_at > LOOP_WEDGED_AFTER
        assert body.startswith("not live: the event loop has not gone round for "), body
        status, ready = probe(port, "/readyz")
        assert status == 503 and "the event loop has not gone round" in ready, ready
        # And the health file is no longer touched (after a second for a touch decided just before)
        time.sleep(1.0)
        touched = health_file.stat().st_mtime
        time.sleep(2.5)
        assert health_file.stat().st_mtime == touched
        # When the main thread is released
        release.touch()
        # Then the loop goes round again: live and ready
        assert wait_probe(port, "/livez", 200, 10) == "live: consuming\n"
        wait_probe(port, "/readyz", 200, 10)
    finally:
        release.touch()
        client.close()
    # And the heartbeat thread, which watches the loop too, logged the stall
    assert "the worker's event loop has not run for" in worker.log()


@pytest.mark.slow
def test_the_cli_runs_beside_a_metrics_worker_and_metrics_sum_the_pool(health_worker, tmp_path):
    # Given the metrics directory a killed worker left behind (its process is gone)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / "tmp" / f"celery-leases-prometheus-{gone.pid}-x1"
    stale.mkdir(parents=True)
    (stale / "counter_1.db").write_bytes(b"")
    # And a prefork worker of an app module that enables Prometheus and sets leases_http_port,
    # as docs/operations.md says
    worker, port, _ = health_worker("prefork", concurrency=2)
    # Then the worker removed the stale directory before making its own
    assert not stale.exists()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **health_worker.env(), "LEASES_TEST_HTTP_PORT": str(port)}

    # When the CLI imports the same module, with the same port, while the worker runs
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CELERY, "-A", HEALTH_APP, *args], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=60)
    stats, ping = cli("leases", "stats", "--no-scan"), cli("inspect", "ping", "--timeout", "5")
    # Then both work: importing the app module starts no server
    for done in (stats, ping):
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Address already in use" not in done.stdout + done.stderr
    assert "pong" in ping.stdout, ping.stdout

    # When pool processes run three recovery passes (beat's task; the fallback is off here)
    from tests.support.apps.leased_app import create_app
    client = create_app(health_worker.env())
    try:
        for _ in range(3):
            client.send_task("celery_leases.recover")
        result = client.signature("tests.support.apps.leased_app.add", (1, 2)).delay()
        assert result.get(timeout=15) == 3
    finally:
        client.close()

    # Then /metrics, served by the main process, counts the passes of the pool processes
    def passes() -> float:
        found = samples(port)
        return sum(found.get(("celery_leases_recovery_passes_total", (("result", r),)), 0)
                   for r in ("ran", "skipped", "failed"))
    wait_for(lambda: passes() == 3, 15, what="three recovery passes in /metrics")
    found = samples(port)
    # And the main process's own counts: the acquisition at receipt
    assert found[("celery_leases_acquired_total", (("taken_over", "false"),))] == 1
    assert all(name.startswith("celery_leases_") for name, _ in found), sorted(found)
    # And the multiprocess directory the worker made is removed at shutdown
    directory = re.search(r"metrics are kept in (\S+) \(removed at shutdown\)", worker.log()).group(1)
    assert os.path.isdir(directory) and Path(directory).name.startswith(f"celery-leases-prometheus-{worker.pid}-")
    worker.stop()
    assert not os.path.exists(directory)


@pytest.mark.slow
def test_the_kubernetes_example_probes_what_its_worker_serves(own_server, tmp_path, request, monkeypatch):
    # Given the example's manifest: a prefork worker, beat-free, probes on the port its app serves
    documents = list(yaml.safe_load_all((K8S / "worker.yaml").read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    service = next(d for d in documents if d["kind"] == "Service")
    pod = deployment["spec"]["template"]
    container, = pod["spec"]["containers"]
    assert container["command"][:4] == ["celery", "-A", "app", "worker"]
    assert "--pool=prefork" in container["command"]
    commands = [c.get("command", []) for d in documents if d["kind"] == "Deployment"
                for c in d["spec"]["template"]["spec"]["containers"]]
    assert not any("beat" in command or "-B" in command or "--beat" in command for command in commands)
    manifest_env = {e["name"]: e["value"] for e in container["env"]}
    port_name, = [p["name"] for p in container["ports"]
                  if p["containerPort"] == int(manifest_env["LEASES_HTTP_PORT"])]
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: (p["path"], p["port"]) for kind, p in probes.items()} == {
        "startupProbe": ("/livez", port_name), "livenessProbe": ("/livez", port_name),
        "readinessProbe": ("/readyz", port_name)}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == manifest_env["LEASES_HTTP_PORT"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert service["spec"]["ports"][0]["targetPort"] == port_name

    # And app.py, with Redis URLs and a port of this test's in the manifest's environment
    broker, store = own_server("broker"), own_server("leases")
    port = free_port()
    (tmp_path / "tmp").mkdir()
    env = {**manifest_env, "BROKER_URL": broker.url, "RESULT_BACKEND": broker.url,
           "LEASES_REDIS_URL": store.url, "LEASES_HTTP_PORT": str(port), "TMPDIR": str(tmp_path / "tmp")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("k8s_example_app", K8S / "app.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    app = example.app
    worker = testing.Worker("app", name="k8s", env=env, pool="prefork", concurrency=1, log_dir=tmp_path,
                            cwd=K8S, pythonpath=[str(K8S), str(ROOT)])
    report_worker_logs(request.node, [worker])
    try:
        # Then its workers run the recovery passes, and beat has nothing to schedule
        assert get_config(app).worker_recovery is True
        assert "celery_leases.recover" not in (app.conf.beat_schedule or {})

        # When it runs as the manifest runs it (celery -A app worker --pool=prefork)
        worker.start()
        # Then the manifest's probe paths answer 200 on the port app.py read, and /metrics too
        wait_probe(port, probes["readinessProbe"]["path"], 200, 15)
        assert probe(port, probes["livenessProbe"]["path"]) == (200, "live: consuming\n")
        assert ("celery_leases_renewed_total", ()) in samples(port)
        # And the example's task runs, leased
        assert app.send_task("app.process", args=["item"]).get(timeout=15) == "ITEM"
    finally:
        worker.kill()
        enable_prometheus(app).disable()   # its metrics leave this process's global registry
        app.close()


# -- in the test process: settings, a port in use, /metrics without Prometheus ---------------


@pytest.mark.parametrize("setting, value, message", [
    ("leases_http_port", 0, "leases_http_port must be None (off) or a TCP port: an integer from 1 to 65535, got 0"),
    ("leases_http_port", 70000, "leases_http_port must be None (off) or a TCP port"),
    ("leases_http_port", "http", "leases_http_port must be None (off) or a TCP port"),
    ("leases_http_port", True, "leases_http_port must be None (off) or a TCP port"),
    ("leases_http_host", "", "leases_http_host must be an address to bind to"),
    ("leases_http_host", "0.0.0.0 ", "leases_http_host must be an address to bind to"),
    ("leases_health_file", "", "leases_health_file must be None (off) or a file path"),
    ("leases_health_file", 5, "leases_health_file must be None (off) or a file path"),
])
def test_a_broken_health_setting_stops_the_worker_not_a_publisher(setting, value, message):
    from celery import Celery

    import celery_leases
    from celery_leases import ConfigurationError
    app = Celery("health_cfg", broker="redis://127.0.0.1:1/0")
    app.conf.update({setting: value})
    celery_leases.install(app)             # a publisher's import proj still works
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        get_config(app)                    # what a worker checks at start


def test_health_settings_accept_what_an_environment_gives():
    from celery import Celery
    app = Celery("health_cfg", broker="redis://127.0.0.1:1/0")
    assert (get_config(app).http_port, get_config(app).http_host, get_config(app).health_file) == \
        (None, "0.0.0.0", None)
    app = Celery("health_cfg", broker="redis://127.0.0.1:1/0")
    app.conf.update(leases_http_port="9808", leases_http_host="::", leases_health_file=Path("/tmp/w.live"))
    config = get_config(app)
    assert (config.http_port, config.http_host, config.health_file) == (9808, "::", "/tmp/w.live")


def test_a_port_in_use_is_an_error_naming_the_setting_and_the_worker_runs_on(client_app, caplog):
    # Given a port something else listens on
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    health = Health(client_app, None, dataclasses.replace(get_config(client_app), http_port=port,
                                                          http_host="127.0.0.1"))
    try:
        # When the health service starts on it
        with caplog.at_level(logging.ERROR, logger="celery_leases.worker"):
            health.start()
        # Then it logs one ERROR naming the setting and the port, and raises nothing
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and f"leases_http_port {port}: cannot serve" in errors[0], errors
        assert "the worker runs on without them" in errors[0]
    finally:
        health.stop()
        taken.close()


def test_metrics_without_prometheus_name_what_is_missing(client_app, monkeypatch):
    health = Health(client_app, None, get_config(client_app))
    status, _, body = health.metrics()
    assert status == 404 and b"enable_prometheus(app)" in body
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # not installed
    status, _, body = health.metrics()
    assert status == 404 and b"prometheus-client" in body and b"celery-leases[prometheus]" in body
