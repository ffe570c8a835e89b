"""`celery -A proj leases doctor` on throwaway Redis servers: healthy exits 0, findings exit 1."""
from __future__ import annotations

import json
import threading

import pytest
import redis

from celery_leases import LeaseStore
from celery_leases.testing.servers import RedisServer
from tests.ops.test_cli import ok


@pytest.fixture
def server_factory():
    started: list[RedisServer] = []

    def start(**kwargs) -> RedisServer:
        server = RedisServer(**kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.cleanup()


def test_a_healthy_store_exits_0_with_ok_lines(cli, server_factory, key_prefix):
    # Given a lease store with AOF, noeviction, and one live lease
    server = server_factory(appendonly=True)
    store = LeaseStore(redis.Redis.from_url(server.url), key_prefix)
    store.acquire("live", "w", ttl=60, name="tests.support.apps.leased_app.add")

    # When the doctor runs
    result = cli("doctor", "--observe", "0", LEASES_TEST_BROKER=server.url)

    # Then it says healthy and exits 0, one line per check
    assert result.returncode == 0, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("healthy: 0 error(s), 0 warning(s)")
    levels = {line.split()[1]: line.split()[0] for line in lines[:-1]}
    assert levels["eviction"] == levels["persistence"] == levels["records"] == "OK"
    assert levels["clock"] == levels["settings"] == levels["parked"] == "OK"
    assert "not observed" in result.stdout   # no recoverer runs here: said, not counted
    assert result.stderr == ""
    data = json.loads(ok(cli("doctor", "--observe", "0", "--json", LEASES_TEST_BROKER=server.url)))
    assert data["healthy"] is True and data["status"] == 0
    assert {f["level"] for f in data["findings"]} <= {"OK", "INFO"}


def test_an_evicting_store_with_a_corrupt_record_exits_1_naming_both(cli, server_factory, key_prefix):
    # Given a lease store whose policy evicts any key, holding a corrupt record
    server = server_factory(appendonly=True, extra_args=("--maxmemory-policy", "allkeys-lru"))
    client = redis.Redis.from_url(server.url)
    store = LeaseStore(client, key_prefix)
    store.acquire("fine", "w", ttl=60)
    client.hset(store.keys.record("broken"), mapping={"state": "active", "token": "not-a-number"})

    # When the doctor runs
    result = cli("doctor", "--observe", "0", LEASES_TEST_BROKER=server.url)

    # Then it exits 1 with one ERROR line for each, each saying what to do
    assert result.returncode == 1, (result.stdout, result.stderr)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    (eviction,) = [line for line in errors if line.split()[1] == "eviction"]
    assert "allkeys-lru" in eviction and "do: CONFIG SET maxmemory-policy noeviction" in eviction
    (corrupt,) = [line for line in errors if line.split()[1] == "records"]
    assert store.keys.record("broken") in corrupt and "token" in corrupt and "do:" in corrupt
    assert result.stdout.splitlines()[-1].startswith("unhealthy: 2 error(s)")
    assert "Traceback" not in result.stderr and "skipping a corrupt" not in result.stderr
    # And the JSON says the same
    data = json.loads(cli("doctor", "--observe", "0", "--json", LEASES_TEST_BROKER=server.url).stdout)
    assert data["healthy"] is False and data["status"] == 1
    assert sorted(f["check"] for f in data["findings"] if f["level"] == "ERROR") == ["eviction", "records"]
    assert sorted(f["kind"] for f in data["findings"] if f["level"] == "ERROR") == ["corrupt_record", "eviction"]


def test_stuck_leases_rdb_only_and_parked_deliveries_are_findings(cli, server_factory, key_prefix):
    # Given RDB snapshots without AOF, a lease due long ago, and a parked delivery
    server = server_factory(extra_args=("--save", "3600 1"))
    client = redis.Redis.from_url(server.url)
    store = LeaseStore(client, key_prefix)
    acq = store.acquire("abandoned", "w", ttl=60, name="proj.charge")
    store.release("w", {"abandoned": acq.token}, started={"abandoned"})
    store.park("p1", "corrupt lease record", name="proj.charge", body=b"b", key="k", field="token")

    # When the doctor runs with a short "stuck" threshold
    result = cli("doctor", "--observe", "0", "--stuck-after", "0", LEASES_TEST_BROKER=server.url)

    # Then each is named, and the exit status is 1
    assert result.returncode == 1, (result.stdout, result.stderr)
    by_check = {}
    for line in result.stdout.splitlines()[:-1]:
        by_check.setdefault(line.split()[1], []).append(line)
    assert any(line.startswith("WARNING") and "RDB" in line for line in by_check["persistence"])
    assert any(line.startswith("ERROR") and "stuck lease proj.charge[abandoned]" in line
               and "celery leases recover" in line for line in by_check["records"])
    assert by_check["parked"][0].startswith("WARNING") and "celery leases replay" in by_check["parked"][0]


def test_the_recovery_cadence_is_observed_from_the_recovery_guard(cli, server_factory, key_prefix):
    # Given a recoverer that takes its turn now and then (as beat's task does)
    server = server_factory(appendonly=True)
    store = LeaseStore(redis.Redis.from_url(server.url), key_prefix)
    # (every 30 s: its guard lives 0.9 of that, so it outlives the CLI's start however slow)
    assert store.try_recovery_turn("beat", 27)

    # When the doctor looks
    data = json.loads(ok(cli("doctor", "--json", LEASES_TEST_BROKER=server.url,
                             LEASES_TEST_RECOVERY_INTERVAL="30")))

    # Then it reports the last turn, who took it, and how long ago
    (finding,) = [f for f in data["findings"] if f["check"] == "recovery"]
    assert finding["level"] == "OK" and "the last by beat" in finding["what"]
    ago = float(finding["what"].split("the last by beat ")[1].split("s ago")[0])
    assert 0 <= ago < 20


def test_an_unreachable_store_is_an_error_line_and_exit_69(cli):
    from celery_leases.testing.servers import free_port
    result = cli("doctor", LEASES_TEST_BROKER=f"redis://:pw-s3cret@127.0.0.1:{free_port()}/0")
    assert result.returncode == 69, (result.stdout, result.stderr)
    assert any(line.startswith("ERROR") and line.split()[1] == "store" for line in result.stdout.splitlines())
    assert "s3cret" not in result.stdout + result.stderr


@pytest.mark.parametrize("every, level", [(1.0, "OK"), (2.6, "WARNING")])
def test_observing_longer_measures_how_often_passes_run(cli, server_factory, key_prefix, every, level):
    # Given a recoverer taking its turn every `every` seconds, at leases_recovery_interval 1 s
    server = server_factory(appendonly=True)
    store = LeaseStore(redis.Redis.from_url(server.url), key_prefix)
    stop = threading.Event()

    def recoverer() -> None:
        while not stop.is_set():
            store.try_recovery_turn("celery@w1:1:abc", 0.9)
            stop.wait(every)

    thread = threading.Thread(target=recoverer, daemon=True)
    thread.start()
    try:
        # When the doctor watches for a while
        data = json.loads(cli("doctor", "--json", "--observe", str(every * 2 + 1.5),
                              LEASES_TEST_BROKER=server.url, LEASES_TEST_RECOVERY_INTERVAL="1").stdout)
    finally:
        stop.set()
        thread.join()

    # Then it reports the cadence it saw, and warns when passes run less often than every 2 intervals
    (finding,) = [f for f in data["findings"] if f["check"] == "recovery"]
    assert finding["level"] == level, finding
    assert "celery@w1:1:abc" in finding["what"] and "turns seen" in finding["what"]
    seen = float(finding["what"].split(", every ")[1].split("s (")[0])
    assert every * 0.7 <= seen <= every * 1.3
